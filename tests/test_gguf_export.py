"""`export --format gguf`: one GGUF file, written with llama.cpp's own `gguf` library.

What it shows: transformers loads the file (`gguf_file=`) with logits equal to our model's, for both
families (GPT-2 and LLaMA, tied and untied heads, grouped-query attention, biases); llama.cpp's
tokenizer, rebuilt from nothing but the file (`gguf.GGUFReader`) and llama.cpp's own pre-tokenizer
regexes, gives our ids on a multilingual text; every tokenizer or model llama.cpp could not reproduce
is refused in one line before anything is written.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

gguf = pytest.importorskip("gguf")

from conftest import dead_pid  # noqa: E402
from llm_trainer import cli  # noqa: E402
from llm_trainer.checkpoint.model_folder import save_model_folder  # noqa: E402
from llm_trainer.config import ModelConfig  # noqa: E402
from llm_trainer.errors import UsageError  # noqa: E402
from llm_trainer.files import atomic  # noqa: E402
from llm_trainer.hf.gguf import export_to_gguf  # noqa: E402
from llm_trainer.model import Transformer  # noqa: E402
from llm_trainer.tokenizer import Tokenizer  # noqa: E402
from test_object_storage import s3, s3_server  # noqa: E402, F401  (the local S3 server's fixtures)

# Latin, Cyrillic, CJK, Arabic, emoji, digits, contractions, whitespace runs, tabs and newlines.
MULTILINGUAL = (
    "Hello world, it's 2024! We've met 1234567 times.\n"
    "Привет, мир! Как дела? Всё хорошо.\n"
    "你好，世界。今天天气很好。\n"
    "مرحبا بالعالم، كيف حالك؟\n"
    "Emoji: 😀🎉👍🏽 and ZWJ 👨‍👩‍👧 done.\n"
    "Numbers 3.14159 and 42, 007.\n"
    "Spaces:    four,\t\ttabs,\n\n\nthree newlines,  \n trailing   "
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog. It's 10 o'clock and we're 42 years old.",
    "Привет мир! Съешь же ещё этих мягких французских булок, да выпей чаю. 2023 год.",
    "你好世界，我们今天学习中文。天气很好，我们去公园散步。",
    "مرحبا بالعالم. هذا نص عربي قصير للاختبار، والأرقام ١٢٣ و 456.",
    "Emoji 😀😀🎉🎉 👍🏽 and more 😀 text.    Indented\tcode\n\n  lines  ",
] * 20
VOCAB = 400  # the tokenizers below have fewer tokens: the rest are padding rows llama.cpp marks unused


def bpe(pre_split: str) -> Tokenizer:
    return Tokenizer.train_bpe(CORPUS, vocab_size=360, max_chars=10**6, pre_split=pre_split)


def randomized(config: ModelConfig) -> Transformer:
    """Every parameter random, norms and biases too, so that a mis-mapped tensor cannot hide."""
    model = Transformer(config)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model.eval()


def model_folder(root: Path, tokenizer: Tokenizer | None, **model) -> tuple[Path, Transformer]:
    values = dict(vocab_size=VOCAB, d_model=16, n_heads=4, n_layers=2, max_seq_len=32, d_ff=24)
    values.update(model)
    ours = randomized(ModelConfig(**values))
    folder = root / "model"
    save_model_folder(ours, folder)
    if tokenizer is not None:
        tokenizer.save(folder)
    return folder, ours


def read_fields(path: Path) -> dict:
    """The file's metadata as plain values (strings, numbers, lists)."""
    reader = gguf.GGUFReader(str(path))
    return {name: field.contents() for name, field in reader.fields.items()}


# ----------------------------------------------------------------------------------------------
# The weights: transformers' GGUF loader gives our logits


# transformers' GGUF loader reads no key for these, so they are passed to it: n_positions (it reads
# context_length into n_ctx), n_inner, LLaMA's biases and a tied head (llama.cpp reads token_embd then).
CASES = {
    "gpt2": (dict(architecture="gpt2", activation="gelu_tanh", d_ff=64), "gpt2", dict(n_positions=32, n_inner=64)),
    "gpt2-untied": (
        dict(architecture="gpt2", activation="gelu_tanh", d_ff=64, tie_embeddings=False),
        "llama3",
        dict(n_positions=32, n_inner=64, tie_word_embeddings=False),
    ),
    "llama-gqa": (dict(architecture="llama", n_kv_heads=2), "llama3", {}),
    "llama-tied": (dict(architecture="llama", tie_embeddings=True), "gpt2", dict(tie_word_embeddings=True)),
    "llama-bias": (
        dict(architecture="llama", bias=True, n_kv_heads=1),
        "llama3",
        dict(attention_bias=True, mlp_bias=True),
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_transformers_loads_the_gguf_with_our_logits(tmp_path, case):
    transformers = pytest.importorskip("transformers")
    model, pre_split, loader_kwargs = CASES[case]
    folder, ours = model_folder(tmp_path, bpe(pre_split), **model)
    out = tmp_path / "model.gguf"
    assert export_to_gguf(folder, out) == str(out)

    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=out.name, dtype=torch.float32, **loader_kwargs
    ).eval()
    ids = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (ours(ids) - theirs(ids).logits).abs().max().item() <= 1e-5

    fields = read_fields(out)
    arch = model["architecture"]
    assert fields["general.architecture"] == arch
    assert fields["general.file_type"] == 0  # all float32
    assert fields[f"{arch}.context_length"] == 32 and fields[f"{arch}.block_count"] == 2
    names = [t.name for t in gguf.GGUFReader(str(out)).tensors]
    assert names[0] == "token_embd.weight" and names[-1] in ("output_norm.weight", "output_norm.bias", "output.weight")
    assert ("output.weight" in names) == (not ours.config.resolved().tie_embeddings)


def llama_cpp_llama_logits(path: Path, ids: torch.Tensor) -> torch.Tensor:
    """llama.cpp's LLaMA graph (llm_build_llama) on one sequence, from the file alone: RMSNorm, RoPE in
    its normal mode (adjacent pairs (2i, 2i+1) rotated by pos * base^(-2i/D)), causal attention with
    grouped kv heads, SwiGLU, the head or else token_embd. Independent of transformers' loader."""
    fields = read_fields(path)
    w = {t.name: torch.from_numpy(t.data.copy()).float() for t in gguf.GGUFReader(str(path)).tensors}
    n_head, n_kv = fields["llama.attention.head_count"], fields["llama.attention.head_count_kv"]
    d_head, eps = fields["llama.attention.key_length"], fields["llama.attention.layer_norm_rms_epsilon"]
    base, n_layer = fields["llama.rope.freq_base"], fields["llama.block_count"]
    T = ids.numel()
    pairs = base ** (-torch.arange(0, d_head, 2, dtype=torch.float64) / d_head)
    angle = torch.arange(T, dtype=torch.float64)[:, None] * pairs[None, :]
    cos, sin = angle.cos().float(), angle.sin().float()

    def rms(x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight

    def linear(x, name):
        out = x @ w[name + ".weight"].T
        return out + w[name + ".bias"] if name + ".bias" in w else out

    def rope(x):  # (T, heads, d_head)
        x0, x1 = x[..., 0::2], x[..., 1::2]
        c, s = cos[:, None, :], sin[:, None, :]
        return torch.stack([x0 * c - x1 * s, x0 * s + x1 * c], dim=-1).flatten(-2)

    x = w["token_embd.weight"][ids.flatten()]
    mask = torch.ones(T, T).tril().bool()
    for i in range(n_layer):
        b = f"blk.{i}."
        h = rms(x, w[b + "attn_norm.weight"])
        q = rope(linear(h, b + "attn_q").view(T, n_head, d_head))
        k = rope(linear(h, b + "attn_k").view(T, n_kv, d_head)).repeat_interleave(n_head // n_kv, dim=1)
        v = linear(h, b + "attn_v").view(T, n_kv, d_head).repeat_interleave(n_head // n_kv, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / d_head**0.5
        attn = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        x = x + linear(torch.einsum("hqk,khd->qhd", attn, v).reshape(T, n_head * d_head), b + "attn_output")
        h = rms(x, w[b + "ffn_norm.weight"])
        x = x + linear(torch.nn.functional.silu(linear(h, b + "ffn_gate")) * linear(h, b + "ffn_up"), b + "ffn_down")
    head = w.get("output.weight", w["token_embd.weight"])
    return rms(x, w["output_norm.weight"]) @ head.T


def llama_cpp_gpt2_logits(path: Path, ids: torch.Tensor) -> torch.Tensor:
    """llama.cpp's GPT-2 graph (llm_build_gpt2) on one sequence, from the file alone: learned positions,
    LayerNorm, one qkv matrix cut [q | k | v], GELU (tanh), the head or else token_embd."""
    fields = read_fields(path)
    w = {t.name: torch.from_numpy(t.data.copy()).float() for t in gguf.GGUFReader(str(path)).tensors}
    n_head, eps = fields["gpt2.attention.head_count"], fields["gpt2.attention.layer_norm_epsilon"]
    d_model, n_layer = fields["gpt2.embedding_length"], fields["gpt2.block_count"]
    T, d_head = ids.numel(), d_model // n_head
    F = torch.nn.functional

    def norm(x, name):
        return F.layer_norm(x, (d_model,), w[name + ".weight"], w[name + ".bias"], eps)

    def linear(x, name):
        return x @ w[name + ".weight"].T + w[name + ".bias"]

    x = w["token_embd.weight"][ids.flatten()] + w["position_embd.weight"][:T]
    mask = torch.ones(T, T).tril().bool()
    for i in range(n_layer):
        b = f"blk.{i}."
        q, k, v = linear(norm(x, b + "attn_norm"), b + "attn_qkv").view(T, 3, n_head, d_head).unbind(1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / d_head**0.5
        attn = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        x = x + linear(torch.einsum("hqk,khd->qhd", attn, v).reshape(T, d_model), b + "attn_output")
        x = x + linear(F.gelu(linear(norm(x, b + "ffn_norm"), b + "ffn_up"), approximate="tanh"), b + "ffn_down")
    head = w.get("output.weight", w["token_embd.weight"])
    return norm(x, "output_norm") @ head.T


@pytest.mark.parametrize("case", ["gpt2", "gpt2-untied", "llama-gqa", "llama-tied", "llama-bias"])
def test_llama_cpps_graph_on_the_file_gives_our_logits(tmp_path, case):
    model, pre_split, _ = CASES[case]
    folder, ours = model_folder(tmp_path, bpe(pre_split), **model)
    export_to_gguf(folder, tmp_path / "model.gguf")
    ids = torch.randint(0, VOCAB, (1, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        reference = llama_cpp_gpt2_logits if model["architecture"] == "gpt2" else llama_cpp_llama_logits
        assert (ours(ids)[0] - reference(tmp_path / "model.gguf", ids)).abs().max().item() <= 1e-4


def test_f16_keeps_norms_and_biases_in_float32_and_stays_close(tmp_path):
    transformers = pytest.importorskip("transformers")
    folder, ours = model_folder(tmp_path, bpe("llama3"), architecture="llama", bias=True)
    out = tmp_path / "half.gguf"
    export_to_gguf(folder, out, dtype="f16")
    tensors = {t.name: t.tensor_type for t in gguf.GGUFReader(str(out)).tensors}
    assert tensors["blk.0.attn_q.weight"] == gguf.GGMLQuantizationType.F16
    assert tensors["blk.0.attn_q.bias"] == tensors["blk.0.attn_norm.weight"] == gguf.GGMLQuantizationType.F32
    assert read_fields(out)["general.file_type"] == 1  # mostly float16
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=out.name, dtype=torch.float32, attention_bias=True, mlp_bias=True
    ).eval()
    ids = torch.randint(0, VOCAB, (1, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert (ours(ids) - theirs(ids).logits).abs().max().item() <= 5e-2


# ----------------------------------------------------------------------------------------------
# The tokenizer: llama.cpp's, rebuilt from the file, tokenizes as ours

# llama.cpp's pre-tokenizer regexes (src/llama-vocab.cpp, llm_tokenizer_bpe, `regex_exprs`), as its
# source spells them: `gpt-2` without GPT-2's final `|\s+` (llama.cpp keeps text no branch matches as
# a piece of its own, which is what `\s+` would have matched), `llama-bpe` with the case-insensitive
# contractions written out.
LLAMA_CPP_REGEX = {
    "gpt-2": r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
    "llama-bpe": (
        r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
        r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    ),
}
# llama.cpp looks a whole piece up before merging it (`ignore_merges`) for these pre-tokenizers.
IGNORE_MERGES = {"llama-bpe"}


def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map (llama.cpp's unicode_byte_to_utf8)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, n = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(printable, map(chr, chars)))


def llama_cpp_tokenize(path: Path, text: str) -> list[int]:
    """What llama.cpp's BPE tokenizer (llm_tokenizer_bpe_session) gives `text`, from the GGUF file alone:
    split by the regex `tokenizer.ggml.pre` names, map bytes to GPT-2's alphabet, merge by rank."""
    regex = pytest.importorskip("regex")  # the Unicode classes (\p{L}) llama.cpp's regexes use

    fields = read_fields(path)
    assert fields["tokenizer.ggml.model"] == "gpt2"
    pre = fields["tokenizer.ggml.pre"]
    ids = {token: i for i, token in enumerate(fields["tokenizer.ggml.tokens"])}
    ranks = {tuple(m.split(" ")): r for r, m in enumerate(fields["tokenizer.ggml.merges"])}
    alphabet = byte_alphabet()

    pieces, end = [], 0
    for match in regex.finditer(LLAMA_CPP_REGEX[pre], text):
        if match.start() > end:
            pieces.append(text[end : match.start()])  # text no branch matched: a piece of its own
        pieces.append(match.group())
        end = match.end()
    if end < len(text):
        pieces.append(text[end:])

    out = []
    for piece in pieces:
        word = "".join(alphabet[b] for b in piece.encode("utf-8"))
        if pre in IGNORE_MERGES and word in ids:
            out.append(ids[word])
            continue
        symbols = list(word)
        while len(symbols) > 1:
            best = min(range(len(symbols) - 1), key=lambda i: (ranks.get((symbols[i], symbols[i + 1]), 1 << 60), i))
            if (symbols[best], symbols[best + 1]) not in ranks:
                break
            symbols[best : best + 2] = [symbols[best] + symbols[best + 1]]
        out.extend(ids[s] for s in symbols)
    return out


@pytest.mark.parametrize("pre_split, pre", [("gpt2", "gpt-2"), ("llama3", "llama-bpe")])
def test_llama_cpps_tokenizer_from_the_file_gives_our_ids_on_multilingual_text(tmp_path, pre_split, pre):
    tokenizer = bpe(pre_split)
    folder, _ = model_folder(tmp_path, tokenizer, architecture="llama")
    out = tmp_path / "model.gguf"
    export_to_gguf(folder, out)

    fields = read_fields(out)
    assert fields["tokenizer.ggml.pre"] == pre
    assert (fields["tokenizer.ggml.bos_token_id"], fields["tokenizer.ggml.eos_token_id"]) == (tokenizer.eot_id,) * 2
    assert fields["tokenizer.ggml.add_bos_token"] is False and fields["tokenizer.ggml.add_eos_token"] is False
    types = fields["tokenizer.ggml.token_type"]
    assert len(types) == VOCAB and types[tokenizer.eot_id] == 3  # control
    assert set(types[tokenizer.vocab_size :]) == {5}  # the padding rows: unused

    ours = tokenizer.encode(MULTILINGUAL)
    assert len(ours) < len(MULTILINGUAL.encode("utf-8"))  # the merges are exercised, not bytes alone
    assert llama_cpp_tokenize(out, MULTILINGUAL) == ours
    assert tokenizer.decode(ours) == MULTILINGUAL

    transformers = pytest.importorskip("transformers")
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=out.name)
    assert theirs(MULTILINGUAL, add_special_tokens=False)["input_ids"] == ours


# ----------------------------------------------------------------------------------------------
# Refusals: one line, before anything is written


def refused(tmp_path, folder, capsys, *extra) -> str:
    """The one line `export --format gguf` refuses with (exit 2, no traceback, no file)."""
    out = tmp_path / "refused.gguf"
    capsys.readouterr()
    code = cli.main(["export", "--checkpoint", str(folder), "--output", str(out), "--format", "gguf", *extra])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "Traceback" not in err and len(err.splitlines()) == 1, err
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".refused")]
    return err


def test_our_unicode_pre_split_is_refused_naming_the_option(tmp_path, capsys):
    folder, _ = model_folder(tmp_path, bpe("unicode"), architecture="llama")
    err = refused(tmp_path, folder, capsys)
    assert "data.tokenizer_pre_split: unicode" in err and "data.tokenizer_pre_split: gpt2 or llama3" in err


def test_the_char_tokenizer_is_refused_naming_the_option(tmp_path, capsys):
    folder, _ = model_folder(tmp_path, Tokenizer.build_char(["the cat"]), architecture="llama")
    err = refused(tmp_path, folder, capsys)
    assert "data.tokenizer: char" in err and "data.tokenizer: bpe" in err


def test_a_model_llama_cpp_cannot_compute_and_a_missing_tokenizer_are_refused(tmp_path, capsys):
    folder, _ = model_folder(tmp_path, bpe("gpt2"), architecture="gpt2", activation="relu")
    assert "llama.cpp's GPT-2 has only GELU" in refused(tmp_path, folder, capsys)
    folder, _ = model_folder(tmp_path / "qk", bpe("gpt2"), architecture="llama", qk_norm=True)
    assert "cannot export to GGUF: qk_norm" in refused(tmp_path, folder, capsys)
    folder, _ = model_folder(tmp_path / "none", None, architecture="llama")
    assert "carries its tokenizer" in refused(tmp_path, folder, capsys)
    (folder / "tokenizer.json").write_text('{"model": {"type": "BPE", "vocab": {"a": "not an id"}}}')
    assert "is not a valid tokenizer.json" in refused(tmp_path, folder, capsys)
    folder, _ = model_folder(tmp_path / "dtype", bpe("gpt2"), architecture="llama")
    assert cli.main(["export", "--checkpoint", str(folder), "--output", str(tmp_path / "hf"), "--dtype", "f16"]) == 2
    assert "--format gguf" in capsys.readouterr().err


def test_an_existing_file_is_kept_without_overwrite_and_replaced_with_it(tmp_path, capsys):
    folder, _ = model_folder(tmp_path, bpe("gpt2"), architecture="llama")
    out = tmp_path / "model.gguf"
    out.write_bytes(b"the user's file")
    argv = ["export", "--checkpoint", str(folder), "--output", str(out), "--format", "gguf"]
    assert cli.main(argv) == 2
    assert "--overwrite" in capsys.readouterr().err and out.read_bytes() == b"the user's file"
    host = atomic.owner().rsplit("-", 1)[0]
    killed = tmp_path / f".model.gguf.tmp-1-{host}-{dead_pid()}"  # the partial file of an export killed -9
    killed.write_bytes(b"half a gguf")
    assert cli.main([*argv, "--overwrite"]) == 0
    assert read_fields(out)["general.architecture"] == "llama"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "model.gguf"]
    with pytest.raises(UsageError, match="is a folder"):
        export_to_gguf(folder, tmp_path, overwrite=True)
    # a link to a file on another disk: the file it names gets the export, the link stays
    disk = tmp_path / "disk"
    disk.mkdir()
    (disk / "model.gguf").write_bytes(b"an older export")
    (tmp_path / "linked.gguf").symlink_to(disk / "model.gguf")
    export_to_gguf(folder, tmp_path / "linked.gguf", overwrite=True)
    assert (tmp_path / "linked.gguf").is_symlink() and read_fields(disk / "model.gguf")[
        "general.architecture"
    ] == "llama"
    assert sorted(p.name for p in disk.iterdir()) == ["model.gguf"]


def test_a_gpt2_with_exact_gelu_exports_with_a_note_on_llama_cpps_approximation(tmp_path, capsys):
    folder, _ = model_folder(tmp_path, bpe("gpt2"), architecture="gpt2", d_ff=64)
    export_to_gguf(folder, tmp_path / "m.gguf")
    (line,) = [line for line in capsys.readouterr().err.splitlines() if "GELU" in line]
    assert "tanh approximation" in line


def test_the_transformers_export_says_nothing_about_gguf(tmp_path, capsys):
    pytest.importorskip("transformers")
    folder, _ = model_folder(tmp_path, bpe("unicode"), architecture="llama")
    capsys.readouterr()
    assert cli.main(["export", "--checkpoint", str(folder), "--output", str(tmp_path / "hf")]) == 0
    captured = capsys.readouterr()
    said = (captured.out + captured.err).lower()
    assert "gguf" not in said and "llama.cpp" not in said
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == "llama"


@pytest.mark.slow  # starts a local S3 server
def test_a_url_output_is_uploaded_once_written_and_replaced_only_with_overwrite(tmp_path, capsys, s3):  # noqa: F811
    fs, bucket = s3
    folder, _ = model_folder(tmp_path, bpe("llama3"), architecture="llama")
    url = f"s3://{bucket}/models/small.gguf"
    argv = ["export", "--checkpoint", str(folder), "--output", url, "--format", "gguf"]
    assert cli.main(argv) == 0
    fs.get(f"{bucket}/models/small.gguf", str(tmp_path / "back.gguf"))
    assert read_fields(tmp_path / "back.gguf")["tokenizer.ggml.pre"] == "llama-bpe"
    capsys.readouterr()
    assert cli.main(argv) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert cli.main([*argv, "--overwrite"]) == 0
    assert fs.ls(f"{bucket}/models") == [f"{bucket}/models/small.gguf"]


@pytest.mark.slow  # trains a model through the CLI
def test_a_trained_runs_gguf_export_computes_the_runs_logits_and_tokens(tmp_path, corpus):
    import yaml

    from conftest import cli_in_process
    from llm_trainer.api import load_for_inference

    config = {
        "model": {
            "architecture": "llama",
            "d_model": 32,
            "n_heads": 4,
            "n_kv_heads": 2,
            "n_layers": 2,
            "max_seq_len": 32,
        },
        "training": {"batch_size": 8, "max_steps": 10, "eval_steps": 0, "save_steps": 0, "output_dir": "run"}
        | {"device": "cpu", "use_amp": False, "progress_bar": False, "report_to": ["jsonl"]},
        "data": {"data_files": [str(corpus)], "tokenizer": "bpe", "tokenizer_vocab_size": 300}
        | {"tokenizer_pre_split": "llama3"},
    }
    (tmp_path / "exp.yaml").write_text(yaml.safe_dump(config))

    def run(*args):
        done = cli_in_process(args, tmp_path)
        assert done.returncode == 0, done.stderr
        return done

    run("train", "--config", "exp.yaml")
    assert (
        "exported to small.gguf"
        in run("export", "--checkpoint", "run", "--output", "small.gguf", "--format", "gguf").stdout
    )
    model, tokenizer, _ = load_for_inference(tmp_path / "run")
    text = "the fox sat on the mat number 5."
    ids = torch.tensor([tokenizer.encode(text)])
    assert llama_cpp_tokenize(tmp_path / "small.gguf", text) == ids[0].tolist()
    with torch.no_grad():
        ours = model.eval()(ids)[0]
    assert (ours - llama_cpp_llama_logits(tmp_path / "small.gguf", ids)).abs().max().item() <= 1e-4


def test_without_the_gguf_package_the_export_says_how_to_install_it(tmp_path, capsys, monkeypatch):
    folder, _ = model_folder(tmp_path, bpe("gpt2"), architecture="llama")
    monkeypatch.setitem(__import__("sys").modules, "gguf", None)  # `import gguf` raises ImportError
    assert "pip install 'llm-trainer[gguf]'" in refused(tmp_path, folder, capsys)


def test_the_padding_rows_are_not_exported_as_tokens(tmp_path):
    """A model of 360 tokens padded to 384 rows: the file holds 360 rows and names 360 tokens."""
    tokenizer = bpe("gpt2")
    folder, ours = model_folder(tmp_path, tokenizer, vocab_size=tokenizer.vocab_size, architecture="llama")
    assert ours.tok_emb.weight.shape[0] > tokenizer.vocab_size == ours.config.vocab_size
    out = tmp_path / "model.gguf"
    export_to_gguf(folder, out)
    fields = read_fields(out)
    assert fields["llama.vocab_size"] == len(fields["tokenizer.ggml.tokens"]) == tokenizer.vocab_size
    shapes = {t.name: tuple(int(n) for n in t.shape) for t in gguf.GGUFReader(str(out)).tensors}
    assert shapes["token_embd.weight"] == shapes["output.weight"] == (16, tokenizer.vocab_size)  # gguf: (cols, rows)
    ids = torch.randint(0, tokenizer.vocab_size, (1, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (ours(ids)[0] - llama_cpp_llama_logits(out, ids)).abs().max().item() <= 1e-4
