"""The Hugging Face path end to end: train here, export with the CLI, measure with transformers;
and continue pretraining a transformers model with `model.init_from`."""

import json
import math

import pytest
import torch
import yaml

from conftest import cli_in_process

pytestmark = pytest.mark.slow  # real training runs and exports: the full tier only

transformers = pytest.importorskip("transformers")


def _experiment(tmp_path, corpus, architecture, **model):
    config = {
        "model": {"architecture": architecture, "d_model": 32, "n_heads": 2, "n_layers": 2, "max_seq_len": 32, **model},
        "training": {
            "batch_size": 8,
            "max_steps": 20,
            "learning_rate": 3e-3,
            "eval_steps": 0,
            "save_steps": 0,
            "output_dir": "run",
            "device": "cpu",
            "use_amp": False,  # eval measures in the run's precision; transformers' forward here is float32
            "progress_bar": False,
            "report_to": ["jsonl"],
        },
        "data": {"data_files": [str(corpus)], "tokenizer": "bpe", "tokenizer_vocab_size": 300},
    }
    (tmp_path / "exp.yaml").write_text(yaml.safe_dump(config))


@pytest.mark.parametrize("architecture, model", [("gpt2", {}), ("llama", {"n_kv_heads": 1})])
def test_exported_perplexity_equals_llm_trainer_eval(tmp_path, corpus, architecture, model):
    """Trained, exported and evaluated by the CLI (in this process), measured by transformers alone."""
    _experiment(tmp_path, corpus, architecture, **model)
    assert cli_in_process(["train", "--config", "exp.yaml"], tmp_path).returncode == 0
    exported = cli_in_process(["export", "--checkpoint", "run", "--output", "hf"], tmp_path)
    assert exported.returncode == 0, exported.stderr

    text_file = tmp_path / "val.txt"
    # (no newline at the end: eval --data cleans its text as prepare does, which strips it)
    text_file.write_text(("the fox sat on the mat number 5.\nthe bird sat on the mat number 2.\n" * 8).rstrip("\n"))
    ours = json.loads(
        cli_in_process(["eval", "--checkpoint", "run", "--data", str(text_file), "--json"], tmp_path).stdout
    )

    # transformers, on its own: the same text, windows of max_seq_len + 1 tokens with stride max_seq_len.
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    ids = tokenizer(text_file.read_text(), add_special_tokens=False)["input_ids"]
    length = hf_model.config.max_position_embeddings if architecture == "gpt2" else 32
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(ids) - 1, length):
            window = torch.tensor([ids[start : start + length + 1]])
            logits = hf_model(window[:, :-1]).logits
            total += torch.nn.functional.cross_entropy(logits[0], window[0, 1:], reduction="sum").item()
            count += window.shape[1] - 1
    assert count == ours["tokens"]
    assert math.exp(total / count) == pytest.approx(ours["perplexity"], rel=1e-4)


def test_continue_pretraining_a_transformers_model(tmp_path, corpus):
    """model.init_from a transformers LLaMA folder: its weights and tokenizer are the starting point."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.train_from_iterator(
        [p.read_text() for p in corpus.iterdir()],
        trainers.BpeTrainer(
            vocab_size=200, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    vocab = backend.get_vocab_size()
    torch.manual_seed(0)
    source = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=vocab,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=32,
            tie_word_embeddings=False,
        )
    )
    source.save_pretrained(tmp_path / "base")
    backend.save(str(tmp_path / "base" / "tokenizer.json"))

    config = {
        "model": {"init_from": str(tmp_path / "base")},
        "training": {
            "batch_size": 4,
            "max_steps": 5,
            "learning_rate": 1e-3,
            "eval_steps": 0,
            "save_steps": 0,
            "output_dir": "run",
            "device": "cpu",
            "progress_bar": False,
            "report_to": ["jsonl"],
        },
        "data": {"data_files": [str(corpus)], "max_length": 32},
    }
    (tmp_path / "exp.yaml").write_text(yaml.safe_dump(config))
    result = cli_in_process(["train", "--config", "exp.yaml"], tmp_path)
    assert result.returncode == 0, result.stderr
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert saved["model"]["architecture"] == "llama" and saved["model"]["n_kv_heads"] == 1
    assert saved["model"]["vocab_size"] == vocab and saved["model"]["d_ff"] == 64
    tokenizer = json.loads((tmp_path / "run" / "tokenizer.json").read_text())
    assert len(tokenizer["model"]["vocab"]) == len(
        json.loads((tmp_path / "base" / "tokenizer.json").read_text())["model"]["vocab"]
    )
    # Training started from the imported weights: 5 Adam steps of lr 1e-3 move each weight by at most
    # about 5e-3, while a fresh initialisation would differ by ~0.1 somewhere.
    from llm_trainer.checkpoint.model_folder import load_model_folder
    from llm_trainer.hf.interop import import_from_hf

    start, _ = import_from_hf(tmp_path / "base")
    trained = load_model_folder(tmp_path / "run" / "checkpoints" / "checkpoint-00000005")
    diffs = {k: (v - start.state_dict()[k]).abs().max().item() for k, v in trained.state_dict().items()}
    assert max(diffs.values()) < 6e-3 and max(diffs.values()) > 0
