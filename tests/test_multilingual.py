"""Text in every script: letters with their marks, words of scripts without spaces, the BPE pre-split,
exact round trips, long text files, and removals named in data_report.json.

The slices in tests/data/multilingual/ are one news story in seven scripts (NTREX-128, CC BY-SA 4.0).
"""

from __future__ import annotations

import json
import re
import unicodedata
from pathlib import Path

import pytest
from tokenizers import pre_tokenizers

from llm_trainer.config import DataConfig
from llm_trainer.data.prepare import prepare_data
from llm_trainer.data.prepare import report as report_module
from llm_trainer.data.prepare.report import REPORT
from llm_trainer.data.text.filters import QualityFilter
from llm_trainer.data.text.sources import split_long_text, stdlib_files
from llm_trainer.data.text.unicode_text import letter_count, mean_word_length, words
from llm_trainer.errors import UsageError
from llm_trainer.tokenizer import Tokenizer, byte_level_pre_tokenizer

SLICES = Path(__file__).parent / "data" / "multilingual"
LANGUAGES = ("english", "hindi", "tamil", "arabic", "russian", "chinese", "korean")
HINDI = "भारत एक विशाल देश है जो दक्षिण एशिया में स्थित है।"
EXTRA = {  # short texts of further scripts (written for these tests)
    "japanese": "今日はとても良い天気です。明日も晴れるでしょう。",
    "thai": "ภาษาไทยเป็นภาษาที่มีวรรณยุกต์ ผู้คนพูดภาษาไทยกันมาก",
    "korean": "한국어는 띄어쓰기를 합니다.",
    "persian": "من می‌خواهم کتاب بخوانم.",
    "emoji_and_controls": "family 👨‍👩‍👧 done\tcafé vs cafe\u0301 \x00\x1b[0m \ufeff 𝔘𝔫𝔦 \u200b",
}


def read(name: str) -> str:
    return (SLICES / f"{name}.txt").read_text(encoding="utf-8")


def nonspace(text: str) -> int:
    return sum(not ch.isspace() for ch in text)


# ----------------------------------------------------------------------------------------------
# letters and words


def test_letter_count_keeps_combining_marks_with_their_letters_and_only_there():
    assert sum(ch.isalpha() for ch in HINDI) / nonspace(HINDI) == pytest.approx(0.6)  # what the filter used to see
    assert letter_count(HINDI) == nonspace(HINDI) - 1  # every character but the danda
    assert letter_count("தமிழ்நாடு") == 9  # vowel signs and the pulli belong to their letters
    assert letter_count("cafe\u0301") == 5 and letter_count("می‌خواهم") == 8  # an accent; a zero-width non-joiner
    assert letter_count("abc 123 !?") == 3 and letter_count("٣ 12 — ।") == 0  # digits and punctuation are not letters
    # a mark or joiner after a symbol or digit is part of it: keycaps, variation selectors, emoji sequences
    assert letter_count("1\ufe0f\u20e32\ufe0f\u20e3") == 0 and letter_count("\u2764\ufe0f ok") == 2
    assert letter_count("\U0001f468\u200d\U0001f469\u200d\U0001f467 family") == 6
    assert letter_count("\u0301abc") == 3  # a mark with no letter before it
    assert letter_count("\U00011013\U00011038 x") == 3  # Brahmi: a letter and its vowel sign, past U+FFFF
    for name in LANGUAGES:  # clean prose scores like English in every script
        text = read(name)
        assert letter_count(text) / nonspace(text) > 0.8, name


def test_cjk_and_thai_words_are_counted_without_spaces():
    assert words("我们是学生").count == 3  # five Han characters: 1.5 characters a word
    mixed = words("我有 4 本 Python 的书，很好。")
    assert mixed.spaced == ["4", "Python"] and mixed.count == 2 + round(7 / 1.5)  # "，" and "。" are not words
    assert words("ภาษาไทย").count == 2  # Thai: 5 letters (2 vowel marks not counted), 3 letters a word
    assert words(EXTRA["japanese"]).count == round(22 / 1.5)
    english = "The quick brown fox, it's said, jumps -- over 12 dogs."
    assert words(english).spaced == english.split() and words(english).count == len(english.split())
    chinese = read("chinese")
    assert (
        words(chinese).count == 117 > 4 * len(chinese.split())
    )  # split on spaces it had 27 "words", 1 per sentence part


def test_word_length_does_not_count_viramas_and_skips_spaceless_text(tmp_path):
    assert mean_word_length(["स्थित"], "स्थित") == 4  # the virama joins स and थ: not a letter of its own
    assert mean_word_length(["tamil", "தமிழ்"], "tamil தமிழ்") == 4.5
    for name in ("hindi", "tamil", "russian", "arabic", "english"):
        text = read(name)
        assert 3.0 <= mean_word_length(words(text).spaced, text) <= 8.0, name
    strict = QualityFilter(DataConfig(data_files="u", min_mean_word_length=3.0))
    assert strict.reason("a b 4 c 5 d") == "mean_word_length"
    assert strict.reason("我 有 4 个 苹果 和 5 个 梨") is None  # mostly spaceless: no word length to measure
    assert strict.reason(read("chinese")) is None


def test_korean_words_are_as_long_as_their_letters_precomposed_or_not():
    """A Hangul syllable is a block of two or three letters (jamo): counted as one character, the Korean
    story without its Latin names had words of 2.9 characters, under the prose preset's minimum of 3,
    and was removed; counted in letters it measures 6.7, beside Tamil's and Russian's 6.3."""
    korean = re.sub(r"\([^)]*\)", "", read("korean"))  # the story without the names in Latin letters
    spaced = words(korean).spaced
    assert mean_word_length(spaced, korean) == pytest.approx(6.707, abs=1e-3)
    decomposed = unicodedata.normalize("NFD", korean)
    assert mean_word_length(words(decomposed).spaced, decomposed) == mean_word_length(spaced, korean)
    assert (
        mean_word_length(["한국", "말", "가"], "한국 말 가") == (6 + 3 + 2) / 3
    )  # ㅎㅏㄴㄱㅜㄱ, ㅁㅏㄹ, ㄱㅏ (no final)
    assert QualityFilter(DataConfig(data_files="u", quality_filters="prose")).check(korean) is None


def test_prose_preset_keeps_clean_prose_in_every_script():
    prose = QualityFilter(DataConfig(data_files="u", quality_filters="prose"))
    for name in LANGUAGES:
        assert prose.check(read(name)) is None, name
    chinese = read("chinese")
    spam = "买便宜的药，现在就买！" * 30
    assert prose.reason(spam) == "duplicate_ngrams"  # repetition is still caught without spaces
    assert prose.reason(chinese.strip() + chinese.splitlines()[1][:30] * 8) == "duplicate_ngrams"


# ----------------------------------------------------------------------------------------------
# the BPE pre-split and round trips


def test_pre_split_keeps_marks_with_letters_and_leaves_ascii_alone():
    split = byte_level_pre_tokenizer().pre_tokenize_str
    gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False).pre_tokenize_str
    assert len(split("भारत है")) == 2 and len(gpt2("भारत है")) == 5  # GPT-2: भ | ा | रत | Ġह | ै
    assert len(split("தமிழ்நாடு அரசு")) == 2
    assert len(split(EXTRA["persian"])) == 5 and len(gpt2(EXTRA["persian"])) == 7  # the non-joiner stays in its word
    code = stdlib_files()[0].read_text(encoding="utf-8")[:20_000]
    for text in (code, read("english"), "It's 2024:\n\n  x = [1, 2]  # ok\t\r\n", "👨‍👩‍👧 done \x00\x1b[0m 𝔘𝔫𝔦 \u200b"):
        assert [p for p, _ in split(text)] == [p for p, _ in gpt2(text)]  # no marks: exactly GPT-2's split


def test_bpe_round_trips_every_script():
    corpus = [read(name) for name in LANGUAGES] + list(EXTRA.values())
    tok = Tokenizer.train_bpe(corpus, vocab_size=600, max_chars=10**6)
    unseen = [
        "ગુજરાતી લિપિ",
        "ᏣᎳᎩ",
        "\U0001f600\U0001f9d1\u200d\U0001f4bb",
        "\u0301 leading mark",
        "a\u0300\u0301\u0302",
        "\x7f\x80",
    ]
    for text in corpus + unseen:
        assert tok.decode(tok.encode(text)) == text, text[:20]
    assert len(tok.encode(" है")) == 1  # a syllable with its vowel sign can be one token: GPT-2's split cuts ह | ै


# ----------------------------------------------------------------------------------------------
# long text files and named removals


def test_split_long_text_cuts_at_paragraph_breaks():
    paragraphs = [f"Paragraph {i} " + "word " * (10 + i % 7) + "end." for i in range(40)]
    text = "\n\n".join(paragraphs) + "\n"
    pieces = split_long_text(text, 500)
    assert "".join(pieces) == text and all(len(p) <= 500 for p in pieces)
    assert len(pieces) == -(-len(text) // 500) and min(map(len, pieces)) > 400  # as few as fit, of about equal size
    assert all(p.endswith("\n\n") for p in pieces[:-1])  # every cut is at a blank line
    assert split_long_text(text, len(text)) == [text]
    one_line = "x" * 250 + " " + "y" * 250
    assert split_long_text(one_line, 300) == ["x" * 250 + " ", "y" * 250]  # no line break: at a space
    assert split_long_text("ab\u0301" * 4, 5) == ["ab\u0301a", "b\u0301a", "b\u0301ab\u0301"]  # never before an accent
    # nor inside an emoji sequence (joiners, a skin tone) or a flag, in a spaceless run of Thai
    family, flags, thumbs = (
        "\U0001f468\u200d\U0001f469\u200d\U0001f467",
        "\U0001f1fa\U0001f1f8\U0001f1ec\U0001f1e7",
        "\U0001f44d\U0001f3fd",
    )
    run = ("\u0e44\u0e17\u0e22" * 3 + family + flags + thumbs) * 100
    pieces = split_long_text(run, 97)
    assert "".join(pieces) == run and all(len(p) <= 97 for p in pieces)
    assert len(pieces) == -(-len(run) // 97)  # as few as fit, though cuts fall short of their share
    assert not any(p.endswith(("\u200d", "\U0001f1fa", "\U0001f1ec")) for p in pieces)  # a joiner, a flag's first half
    assert not any(p.startswith(("\u200d", "\U0001f3fd", "\U0001f1f8", "\U0001f1e7")) for p in pieces)


def test_a_long_files_documents_do_not_depend_on_its_line_ends(tmp_path):
    """The same text with LF and with CRLF line ends, cut by max_chars: the same documents (the cut is
    made where cleaning puts the line ends)."""
    words = "the of and to in is was for on that with as by at from".split()
    lengths = [5 + (i * 37) % 56 for i in range(60)]  # paragraphs of 5 to 60 words, unevenly
    text = "\n\n".join(" ".join(words[(i + j) % 15] for j in range(n)) + "." for i, n in enumerate(lengths)) + "\n"
    for name, ends in (("lf", "\n"), ("crlf", "\r\n")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "b.txt").write_bytes(text.replace("\n", ends).encode())
    prepared = [
        prepare_data(
            DataConfig(
                data_files=str(tmp_path / name),
                cache_dir=str(tmp_path / f"c_{name}"),
                tokenizer="char",
                validation_split=0.0,
                max_chars=2000,
                progress_bar=False,
            )
        )
        for name in ("lf", "crlf")
    ]
    lf, crlf = (list(p.tokens("train")) for p in prepared)
    assert lf == crlf and prepared[0].manifest["splits"]["train"]["documents"] == -(-len(text) // 1800)


def test_long_text_file_becomes_documents_only_under_max_chars(tmp_path):
    book = tmp_path / "book.txt"
    paragraphs = [" ".join(f"sentence {i} of a long book with many words" for _ in range(3)) for i in range(60)]
    book.write_text("\n\n".join(paragraphs) + "\n", encoding="utf-8")
    common = dict(data_files=str(book), tokenizer="char", validation_split=0.0, progress_bar=False)
    whole = prepare_data(DataConfig(cache_dir=str(tmp_path / "a"), **common))
    assert whole.manifest["splits"]["train"]["documents"] == 1  # no max_chars: the file is one document
    limit = len(book.read_text()) // 3  # pieces of at most 90% of it: four
    split = prepare_data(DataConfig(cache_dir=str(tmp_path / "b"), max_chars=limit, **common))
    report = json.loads((split.directory / REPORT).read_text())
    assert split.manifest["splits"]["train"]["documents"] == 4 and report["removed"]["max_chars"] == 0
    records = tmp_path / "records.jsonl"
    records.write_text(json.dumps({"text": book.read_text()}) + "\n" + json.dumps({"text": "short"}) + "\n")
    dropped = prepare_data(
        DataConfig(cache_dir=str(tmp_path / "c"), max_chars=limit, **{**common, "data_files": str(records)})
    )
    assert json.loads((dropped.directory / REPORT).read_text())["removed_documents"]["max_chars"] == [
        {
            "origin": f"{records}:1",
            "bytes": len(book.read_text()),
            "value": len(book.read_text().strip()),
            "threshold": limit,
            "setting": "max_chars",
        }
    ]  # a record is a document: too long, dropped and named

    # a file within max_chars but over max_words (short words; Chinese counts about a word per character or
    # two) is cut by words too, so that its pieces pass the filter that would drop the whole of it
    many_words = 4 * book.read_text().count(" ")
    by_words = prepare_data(DataConfig(cache_dir=str(tmp_path / "d"), max_words=many_words // 10, **common))
    report = json.loads((by_words.directory / REPORT).read_text())
    assert report["removed"]["max_words"] == 0 and by_words.manifest["splits"]["train"]["documents"] >= 3
    chinese = tmp_path / "zh.txt"
    chinese.write_text("\n\n".join(chr(0x4E00 + i) * 240 for i in range(30)), encoding="utf-8")  # 4,800 words
    zh = prepare_data(
        DataConfig(cache_dir=str(tmp_path / "e"), max_words=2000, **{**common, "data_files": str(chinese)})
    )
    assert json.loads((zh.directory / REPORT).read_text())["removed"]["max_words"] == 0
    assert zh.manifest["splits"]["train"]["documents"] > 1


def test_report_names_removed_documents_and_warns(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(report_module, "NAMED_REMOVALS", 3)
    folder = tmp_path / "corpus"
    folder.mkdir()
    tables = []
    for i in range(5):
        tables.append(folder / f"table{i}.txt")
        tables[-1].write_text(f"| {i} | 12 | 3.4 | 5.67 | 8.9 |\n" * 20, encoding="utf-8")
    (folder / "story.txt").write_text(read("english"), encoding="utf-8")
    (folder / "hindi.txt").write_text(read("hindi"), encoding="utf-8")
    config = DataConfig(
        data_files=str(folder),
        tokenizer="char",
        validation_split=0.0,
        progress_bar=False,
        cache_dir=str(tmp_path / "cache"),
        quality_filters="prose",
    )
    prepared = prepare_data(config)
    report = json.loads((prepared.directory / REPORT).read_text())
    assert report["removed"]["alpha_fraction"] == 5 and report["documents_out"] == 2  # Hindi is kept
    named = report["removed_documents"]["alpha_fraction"]
    assert [entry["origin"] for entry in named] == [str(p) for p in tables[:3]]  # the first three, in order
    assert named[0]["setting"] == "min_alpha_fraction" and named[0]["threshold"] == 0.6 and named[0]["value"] < 0.6
    assert named[0]["bytes"] == tables[0].stat().st_size
    assert report["removed_bytes"]["alpha_fraction"] == sum(p.stat().st_size for p in tables)
    err = capsys.readouterr().err
    warnings = [line for line in err.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "alpha_fraction removed" in warnings[0] and str(tables[0]) in warnings[0]
    assert "min_alpha_fraction" in warnings[0]
    (folder / "story.txt").unlink()
    (folder / "hindi.txt").unlink()
    with pytest.raises(
        UsageError,
        match=r"all 5 documents read were removed \(5 by alpha_fraction\), e\.g\. .*table0\.txt "
        r"\(alpha_fraction 0\.\d+ vs min_alpha_fraction 0\.6\); change data\.min_alpha_fraction",
    ):
        prepare_data(config)  # a corpus that vanishes entirely says why in its error


# ----------------------------------------------------------------------------------------------
# text given to a trained model is cleaned as its training text was


def test_eval_data_and_a_prompt_are_cleaned_as_the_training_text_was(tmp_path, capsys):
    """`eval --data` scores a messy file (CRLF, trailing spaces, control characters, decomposed accents)
    as the same text cleaned, record by record as `prepare` would; `generate` continues a prompt typed
    in NFD as the same prompt in NFC. Both read the text as given before."""
    import yaml

    from llm_trainer import cli
    from llm_trainer.data.text.clean import clean_text

    corpus = tmp_path / "corpus.jsonl"
    stories = [read(name) for name in LANGUAGES] + ["Café au lait, crème brûlée et déjà vu. " * 6]
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in stories * 3), encoding="utf-8")
    config = {
        "model": {"d_model": 16, "n_heads": 2, "n_layers": 1, "max_seq_len": 32},
        "training": {"batch_size": 4, "max_steps": 4, "output_dir": str(tmp_path / "run"), "device": "cpu"},
        "data": {"data_files": [str(corpus)], "tokenizer": "bpe", "tokenizer_vocab_size": 400},
    }
    config["training"].update(progress_bar=False, eval_steps=0, save_steps=0, report_to=["jsonl"])
    config["data"].update(validation_split=0.2, cache_dir=str(tmp_path / "cache"))
    (tmp_path / "exp.yaml").write_text(yaml.safe_dump(config))
    assert cli.main(["train", "--config", str(tmp_path / "exp.yaml")]) == 0
    capsys.readouterr()

    messy = [
        unicodedata.normalize("NFD", "Crème brûlée, déjà vu.") + "  \r\n\r\n\r\n\r\nsecond\x07 line\t",
        unicodedata.normalize("NFD", read("korean")).replace("\n", "\r\n"),
        "\x1b[0m\x00",  # nothing left once cleaned: no document, as prepare leaves none
    ]
    raw, cleaned = tmp_path / "raw.jsonl", tmp_path / "cleaned.jsonl"
    raw.write_text("".join(json.dumps({"text": t}) + "\n" for t in messy), encoding="utf-8")
    kept = [clean_text(t, DataConfig(data_files="u")) for t in messy]
    cleaned.write_text("".join(json.dumps({"text": t}) + "\n" for t in kept if t), encoding="utf-8")
    scores = []
    for data in (raw, cleaned):
        assert cli.main(["eval", "--checkpoint", str(tmp_path / "run"), "--data", str(data), "--json"]) == 0
        scores.append(json.loads(capsys.readouterr().out))
    assert scores[0] == scores[1]

    continuations = []
    for prompt in ("Crème brûlée", unicodedata.normalize("NFD", "Crème brûlée")):
        argv = ["generate", "--checkpoint", str(tmp_path / "run"), "--prompt", prompt, "--temperature", "0"]
        assert cli.main([*argv, "--max_new_tokens", "8"]) == 0
        out = capsys.readouterr().out
        assert out.startswith(prompt)  # the prompt as typed, then what the model wrote
        continuations.append(out[len(prompt) :])
    assert continuations[0] == continuations[1]


def test_only_what_reads_as_the_unknown_token_is_named_for_a_tokenizer_json_of_another_kind(capsys):
    """A BPE and a WordPiece file made with `tokenizers` (an [UNK] token, whitespace split off before the
    model): spaces and newlines, which the pre-tokenizer drops, and every character the vocabulary has
    read as no unknown token, so nothing is said; what the encoding turns into [UNK] is named."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers, trainers

    from llm_trainer.tokenizer import Tokenizer, warn_unseen

    text = "The quick brown fox\njumps over the lazy dog.\n" * 20
    for model, trainer in (
        (models.BPE(unk_token="[UNK]"), trainers.BpeTrainer(vocab_size=120, special_tokens=["[UNK]"])),
        (models.WordPiece(unk_token="[UNK]"), trainers.WordPieceTrainer(vocab_size=120, special_tokens=["[UNK]"])),
    ):
        backend = HFTokenizer(model)
        backend.pre_tokenizer = pre_tokenizers.Whitespace()
        backend.train_from_iterator([text], trainer)
        tokenizer = Tokenizer(backend)
        assert tokenizer.unknown_token == "[UNK]" and tokenizer.unseen_characters(text) == set()
        assert warn_unseen(tokenizer, "The lazy dog", "--prompt") == set() and capsys.readouterr().err == ""
        unseen = warn_unseen(tokenizer, "The lazy Ωog", "--prompt")
        assert unseen == ({"Ω"} if isinstance(model, models.BPE) else {"Ωog"})  # WordPiece: the word
        assert "read as [UNK], which the model never saw in training: Ω" in capsys.readouterr().err


def test_a_tokenizer_json_with_a_post_processor_and_a_unigram_unknown_exports_the_ids_it_trains_on(tmp_path):
    """A SentencePiece-style Unigram file that adds `<s>` to every text (a LLaMA-2 post-processor) and
    names its unknown token by id: the transformers tokenizer (and an export's) gives the ids training
    reads, without the `<s>`; what reads as `<unk>` is named; `<|endoftext|>` is not declared unknown."""
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    from llm_trainer.tokenizer import Tokenizer

    backend = HFTokenizer(models.Unigram())
    backend.pre_tokenizer, backend.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    backend.train_from_iterator(
        ["hello world, this is a small corpus"] * 50,
        trainers.UnigramTrainer(vocab_size=60, special_tokens=["<unk>", "<s>", "</s>"], unk_token="<unk>"),
    )
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    (tmp_path / "unigram.json").write_text(backend.to_str())
    tokenizer = Tokenizer.load(tmp_path / "unigram.json")
    text = "hello \u041f\u0440\u0438\u0432\u0435\u0442 world"
    ids = tokenizer.encode(text)
    assert 1 not in ids and tokenizer.unknown_token == "<unk>" and tokenizer.unk_id in ids
    assert tokenizer.unseen_characters(text) == {"\u041f\u0440\u0438\u0432\u0435\u0442"}
    assert tokenizer.as_transformers()(text)["input_ids"] == ids
    tokenizer.save_pretrained(tmp_path / "export")
    from transformers import AutoTokenizer

    exported = AutoTokenizer.from_pretrained(str(tmp_path / "export"))
    assert exported(text)["input_ids"] == ids and exported.unk_token != "<|endoftext|>"


def test_characters_a_char_tokenizer_never_saw_are_named_once_where_they_are_read(tmp_path, capsys):
    """A prompt or an `eval --data` file with characters outside the char tokenizer's vocabulary: one
    warning naming them (they read as <unk>, which the model never trained on), and the command runs."""
    from conftest import write_tiny_experiment
    from llm_trainer import cli

    assert cli.main(["train", "--config", str(write_tiny_experiment(tmp_path))]) == 0
    capsys.readouterr()
    run = str(tmp_path / "run")
    argv = ["generate", "--checkpoint", run, "--temperature", "0", "--max_new_tokens", "3", "--prompt"]
    assert cli.main([*argv, "the cat Ελλ \u2211"]) == 0
    warned = [line for line in capsys.readouterr().err.splitlines() if "vocabulary" in line]
    assert warned == [
        "warning: --prompt: 3 character(s) are not in the tokenizer's vocabulary and read as <unk>, which "
        "the model never saw in training: \u0395 \u03bb \u2211"
    ]
    assert cli.main([*argv, "the cat"]) == 0
    assert "vocabulary" not in capsys.readouterr().err
    assert cli.main([*argv, "the \udce0\udca4"]) == 0  # argv's bytes e0 a4: half a Devanagari letter
    assert "warning: --prompt holds bytes that are not UTF-8 text" in capsys.readouterr().err
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in ["the cat sat", "the \u4e2d dog", "mat \u00fc"]))
    assert cli.main(["eval", "--checkpoint", run, "--data", str(data)]) == 0
    warned = [line for line in capsys.readouterr().err.splitlines() if "vocabulary" in line]
    assert len(warned) == 1 and warned[0].startswith(f"warning: --data {data}: 2 character(s)"), warned
