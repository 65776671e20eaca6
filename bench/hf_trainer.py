"""Baby GPT on Tiny Shakespeare through transformers: GPT2LMHeadModel + Trainer.

Same setting as bench/bare_loop.py, expressed the way an HF user would: a GPT2Config, a torch
Dataset and TrainingArguments. Prints one JSON line on stdout.

    python bench/hf_trainer.py [--steps 2000]

Alignment with the other runners (so the numbers are comparable):

* Targets. GPT2LMHeadModel shifts ``labels`` inside the loss, so a 64-token input with
  ``labels=input_ids`` would train on only 63 predictions per row. Each example therefore carries
  ``input_ids = window[:64]``, ``labels = window[:64]`` and ``shift_labels = window[1:]``:
  transformers' causal-LM loss uses ``shift_labels`` as the already-shifted targets when given
  (the path its padding-free collators use), and the Trainer counts ``num_items_in_batch`` from it.
  Result: 64 positions, 64 predictions per row, the exact targets of the bare loop, same compute,
  n_positions stays 64. ``remove_unused_columns=False`` keeps ``shift_labels``
  in the batch (the default collator wrapper would drop it, silently falling back to 63 targets).
  A one-batch check at start-up, through the Trainer's dataloader and ``compute_loss``, asserts that
  the loss equals F.cross_entropy(logits, window[1:]) over all 64 positions.
* Batches. The dataset holds the ``steps * 12`` windows that the shared sampler
  (``shakespeare.sample_windows``) draws, read in order (``train_sampling_strategy="sequential"``),
  so step s trains on exactly the batch the bare loop draws at step s.
* Schedule. ``cosine_with_min_lr`` with ``min_lr=1e-4``, 100 warmup steps: identical to
  ``shakespeare.lr_at`` (which the bare loop uses).
* Weight decay. The Trainer's default excludes biases and LayerNorm weights but decays the
  embeddings; the setting excludes embeddings too, so ``get_decay_parameter_names`` also drops
  ``wte``/``wpe`` (the tied head shares ``wte``).
* ``use_cache=False`` in the config: a KV cache is useless in training and would cost time.
* Optimizer: the Trainer's default for this torch (``adamw_torch_fused`` on torch >= 2.8) is kept.
* tqdm is disabled (``disable_tqdm``), as progress bars are off for the other runners.
"""

import time

_T0 = time.perf_counter()  # process wall is measured from here (script import)

import argparse
import dataclasses
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import torch
import torch.nn.functional as F
import transformers
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, PrinterCallback, Trainer, TrainingArguments

sys.path.insert(0, str(Path(__file__).resolve().parent))
import shakespeare as sh  # noqa: E402


class WindowDataset(Dataset):
    def __init__(self, windows: torch.Tensor):
        self.windows = windows  # (N, 65)

    def __len__(self):
        return len(self.windows)

    def __getitem__(self, i):
        w = self.windows[i]
        return {"input_ids": w[:-1], "labels": w[:-1], "shift_labels": w[1:]}


class BenchTrainer(Trainer):
    """Trainer whose only change is the weight-decay exclusion list (adds the embeddings)."""

    def get_decay_parameter_names(self, model):
        names = super().get_decay_parameter_names(model)
        embeddings = ("wte.weight", "wpe.weight", "lm_head.weight")  # lm_head is tied to wte
        return [n for n in names if not n.endswith(embeddings)]


def _training_args(output_dir: str, steps: int) -> tuple[TrainingArguments, dict]:
    fields = {f.name for f in dataclasses.fields(TrainingArguments)}
    notes = {}
    kwargs = dict(
        output_dir=output_dir,
        max_steps=steps,
        per_device_train_batch_size=sh.BATCH_SIZE,
        gradient_accumulation_steps=1,
        learning_rate=sh.LEARNING_RATE,
        warmup_steps=sh.WARMUP_STEPS,
        adam_beta1=sh.BETAS[0],
        adam_beta2=sh.BETAS[1],
        adam_epsilon=1e-8,
        weight_decay=sh.WEIGHT_DECAY,
        max_grad_norm=sh.GRAD_CLIP,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        seed=sh.SEED,
        dataloader_num_workers=0,
        dataloader_pin_memory=False,
        logging_steps=max(steps, 1) * 10,  # never logs during training
        disable_tqdm=True,
        remove_unused_columns=False,  # else the collator drops `shift_labels` (not a forward() argument)
    )
    kwargs["eval_strategy" if "eval_strategy" in fields else "evaluation_strategy"] = "no"
    schedulers = {s.value for s in transformers.SchedulerType}
    if "cosine_with_min_lr" in schedulers:
        kwargs.update(lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs={"min_lr": sh.MIN_LR})
    else:  # older transformers: cosine to 0 is the closest built-in
        kwargs.update(lr_scheduler_type="cosine")
        notes["lr_scheduler"] = "cosine_with_min_lr unavailable; cosine to 0 used"
    if "train_sampling_strategy" in fields:
        kwargs["train_sampling_strategy"] = "sequential"
    else:
        notes["sampler"] = "sequential sampler via _get_train_sampler override"
    return TrainingArguments(**kwargs), notes


def _check_targets(trainer) -> float:
    """Through the Trainer's own dataloader and compute_loss: the loss of the first batch must equal
    CE over all 64 positions against window[1:] (not 63 positions, as a plain labels=input_ids gives)."""
    batch = next(iter(trainer.get_train_dataloader()))
    model = trainer.model
    model.eval()
    with torch.no_grad():
        loss, out = trainer.compute_loss(model, batch, return_outputs=True)
        logits = out.logits
        ref = F.cross_entropy(logits.reshape(-1, logits.size(-1)), batch["shift_labels"].reshape(-1))
    model.train()
    if set(batch) != {"input_ids", "labels", "shift_labels"} or batch["shift_labels"].shape != (
        sh.BATCH_SIZE,
        sh.BLOCK_SIZE,
    ):
        raise RuntimeError(f"unexpected training batch: { {k: tuple(v.shape) for k, v in batch.items()} }")
    if not torch.allclose(loss, ref, rtol=1e-5, atol=1e-6):
        raise RuntimeError(f"HF loss {loss.item()} != CE over 64 shifted targets {ref.item()}")
    return loss.item()


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=sh.MAX_STEPS)
    args = parser.parse_args(argv)
    steps = args.steps

    torch.manual_seed(sh.SEED)
    data = sh.load_data()
    config = GPT2Config(
        vocab_size=data.vocab_size,
        n_positions=sh.BLOCK_SIZE,
        n_embd=sh.D_MODEL,
        n_layer=sh.N_LAYER,
        n_head=sh.N_HEAD,
        activation_function="gelu",
        resid_pdrop=sh.DROPOUT,
        embd_pdrop=sh.DROPOUT,
        attn_pdrop=sh.DROPOUT,
        layer_norm_epsilon=1e-5,
        tie_word_embeddings=True,
        use_cache=False,
        bos_token_id=0,  # only silences the "50256 outside the vocabulary" warning; unused in training
        eos_token_id=0,
    )
    model = GPT2LMHeadModel(config)
    dataset = WindowDataset(sh.sample_windows(data.train_ids, steps))

    with tempfile.TemporaryDirectory(prefix="hf_bench_") as tmp:
        training_args, notes = _training_args(tmp, steps)
        trainer = BenchTrainer(model=model, args=training_args, train_dataset=dataset)
        trainer.remove_callback(PrinterCallback)  # keep stdout to the one JSON line
        if "sampler" in notes:
            trainer._get_train_sampler = lambda *a, **k: torch.utils.data.SequentialSampler(dataset)
        initial_loss = _check_targets(trainer)
        t_train = time.perf_counter()
        output = trainer.train()
        train_wall = time.perf_counter() - t_train
        optim_name = str(getattr(training_args.optim, "value", training_args.optim))
        decayed = trainer.get_decay_parameter_names(model)

    t_eval = time.perf_counter()
    model.eval()
    val = sh.evaluate_val_loss(lambda x: model(input_ids=x).logits, data.val_ids)
    eval_s = time.perf_counter() - t_eval

    result = {
        "name": "hf_trainer",
        "steps": steps,
        "tokens_per_s": steps * sh.tokens_per_step() / train_wall if train_wall > 0 else None,
        "train_wall_s": train_wall,
        "process_wall_s": time.perf_counter() - _T0,
        "val_loss": val["val_loss"],
        "compile": False,
        "hf_train_runtime_s": output.metrics.get("train_runtime"),
        "train_loss_mean": output.metrics.get("train_loss", output.training_loss),
        "initial_loss": initial_loss,
        "setup_s": t_train - _T0,
        "eval_s": eval_s,
        "val_tokens": val["val_tokens"],
        "n_params": sum(p.numel() for p in model.parameters()),
        "optim": optim_name,
        "lr_scheduler": str(getattr(training_args.lr_scheduler_type, "value", training_args.lr_scheduler_type)),
        "attn_implementation": getattr(model.config, "_attn_implementation", None),
        "decayed_params": len(decayed),
        "transformers": transformers.__version__,
        "torch_num_threads": torch.get_num_threads(),
        **({"notes": notes} if notes else {}),
    }
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
