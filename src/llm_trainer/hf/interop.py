"""Hugging Face `transformers` interop: export our model folders as GPT-2 / LLaMA, import them back.

`export_to_hf` writes a folder that `AutoModelForCausalLM.from_pretrained` and
`AutoTokenizer.from_pretrained` load with no code of ours (`export_model`, which `model.save_pretrained`
calls, writes the same folder from a model in memory); `import_from_hf` turns a transformers GPT-2
or LLaMA folder (or hub name) into our `Transformer`. The weights map one to one, so logits agree to
float32 rounding. Only the layouts differ:

* GPT-2 stores its linear layers as `Conv1D`, i.e. transposed: (in, out) instead of (out, in).
* Our attention has three matrices q, k, v, as LLaMA; GPT-2 one fused `c_attn`, rows [q | k | v].
* Our SwiGLU MLP has gate and up matrices, as LLaMA.
* RoPE uses the rotate-half layout on both sides, so q and k need no permutation.

transformers is an optional dependency (`pip install 'llm-trainer[hf]'`); it is imported lazily.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..checkpoint.model_folder import clean_name, load_model_folder, load_model_state
from ..checkpoint.publish import check_target, publish
from ..config import ModelConfig
from ..errors import UsageError, first_line
from ..files.buckets import Location
from ..files.disk import with_default_mode
from ..model import Transformer
from ..tokenizer import EOT as EOT_TOKEN
from ..tokenizer import backend_from_json, load_backend, tokenizer_json
from .fast_tokenizer import require_transformers as _transformers
from .fast_tokenizer import save_tokenizer

if TYPE_CHECKING:
    from tokenizers import Tokenizer

# Our activation -> GPT2Config.activation_function.
GPT2_ACTIVATIONS = {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu", "silu": "silu"}
# GPT2Config.activation_function -> ours (several transformers names are the same tanh approximation).
_GPT2_ACTIVATIONS_BACK = {
    "gelu": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
    "relu": "relu",
    "silu": "silu",
    "swish": "silu",
}


# ----------------------------------------------------------------------------------------------
# Configs


def check_exportable(config: ModelConfig, target: str = "transformers", more: tuple[str, ...] = ()) -> None:
    """Refuse, in one line naming every one, the settings the target transformers class (or llama.cpp's
    graph of the same family, `target="GGUF"`) cannot express; `more`: the target's own problems."""
    problems = [*export_problems(config), *more]
    if problems:
        raise UsageError(f"cannot export to {target}: {'; '.join(problems)}")


def export_problems(config: ModelConfig) -> list[str]:
    """What in `config` transformers' GPT-2 or LLaMA cannot express, each with what to train instead."""
    problems = []
    if not config.pre_norm:
        problems.append(
            "post-norm blocks (pre_norm: false) exist in neither GPT-2 nor LLaMA; only pre-norm models export"
        )
    unknown = [name for name, value in (("qk_norm", config.qk_norm), ("logit_softcap", config.logit_softcap)) if value]
    if unknown:
        problems.append(
            f"{' and '.join(unknown)} {'is' if len(unknown) == 1 else 'are'} not part of transformers' "
            "GPT-2 or LLaMA; train without it to export"
        )
    if config.architecture == "gpt2":
        if config.norm != "layernorm":
            problems.append(
                f"GPT-2 uses LayerNorm, this model has norm: {config.norm} (use architecture: llama for RMSNorm)"
            )
        if config.position_embedding != "learned":
            problems.append(
                f"GPT-2 uses learned positions, this model has position_embedding: {config.position_embedding}"
            )
        if config.n_kv_heads != config.n_heads:
            problems.append(
                f"GPT-2 has no grouped-query attention (n_kv_heads={config.n_kv_heads}, n_heads={config.n_heads})"
            )
        if not config.bias:
            problems.append("GPT-2 always has biases; this model has bias: false")
        if config.activation == "swiglu":
            problems.append("GPT-2 has no gated MLP; activation: swiglu needs architecture: llama")
        elif config.activation not in GPT2_ACTIVATIONS:
            problems.append(f"transformers' GPT-2 has no activation {config.activation}")
    else:
        if config.norm != "rmsnorm":
            problems.append(f"LLaMA uses RMSNorm, this model has norm: {config.norm}")
        if config.position_embedding != "rope":
            problems.append(
                f"LLaMA uses rotary positions, this model has position_embedding: {config.position_embedding}"
            )
        if config.activation != "swiglu":
            problems.append(f"LLaMA's MLP is SwiGLU, this model has activation: {config.activation}")
    return problems


def _rope_kwargs(config_class, theta: float) -> dict[str, Any]:
    """transformers 5 takes `rope_parameters`; 4.x took a flat `rope_theta`."""
    if "rope_parameters" in inspect.signature(config_class).parameters:
        return {"rope_parameters": {"rope_type": "default", "rope_theta": theta}}
    return {"rope_theta": theta}


def to_hf_config(config: ModelConfig, eos_token_id: int | None = None):
    """The transformers config (GPT2Config or LlamaConfig) equivalent to `config`."""
    config = config.resolved()
    check_exportable(config)
    tf = _transformers()
    common = dict(
        vocab_size=config.vocab_size,
        initializer_range=config.init_std,
        bos_token_id=eos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=None,
        tie_word_embeddings=bool(config.tie_embeddings),
    )
    if config.architecture == "gpt2":
        return tf.GPT2Config(
            n_positions=config.max_seq_len,
            n_embd=config.d_model,
            n_layer=config.n_layers,
            n_head=config.n_heads,
            n_inner=config.d_ff,
            activation_function=GPT2_ACTIVATIONS[config.activation],
            resid_pdrop=config.dropout,
            embd_pdrop=config.dropout,
            attn_pdrop=config.attention_dropout,
            layer_norm_epsilon=config.rms_norm_eps,
            **common,
        )
    return tf.LlamaConfig(
        hidden_size=config.d_model,
        intermediate_size=config.d_ff,
        num_hidden_layers=config.n_layers,
        num_attention_heads=config.n_heads,
        num_key_value_heads=config.n_kv_heads,
        head_dim=config.head_dim,
        hidden_act="silu",
        max_position_embeddings=config.max_seq_len,
        rms_norm_eps=config.rms_norm_eps,
        attention_bias=bool(config.bias),
        mlp_bias=bool(config.bias),
        attention_dropout=config.attention_dropout,
        **_rope_kwargs(tf.LlamaConfig, config.rope_theta),
        **common,
    )


def _llama_rope_theta(hf_config) -> float:
    """The base of plain RoPE; scaled variants (llama3, yarn, ...) have no equivalent here."""
    params = getattr(hf_config, "rope_parameters", None)  # transformers 5
    if not params:  # transformers 4.x
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise UsageError(f"cannot import: RoPE scaling of type {rope_type!r} is not supported, only plain RoPE")
    partial = params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", None))
    if partial not in (None, 1, 1.0):
        raise UsageError(f"cannot import: partial rotary embeddings (partial_rotary_factor={partial}) are unsupported")
    return float(params.get("rope_theta", 10000.0))


def from_hf_config(hf_config) -> ModelConfig:
    """Our ModelConfig equivalent to a transformers GPT2Config or LlamaConfig."""
    model_type = getattr(hf_config, "model_type", None)

    def refuse(reason: str) -> None:
        raise UsageError(f"cannot import this {model_type} model: {reason}")

    if model_type == "gpt2":
        activation = _GPT2_ACTIVATIONS_BACK.get(hf_config.activation_function)
        if activation is None:
            refuse(f"activation_function {hf_config.activation_function!r} is not supported")
        scaled = getattr(hf_config, "scale_attn_weights", True)
        if not scaled or getattr(hf_config, "scale_attn_by_inverse_layer_idx", False):
            refuse("only the standard 1/sqrt(head_dim) attention scaling is supported")
        if getattr(hf_config, "add_cross_attention", False):
            refuse("cross-attention is not supported")
        values = dict(
            architecture="gpt2",
            n_kv_heads=hf_config.n_head,
            d_model=hf_config.n_embd,
            n_heads=hf_config.n_head,
            n_layers=hf_config.n_layer,
            d_ff=hf_config.n_inner or 4 * hf_config.n_embd,
            max_seq_len=hf_config.n_positions,
            dropout=float(hf_config.resid_pdrop),
            attention_dropout=float(hf_config.attn_pdrop),
            activation=activation,
            norm="layernorm",
            position_embedding="learned",
            bias=True,
            rms_norm_eps=float(hf_config.layer_norm_epsilon),
        )
    elif model_type == "llama":
        if hf_config.hidden_act not in ("silu", "swish"):
            refuse(f"hidden_act {hf_config.hidden_act!r} is not supported (only SwiGLU, i.e. silu)")
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        if head_dim * hf_config.num_attention_heads != hf_config.hidden_size:
            refuse(f"head_dim={head_dim} differs from hidden_size / num_attention_heads")
        attention_bias, mlp_bias = bool(hf_config.attention_bias), bool(getattr(hf_config, "mlp_bias", False))
        if attention_bias != mlp_bias:
            refuse(f"attention_bias={attention_bias} with mlp_bias={mlp_bias}; both must match")
        values = dict(
            architecture="llama",
            d_model=hf_config.hidden_size,
            n_heads=hf_config.num_attention_heads,
            n_kv_heads=hf_config.num_key_value_heads or hf_config.num_attention_heads,
            n_layers=hf_config.num_hidden_layers,
            d_ff=hf_config.intermediate_size,
            max_seq_len=hf_config.max_position_embeddings,
            attention_dropout=float(hf_config.attention_dropout or 0.0),
            activation="swiglu",
            norm="rmsnorm",
            position_embedding="rope",
            bias=attention_bias,
            rms_norm_eps=float(hf_config.rms_norm_eps),
            rope_theta=_llama_rope_theta(hf_config),
        )
    else:
        raise UsageError(f"cannot import model_type {model_type!r}: only gpt2 and llama models are supported")
    init_std = float(getattr(hf_config, "initializer_range", 0.02) or 0.02)
    try:
        return ModelConfig(
            vocab_size=hf_config.vocab_size,
            tie_embeddings=bool(getattr(hf_config, "tie_word_embeddings", model_type == "gpt2")),
            pre_norm=True,
            init_std=init_std,
            **values,
        )
    except ValueError as exc:
        raise UsageError(f"cannot import this {model_type} model: {exc}") from None


# ----------------------------------------------------------------------------------------------
# Weights


def _gpt2_pairs(config: ModelConfig):
    """(our name, transformers name, transposed) for every GPT-2 tensor except the head."""
    yield "tok_emb.weight", "transformer.wte.weight", False
    yield "pos_emb.weight", "transformer.wpe.weight", False
    for i in range(config.n_layers):
        ours, theirs = f"blocks.{i}.", f"transformer.h.{i}."
        for a, b, conv in (
            ("attn_norm", "ln_1", False),
            ("attn.proj", "attn.c_proj", True),
            ("mlp_norm", "ln_2", False),
            ("mlp.fc", "mlp.c_fc", True),
            ("mlp.proj", "mlp.c_proj", True),
        ):
            yield ours + a + ".weight", theirs + b + ".weight", conv
            yield ours + a + ".bias", theirs + b + ".bias", False
    yield "norm.weight", "transformer.ln_f.weight", False
    yield "norm.bias", "transformer.ln_f.bias", False


def _gpt2_qkv(config: ModelConfig):
    """(our q, k, v names, GPT-2's fused c_attn name, rows of each part) per layer and tensor kind."""
    kv = config.n_kv_heads * config.head_dim
    rows = [config.n_heads * config.head_dim, kv, kv]
    for i in range(config.n_layers):
        for s in (".weight", ".bias"):
            yield [f"blocks.{i}.attn.{p}{s}" for p in ("q", "k", "v")], f"transformer.h.{i}.attn.c_attn{s}", rows


def _llama_pairs(config: ModelConfig):
    """(our name, transformers name) for every LLaMA tensor that maps one to one, except the head."""
    suffixes = (".weight", ".bias") if config.bias else (".weight",)
    yield "tok_emb.weight", "model.embed_tokens.weight"
    for i in range(config.n_layers):
        ours, theirs = f"blocks.{i}.", f"model.layers.{i}."
        yield ours + "attn_norm.weight", theirs + "input_layernorm.weight"
        yield ours + "mlp_norm.weight", theirs + "post_attention_layernorm.weight"
        for s in suffixes:
            for a, b in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj"), ("proj", "o_proj")):
                yield ours + "attn." + a + s, theirs + "self_attn." + b + s
            for a, b in (("gate", "gate_proj"), ("up", "up_proj"), ("proj", "down_proj")):
                yield ours + "mlp." + a + s, theirs + "mlp." + b + s
    yield "norm.weight", "model.norm.weight"


VOCAB_ROWS = ("tok_emb.weight", "lm_head.weight")  # our tensors with one row per token id


def real_vocab_rows(config: ModelConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` with the embedding and head cut to the real vocabulary: padding rows are never exported."""
    return {k: v[: config.vocab_size] if k in VOCAB_ROWS else v for k, v in state.items()}


def padded_vocab_rows(config: ModelConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` (real rows only) with zero rows appended up to the model's padded vocabulary."""

    def pad(tensor: torch.Tensor) -> torch.Tensor:
        extra = config.padded_vocab_size - tensor.shape[0]
        return torch.cat([tensor, tensor.new_zeros(extra, *tensor.shape[1:])]) if extra > 0 else tensor

    return {k: pad(v) if k in VOCAB_ROWS else v for k, v in state.items()}


def to_hf_state(config: ModelConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our state dict (with `lm_head.weight`, tied or not) -> the transformers model's names and layouts,
    the real vocabulary's rows only."""
    config = config.resolved()
    state = real_vocab_rows(config, state)
    out: dict[str, torch.Tensor] = {}
    if config.architecture == "gpt2":
        for ours, theirs, conv in _gpt2_pairs(config):
            out[theirs] = state[ours].t().contiguous() if conv else state[ours]  # (out, in) -> Conv1D (in, out)
        for parts, theirs, _ in _gpt2_qkv(config):  # q (H*D, ...), k, v (K*D, ...) -> c_attn (..., (H + 2K) D)
            out[theirs] = torch.cat([state[p] for p in parts]).t().contiguous()
    else:
        out.update({theirs: state[ours] for ours, theirs in _llama_pairs(config)})
    out["lm_head.weight"] = state["lm_head.weight"]
    return out


def from_hf_state(config: ModelConfig, hf_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A transformers GPT-2/LLaMA state dict -> our names and layouts (no `lm_head.weight` when tied), the
    embedding and head padded with zero rows to `config`'s padded vocabulary."""
    config = config.resolved()
    out: dict[str, torch.Tensor] = {}
    if config.architecture == "gpt2":
        for ours, theirs, conv in _gpt2_pairs(config):
            out[ours] = hf_state[theirs].t().contiguous() if conv else hf_state[theirs]  # Conv1D (in, out) -> (out, in)
        for parts, theirs, rows in _gpt2_qkv(config):  # c_attn (..., (H + 2K) D) -> q, k, v (rows, ...)
            pieces = hf_state[theirs].t().split(rows, dim=0)
            out.update({p: piece.contiguous() for p, piece in zip(parts, pieces, strict=True)})
    else:
        out.update({ours: hf_state[theirs] for ours, theirs in _llama_pairs(config)})
    if not config.tie_embeddings:
        out["lm_head.weight"] = hf_state["lm_head.weight"]
    return padded_vocab_rows(config, out)


# ----------------------------------------------------------------------------------------------
# Export


def _resolve_tokenizer_file(model_dir: Path, tokenizer_file) -> Path | None:
    if tokenizer_file is None:
        found = model_dir / "tokenizer.json"  # checkpoint folders carry their tokenizer
        return found if found.is_file() else None
    path = Path(tokenizer_file)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise UsageError(f"tokenizer file {path} does not exist; pass the tokenizer.json the model was trained with")
    return path


def _format_count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)


def _model_card(
    name: str,
    config: ModelConfig,
    hf_class: str,
    n_params: int,
    metrics: dict | None,
    has_tokenizer: bool,
    text_cleaning: list[str] | None = None,
) -> str:
    """The export's README.md. `text_cleaning`: how the run cleaned characters before tokenizing (in words,
    then Python lines: `Cleaner.described`), which text given to the model should get too."""
    family = "GPT-2" if config.architecture == "gpt2" else "LLaMA"
    lines = [
        "---",
        "library_name: transformers",
        "pipeline_tag: text-generation",
        f"tags: [llm-trainer, {config.architecture}, causal-lm]",
        "---",
        "",
        f"# {name}",
        "",
        f"A {family}-style decoder-only language model trained with llm-trainer and exported to the",
        f"Hugging Face `transformers` format as `{hf_class}`.",
        "",
        "## Usage",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM" + (", AutoTokenizer" if has_tokenizer else ""),
        "",
        f'model = AutoModelForCausalLM.from_pretrained("{name}")',
    ]
    if has_tokenizer:
        lines += [
            f'tokenizer = AutoTokenizer.from_pretrained("{name}")',
            'inputs = tokenizer("Once upon a time", return_tensors="pt")',
            "print(tokenizer.decode(model.generate(**inputs, max_new_tokens=40)[0]))",
        ]
    lines += ["```", ""]
    if text_cleaning and has_tokenizer:
        words, *code = text_cleaning
        lines += [
            "## Input text",
            "",
            f"The training text was cleaned before it was tokenized: {words}. Clean a prompt the same way for",
            "the tokens the model was trained on:",
            "",
            "```python",
            "import re, unicodedata",
            "",
            *code,
            "```",
            "",
        ]
    lines += [
        "## Model",
        "",
        f"- architecture: {config.architecture} (`{hf_class}`)",
        f"- parameters: {n_params:,} ({_format_count(n_params)})",
        "",
        "| setting | value |",
        "| --- | --- |",
    ]
    for key in (
        "vocab_size",
        "d_model",
        "n_layers",
        "n_heads",
        "n_kv_heads",
        "d_ff",
        "max_seq_len",
        "activation",
        "norm",
        "position_embedding",
        "bias",
        "tie_embeddings",
        "rms_norm_eps",
        "rope_theta",
    ):
        if key == "rope_theta" and config.position_embedding != "rope":
            continue
        lines.append(f"| {key} | {getattr(config, key)} |")
    if metrics:
        lines += ["", "## Metrics", "", "| metric | value |", "| --- | --- |"]
        for key, value in metrics.items():
            shown = f"{value:.4g}" if isinstance(value, float) else str(value)
            lines.append(f"| {key} | {shown} |")
    return "\n".join(lines) + "\n"


def export_to_hf(
    model_dir,
    output_dir,
    *,
    tokenizer_file=None,
    metrics: dict | None = None,
    max_shard_size_bytes: int = 5 * 2**30,
    overwrite: bool = False,
    text_cleaning: list[str] | None = None,
) -> Path:
    """Write our model folder as a transformers GPT-2/LLaMA folder; returns `output_dir`.

    `tokenizer_file` defaults to `model_dir/tokenizer.json` when that exists. The folder is built next
    to `output_dir` first, so a failed export leaves nothing half-written; a non-empty `output_dir`
    is refused unless `overwrite`, which replaces only the files an export writes (see
    `checkpoint.publish`).
    """
    model_dir, output_dir = Path(model_dir), Path(output_dir)
    _transformers()
    check_target(output_dir, model_dir, overwrite)  # before the weights are read
    model = load_model_folder(model_dir)
    tokenizer_path = _resolve_tokenizer_file(model_dir, tokenizer_file)
    backend = load_backend(tokenizer_path) if tokenizer_path is not None else None
    return export_model(
        model,
        output_dir,
        tokenizer=backend,
        tokenizer_name=str(tokenizer_path),
        metrics=metrics,
        max_shard_size_bytes=max_shard_size_bytes,
        overwrite=overwrite,
        source=model_dir,
        text_cleaning=text_cleaning,
    )


def export_model(
    model: Transformer,
    output_dir,
    *,
    tokenizer: Tokenizer | None = None,
    metrics: dict | None = None,
    max_shard_size_bytes: int = 5 * 2**30,
    overwrite: bool = False,
    source: Path | None = None,
    tokenizer_name: str = "the tokenizer",
    overwrite_hint: str = "pass --overwrite",
    text_cleaning: list[str] | None = None,
) -> Path:
    """Write a model in memory (and its `tokenizers.Tokenizer`, if given) as the folder `export_to_hf`
    writes, through the same `checkpoint.publish` rules; `model.save_pretrained` is this. `source`: the
    folder the model was read from, which the output may not hold; the names are for messages.
    `text_cleaning`: the run's character cleaning, said in the model card (`_model_card`)."""
    tf = _transformers()
    output_dir = Path(output_dir)
    config = model.config
    check_exportable(config)
    if max_shard_size_bytes <= 0:
        raise UsageError(f"max_shard_size_bytes must be positive, got {max_shard_size_bytes}")
    if tokenizer is not None and tokenizer.get_vocab_size(with_added_tokens=True) > config.vocab_size:
        raise UsageError(
            f"{tokenizer_name} has {tokenizer.get_vocab_size(with_added_tokens=True)} tokens but the model's "
            f"vocab_size is {config.vocab_size}; wrong tokenizer?"
        )
    check_target(output_dir, source, overwrite, overwrite_hint)

    def build(tmp: Path) -> None:
        eot_id = save_tokenizer(tokenizer, EOT_TOKEN, tmp, config.max_seq_len) if tokenizer is not None else None
        hf_config = to_hf_config(config, eos_token_id=eot_id)
        model_class = tf.GPT2LMHeadModel if config.architecture == "gpt2" else tf.LlamaForCausalLM
        with torch.device("meta"):  # no random init, no second copy: the weights are assigned below
            hf_model = model_class(hf_config)
        # under the names of the bare model (a trained one may hold checkpoint or compile wrappers), on the CPU
        state = {clean_name(name): tensor.detach().cpu() for name, tensor in model.state_dict().items()}
        hf_model.load_state_dict(to_hf_state(config, state), strict=True, assign=True)
        if config.tie_embeddings:
            hf_model.tie_weights()
        hf_model.generation_config = tf.GenerationConfig(bos_token_id=eot_id, eos_token_id=eot_id)
        hf_model.save_pretrained(str(tmp), max_shard_size=int(max_shard_size_bytes))
        for weights in tmp.glob("*.safetensors"):
            with_default_mode(weights)
        card = _model_card(
            output_dir.name,
            config,
            model_class.__name__,
            hf_model.num_parameters(),
            metrics,
            tokenizer is not None,
            text_cleaning,
        )
        (tmp / "README.md").write_text(card)

    publish(output_dir, build, source=source, overwrite=overwrite, overwrite_hint=overwrite_hint)
    return output_dir


def save_pretrained(model: Transformer, save_directory, tokenizer: Any = None, *, overwrite: bool = False) -> Path:
    """`model.save_pretrained(dir)`: `export_model` for a model in memory, with `tokenizer` given as ours,
    a `tokenizers.Tokenizer` or a transformers fast tokenizer (anything else is refused in one line)."""

    Location(save_directory).refuse_url(
        f"save_pretrained writes a local folder, not {save_directory}; save it locally, or save a checkpoint "
        f"and run llm-trainer export --checkpoint DIR --output {save_directory}"
    )
    backend = None
    if tokenizer is not None:
        text = tokenizer_json(tokenizer)
        if text is None:
            raise UsageError(
                f"save_pretrained(tokenizer=...) takes llm-trainer's Tokenizer, a tokenizers.Tokenizer or a "
                f"transformers fast tokenizer, got {type(tokenizer).__name__}; or save the tokenizer on its own"
            )
        backend = backend_from_json(text, "save_pretrained(tokenizer=...)")
    return export_model(
        model, save_directory, tokenizer=backend, overwrite=overwrite, overwrite_hint="pass overwrite=True"
    )


# ----------------------------------------------------------------------------------------------
# Import


def _local_folder(path_or_name) -> Path:
    """A local folder as is; a hub name is downloaded (config, safetensors weights, tokenizer files)."""
    path = Path(path_or_name).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            hint = (
                "; it is an llm-trainer model folder, load it with llm_trainer.checkpoint.model_folder.load_model_folder"
                if (path / "model_config.json").is_file()
                else ""
            )
            raise UsageError(f"{path} is not a transformers model folder (no config.json){hint}")
        return path
    text = str(path_or_name)
    if path.is_absolute() or text.startswith((".", "~")) or text.count("/") > 1:
        raise UsageError(f"{text} does not exist; pass a transformers model folder or a Hugging Face Hub name")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(text, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model"]))
    except Exception as exc:  # hub errors: unknown repo, gated repo, no network
        reason = f"{type(exc).__name__}: {exc}"
        raise UsageError(f"could not download {text!r} from the Hugging Face Hub ({reason})") from None


def import_from_hf(path_or_name) -> tuple[Transformer, Tokenizer | None]:
    """Load a transformers GPT-2/LLaMA model as our Transformer, with its tokenizer.json when it has one.

    A path that exists is read offline; anything else is taken as a Hugging Face Hub name. The model comes
    back in training mode, like `load_model_folder`; call `.eval()` for inference.
    """
    tf = _transformers()
    folder = _local_folder(path_or_name)
    try:
        model_type = json.loads((folder / "config.json").read_text(encoding="utf-8")).get("model_type")
    except (OSError, UnicodeDecodeError, ValueError, AttributeError):
        raise UsageError(f"{folder / 'config.json'} is not a JSON object; the transformers folder is corrupt") from None
    if model_type not in ("gpt2", "llama"):
        raise UsageError(f"cannot import model_type {model_type!r} from {path_or_name}: only gpt2 and llama work")
    if not any(folder.glob("*.safetensors")):  # pytorch_model.bin & co. are pickles: never handed to torch.load
        pickles = sorted(p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt", ".pkl"))
        found = f" (it has {', '.join(pickles)}, a pickle that could run code)" if pickles else ""
        raise UsageError(
            f"{path_or_name} has no safetensors weights{found}; convert them to model.safetensors "
            "in a process you trust, then import that folder"
        )
    try:
        hf_config = tf.AutoConfig.from_pretrained(str(folder), local_files_only=True)
        config = from_hf_config(hf_config)
    except UsageError:
        raise
    except Exception as exc:  # transformers' own validation of a malformed config.json
        raise UsageError(f"{folder / 'config.json'} could not be read ({first_line(exc, 160)})") from None

    major, minor = (int(p) for p in tf.__version__.split(".")[:2])
    dtype_kw = "dtype" if (major, minor) >= (4, 56) else "torch_dtype"
    try:
        hf_model = tf.AutoModelForCausalLM.from_pretrained(
            str(folder), local_files_only=True, use_safetensors=True, **{dtype_kw: torch.float32}
        )
    except OSError as exc:
        raise UsageError(f"could not load the weights of {path_or_name} ({exc})") from None
    hf_state = {name: tensor.detach() for name, tensor in hf_model.state_dict().items()}
    model = Transformer(config)
    load_model_state(model, from_hf_state(config, hf_state), str(path_or_name))
    del hf_model, hf_state

    tokenizer = None
    if (folder / "tokenizer.json").is_file():
        tokenizer = load_backend(folder / "tokenizer.json")
    return model, tokenizer
