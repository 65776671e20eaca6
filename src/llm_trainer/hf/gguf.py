"""GGUF export: one `.gguf` file that llama.cpp runs and transformers loads (`gguf_file=`).

llama.cpp's own converter (`convert_hf_to_gguf.py`) knows a byte-level BPE tokenizer only by a hash
of the ids it gives a fixed text, so it refuses every vocabulary trained here. This module writes the
file itself with `gguf`, llama.cpp's Python library, and declares what the converter would have
guessed: the pre-split as llama.cpp names it (`tokenizer.ggml.pre`). That is only possible for the
pre-splits llama.cpp has, `data.tokenizer_pre_split: gpt2` (its `gpt-2`) and `llama3` (its
`llama-bpe`); our default, `unicode`, has no llama.cpp twin and is refused in one line.

The weights are the transformers export's (`interop.to_hf_state`), renamed with gguf's own table of
transformers -> GGUF tensor names, in llama.cpp's layouts:

* GPT-2: every matrix (out, in), i.e. transformers' Conv1D weights transposed back.
* LLaMA: llama.cpp rotates adjacent pairs (q0, q1), transformers and we rotate halves (q0, q_{D/2}),
  so each head's q and k rows are reordered the way llama.cpp's converter does (`_permute_rope`);
  transformers' GGUF loader undoes exactly that reordering.
* A tied output head is left out: llama.cpp then reads the token embedding for it.

`gguf` is an optional dependency (`pip install 'llm-trainer[gguf]'`); it is imported lazily.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tokenizers import Tokenizer as HFTokenizer

from ..checkpoint.model_folder import load_model_folder
from ..config import ModelConfig
from ..errors import UsageError, first_line
from ..files import buckets
from ..files.atomic import remove_dead_temporary_files, temporary_file
from ..files.disk import check_output_file, disk_full, new_file_mode, no_follow
from ..logs import log
from ..tokenizer import EOT, pre_split_of
from .interop import GPT2_ACTIVATIONS, check_exportable, to_hf_state

# Our pre-splits -> the name llama.cpp gives the same regex (`tokenizer.ggml.pre`); `unicode` has none.
LLAMA_CPP_PRE = {"gpt2": "gpt-2", "llama3": "llama-bpe"}
# llama.cpp's token types (gguf.TokenType), written as plain ints.
_NORMAL, _CONTROL, _USER_DEFINED, _UNUSED = 1, 3, 4, 5
# The activations llama.cpp's GPT-2 graph can compute: it has GELU only, in the tanh approximation.
_GPT2_GELU = ("gelu_tanh", "gelu")
DTYPES = ("f32", "f16")


def require_gguf():
    """The gguf module, or a one-line UsageError saying how to install it."""
    try:
        import gguf
    except ImportError:
        raise UsageError(
            "--format gguf needs the gguf package; install it with: pip install 'llm-trainer[gguf]'"
        ) from None
    return gguf


def _refuse(reason: str) -> UsageError:
    return UsageError(f"cannot export to GGUF: {reason}")


# ----------------------------------------------------------------------------------------------
# Tokenizer


@dataclass(frozen=True)
class GGUFVocab:
    """The `tokenizer.ggml.*` metadata of a byte-level BPE tokenizer, as llama.cpp reads it."""

    pre: str  # llama.cpp's name of the pre-split regex
    tokens: list[str]  # by id, in the byte-level alphabet, padded to the model's vocab_size
    token_types: list[int]
    merges: list[str]  # "left right", best first
    eot_id: int


def _merges(model: dict[str, Any]) -> list[str]:
    """The BPE merges as "left right" strings (tokenizers writes either those or [left, right] pairs)."""
    merges = model.get("merges") or []
    return [m if isinstance(m, str) else " ".join(m) for m in merges]


def llama_cpp_pre(tokenizer_json: dict[str, Any]) -> str:
    """llama.cpp's name of the tokenizer's pre-split, or a one-line refusal naming what llama.cpp could
    not reproduce and the setting that would."""
    model = tokenizer_json.get("model") or {}
    kind = model.get("type")
    if kind == "WordLevel":
        raise _refuse(
            "llama.cpp has no character-level tokenizer (data.tokenizer: char); train with data.tokenizer: bpe "
            "and data.tokenizer_pre_split: gpt2 or llama3"
        )
    pre_split = pre_split_of(tokenizer_json)
    if kind != "BPE" or (pre_split is None and not _byte_level(tokenizer_json)):
        what = "BPE without the byte-level alphabet" if kind == "BPE" else f"a {kind or 'model of no known type'}"
        raise _refuse(f"llama.cpp reads byte-level BPE tokenizers only and this tokenizer.json holds {what}")
    if pre_split not in LLAMA_CPP_PRE:
        raise _refuse(
            f"none of llama.cpp's pre-tokenizers splits text as this tokenizer's "
            f"({'data.tokenizer_pre_split: ' + pre_split if pre_split else 'its own regex'}) does; train with "
            "data.tokenizer_pre_split: gpt2 or llama3 for a tokenizer llama.cpp reproduces"
        )
    if tokenizer_json.get("normalizer") is not None:
        raise _refuse("llama.cpp applies no normalizer and this tokenizer.json has one; use a tokenizer without it")
    for option in ("dropout", "continuing_subword_prefix", "end_of_word_suffix"):
        if model.get(option):
            raise _refuse(f"llama.cpp's BPE has no {option} and this tokenizer.json sets it")
    return LLAMA_CPP_PRE[pre_split]


def read_tokenizer_json(path: Path) -> tuple[HFTokenizer, dict[str, Any]]:
    """The tokenizer a GGUF file is made with, loaded by `tokenizers` (which validates it; nothing in it
    runs) and as JSON (its merges and settings), or a one-line error."""
    path = Path(path)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise UsageError(f"a GGUF file carries its tokenizer and {path} does not exist; pass the tokenizer.json")
    try:
        text = path.read_text(encoding="utf-8")
        backend = HFTokenizer.from_str(text)
        data = json.loads(text)
    except (OSError, UnicodeDecodeError, RecursionError, ValueError) as exc:
        raise UsageError(f"{path} is not a valid tokenizer.json ({type(exc).__name__})") from None
    except Exception as exc:  # tokenizers raises plain Exception for malformed JSON
        raise UsageError(f"{path} is not a valid tokenizer.json ({first_line(exc, 120)})") from None
    return backend, data


def gguf_vocab(backend: HFTokenizer, tokenizer_json: dict[str, Any], vocab_size: int) -> GGUFVocab:
    """The tokenizer as GGUF metadata, or a one-line refusal (`llama_cpp_pre`, or ids llama.cpp cannot list)."""
    pre = llama_cpp_pre(tokenizer_json)
    by_id = {i: t for t, i in backend.get_vocab(with_added_tokens=True).items()}
    types = {i: _NORMAL for i in by_id}
    for i, added in backend.get_added_tokens_decoder().items():
        types[i] = _CONTROL if added.special else _USER_DEFINED
    n = len(by_id)
    if sorted(by_id) != list(range(n)):
        raise _refuse("the tokenizer's ids are not 0..N-1 without gaps, as llama.cpp's token list needs")
    if n > vocab_size:
        raise _refuse(f"the tokenizer has {n} tokens but the model's vocab_size is {vocab_size}; wrong tokenizer?")
    eot_id = next((i for i, t in by_id.items() if t == EOT), None)
    if eot_id is None:
        raise _refuse(f"the tokenizer has no {EOT} token to begin and end documents with")
    # Rows of the embedding past the tokenizer (vocab_size rounded up): tokens llama.cpp never produces.
    tokens = [by_id[i] for i in range(n)] + [f"[PAD{i}]" for i in range(n, vocab_size)]
    token_types = [types[i] for i in range(n)] + [_UNUSED] * (vocab_size - n)
    return GGUFVocab(pre, tokens, token_types, _merges(tokenizer_json.get("model") or {}), eot_id)


def _byte_level(tokenizer_json: dict[str, Any]) -> bool:
    pre = tokenizer_json.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    return any(step.get("type") == "ByteLevel" for step in steps)


# ----------------------------------------------------------------------------------------------
# Weights


def check_gguf_exportable(config: ModelConfig) -> None:
    """Refuse, in one line, a model llama.cpp's GPT-2 or LLaMA graph cannot compute; note an approximation."""
    config = config.resolved()
    gpt2 = config.architecture == "gpt2"
    only_ours = gpt2 and config.activation in GPT2_ACTIVATIONS and config.activation not in _GPT2_GELU
    gelu = (f"llama.cpp's GPT-2 has only GELU, this model has activation: {config.activation}",) if only_ours else ()
    check_exportable(config, target="GGUF", more=gelu)
    if gpt2:
        if config.activation == "gelu":
            log(
                "export: llama.cpp computes GPT-2's GELU with the tanh approximation and this model was trained "
                "with the exact one (activation: gelu); its logits there differ slightly from ours"
            )


def _permute_rope(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder each head's rows from rotate-half pairs (i, i + D/2) to llama.cpp's adjacent pairs
    (2i, 2i + 1), as llama.cpp's converter does for a transformers LLaMA."""
    shape = weight.shape
    return weight.reshape(n_heads, 2, shape[0] // n_heads // 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def _conv1d(name: str) -> bool:
    """Whether a transformers GPT-2 tensor is a Conv1D weight, stored (in, out)."""
    return name.endswith(("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight"))


def _tensor_order(name: str) -> tuple:
    """llama.cpp's order: embeddings, then block by block, then the final norm and the head."""
    found = re.match(r"blk\.(\d+)\.", name)
    if found:
        return (1, int(found.group(1)))
    return (0 if name.startswith(("token_embd", "position_embd")) else 2, 0)


def gguf_tensors(config: ModelConfig, state: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """(GGUF name, tensor in llama.cpp's layout) for every tensor of our state dict."""
    gguf = require_gguf()
    config = config.resolved()
    arch = gguf.MODEL_ARCH.GPT2 if config.architecture == "gpt2" else gguf.MODEL_ARCH.LLAMA
    names = gguf.get_tensor_name_map(arch, config.n_layers)
    out: list[tuple[str, torch.Tensor]] = []
    for hf_name, tensor in to_hf_state(config, state).items():
        if hf_name == "lm_head.weight" and config.tie_embeddings:
            continue  # llama.cpp reads token_embd for a missing output head
        base, suffix = hf_name.rsplit(".", 1)
        name = names.get_name(base)
        if name is None:  # a tensor gguf has no name for is a bug here, not the user's
            raise RuntimeError(f"gguf has no tensor name for {hf_name}")
        if _conv1d(hf_name):
            tensor = tensor.t()
        elif name.endswith(".attn_q"):
            tensor = _permute_rope(tensor, config.n_heads)
        elif name.endswith(".attn_k"):
            tensor = _permute_rope(tensor, config.n_kv_heads)
        out.append((f"{name}.{suffix}", tensor))
    yield from sorted(out, key=lambda item: _tensor_order(item[0]))


def _add_hparams(writer, config: ModelConfig) -> None:
    """The `<arch>.*` keys llama.cpp's GPT-2 / LLaMA loaders read."""
    writer.add_context_length(config.max_seq_len)
    writer.add_embedding_length(config.d_model)
    writer.add_feed_forward_length(config.d_ff)
    writer.add_block_count(config.n_layers)
    writer.add_head_count(config.n_heads)
    if config.architecture == "gpt2":
        writer.add_layer_norm_eps(config.rms_norm_eps)
        return
    writer.add_head_count_kv(config.n_kv_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_rope_freq_base(float(config.rope_theta))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)


def _add_vocab(writer, vocab: GGUFVocab) -> None:
    writer.add_tokenizer_model("gpt2")  # llama.cpp's name for byte-level BPE
    writer.add_tokenizer_pre(vocab.pre)
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.token_types)
    writer.add_token_merges(vocab.merges)
    # One token begins, ends and pads documents, as in training; llama.cpp adds none on its own.
    writer.add_bos_token_id(vocab.eot_id)
    writer.add_eos_token_id(vocab.eot_id)
    writer.add_pad_token_id(vocab.eot_id)
    writer.add_add_bos_token(False)
    writer.add_add_eos_token(False)


def _write(path: Path, name: str, config: ModelConfig, state: dict[str, torch.Tensor], vocab: GGUFVocab, dtype: str):
    gguf = require_gguf()
    writer = gguf.GGUFWriter(str(path), config.architecture)
    try:
        writer.add_name(name)
        writer.add_file_type(gguf.LlamaFileType.ALL_F32 if dtype == "f32" else gguf.LlamaFileType.MOSTLY_F16)
        _add_hparams(writer, config)
        _add_vocab(writer, vocab)
        for tensor_name, tensor in gguf_tensors(config, state):
            array = tensor.detach().to(torch.float32).contiguous().numpy()
            # llama.cpp keeps norms and biases (1-D) in float32 whatever the file type
            if dtype == "f16" and array.ndim > 1:
                array = array.astype(np.float16)
            writer.add_tensor(tensor_name, array)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()


# ----------------------------------------------------------------------------------------------
# Export


def check_output(output, overwrite: bool) -> None:
    """Refuse, before any work, a target that is a folder, that exists (without `overwrite`), or whose
    folder cannot be written (a URL: that exists without `overwrite`)."""
    url = buckets.Location(output).url
    if url is not None:
        if buckets.exists(url) and not overwrite:
            raise UsageError(f"{output} exists; choose another name or pass --overwrite to replace it")
        return
    check_output_file(output, overwrite, example="model.gguf")


def export_to_gguf(model_dir, output, *, tokenizer_file=None, dtype: str = "f32", overwrite: bool = False) -> str:
    """Write our model folder (with its tokenizer.json, or `tokenizer_file`) as one GGUF file; returns `output`.

    `output` is a file path or a URL (s3://...). The file is written next to the target first and moved
    into place in one rename (a URL: uploaded once written), so a failed export leaves nothing
    half-written and an existing file is replaced only with `overwrite`.
    """
    require_gguf()
    if dtype not in DTYPES:
        raise UsageError(f"unknown GGUF dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    model_dir = Path(model_dir)
    target = buckets.Location(output)
    check_output(output, overwrite)
    backend, tokenizer_json = read_tokenizer_json(
        model_dir / "tokenizer.json" if tokenizer_file is None else tokenizer_file
    )
    llama_cpp_pre(tokenizer_json)  # refused before the weights are read
    model = load_model_folder(model_dir)
    config = model.config.resolved()
    check_gguf_exportable(config)
    vocab = gguf_vocab(backend, tokenizer_json, config.vocab_size)
    state = {name: tensor.detach() for name, tensor in model.state_dict().items()}

    with target.staged(Path(str(output)).name) as final:
        remove_dead_temporary_files(final.parent, of=final.name)  # an export that was killed
        tmp = temporary_file(final)
        try:
            tmp.unlink(missing_ok=True)  # a symlink planted there goes, its target untouched
            os.close(no_follow(str(tmp), os.O_WRONLY | os.O_CREAT | os.O_EXCL))  # ours, new, no link followed
            _write(tmp, Path(str(output)).stem, config, state, vocab, dtype)
            os.chmod(tmp, new_file_mode())
            with open(tmp, "rb+") as written:
                os.fsync(written.fileno())  # on disk before the rename makes it the target
            target.put_file(tmp, final)  # renamed onto the target, or uploaded to its URL
        except OSError as exc:
            reason = "disk full" if disk_full(exc, tmp.parent) else exc.strerror or str(exc)
            raise UsageError(f"could not write {output} ({reason}); nothing was replaced") from None
        finally:
            tmp.unlink(missing_ok=True)
    return str(output)
