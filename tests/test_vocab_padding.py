"""The vocabulary padded to a multiple of 128: the extra embedding and head rows change nothing that is
computed, sampled, scored or exported, and model folders written before the padding load as before."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import write_tiny_experiment
from llm_trainer import cli, loss
from llm_trainer.checkpoint.model_folder import CONFIG_NAME, load_model_folder, save_model_folder
from llm_trainer.config import ModelConfig, TrainingConfig
from llm_trainer.config_aliases import MODEL
from llm_trainer.errors import UsageError
from llm_trainer.generate import generate
from llm_trainer.model import Transformer
from llm_trainer.tokenizer import Tokenizer
from llm_trainer.tools.estimate import estimate_memory
from llm_trainer.train.evaluate import evaluate
from llm_trainer.train.flops import count_parameters, flops_per_token

VOCAB = 61  # pads to 128


def pair(**overrides) -> tuple[Transformer, Transformer]:
    """(unpadded, padded) models drawn from the same seed: the same real-row weights."""
    values = dict(vocab_size=VOCAB, d_model=16, n_heads=2, n_layers=2, max_seq_len=24)
    values.update(overrides)
    torch.manual_seed(0)
    plain = Transformer(ModelConfig(**values, vocab_pad_multiple=1))
    torch.manual_seed(0)
    padded = Transformer(ModelConfig(**values))
    return plain, padded


def batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (3, 12), generator=g), torch.randint(0, VOCAB, (3, 12), generator=g)


def test_the_default_pads_gpt2s_vocabulary_to_nanogpts_50304():
    assert ModelConfig(vocab_size=50257).padded_vocab_size == 50304
    assert ModelConfig(vocab_size=50257, vocab_pad_multiple=1).padded_vocab_size == 50257
    assert ModelConfig(vocab_size=32000).padded_vocab_size == 32000  # already a multiple: unchanged
    model = Transformer.on_meta(ModelConfig(vocab_size=50257, d_model=64, n_heads=2, n_layers=1))
    assert model.tok_emb.weight.shape == model.lm_head.weight.shape == (50304, 64)
    assert MODEL["pad_vocab_size_multiple"] == "vocab_pad_multiple"
    for wrong in (0, 10**9):
        with pytest.raises(ValueError, match="vocab_pad_multiple must be 1 \\(no padding\\) to 65,536"):
            ModelConfig(vocab_size=50257, vocab_pad_multiple=wrong)


def test_a_seed_draws_the_same_real_rows_and_zero_padding_rows():
    for tie in (True, False):
        plain, padded = pair(tie_embeddings=tie)
        assert padded.lm_head.weight.shape[0] == 128 and plain.lm_head.weight.shape[0] == VOCAB
        for name, tensor in plain.state_dict().items():
            theirs = padded.state_dict()[name]
            assert torch.equal(theirs[:VOCAB] if theirs.shape != tensor.shape else theirs, tensor), name
        assert not padded.tok_emb.weight[VOCAB:].any() and not padded.lm_head.weight[VOCAB:].any()


@pytest.mark.parametrize("fused", [True, False], ids=["chunked-gradient", "autograd"])
@pytest.mark.parametrize("architecture", ["gpt2", "llama"])
def test_padded_and_unpadded_train_alike_step_by_step(architecture, fused, monkeypatch):
    """Identical losses through training, by the loss's chunked gradient and by autograd: the head
    multiplies its padding rows, whose logits leave the softmax, so they get no gradient and stay zero."""
    if fused:
        monkeypatch.setattr(loss, "SMALL_LOGITS", 0)
    plain, padded = pair(architecture=architecture, tie_embeddings=architecture == "gpt2")
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in (plain, padded)]
    for step in range(4):
        x, y = batch(step)
        losses = []
        for model, opt in zip((plain, padded), optimizers, strict=True):
            mean = model(x, targets=y) / y.numel()
            mean.backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
            losses.append(mean.item())
        assert losses[0] == losses[1]
        assert not padded.lm_head.weight.grad[VOCAB:].any()
    assert not padded.tok_emb.weight[VOCAB:].any() and not padded.lm_head.weight[VOCAB:].any()
    assert torch.equal(plain.lm_head.weight, padded.lm_head.weight[:VOCAB])


def test_logits_evaluation_scoring_and_generation_cover_the_real_vocabulary_only():
    plain, padded = pair()
    with torch.no_grad():  # padding rows that would win every argmax if they were ever read
        padded.lm_head.weight[VOCAB:] = 100.0
    plain.eval(), padded.eval()
    x, y = batch()
    with torch.no_grad():
        assert padded(x).shape == (3, 12, VOCAB)
        assert torch.equal(plain(x), padded(x))
        assert torch.equal(plain(x, targets=y, reduction="none"), padded(x, targets=y, reduction="none"))
        T = x.shape[1]
        positions = torch.arange(T).expand(3, T)
        mask = torch.ones(T, T, dtype=torch.bool).tril().expand(3, 1, T, T)
        select = (torch.tensor([0, 1, 2]), torch.tensor([4, 7, 11]))
        targets = y[select]
        scored = [m.extend(x, None, positions, mask, select=select, targets=targets) for m in (plain, padded)]
        assert all(torch.equal(a, b) for a, b in zip(*scored, strict=True))
    assert evaluate(plain, [(x, y)]) == evaluate(padded, [(x, y)])
    for kwargs in (dict(temperature=1.0, seed=3), dict(temperature=0.8, top_k=5, seed=4), dict(temperature=0.0)):
        ours = generate(padded, [1, 2, 3], max_new_tokens=15, **kwargs)
        assert ours == generate(plain, [1, 2, 3], max_new_tokens=15, **kwargs)
        assert max(ours) < VOCAB


def test_a_model_folder_written_before_the_padding_loads_exactly_as_before(tmp_path):
    plain, _ = pair()
    save_model_folder(plain, tmp_path)
    config_file = tmp_path / CONFIG_NAME
    values = json.loads(config_file.read_text())
    assert values.pop("vocab_pad_multiple") == 1  # recorded from now on
    config_file.write_text(json.dumps(values))  # as written before the field existed
    loaded = load_model_folder(tmp_path)
    assert loaded.config.vocab_pad_multiple == 1 and loaded.tok_emb.weight.shape[0] == VOCAB
    x, _ = batch()
    with torch.no_grad():
        assert torch.equal(loaded.eval()(x), plain.eval()(x))


def test_a_padded_model_folder_round_trips_and_an_unpadded_file_is_named_in_the_refusal(tmp_path):
    plain, padded = pair()
    save_model_folder(padded, tmp_path / "padded")
    loaded = load_model_folder(tmp_path / "padded")
    assert loaded.config.vocab_pad_multiple == 128 and loaded.lm_head.weight.shape[0] == 128
    save_model_folder(plain, tmp_path / "plain")
    config_file = tmp_path / "plain" / CONFIG_NAME
    values = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**values, "vocab_pad_multiple": 128}))  # a config that does not fit
    with pytest.raises(UsageError, match="vocab_pad_multiple: 1"):
        load_model_folder(tmp_path / "plain")


def test_the_parameter_count_and_memory_estimate_count_the_padding_rows():
    gpt2 = dict(vocab_size=50257, d_model=768, n_heads=12, n_layers=12, d_ff=3072, max_seq_len=1024)
    padded, plain = count_parameters(ModelConfig(**gpt2)), count_parameters(ModelConfig(**gpt2, vocab_pad_multiple=1))
    assert padded.total - plain.total == 47 * 768  # nanoGPT's 50304-row GPT-2: 124,475,904 parameters
    assert padded.total == 124_475_904
    # FLOPs count the work done: the head multiplies its padding rows too (nanoGPT's count)
    assert (
        flops_per_token(ModelConfig(**gpt2), 1024) - flops_per_token(ModelConfig(**gpt2, vocab_pad_multiple=1), 1024)
        == 6 * 47 * 768
    )
    memory = [
        estimate_memory(ModelConfig(**gpt2, vocab_pad_multiple=m), TrainingConfig(), seq_len=1024, batch_size=1)
        for m in (128, 1)
    ]
    assert memory[0].parameters - memory[1].parameters == 47 * 768
    assert memory[0].params_bytes - memory[1].params_bytes == 4 * 47 * 768


@pytest.mark.parametrize("architecture", ["gpt2", "llama"])
def test_the_transformers_export_writes_the_real_rows_with_our_logits_and_imports_padded(tmp_path, architecture):
    transformers = pytest.importorskip("transformers")
    from llm_trainer.hf.interop import export_to_hf, import_from_hf

    plain, padded = pair(architecture=architecture, tie_embeddings=architecture == "gpt2")
    with torch.no_grad():
        padded.lm_head.weight[VOCAB:] = 100.0  # would show in any exported or computed logit
    x, _ = batch()
    logits = []
    for name, model in (("plain", plain), ("padded", padded)):
        save_model_folder(model, tmp_path / name)
        out = export_to_hf(str(tmp_path / name), tmp_path / f"hf-{name}")
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True).eval()
        assert hf.config.vocab_size == VOCAB
        assert hf.get_input_embeddings().weight.shape[0] == hf.get_output_embeddings().weight.shape[0] == VOCAB
        with torch.no_grad():
            logits.append(hf(x).logits)
            assert (logits[-1] - model.eval()(x)).abs().max().item() <= 1e-5
    assert torch.equal(logits[0], logits[1])
    imported, _ = import_from_hf(str(tmp_path / "hf-padded"))
    assert imported.tok_emb.weight.shape[0] == 128 and not imported.tok_emb.weight[VOCAB:].any()
    with torch.no_grad():
        assert (imported.eval()(x) - logits[1]).abs().max().item() <= 1e-5


@pytest.mark.slow
def test_ids_past_the_tokenizers_are_said_at_start_and_never_generated(tmp_path, capsys):
    """model.vocab_size larger than the tokenizer (a lesson's 30522 beside a char tokenizer): those ids are
    real rows of the model, which the head predicts, so the start says what they cost; `generate` and the
    CLI never draw one, as no token decodes from it."""
    config = str(write_tiny_experiment(tmp_path, max_steps=2, save_steps=2, eval_steps=0))
    assert cli.main(["train", "--config", config, "model.vocab_size=1000"]) == 0
    err = capsys.readouterr().err
    assert "warning: model.vocab_size is 1,000 but the tokenizer has " in err
    assert "so its loss starts near ln 1,000 = 6.91 instead of ln " in err
    checkpoint = next((tmp_path / "run" / "checkpoints").glob("checkpoint-*"))
    model, tokens = load_model_folder(checkpoint), Tokenizer.load(checkpoint).vocab_size
    assert model.config.vocab_size == 1000 and tokens < 100
    # after two steps the ids past the tokenizer's still hold most of the model's probability
    assert max(generate(model, [1, 2, 3], max_new_tokens=8, temperature=1.0, seed=3)) >= tokens
    for kwargs in (dict(temperature=1.0, seed=3), dict(temperature=0.7, top_k=50, seed=4), dict(temperature=0.0)):
        assert max(generate(model, [1, 2, 3], max_new_tokens=8, vocab_size=tokens, **kwargs)) < tokens
    tokenizer = Tokenizer.load(checkpoint)
    for seed in range(3):  # the command draws as `generate` with the tokenizer's size does
        argv = ["generate", "--checkpoint", str(checkpoint), "--prompt", "the", "--max_new_tokens", "12"]
        assert cli.main([*argv, "--seed", str(seed)]) == 0
        ids = generate(
            model,
            tokenizer.encode("the"),
            max_new_tokens=12,
            seed=seed,
            eos_token_id=tokenizer.eot_id,
            vocab_size=tokens,
        )
        assert capsys.readouterr().out == "the" + tokenizer.decode(ids) + "\n" and max(ids) < tokens


def test_resuming_an_unpadded_checkpoint_names_the_setting_that_loads_it(tmp_path, capsys):
    """A checkpoint of unpadded rows (as every one written before the padding) under today's default:
    refused in one line naming model.vocab_pad_multiple: 1, with which it resumes."""
    config = str(write_tiny_experiment(tmp_path, max_steps=3, save_steps=3, eval_steps=0))
    assert cli.main(["train", "--config", config, "model.vocab_pad_multiple=1"]) == 0
    resume = ["train", "--config", config, "training.max_steps=5", "training.resume_from_checkpoint=latest"]
    capsys.readouterr()
    assert cli.main(resume) == 2
    err = capsys.readouterr().err
    assert "set model.vocab_pad_multiple: 1 to load it" in err and "Traceback" not in err
    assert cli.main([*resume, "model.vocab_pad_multiple=1"]) == 0
    assert "continuing from" in capsys.readouterr().err


def test_estimate_counts_and_names_the_padding_rows_of_the_gpt2_preset(capsys):
    assert cli.main(["estimate", "--config", "gpt2-small", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["vocab_size"] == 50257 and report["vocab_rows"] == 50304  # the preset's vocabulary, padded
    assert report["parameters"] == 124_475_904 and report["non_embedding_parameters"] == 123_689_472  # nanoGPT's
    assert cli.main(["estimate", "--config", "gpt2-small"]) == 0
    assert "50,257 (data.tokenizer_vocab_size), 50,304 rows (model.vocab_pad_multiple)" in capsys.readouterr().out
