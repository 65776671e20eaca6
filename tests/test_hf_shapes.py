"""The Hugging Face shapes users bring from the lesson (seed 002) and the pretraining guide's YAML (seed
003), as written: `model(input_ids=, attention_mask=, labels=)` with `.loss` / `.logits`, the run's
tokenizer as a transformers tokenizer, configs without a data section, and the BPE pre-split an
export carries for converters (llama.cpp's) that know a tokenizer by its pre-split.

The seed text each test needs is copied here, so the tests run without ../shared.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from conftest import tiny_model, write_corpus
from llm_trainer.cli import main
from llm_trainer.config import DataConfig
from llm_trainer.config_loader import load_experiment
from llm_trainer.data.prepare import prepare_data
from llm_trainer.errors import UsageError
from llm_trainer.model import IGNORE_INDEX, CausalLMOutput
from llm_trainer.tokenizer import PRE_SPLIT, Tokenizer
from llm_trainer.train.batches import IterableBatches

# The reference pre-splits, typed from GPT-2's byte-level regex and from LLaMA-3's tokenizer.json.
GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

TEXTS = [
    "the cat sat on the mat.",
    "a dog ran after 12345 birds, didn't it?",
    "hello",
    "The quick brown fox jumps over the lazy dog. We've seen it.",
] * 8


def bpe(pre_split: str = "unicode", vocab_size: int = 300) -> Tokenizer:
    return Tokenizer.train_bpe(TEXTS * 4, vocab_size=vocab_size, max_chars=10**6, pre_split=pre_split)


def right_padded(vocab: int = 61) -> tuple[torch.Tensor, torch.Tensor]:
    """ids (3, 10) and an attention_mask with 0, 4 and 9 padding positions at the end of the rows."""
    ids = torch.randint(1, vocab, (3, 10), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    mask[2, 1:] = 0
    return ids, mask


# ==================================================================================================
# model(input_ids=..., attention_mask=..., labels=...)


def test_transformers_call_returns_the_reference_loss_and_the_logits_of_a_plain_call():
    model = tiny_model().eval()
    ids, mask = right_padded()
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, labels=ids.clone())
        logits = model(ids)
    assert isinstance(out, CausalLMOutput) and isinstance(logits, torch.Tensor)
    assert torch.equal(out.logits, logits)
    targets = ids.masked_fill(mask == 0, IGNORE_INDEX)[:, 1:]
    reference = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100)
    assert torch.allclose(out.loss, reference, atol=1e-6)
    # padding changes nothing before it: row 1's text has the logits of the row without its padding
    with torch.no_grad():
        alone = model(ids[1:2, :6])
    assert torch.allclose(out.logits[1:2, :6], alone, atol=1e-5)


def test_the_loss_is_the_one_the_trainer_computes_for_the_same_dict_batch():
    model = tiny_model().eval()
    ids, mask = right_padded()
    inputs, targets = IterableBatches([], torch.device("cpu"))._convert({"input_ids": ids, "attention_mask": mask})
    with torch.no_grad():
        trainer_loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX)
        assert torch.allclose(model(input_ids=ids, attention_mask=mask, labels=ids).loss, trainer_loss, atol=1e-6)


def test_labels_with_ignore_index_and_no_mask_and_no_labels():
    model = tiny_model().eval()
    ids, _ = right_padded()
    labels = ids.clone()
    labels[:, :5] = IGNORE_INDEX  # a prompt left out of the loss, as transformers users write it
    with torch.no_grad():
        out = model(input_ids=ids, labels=labels)
        logits = model(ids)
        no_labels = model(input_ids=ids, attention_mask=torch.ones_like(ids))
    reference = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=IGNORE_INDEX)
    assert torch.allclose(out.loss, reference, atol=1e-6)
    assert no_labels.loss is None and torch.equal(no_labels.logits, logits)
    assert torch.equal(model(input_ids=ids).logits, logits)


def test_the_loss_trains_and_wrong_calls_say_what_to_do():
    model = tiny_model()
    ids, mask = right_padded()
    out = model(input_ids=ids, attention_mask=mask, labels=ids)
    out.loss.backward()
    assert model.tok_emb.weight.grad is not None and torch.isfinite(model.tok_emb.weight.grad).all()
    left = mask.flip(1)
    with pytest.raises(ValueError, match="pad on the right"):
        model(input_ids=ids, attention_mask=left)
    with pytest.raises(ValueError, match="once"):
        model(ids, input_ids=ids)


# ==================================================================================================
# The run's tokenizer as a transformers tokenizer; the lesson's training loop as written


# Seed 002's data cleaning block, as written.
def clean_text(text):
    """Basic text cleaning function."""
    # Remove extra whitespace
    text = re.sub(r"\s+", " ", text)
    # Remove leading/trailing whitespace
    text = text.strip()
    # Handle special characters (customize based on needs)
    text = re.sub(r"[^\w\s.,!?;:()\-\']", "", text)
    return text


class TextDataset(Dataset):
    def __init__(self, texts, tokenizer, max_length=512):
        self.texts = texts
        self.tokenizer = tokenizer
        self.max_length = max_length

    def __len__(self):
        return len(self.texts)

    def __getitem__(self, idx):
        text = clean_text(self.texts[idx])
        encoding = self.tokenizer.encode_plus(
            text, truncation=True, padding="max_length", max_length=self.max_length, return_tensors="pt"
        )

        return {"input_ids": encoding["input_ids"].flatten(), "attention_mask": encoding["attention_mask"].flatten()}


def test_the_lessons_dataset_and_training_step_run_as_written_on_our_model_and_tokenizer():
    pytest.importorskip("transformers")
    ours = bpe()
    tokenizer = ours.as_transformers(model_max_length=24)
    model = tiny_model(vocab_size=ours.vocab_size)
    loader = DataLoader(TextDataset(TEXTS, tokenizer, max_length=16), batch_size=4, shuffle=True)
    batch = next(iter(loader))
    assert batch["input_ids"].shape == batch["attention_mask"].shape == (4, 16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(5):  # the lesson's train_epoch body, on the same batch
        input_ids = batch["input_ids"]
        attention_mask = batch["attention_mask"]
        labels = input_ids.clone()
        outputs = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
        loss = outputs.loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


def test_encode_plus_call_and_save_pretrained_give_our_ids_padded_with_end_of_text(tmp_path):
    transformers = pytest.importorskip("transformers")
    ours = bpe()
    tokenizer = ours.as_transformers(model_max_length=12)
    text = "the cat sat on the mat."
    n = len(ours.encode(text))
    encoding = tokenizer.encode_plus(text, truncation=True, padding="max_length", max_length=n + 3, return_tensors="pt")
    assert encoding["input_ids"][0].tolist() == ours.encode(text) + [ours.eot_id] * 3
    assert encoding["attention_mask"][0].tolist() == [1] * n + [0] * 3

    texts = ["hello", "The quick brown fox jumps over the lazy dog. We've seen it, twice over."]
    batch = tokenizer(texts, padding=True, truncation=True, return_tensors="pt")
    assert batch["input_ids"].shape == (2, 12)  # truncated at model_max_length, padded to the longest
    assert batch["input_ids"][1].tolist() == ours.encode(texts[1])[:12]
    assert batch["attention_mask"][0].tolist() == [1] * len(ours.encode("hello")) + [0] * (
        12 - len(ours.encode("hello"))
    )
    assert tokenizer.pad_token_id == tokenizer.eos_token_id == ours.eot_id

    tokenizer.save_pretrained(str(tmp_path / "tok"))
    again = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    assert again(texts[1])["input_ids"] == ours.encode(texts[1])
    assert again.pad_token == again.eos_token == "<|endoftext|>"
    assert ours.encode(texts[1]) == bpe().encode(texts[1])  # ours is not changed by the transformers copy
    loaded = Tokenizer.load(ours.save(tmp_path / "file"), model_max_length=12)  # a tokenizer file, its context told
    assert loaded.as_transformers()(texts, truncation=True, padding=True, return_tensors="pt")["input_ids"].shape == (
        2,
        12,
    )


def test_the_lessons_dataset_given_our_tokenizer_itself_says_to_pass_as_transformers():
    dataset = TextDataset(TEXTS, bpe(), max_length=16)
    with pytest.raises(AttributeError, match=r"has no encode_plus; pass tokenizer\.as_transformers\(\)"):
        dataset[0]
    assert not hasattr(bpe(), "pad_token_id") and getattr(bpe(), "eos_token_id", None) is None
    with pytest.raises(AttributeError, match="'Tokenizer' object has no attribute 'encod'"):
        bpe().encod("x")  # a typo is not sent to transformers
    with pytest.raises(TypeError, match=r"not called like a transformers tokenizer; .*as_transformers\(\)"):
        bpe()(TEXTS, truncation=True, padding=True, max_length=16, return_tensors="pt")  # the pipeline document's call


def test_the_char_tokenizer_reads_every_text_as_transformers_does_unknown_characters_and_a_written_unk_too():
    """Characters the char tokenizer never saw read as its `<unk>` id in both; the text `<unk>` written
    out reads as its five characters in both (transformers would match a declared unk_token in text);
    decoding gives the same text either way."""
    pytest.importorskip("transformers")
    ours = Tokenizer.build_char(["abc def <nku>"])
    tokenizer = ours.as_transformers()
    assert tokenizer.pad_token == "<|endoftext|>" and tokenizer.unk_token is None
    text = "cab \u4e2d x = '<unk>'"
    ids = ours.encode(text)
    assert tokenizer(text)["input_ids"] == ids and ids.count(ours.backend.token_to_id("<unk>")) == 5  # 中 x = ' '
    ids = ids + [ours.eot_id]
    for skip in (True, False):
        assert ours.decode(ids, skip_special_tokens=skip) == tokenizer.decode(ids, skip_special_tokens=skip)


def test_the_export_writes_the_same_tokenizer_as_as_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    from llm_trainer.checkpoint.model_folder import save_model_folder
    from llm_trainer.hf.interop import export_to_hf

    ours = bpe()
    model = tiny_model(vocab_size=ours.vocab_size, architecture="llama")
    save_model_folder(model, tmp_path / "model")
    ours.save(tmp_path / "model")
    export_to_hf(tmp_path / "model", tmp_path / "hf")
    exported = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    in_memory = ours.as_transformers(model_max_length=model.config.max_seq_len)
    assert exported.special_tokens_map == in_memory.special_tokens_map
    assert exported.model_max_length == in_memory.model_max_length
    texts = ["hello", "the lazy dog"]
    assert exported(texts, padding=True)["input_ids"] == in_memory(texts, padding=True)["input_ids"]


# Seed 002's export block, as written.
def export_model(model, tokenizer, export_dir):
    """Export model for inference."""
    # Save model
    model.save_pretrained(export_dir)

    # Save tokenizer
    tokenizer.save_pretrained(export_dir)

    # Save config
    config_dict = {
        "model_type": "transformer",
        "hidden_size": model.config.hidden_size,
        "num_layers": model.config.num_hidden_layers,
        "num_heads": model.config.num_attention_heads,
    }

    with open(f"{export_dir}/model_config.json", "w") as f:
        json.dump(config_dict, f)


@pytest.mark.parametrize("architecture", ["gpt2", "llama"])
def test_the_lessons_export_model_runs_as_written_and_transformers_loads_the_same_model(tmp_path, architecture):
    transformers = pytest.importorskip("transformers")
    ours = bpe()
    model = tiny_model(vocab_size=ours.vocab_size, architecture=architecture, max_seq_len=32).eval()
    tokenizer = ours.as_transformers(model_max_length=model.config.max_seq_len)
    export_model(model, tokenizer, str(tmp_path / "export"))

    written = json.loads((tmp_path / "export" / "model_config.json").read_text())
    assert written == {"model_type": "transformer", "hidden_size": 16, "num_layers": 1, "num_heads": 2}
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "export")).eval()
    again = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "export"))
    ids = again(TEXTS[:2], padding=True, return_tensors="pt")["input_ids"]
    assert ids[0].tolist()[: len(ours.encode(TEXTS[0]))] == ours.encode(TEXTS[0])
    with torch.no_grad():
        assert torch.allclose(loaded(ids).logits, model(ids), atol=1e-5)
    assert again.model_max_length == 32
    # the lesson's own model_config.json beside the export does not make it a folder of ours
    from llm_trainer.api import load_for_inference
    from llm_trainer.pipeline import load_init_model

    with torch.no_grad():
        assert torch.allclose(load_init_model(str(tmp_path / "export")).eval()(ids), model(ids), atol=1e-5)
    with pytest.raises(UsageError, match="is a transformers model folder"):
        load_for_inference(tmp_path / "export")


def test_save_pretrained_writes_the_tokenizer_it_is_given_and_refuses_a_full_folder_without_overwrite(tmp_path):
    transformers = pytest.importorskip("transformers")
    ours = bpe()
    model = tiny_model(vocab_size=ours.vocab_size, architecture="llama")
    assert model.save_pretrained(tmp_path / "hf", ours) == tmp_path / "hf"
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["eos_token_id"] == ours.eot_id and config["hidden_size"] == 16
    assert transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf")).model_max_length == 24
    (tmp_path / "hf" / "notes.txt").write_text("mine")
    with pytest.raises(UsageError, match=r"is not empty \(.*\); .* or pass overwrite=True to replace"):
        model.save_pretrained(tmp_path / "hf")
    model.save_pretrained(tmp_path / "hf", ours.as_transformers(), overwrite=True)
    assert (tmp_path / "hf" / "notes.txt").read_text() == "mine"  # the user's file is kept
    with pytest.raises(UsageError, match="save_pretrained\\(tokenizer=...\\) takes llm-trainer's Tokenizer"):
        model.save_pretrained(tmp_path / "other", tokenizer="gpt2")
    assert not (tmp_path / "other").exists()
    with pytest.raises(UsageError, match="save_pretrained writes a local folder, not s3://bucket/hf"):
        model.save_pretrained("s3://bucket/hf")
    # our Tokenizer saves as transformers expects it, too
    ours.model_max_length = 20
    ours.save_pretrained(tmp_path / "tok")
    loaded = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    assert loaded.model_max_length == 20 and loaded(TEXTS[0])["input_ids"] == ours.encode(TEXTS[0])


def test_a_checkpoints_tokenizer_truncates_at_max_seq_len_and_the_model_names_max_length(tmp_path):
    pytest.importorskip("transformers")
    from llm_trainer.api import load_for_inference
    from llm_trainer.checkpoint.model_folder import save_model_folder

    ours = bpe()
    save_model_folder(tiny_model(vocab_size=ours.vocab_size), tmp_path / "model")
    ours.save(tmp_path / "model")
    model, tokenizer, _ = load_for_inference(tmp_path / "model")
    hf = tokenizer.as_transformers()
    long_text = " ".join(TEXTS)
    assert len(ours.encode(long_text)) > 24
    assert hf.model_max_length == 24
    ids = hf(long_text, truncation=True, return_tensors="pt")["input_ids"]
    assert ids.shape == (1, 24)
    assert model(input_ids=ids).logits.shape == (1, 24, ours.vocab_size)
    too_long = torch.tensor([ours.encode(long_text)])
    with pytest.raises(ValueError, match=r"longer than max_seq_len=24; .*truncation=True, max_length=24\)"):
        model(input_ids=too_long)
    assert tokenizer.as_transformers(model_max_length=8).model_max_length == 8  # an explicit length wins


def test_the_tokenizer_of_a_prepared_run_truncates_at_the_models_max_seq_len(tmp_path):
    pytest.importorskip("transformers")
    from llm_trainer.config import ExperimentConfig, ModelConfig, TrainingConfig
    from llm_trainer.pipeline import prepare_run
    from llm_trainer.train.batch_size import auto_batch_size

    experiment = ExperimentConfig(
        model=ModelConfig(hidden_size=16, num_attention_heads=2, num_hidden_layers=1, max_position_embeddings=20),
        training=TrainingConfig(output_dir=str(tmp_path / "run"), device="cpu"),
        data=DataConfig(
            data_files=[str(write_corpus(tmp_path / "corpus"))],
            tokenizer_vocab_size=300,
            cache_dir=str(tmp_path / "cache"),
            progress_bar=False,
        ),
    )
    ready = prepare_run(experiment, pick_batch_size=auto_batch_size, local=True)
    assert ready.model.config.max_position_embeddings == 20
    assert ready.prepared.tokenizer.as_transformers().model_max_length == 20


# ==================================================================================================
# Seed 003's YAML as written (no data section), and the guide's DataConfig fragment

PRETRAINING_YAML = """\
model:
  type: llama
  size: 7B
  vocab_size: 32000
  hidden_size: 4096
  intermediate_size: 11008
  num_hidden_layers: 32
  num_attention_heads: 32
  max_position_embeddings: 4096
  rms_norm_eps: 1.0e-6

training:
  batch_size: 32
  gradient_accumulation_steps: 8
  learning_rate: 3.0e-4
  warmup_steps: 2000
  max_steps: 100000
  lr_scheduler: cosine
  weight_decay: 0.1
  clip_grad_norm: 1.0

distributed:
  strategy: fsdp
  fsdp_config:
    sharding_strategy: FULL_SHARD
    mixed_precision: true
    activation_checkpointing: true
"""


def test_the_guides_data_fragment_constructs_and_sources_are_checked_where_data_is_read():
    config = DataConfig(pack_sequences=True, packing_strategy="greedy", max_length=1024)
    assert (config.pack_sequences, config.packing_strategy, config.max_length) == (True, "greedy", 1024)
    with pytest.raises(UsageError, match=r"add data\.data_files .*data: \{data_files: \[corpus/\]\}"):
        prepare_data(config)


def test_the_pretraining_yaml_as_written_estimates_and_train_names_the_key_to_add(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "pretrain.yaml").write_text(PRETRAINING_YAML)
    experiment = load_experiment(tmp_path / "pretrain.yaml")
    assert experiment.model.vocab_size == 32000
    assert main(["estimate", "--config", "pretrain.yaml"]) == 0
    assert "32,000 (model.vocab_size)" in capsys.readouterr().out
    assert main(["train", "--config", "pretrain.yaml"]) == 2
    error = capsys.readouterr().err
    assert "data.data_files" in error and "data.data_files=corpus/" in error
    assert len(error.strip().splitlines()) == 1


# ==================================================================================================
# The BPE pre-split: ours by default, GPT-2's or LLaMA-3's exactly as their tokenizers have them


def split_regex(tokenizer_json: dict) -> str:
    (split,) = [p for p in tokenizer_json["pre_tokenizer"]["pretokenizers"] if p["type"] == "Split"]
    return split["pattern"]["Regex"]


@pytest.mark.parametrize("pre_split, regex", [("gpt2", GPT2_REGEX), ("llama3", LLAMA3_REGEX), ("unicode", PRE_SPLIT)])
def test_an_export_carries_exactly_its_pre_split_and_says_nothing_of_gguf(tmp_path, capsys, pre_split, regex):
    pytest.importorskip("transformers")
    from llm_trainer.checkpoint.model_folder import save_model_folder
    from llm_trainer.hf.interop import export_to_hf

    ours = bpe(pre_split)
    model = tiny_model(vocab_size=ours.vocab_size, architecture="llama")
    save_model_folder(model, tmp_path / "model")
    ours.save(tmp_path / "model")
    capsys.readouterr()
    export_to_hf(tmp_path / "model", tmp_path / "hf")
    exported = json.loads((tmp_path / "hf" / "tokenizer.json").read_text())
    assert split_regex(exported) == regex
    byte_level = exported["pre_tokenizer"]["pretokenizers"][1]
    assert (byte_level["type"], byte_level["use_regex"], byte_level["add_prefix_space"]) == ("ByteLevel", False, False)
    assert "llama.cpp" not in capsys.readouterr().err  # GGUF is `export --format gguf`'s business, not this one's


def test_the_gpt2_pre_split_cuts_as_gpt2s_own_byte_level_layout():
    from tokenizers import pre_tokenizers

    from llm_trainer.tokenizer import byte_level_pre_tokenizer

    text = "Hello world's 12345 तुम्हारा  ---=== I'VE\n\n  done"
    gpt2_layout = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    assert byte_level_pre_tokenizer("gpt2").pre_tokenize_str(text) == gpt2_layout.pre_tokenize_str(text)
    pieces = [p for p, _ in byte_level_pre_tokenizer("llama3").pre_tokenize_str("I'VE 12345")]
    assert pieces == ["I", "'VE", "Ġ", "123", "45"]


def test_prepare_trains_the_pre_split_the_config_names(tmp_path):
    config = DataConfig(
        data_files=[str(write_corpus(tmp_path / "corpus"))],
        tokenizer_vocab_size=300,
        tokenizer_pre_split="llama3",
        cache_dir=str(tmp_path / "cache"),
        progress_bar=False,
    )
    prepared = prepare_data(config)
    assert split_regex(json.loads(prepared.tokenizer.to_json())) == LLAMA3_REGEX
    assert DataConfig(data_files=["x"]).tokenizer_pre_split == "unicode"
    with pytest.raises(ValueError, match="tokenizer_pre_split"):
        DataConfig(data_files=["x"], tokenizer_pre_split="gpt4")
