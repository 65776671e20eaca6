"""Shared data and definitions for the baby-GPT Tiny Shakespeare (char-level) benchmark.

Every runner (bare loop, HF Trainer, llm_trainer) must use these helpers so that the data,
the training batches, the learning-rate schedule and above all the validation loss mean the same thing.

Definitions
-----------
* Text: ``input.txt`` read as UTF-8, unmodified (no whitespace normalisation).
* Vocabulary: ``sorted(set(text))`` over the WHOLE text (65 characters); id = index in that list.
* Split: first ``int(0.9 * len(text))`` characters train, the rest validation (nanoGPT's split).
* Training batch (nanoGPT ``get_batch``): ``batch_size`` start offsets drawn uniformly from
  ``[0, len(train) - 64)``; a row is the 65-char window at that offset, ``x = window[:64]``,
  ``y = window[1:]``. Offsets come from a dedicated ``torch.Generator`` seeded with ``SEED`` so that
  the sequence of batches does not depend on how much global RNG a runner's model init consumed:
  the bare loop and the HF Trainer see exactly the same batches in the same order.
* Validation loss: token-weighted mean cross-entropy over ALL non-overlapping windows of the
  validation ids: window ``i`` covers ids ``[64*i, min(64*i + 65, N))`` for
  ``i = 0 .. ceil((N - 1) / 64) - 1``; inputs are the window minus its last id, targets the window
  minus its first id. Every validation id except the first is predicted exactly once (the final
  window is shorter when ``(N - 1) % 64 != 0``), and the loss is the sum of per-token CE over all
  targets divided by the number of targets (N - 1). Evaluated once, at the end of training.
* Learning rate at optimizer step ``t`` (0-based): ``lr_at(t)`` — identical to transformers'
  ``cosine_with_min_lr`` schedule: linear warmup ``lr * t / warmup`` (so step 0 runs at lr 0),
  then half-cosine from ``lr`` to ``min_lr`` over ``[warmup, max_steps)``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

# ----------------------------------------------------------------------------------------------
# The setting

REPO_ROOT = Path(__file__).resolve().parents[1]
DATA_ENV_VAR = "BABY_GPT_DATA"  # override the path of input.txt
DEFAULT_DATA_PATH = REPO_ROOT.parent / "shared" / "data" / "tinyshakespeare" / "input.txt"

SEED = 1337
TRAIN_FRACTION = 0.9
BLOCK_SIZE = 64  # context length; a training window is BLOCK_SIZE + 1 characters
BATCH_SIZE = 12
MAX_STEPS = 2000
N_LAYER = 4
N_HEAD = 4
D_MODEL = 128
DROPOUT = 0.0
LEARNING_RATE = 1e-3
MIN_LR = 1e-4
WARMUP_STEPS = 100
BETAS = (0.9, 0.99)
WEIGHT_DECAY = 0.1  # not on biases, norms or embeddings
GRAD_CLIP = 1.0
EVAL_BATCH_SIZE = 64  # windows per forward pass during validation (does not change the result)


def data_path() -> Path:
    """``$BABY_GPT_DATA`` if set, else ``<repo>/../shared/data/tinyshakespeare/input.txt``."""
    override = os.environ.get(DATA_ENV_VAR)
    path = Path(override).expanduser() if override else DEFAULT_DATA_PATH
    if not path.is_file():
        raise FileNotFoundError(f"Tiny Shakespeare not found at {path}; set ${DATA_ENV_VAR} to the path of input.txt")
    return path


# ----------------------------------------------------------------------------------------------
# Data


@dataclass
class ShakespeareData:
    text: str
    chars: list[str]  # id -> char
    train_ids: torch.Tensor  # int64, 1-D
    val_ids: torch.Tensor  # int64, 1-D
    split_at: int  # character offset where validation starts

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    @property
    def train_text(self) -> str:
        return self.text[: self.split_at]

    @property
    def val_text(self) -> str:
        return self.text[self.split_at :]

    def encode(self, s: str) -> torch.Tensor:
        stoi = {c: i for i, c in enumerate(self.chars)}
        return torch.tensor([stoi[c] for c in s], dtype=torch.long)

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i)] for i in ids)


def load_data(path: str | Path | None = None) -> ShakespeareData:
    """Read the text, build the char vocabulary over the whole text and split 90/10 by position."""
    path = Path(path) if path is not None else data_path()
    text = path.read_text(encoding="utf-8")
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    ids = torch.tensor([stoi[c] for c in text], dtype=torch.long)
    split_at = int(TRAIN_FRACTION * len(text))
    return ShakespeareData(text=text, chars=chars, train_ids=ids[:split_at], val_ids=ids[split_at:], split_at=split_at)


def write_split_files(out_dir: str | Path, data: ShakespeareData | None = None) -> tuple[Path, Path]:
    """Write ``train.txt`` and ``val.txt`` (exact character split, UTF-8, no newline translation)."""
    data = data or load_data()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    train_path, val_path = out_dir / "train.txt", out_dir / "val.txt"
    with open(train_path, "w", encoding="utf-8", newline="") as f:
        f.write(data.train_text)
    with open(val_path, "w", encoding="utf-8", newline="") as f:
        f.write(data.val_text)
    return train_path, val_path


# ----------------------------------------------------------------------------------------------
# Training batches


def make_generator(seed: int = SEED) -> torch.Generator:
    """The dedicated RNG of the batch sampler (independent of the global torch RNG)."""
    return torch.Generator().manual_seed(seed)


def get_batch(
    train_ids: torch.Tensor,
    generator: torch.Generator,
    batch_size: int = BATCH_SIZE,
    block_size: int = BLOCK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """nanoGPT's get_batch: uniform random 65-char windows; returns (x, y), each (batch_size, 64)."""
    ix = torch.randint(len(train_ids) - block_size, (batch_size,), generator=generator)
    windows = torch.stack([train_ids[i : i + block_size + 1] for i in ix.tolist()])
    return windows[:, :-1], windows[:, 1:]


def sample_windows(
    train_ids: torch.Tensor,
    steps: int,
    batch_size: int = BATCH_SIZE,
    block_size: int = BLOCK_SIZE,
    seed: int = SEED,
) -> torch.Tensor:
    """All windows a ``steps``-step run sees, in order: (steps * batch_size, block_size + 1).

    Row ``s * batch_size + b`` is row ``b`` of the batch ``get_batch`` returns at step ``s`` with a
    generator seeded by ``seed`` — i.e. exactly what the bare loop trains on.
    """
    gen = make_generator(seed)
    out = torch.empty(steps * batch_size, block_size + 1, dtype=torch.long)
    for s in range(steps):
        x, y = get_batch(train_ids, gen, batch_size, block_size)
        out[s * batch_size : (s + 1) * batch_size, :-1] = x
        out[s * batch_size : (s + 1) * batch_size, -1] = y[:, -1]
    return out


# ----------------------------------------------------------------------------------------------
# Learning-rate schedule


def lr_at(
    step: int,
    max_steps: int = MAX_STEPS,
    lr: float = LEARNING_RATE,
    min_lr: float = MIN_LR,
    warmup: int = WARMUP_STEPS,
) -> float:
    """LR for 0-based optimizer step ``step``; equals transformers' ``cosine_with_min_lr`` schedule."""
    if step < warmup:
        return lr * step / max(1, warmup)
    progress = (step - warmup) / max(1, max_steps - warmup)
    factor = 0.5 * (1.0 + math.cos(math.pi * progress))
    return max(0.0, lr * (factor * (1 - min_lr / lr) + min_lr / lr))


# ----------------------------------------------------------------------------------------------
# Validation


def val_windows(val_ids: torch.Tensor, block_size: int = BLOCK_SIZE) -> list[torch.Tensor]:
    """Non-overlapping windows: window i = val_ids[64*i : 64*i + 65] (the last one may be shorter)."""
    n = len(val_ids)
    count = math.ceil((n - 1) / block_size) if n > 1 else 0
    return [val_ids[block_size * i : block_size * i + block_size + 1] for i in range(count)]


@torch.no_grad()
def evaluate_val_loss(
    logits_fn: Callable[[torch.Tensor], torch.Tensor],
    val_ids: torch.Tensor,
    block_size: int = BLOCK_SIZE,
    batch_size: int = EVAL_BATCH_SIZE,
    device: str | torch.device = "cpu",
) -> dict:
    """Token-weighted mean CE over all validation windows.

    ``logits_fn(input_ids)`` maps (B, T) int64 ids (T <= block_size) to (B, T, vocab) logits; the
    caller puts its model in eval mode. Returns {"val_loss", "val_tokens", "val_windows"}.
    """
    windows = val_windows(val_ids, block_size)
    full = [w for w in windows if len(w) == block_size + 1]
    tail = [w for w in windows if len(w) != block_size + 1]
    total, count = 0.0, 0
    groups = [torch.stack(full[i : i + batch_size]) for i in range(0, len(full), batch_size)]
    groups += [w.unsqueeze(0) for w in tail]
    for batch in groups:
        batch = batch.to(device)
        x, y = batch[:, :-1], batch[:, 1:]
        logits = logits_fn(x).float()
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1), reduction="sum")
        total += loss.item()
        count += y.numel()
    return {"val_loss": total / count, "val_tokens": count, "val_windows": len(windows)}


def tokens_per_step(batch_size: int = BATCH_SIZE, block_size: int = BLOCK_SIZE) -> int:
    """Trained (predicted) tokens per optimizer step: 12 * 64 = 768."""
    return batch_size * block_size
