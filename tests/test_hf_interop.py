"""Hugging Face transformers interop: exact logit parity both ways, round trips, tokenizer, sharding, refusals.

Every model here is tiny (d_model 16, 2 layers) and every parameter, norms and biases included, is
randomised so that a mis-mapped tensor cannot hide behind an init of zeros or ones.
"""

import json

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402

from llm_trainer.checkpoint.model_folder import save_model_folder  # noqa: E402
from llm_trainer.config import DataConfig, ModelConfig  # noqa: E402
from llm_trainer.errors import UsageError  # noqa: E402
from llm_trainer.hf.interop import export_to_hf, import_from_hf  # noqa: E402
from llm_trainer.model import Transformer  # noqa: E402

VOCAB = 67
TOL = 1e-5


def randomize(module: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():  # shared (tied) parameters come once
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return module.eval()


def tokens(vocab: int = VOCAB, shape=(2, 12), seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape
    return (a - b).abs().max().item()


def our_model(**overrides) -> Transformer:
    values = dict(vocab_size=VOCAB, d_model=16, n_heads=4, n_layers=2, max_seq_len=32)
    values.update(overrides)
    values.setdefault("d_ff", 24 if values.get("architecture") == "llama" else 32)
    return randomize(Transformer(ModelConfig(**values)))


def saved(model: Transformer, directory) -> str:
    save_model_folder(model, directory)
    return str(directory)


def load_hf(directory):
    return transformers.AutoModelForCausalLM.from_pretrained(str(directory), local_files_only=True).eval()


def hf_gpt2(**overrides):
    values = dict(vocab_size=VOCAB, n_positions=32, n_embd=16, n_layer=2, n_head=4, n_inner=32)
    values.update(overrides)
    return randomize(transformers.GPT2LMHeadModel(transformers.GPT2Config(**values)))


def hf_llama(**overrides):
    values = dict(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=32,
        rms_norm_eps=1e-5,
    )
    values.update(overrides)
    return randomize(transformers.LlamaForCausalLM(transformers.LlamaConfig(**values)))


def tiny_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(["hello world", "the quick brown fox", "jumps over the lazy dog"] * 5, trainer)
    return tok


# ----------------------------------------------------------------------------------------------
# transformers -> ours


@pytest.mark.parametrize(
    "overrides",
    [
        {},  # tied head, gelu_new
        {"tie_word_embeddings": False},
        {"activation_function": "gelu"},
        {"activation_function": "relu", "layer_norm_epsilon": 1e-6},
    ],
    ids=["tied", "untied", "gelu", "relu"],
)
def test_import_gpt2_logits_match(tmp_path, overrides):
    hf = hf_gpt2(**overrides)
    hf.save_pretrained(tmp_path)
    model, tokenizer = import_from_hf(tmp_path)
    assert tokenizer is None
    assert model.config.architecture == "gpt2"
    assert model.config.tie_embeddings == overrides.get("tie_word_embeddings", True)
    ids = tokens()
    with torch.no_grad():
        assert max_diff(model.eval()(ids), hf(ids).logits) <= TOL


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"num_key_value_heads": 2, "tie_word_embeddings": True},
        {"num_key_value_heads": 1, "attention_bias": True, "mlp_bias": True},
        {"num_key_value_heads": 2, "rope_theta": 500.0},
    ],
    ids=["mha-untied", "gqa-tied", "mqa-bias", "rope-theta"],
)
def test_import_llama_logits_match(tmp_path, overrides):
    hf = hf_llama(**overrides)
    hf.save_pretrained(tmp_path)
    model, _ = import_from_hf(tmp_path)
    config = model.config
    assert (config.architecture, config.n_kv_heads) == ("llama", overrides.get("num_key_value_heads", 4))
    assert config.bias == overrides.get("attention_bias", False)
    assert config.rope_theta == overrides.get("rope_theta", 10000.0)
    ids = tokens()
    with torch.no_grad():
        assert max_diff(model.eval()(ids), hf(ids).logits) <= TOL


# ----------------------------------------------------------------------------------------------
# ours -> transformers

EXPORTABLE = {
    "gpt2-tied": dict(architecture="gpt2"),
    "gpt2-untied-gelu-tanh": dict(architecture="gpt2", tie_embeddings=False, activation="gelu_tanh"),
    "gpt2-relu": dict(architecture="gpt2", activation="relu", rms_norm_eps=1e-6),
    "llama-mha-untied": dict(architecture="llama"),
    "llama-gqa-tied": dict(architecture="llama", n_kv_heads=2, tie_embeddings=True, rope_theta=500.0),
    "llama-mqa-bias": dict(architecture="llama", n_kv_heads=1, bias=True),
}


@pytest.mark.parametrize("overrides", EXPORTABLE.values(), ids=EXPORTABLE.keys())
def test_export_logits_match(tmp_path, overrides):
    model = our_model(**overrides)
    out = export_to_hf(saved(model, tmp_path / "ours"), tmp_path / "hf")
    written = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "README.md"} <= written
    hf = load_hf(out)
    expected_class = "GPT2LMHeadModel" if overrides["architecture"] == "gpt2" else "LlamaForCausalLM"
    assert type(hf).__name__ == expected_class
    ids = tokens()
    with torch.no_grad():
        assert max_diff(model(ids), hf(ids).logits) <= TOL


@pytest.mark.parametrize("overrides", EXPORTABLE.values(), ids=EXPORTABLE.keys())
def test_export_import_round_trip(tmp_path, overrides):
    model = our_model(**overrides)
    export_to_hf(saved(model, tmp_path / "ours"), tmp_path / "hf")
    back, _ = import_from_hf(tmp_path / "hf")
    assert back.config.to_dict() == model.config.to_dict()
    ours, theirs = model.state_dict(), back.state_dict()
    assert ours.keys() == theirs.keys()
    for name in ours:  # the padding rows of the embedding and head are not exported: they come back zero
        rows = VOCAB if name in ("tok_emb.weight", "lm_head.weight") else None
        assert torch.equal(ours[name][:rows], theirs[name][:rows]), name
        if rows is not None:
            assert not theirs[name][rows:].any(), name
    ids = tokens()
    with torch.no_grad():
        assert torch.equal(model(ids), back.eval()(ids))


# ----------------------------------------------------------------------------------------------
# Tokenizer, sharding, model card, overwrite rules


def test_tokenizer_round_trip(tmp_path):
    tok = tiny_tokenizer()
    tok.save(str(tmp_path / "tokenizer.json"))
    eot = tok.token_to_id("<|endoftext|>")
    model = our_model(architecture="gpt2", vocab_size=tok.get_vocab_size())
    out = export_to_hf(saved(model, tmp_path / "ours"), tmp_path / "hf", tokenizer_file=tmp_path / "tokenizer.json")

    assert {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"} <= {p.name for p in out.iterdir()}
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(out))
    for text in ["hello world", "the lazy fox<|endoftext|>jumps", "unseen wörds ✓ and  spaces"]:
        assert hf_tok(text)["input_ids"] == tok.encode(text).ids
    assert hf_tok.eos_token_id == hf_tok.bos_token_id == eot
    assert hf_tok.unk_token == "<|endoftext|>"
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == eot
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] == generation["bos_token_id"] == eot

    _, imported = import_from_hf(out)
    assert imported is not None and imported.encode("hello lazy dog").ids == tok.encode("hello lazy dog").ids


def test_checkpoint_tokenizer_is_found_next_to_the_weights(tmp_path):
    tok = tiny_tokenizer()
    model = our_model(architecture="llama", vocab_size=tok.get_vocab_size())
    checkpoint = tmp_path / "checkpoint"
    saved(model, checkpoint)
    tok.save(str(checkpoint / "tokenizer.json"))
    out = export_to_hf(checkpoint, tmp_path / "hf")
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(out))
    assert hf_tok("hello world")["input_ids"] == tok.encode("hello world").ids


def test_tokenizer_larger_than_vocab_is_refused(tmp_path):
    tok = tiny_tokenizer()
    tok.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(UsageError, match="vocab_size"):
        export_to_hf(saved(our_model(), tmp_path / "ours"), tmp_path / "hf", tokenizer_file=tmp_path / "tokenizer.json")
    assert not (tmp_path / "hf").exists()


def test_sharded_export_loads(tmp_path):
    model = our_model(architecture="llama", n_kv_heads=2)
    out = export_to_hf(saved(model, tmp_path / "ours"), tmp_path / "hf", max_shard_size_bytes=4096)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1 and all((out / name).is_file() for name in shards)
    assert not (out / "model.safetensors").exists()
    ids = tokens()
    with torch.no_grad():
        assert max_diff(model(ids), load_hf(out)(ids).logits) <= TOL
    back, _ = import_from_hf(out)
    assert torch.equal(back.eval()(ids), model(ids))


def test_model_card_and_overwrite_rules(tmp_path, capsys):
    model = our_model(architecture="gpt2")
    source = saved(model, tmp_path / "ours")
    out = export_to_hf(source, tmp_path / "hf", metrics={"val_loss": 3.14159, "val_perplexity": 23.1})
    card = (out / "README.md").read_text()
    assert "GPT2LMHeadModel" in card and "val_loss | 3.142" in card
    padding = (model.tok_emb.weight.shape[0] - VOCAB) * 16  # the tied embedding's rows past the vocabulary
    assert f"{model.num_parameters() - padding:,}" in card and f"{load_hf(out).num_parameters():,}" in card

    # A second export into it is refused, nothing touched; with overwrite the export's own files are
    # replaced and everything else (a file of the user's) is kept.
    (out / "notes.txt").write_text("mine")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(UsageError, match=r"not empty \(README.md, config.json, generation_config.json, model"):
        export_to_hf(source, tmp_path / "hf")  # what is there, named
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    capsys.readouterr()
    export_to_hf(source, tmp_path / "hf", overwrite=True)
    assert (out / "notes.txt").read_text() == "mine" and "## Metrics" not in (out / "README.md").read_text()
    replaced = [line for line in capsys.readouterr().err.splitlines() if ": replaced " in line]
    assert replaced == [f"{out}: replaced {', '.join(sorted(before.keys() - {'notes.txt'}))}; its other files are kept"]
    assert {p.name for p in out.iterdir()} == set(before)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp folders left behind

    # Anything else that is not empty is refused, and left alone.
    other = tmp_path / "notes"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(UsageError, match="not empty"):
        export_to_hf(source, other)
    assert [p.name for p in other.iterdir()] == ["notes.txt"]
    with pytest.raises(UsageError, match="must not contain"):
        export_to_hf(source, tmp_path)


def test_overwrite_keeps_a_folders_mode_and_never_replaces_a_checkpoint(tmp_path):
    """--overwrite onto a private folder leaves it private, and a run's checkpoint (its meta.json) is
    refused whatever the flag, untouched. (A link is written through, to its target: test_lost_data.)"""
    source = saved(our_model(architecture="gpt2"), tmp_path / "ours")
    private = tmp_path / "private"
    private.mkdir()
    private.chmod(0o700)
    (private / "notes.txt").write_text("mine")
    export_to_hf(source, private, overwrite=True)
    assert (private / "config.json").is_file() and (private / "notes.txt").read_text() == "mine"
    assert (private.stat().st_mode & 0o777) == 0o700

    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    (checkpoint / "meta.json").write_text("{}")
    (checkpoint / "optimizer.pt").write_bytes(b"state")
    with pytest.raises(UsageError, match=r"holds a run's checkpoint \(meta.json\); it is never replaced"):
        export_to_hf(source, checkpoint, overwrite=True)
    assert sorted(p.name for p in checkpoint.iterdir()) == ["meta.json", "optimizer.pt"]


# ----------------------------------------------------------------------------------------------
# Refusals

UNEXPORTABLE = {
    "gpt2-rmsnorm": (dict(architecture="gpt2", norm="rmsnorm"), "RMSNorm"),
    "gpt2-rope": (dict(architecture="gpt2", position_embedding="rope"), "learned positions"),
    "gpt2-gqa": (dict(architecture="gpt2", n_kv_heads=2), "grouped-query"),
    "gpt2-no-bias": (dict(architecture="gpt2", bias=False), "biases"),
    "gpt2-swiglu": (dict(architecture="gpt2", activation="swiglu"), "gated"),
    "gpt2-post-norm": (dict(architecture="gpt2", pre_norm=False), "post-norm"),
    "llama-layernorm": (dict(architecture="llama", norm="layernorm"), "RMSNorm"),
    "llama-learned": (dict(architecture="llama", position_embedding="learned"), "rotary"),
    "llama-gelu": (dict(architecture="llama", activation="gelu", d_ff=32), "SwiGLU"),
    "llama-post-norm": (dict(architecture="llama", pre_norm=False), "post-norm"),
}


@pytest.mark.parametrize("overrides, message", UNEXPORTABLE.values(), ids=UNEXPORTABLE.keys())
def test_unexportable_configs_are_refused(tmp_path, overrides, message):
    source = saved(our_model(**overrides), tmp_path / "ours")
    with pytest.raises(UsageError, match=message):
        export_to_hf(source, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_unsupported_imports_are_refused(tmp_path):
    bert = transformers.BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=4)
    bert.save_pretrained(tmp_path / "bert")
    with pytest.raises(UsageError, match="'bert'"):
        import_from_hf(tmp_path / "bert")

    hf_llama(hidden_act="gelu").save_pretrained(tmp_path / "geglu")
    with pytest.raises(UsageError, match="hidden_act"):
        import_from_hf(tmp_path / "geglu")

    scaled = hf_llama()
    scaled.config.rope_parameters = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    scaled.save_pretrained(tmp_path / "scaled")
    with pytest.raises(UsageError, match="linear"):
        import_from_hf(tmp_path / "scaled")

    saved(our_model(), tmp_path / "ours")
    with pytest.raises(UsageError, match="llm-trainer model folder"):
        import_from_hf(tmp_path / "ours")
    with pytest.raises(UsageError, match="does not exist"):
        import_from_hf(tmp_path / "missing")


# ----------------------------------------------------------------------------------------------
# Generation


@pytest.mark.parametrize("architecture", ["gpt2", "llama"])
def test_greedy_generation_matches_transformers(tmp_path, architecture):
    from llm_trainer.generate import generate

    overrides = {"n_kv_heads": 2} if architecture == "llama" else {}
    model = our_model(architecture=architecture, **overrides)
    out = export_to_hf(saved(model, tmp_path / "ours"), tmp_path / "hf")  # no tokenizer: no eos to stop at
    hf = load_hf(out)
    prompt = tokens(shape=(1, 5))
    with torch.no_grad():
        expected = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=10, do_sample=False)
    new = generate(model, prompt[0].tolist(), max_new_tokens=10, temperature=0.0)
    assert list(new) == expected[0, prompt.shape[1] :].tolist()


def test_the_model_card_says_how_text_was_cleaned_and_its_code_cleans_a_prompt_as_generate_does(tmp_path, capsys):
    """An exported model is used without llm-trainer: its card says how the training text's characters
    were cleaned, and the card's Python does to a messy prompt (CRLF, a control character, NFD accents)
    what `generate` does to it, so transformers reads the same tokens."""
    import re

    from conftest import write_tiny_experiment
    from llm_trainer import cli
    from llm_trainer.data.text.clean import Cleaner

    assert cli.main(["train", "--config", str(write_tiny_experiment(tmp_path))]) == 0
    assert cli.main(["export", "--checkpoint", str(tmp_path / "run"), "--output", str(tmp_path / "hf")]) == 0
    capsys.readouterr()
    card = (tmp_path / "hf" / "README.md").read_text()
    assert "cleaned before it was tokenized: line ends as `\\n`" in card and "Unicode in NFC" in card
    code = re.search(r"## Input text.*?```python\n(.*?)```", card, re.S).group(1)
    prompt = "the cat\r\nsat\x07 on the cafe\u0301\rmat"
    namespace = {"text": prompt}
    exec(code, namespace)
    assert (
        namespace["text"]
        == Cleaner(DataConfig(data_files="x")).characters(prompt)
        == "the cat\nsat on the caf\u00e9\nmat"
    )
