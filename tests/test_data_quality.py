"""Data quality stages of prepare: cleaning, quality filters, deduplication, the source mixture, bad input.

Small corpora written into tmp_path; char tokenizer (fast) unless the test is about something else.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from llm_trainer.config import DataConfig
from llm_trainer.data.prepare import prepare_data
from llm_trainer.data.prepare.report import REPORT
from llm_trainer.data.text.clean import Cleaner, clean_text
from llm_trainer.data.text.dedup import Deduplicator, MinHasher, exact_key
from llm_trainer.data.text.filters import QualityFilter, char_entropy
from llm_trainer.data.text.sources import stdlib_files
from llm_trainer.errors import UsageError
from llm_trainer.tokenizer import EOT

PROSE = (
    "The history of the river valley is a story of farmers, traders and travellers. For centuries the "
    "water carried grain from the northern fields to the markets of the coast, and every town along its "
    "banks grew rich on the trade. When the railway arrived, the boats slowly disappeared, but the old "
    "warehouses still stand by the water, and on summer evenings people gather there to eat, to talk and "
    "to watch the light fade over the hills. Historians who study the region often begin with the letters "
    "of merchants, which describe prices, weather and the difficult politics of the time in great detail."
)
PROSE2 = (
    "Modern bridges are designed with computer models that predict how wind, traffic and temperature will "
    "stress every beam. Engineers still walk the structures, though, because sensors miss the small cracks "
    "and rust that an experienced eye can spot. A good inspection report lists what was found, how serious "
    "it is and what should be repaired first, so that the money available goes where it matters most."
)


def config(tmp_path: Path, **overrides) -> DataConfig:
    overrides.setdefault("cache_dir", str(tmp_path / "cache"))
    overrides.setdefault("tokenizer", "char")
    overrides.setdefault("validation_split", 0.0)
    overrides.setdefault("progress_bar", False)
    return DataConfig(**overrides)


def write_jsonl(path: Path, texts: list, **extra) -> Path:
    path.write_text("".join(json.dumps({"text": t, **extra}) + "\n" for t in texts), encoding="utf-8")
    return path


def documents(prepared, split: str = "train") -> list[str]:
    if prepared.manifest["splits"][split]["tokens"] == 0:
        return []
    tokens, offsets = np.asarray(prepared.tokens(split)), prepared.offsets(split)
    return [prepared.tokenizer.decode(tokens[s : e - 1].tolist()) for s, e in zip(offsets[:-1], offsets[1:])]


def report(prepared) -> dict:
    return json.loads((prepared.directory / REPORT).read_text())


def words(seed: int, n: int = 120) -> str:
    rng = np.random.default_rng(seed)
    return " ".join(f"w{i}" for i in rng.integers(0, 5000, size=n))


# ----------------------------------------------------------------------------------------------
# cleaning


def test_cleaning_unicode_controls_and_markers(tmp_path):
    clean = Cleaner(config(tmp_path, data_files="unused"))
    assert clean("cafe\u0301") == "caf\u00e9"  # NFC
    assert clean("a\x00b\x07c\x1b[0m\x7fde") == "abc[0mde"  # C0/C1 controls; tab and newline stay
    # the control characters that end lines (a Word line break, a page break, NEL) end them: no words glued
    assert clean("First line\x0bsecond\x0cpage two\x85third") == "First line\nsecond\npage two\nthird"
    assert clean("tab\tand\nnewline") == "tab\tand\nnewline"
    assert clean("\ufeffwith bom") == "with bom"
    assert clean(f"one{EOT}two") == "onetwo"  # the document separator cannot appear inside a document
    # nor can one be left over when a removal joins its pieces, or a removed control character does
    assert clean("A <|endo<|endoftext|>ftext|> B") == "A  B" and clean("C <|endof\x07text|> D") == "C  D"
    assert Cleaner(config(tmp_path, data_files="u", unicode_normalization="NFKC"))("\uff1c|endoftext|\uff1e x") == " x"
    assert clean("lone \ud800 surrogate") == "lone \ufffd surrogate"
    assert Cleaner(config(tmp_path, data_files="u", unicode_normalization="NFKC"))("\ufb01ne") == "fine"
    assert Cleaner(config(tmp_path, data_files="u", unicode_normalization="none"))("e\u0301") == "e\u0301"
    assert Cleaner(config(tmp_path, data_files="u", remove_control_chars=False))("a\x07b") == "a\x07b"


def test_whitespace_never_touches_code_indentation(tmp_path):
    code = "def f(x):\n    if x:  \n\t\treturn  x   # aligned   comment\n\n\n\n    return 0\n"
    expected = "def f(x):\n    if x:\n\t\treturn  x   # aligned   comment\n\n    return 0"
    for corpus_type in ("prose", "code"):
        assert clean_text(code, config(tmp_path, data_files="u", corpus_type=corpus_type)) == expected
    prose = config(tmp_path, data_files="u", collapse_spaces=True)
    assert clean_text("  Indented   line  with\t\tgaps.", prose) == "  Indented line with gaps."
    with pytest.raises(ValueError, match="collapse_spaces"):
        DataConfig(data_files="u", corpus_type="code", collapse_spaces=True)


def test_boilerplate_lines(tmp_path):
    text = (
        "Skip to main content\nReal content here.\nPrivacy Policy | Terms of Use\nMore content.\nAll rights reserved."
    )
    assert clean_text(text, config(tmp_path, data_files="u")) == text  # off by default
    on = config(tmp_path, data_files="u", remove_boilerplate=True)
    assert clean_text(text, on) == "Real content here.\nMore content."
    custom = config(tmp_path, data_files="u", remove_boilerplate=True, boilerplate_patterns=[r"More .*"])
    assert clean_text(text, custom) == text.replace("\nMore content.", "")
    with pytest.raises(ValueError, match="not a valid regex"):
        DataConfig(data_files="u", boilerplate_patterns=["("])


def test_invalid_utf8_replaced_or_dropped(tmp_path):
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "good.txt").write_text("fine text", encoding="utf-8")
    (folder / "latin.txt").write_bytes("caf\u00e9 au lait".encode("latin-1"))
    lines = tmp_path / "lines.jsonl"
    lines.write_bytes(b'{"text": "ok line"}\n' + '{"text": "bad \u00e9 line"}\n'.encode("latin-1"))
    replaced = prepare_data(config(tmp_path, data_files=[str(folder), str(lines)], invalid_utf8="replace"))
    assert documents(replaced) == ["fine text", "caf\ufffd au lait", "ok line", "bad \ufffd line"]
    dropped = prepare_data(config(tmp_path, data_files=[str(folder), str(lines)], invalid_utf8="drop"))
    assert documents(dropped) == ["fine text", "ok line"]
    assert report(dropped)["skipped_inputs"]["invalid_utf8"] == 2
    with pytest.raises(UsageError, match=r"lines.jsonl:2 is not UTF-8"):  # default: bad input, named with its line
        prepare_data(config(tmp_path, data_files=[str(lines)]))


# ----------------------------------------------------------------------------------------------
# quality filters: each removes what it should and keeps what it should


FILTER_CASES = [
    # (filter counted, thresholds, a document it must remove, a document it must keep)
    ("min_length", dict(min_length=20), "too short", "long enough to be kept here"),
    ("max_chars", dict(max_chars=40), "x" * 41, "short and sweet"),
    ("min_words", dict(min_words=5), "only three words", "one two three four five"),
    ("max_words", dict(max_words=5), "one two three four five six", "one two three four five"),
    ("alpha_fraction", dict(min_alpha_fraction=0.6), "12 345 6789 !!! ## ab", "mostly letters, 42 only"),
    ("mean_word_length", dict(min_mean_word_length=3.0), "a b c d e f g h", "these words have ordinary lengths"),
    ("mean_word_length", dict(max_mean_word_length=12.0), "x" * 30 + " " + "y" * 30, "normal words again"),
    (
        "repeated_lines",
        dict(max_repeated_line_fraction=0.3),
        "menu\nhome\nmenu\nhome\nmenu\ntext",
        "one\ntwo\nthree\nfour",
    ),
    (
        "duplicate_ngrams",
        dict(max_duplicate_ngram_fraction=0.2, duplicate_ngram_size=3),
        "buy now cheap buy now cheap buy now cheap buy now cheap",
        PROSE,
    ),
    (
        "char_entropy",
        dict(min_char_entropy=3.0),
        "aaaaaaaaaabbbbbbbbbbaaaaab",
        "The quick brown fox jumps over the lazy dog",
    ),
]


@pytest.mark.parametrize(
    "name, thresholds, bad, good", FILTER_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(FILTER_CASES)]
)
def test_each_filter_removes_and_keeps(tmp_path, name, thresholds, bad, good):
    qf = QualityFilter(config(tmp_path, data_files="u", **thresholds))
    assert qf.reason(bad) == name
    assert qf.reason(good) is None
    assert name in qf.active()
    path = write_jsonl(tmp_path / "d.jsonl", [bad, good, bad + " "])  # the same through prepare, counted
    prepared = prepare_data(config(tmp_path, data_files=str(path), **thresholds))
    assert documents(prepared) == [good]
    assert report(prepared)["removed"][name] == 2
    assert report(prepared)["removed"]["exact_duplicates"] == 0  # filters run before dedup


def test_presets_keep_real_text_and_drop_junk(tmp_path):
    prose = QualityFilter(config(tmp_path, data_files="u", quality_filters="prose"))
    assert prose.reason(PROSE) is None
    assert prose.reason(PROSE + "\n\n" + PROSE2) is None
    assert prose.reason(PROSE2) is None
    junk = {
        "buy cheap pills now! " * 40: "duplicate_ngrams",
        "| 12 | 3.4 | 5.67 | 8.9 |\n" * 30: "alpha_fraction",
        "Home\nAbout\nContact\n" * 20: "repeated_lines",
        "Home | About | Contact": "min_words",
        ("lorem " * 60).strip(): "duplicate_ngrams",
    }
    for text, reason in junk.items():
        assert prose.reason(text) == reason, text[:40]
    code = QualityFilter(config(tmp_path, data_files="u", quality_filters="code", corpus_type="code"))
    files = [p for p in stdlib_files()[:60] if p.stat().st_size > 500]
    kept = [p for p in files if code.reason(p.read_text(encoding="utf-8", errors="replace")) is None]
    assert len(kept) >= 0.9 * len(files)
    assert code.reason("x = 1\n" * 200) == "repeated_lines"
    # an explicit threshold overrides the preset's
    assert QualityFilter(config(tmp_path, data_files="u", quality_filters="prose", min_words=1)).min_words == 1


def test_char_entropy():
    assert char_entropy("") == 0.0
    assert char_entropy("aaaa") == 0.0
    assert abs(char_entropy("abab") - 1.0) < 1e-9
    assert abs(char_entropy("\u4e2d\u6587\u4e2d\u6587") - 1.0) < 1e-9  # characters, not bytes
    assert char_entropy(PROSE) > 3.9


MULTILINGUAL = Path(__file__).parent / "data" / "multilingual"


def test_cleaned_text_is_normalised_and_cleaning_it_again_changes_nothing(tmp_path):
    """A removal (a control character, an end-of-text marker) between a letter and its combining mark
    joins them: the text is normalised again, so what comes out is NFC and a fixed point of cleaning."""
    import unicodedata

    clean = Cleaner(config(tmp_path, data_files="unused"))
    assert clean("cafe\x07\u0301") == clean(f"cafe{EOT}\u0301") == clean("cafe\u0301") == "caf\u00e9"
    assert clean("\u1100\x01\u1161") == "\uac00"  # Hangul jamo joined across a removed control character
    assert clean(f"e<|endo{EOT}ftext|>\u0301") == "\u00e9"  # a marker that a removal builds goes too
    # a removed marker leaves no trailing space, edge newline or run of blank lines behind
    assert clean(f"abc {EOT}\nxyz") == "abc\nxyz" and clean(f"{EOT}\nabc") == "abc"
    assert clean(f"a\n\n{EOT}\n\nb") == "a\n\nb"
    messy = [(MULTILINGUAL / f"{name}.txt").read_text(encoding="utf-8") for name in ("hindi", "korean", "arabic")]
    noise = ["\x07", EOT, "\r\n", " \u3000\n", "\u0301", "\x1b", "\n\n\n\n", "\u00a0", f" {EOT}\n\n", "\x0b", "\x85"]
    for text in messy:
        for k, piece in enumerate(noise):  # noise spliced at a few places, in NFD and NFC
            at = [len(text) * (i + 1) // 5 for i in range(4)]
            spliced = "".join(text[a:b] + piece for a, b in zip([0, *at], at)) + text[at[-1] :]
            for variant in (spliced, unicodedata.normalize("NFD", spliced)):
                once = clean(variant)
                assert unicodedata.is_normalized("NFC", once) and clean(once) == once, (k, once[:80])


def test_every_unicode_space_trails_a_line_as_a_space_does(tmp_path):
    """The ideographic space (U+3000) and the no-break space at a line's end are removed like spaces, a
    line of them is blank, and the exact-dedup key ignores them; indentation stays."""
    clean = Cleaner(config(tmp_path, data_files="unused"))
    japanese = "日本語の文章。\u3000\u3000\n\u3000\n\u3000\n\u3000\n\n次の段落\u00a0"
    assert (
        clean(japanese)
        == "日本語の文章。\n\n次の段落"
        == clean(japanese.replace("\u3000", " ").replace("\u00a0", "\t"))
    )
    assert clean("\u3000段落の字下げ\n\u3000次") == "\u3000段落の字下げ\n\u3000次"  # leading: kept
    assert exact_key("\u3000日本語です。\u3000") == exact_key("日本語です。") == exact_key("日本語です。\u00a0")
    assert exact_key("日本語です。") != exact_key("日本語でした。")


# ----------------------------------------------------------------------------------------------
# deduplication


def test_exact_key_normalises_case_and_whitespace():
    assert exact_key("Hello  World\n\tagain") == exact_key("hello world again")
    assert exact_key("hello world") != exact_key("hello word")


def test_minhash_estimates_jaccard():
    hasher = MinHasher(128, 5, 0.8)
    base = words(0, 300).split()
    for changed, low, high in ((0, 1.0, 1.0), (3, 0.8, 1.0), (60, 0.1, 0.45), (300, 0.0, 0.05)):
        other = list(base)
        for i in np.random.default_rng(changed).choice(300, changed, replace=False):
            other[i] = f"new{i}"
        same = (hasher.signature(" ".join(base)) == hasher.signature(" ".join(other))).mean()
        assert low <= same <= high, (changed, same)
    assert (hasher.signature("Hello, World!") == hasher.signature("hello world")).all()  # case and punctuation


def test_exact_and_near_duplicates_removed_across_sources(tmp_path):
    distinct_a = [words(i, 300) for i in range(30)]
    distinct_b = [words(100 + i, 300) for i in range(30)]
    near = distinct_a[5].split()
    for i in (10, 150, 290):  # Jaccard of 5-word shingles ~0.9
        near[i] = "changed"
    near_within_b = distinct_b[2].split()
    near_within_b[7] = "edited"
    b_docs = [*distinct_b, "  " + distinct_a[3].upper() + "\n", " ".join(near), " ".join(near_within_b)]
    a = write_jsonl(tmp_path / "a.jsonl", distinct_a)
    folder = tmp_path / "b"
    folder.mkdir()
    for i, text in enumerate(b_docs):
        (folder / f"{i:03d}.txt").write_text(text, encoding="utf-8")
    sources = [{"name": "web", "data_files": str(a)}, {"name": "books", "data_files": str(folder)}]
    prepared = prepare_data(config(tmp_path, sources=sources, deduplication="near", mixture_stopping="all_exhausted"))
    out = report(prepared)
    assert out["removed"]["exact_duplicates"] == 1
    assert out["removed"]["near_duplicates"] == 2
    assert sorted(documents(prepared)) == sorted(distinct_a + distinct_b)  # every distinct document stays
    assert out["sources"]["web"]["documents_in"] == 30 and out["sources"]["books"]["documents_in"] == 33
    origin = dict(zip(documents(prepared), prepared.sources("train")))  # each document keeps its source
    assert all(origin[t] == "web" for t in distinct_a) and all(origin[t] == "books" for t in distinct_b)
    exact_only = prepare_data(config(tmp_path, sources=sources, deduplication="exact"))
    assert report(exact_only)["removed"] == {"min_length": 0, "exact_duplicates": 1}
    none = prepare_data(config(tmp_path, sources=sources, deduplication="none"))
    assert report(none)["documents_out"] == 63


def test_near_duplicates_in_scripts_without_spaces_are_found_as_in_english(tmp_path):
    """A copy of a Chinese, Japanese or Thai paragraph with two characters changed is a near duplicate,
    as an English one with two words changed is: characters are the shingles' words there."""
    rng = np.random.default_rng(0)
    alphabets = {
        "zh": [chr(c) for c in range(0x4E00, 0x4E00 + 3000)],
        "ja": [chr(c) for c in [*range(0x3041, 0x3097), *range(0x4E00, 0x4E00 + 500)]],
        "th": [chr(c) for c in range(0x0E01, 0x0E2F)],
    }
    folder = tmp_path / "corpus"
    folder.mkdir()
    originals = []
    for name, alphabet in alphabets.items():
        for i in range(3):  # distinct paragraphs of 400 characters, with a full stop every 40
            chars = list(rng.choice(alphabet, 400))
            text = "".join(c + ("\u3002" if k % 40 == 39 else "") for k, c in enumerate(chars))
            (folder / f"{name}{i}.txt").write_text(text, encoding="utf-8")
            originals.append(text)
        edited = list(originals[-1])
        edited[100], edited[300] = "\u4e00", "\u4e8c"
        (folder / f"{name}_edited.txt").write_text("".join(edited), encoding="utf-8")
    english = " ".join(f"w{w}" for w in rng.integers(0, 10**6, 300))
    edited_english = english.split()
    edited_english[100], edited_english[200] = "one", "two"
    (folder / "en.txt").write_text(english, encoding="utf-8")
    (folder / "en_edited.txt").write_text(" ".join(edited_english), encoding="utf-8")
    prepared = prepare_data(config(tmp_path, data_files=str(folder), deduplication="near"))
    assert report(prepared)["removed"]["near_duplicates"] == 4
    assert sorted(documents(prepared)) == sorted([*originals, english])


def test_a_copy_without_its_punctuation_is_a_near_duplicate_in_every_script():
    """Punctuation separates words in every script, as ASCII punctuation does: a copy of the story with
    its commas and full stops taken out (the Arabic comma, the ideographic full stop, the danda) is
    as similar to it in Arabic, Chinese or Hindi as in English; it was not (Jaccard 0.5 to 0.8)."""
    hasher = MinHasher(128, 5, 0.8)
    marks = ",.،。，।"
    for name in ("english", "hindi", "tamil", "arabic", "russian", "chinese", "korean"):
        text = (MULTILINGUAL / f"{name}.txt").read_text(encoding="utf-8")
        bare = "".join(ch for ch in text if ch not in marks)
        assert bare != text, name
        assert (hasher.signature(text) == hasher.signature(bare)).mean() == 1.0, name
    assert (hasher.signature("日本語、です。") == hasher.signature("日本語 です")).all()
    assert (
        hasher.signature("one 🙂 two") == hasher.signature("one two")
    ).all()  # a symbol is not a word, as "+" is not


def test_near_dedup_memory_per_document_is_bounded():
    """The index grows with the number of documents only (not their length)."""
    import tracemalloc

    dedup = Deduplicator(DataConfig(data_files="u", deduplication="near"))
    hasher = dedup.hasher
    sig = hasher.signature(words(0, 2000))
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    rng = np.random.default_rng(0)
    for i in range(3000):
        fake = rng.integers(0, 2**32, size=128, dtype=np.uint64).astype(np.uint32)  # distinct signatures
        dedup.check(i + 1, fake, hasher.band_keys(fake[None])[0])
    per_doc = (tracemalloc.get_traced_memory()[0] - before) / 3000
    tracemalloc.stop()
    assert per_doc < 4000, per_doc
    assert dedup.check(10**9, sig, hasher.band_keys(sig[None])[0]) is None


# ----------------------------------------------------------------------------------------------
# sources: mixture, include/exclude, formats, bad input


def test_mixture_weights_hold_within_sampling_error(tmp_path, capsys):
    a = write_jsonl(tmp_path / "a.jsonl", [f"a{i}" for i in range(3000)])
    b = write_jsonl(tmp_path / "b.jsonl", [f"b{i}" for i in range(3000)])
    sources = [{"name": "a", "data_files": str(a), "weight": 3}, {"name": "b", "data_files": str(b), "weight": 1}]
    n = 2000
    prepared = prepare_data(config(tmp_path, sources=sources, max_documents=n, seed=5))
    docs = documents(prepared)
    share = sum(d.startswith("a") for d in docs) / n
    assert abs(share - 0.75) < 4 * (0.75 * 0.25 / n) ** 0.5, share  # 4 sigma
    assert [d for d in docs if d.startswith("a")] == [f"a{i}" for i in range(len([d for d in docs if d[0] == "a"]))]
    again = prepare_data(config(tmp_path, sources=sources, max_documents=n, seed=5, cache_dir=str(tmp_path / "c2")))
    assert documents(again) == docs  # reproducible from the seed
    other = prepare_data(config(tmp_path, sources=sources, max_documents=n, seed=6))
    assert documents(other) != docs
    first = prepare_data(config(tmp_path, sources=sources, seed=5, mixture_stopping="first_exhausted"))
    firsts = documents(first)
    assert firsts.count("b2999") == 0 and firsts[-1] == "a2999"  # stops when a runs out, b partly unused
    everything = prepare_data(config(tmp_path, sources=sources, seed=5, mixture_stopping="all_exhausted"))
    assert sorted(documents(everything)) == sorted([f"a{i}" for i in range(3000)] + [f"b{i}" for i in range(3000)])
    per_source = report(everything)["sources"]
    assert per_source["a"]["documents_out"] == per_source["b"]["documents_out"] == 3000
    # there the weights changed nothing the loader's shuffle keeps, and the prepare said so, once
    said = [line for line in capsys.readouterr().err.splitlines() if "do not change what is trained" in line]
    assert said == [
        "warning: data.sources' weights (a 3, b 1) do not change what is trained: with data.mixture_stopping: "
        "all_exhausted (the default) every document of every source is used once, and the training order is "
        "shuffled; set data.mixture_stopping: first_exhausted for the weights to hold to the end (the draw stops "
        "when one source runs out, the rest of the others unused), or data.max_documents to draw that many by "
        "weight"
    ]


def test_include_exclude_globs(tmp_path):
    root = tmp_path / "repo"
    (root / "tests").mkdir(parents=True)
    (root / "pkg").mkdir()
    (root / "pkg" / "a.py").write_text("a = 1", encoding="utf-8")
    (root / "b.md").write_text("# b", encoding="utf-8")
    (root / "tests" / "test_a.py").write_text("assert a", encoding="utf-8")
    (root / "pkg" / "c.min.js").write_text("var c", encoding="utf-8")
    prepared = prepare_data(
        config(tmp_path, data_files=str(root), include=["*.py", "*.js"], exclude=["tests/*", "*.min.js"])
    )
    assert documents(prepared) == ["a = 1"]
    globbed = prepare_data(config(tmp_path, data_files=str(root / "**" / "*.py"), exclude=["tests/*"]))
    assert documents(globbed) == ["a = 1"]


def test_jsonl_zst(tmp_path):
    zstandard = pytest.importorskip("zstandard")
    path = tmp_path / "d.jsonl.zst"
    payload = "".join(json.dumps({"text": f"zst doc {i}"}) + "\n" for i in range(50)).encode()
    path.write_bytes(zstandard.ZstdCompressor().compress(payload))
    prepared = prepare_data(config(tmp_path, data_files=str(path)))
    assert documents(prepared) == [f"zst doc {i}" for i in range(50)]
    broken = tmp_path / "broken.jsonl.zst"
    broken.write_bytes(b"not zstandard data" * 4)
    with pytest.raises(UsageError, match="broken.jsonl.zst"):
        prepare_data(config(tmp_path, data_files=str(broken)))


def test_hf_dataset_streaming_from_a_local_folder(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    datasets.disable_progress_bars()
    folder = tmp_path / "ds"
    folder.mkdir()
    pq.write_table(pa.table({"text": [f"streamed {i}" for i in range(6)]}), folder / "part-0.parquet")
    prepared = prepare_data(config(tmp_path, dataset_name=str(folder), streaming=True))
    assert documents(prepared) == [f"streamed {i}" for i in range(6)]
    saved = tmp_path / "saved"
    datasets.Dataset.from_dict({"text": ["x one", "x two"]}).save_to_disk(str(saved))
    assert documents(prepare_data(config(tmp_path, dataset_name=str(saved), streaming=True))) == ["x one", "x two"]


def _bad_inputs(tmp_path: Path) -> list[dict]:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    good = write_jsonl(tmp_path / "good.jsonl", ["good one", "good two"])
    lines = tmp_path / "lines.jsonl"
    lines.write_text('{"text": "kept"}\n{"text": oops}\n{"body": "no text"}\n', encoding="utf-8")
    blob = tmp_path / "blob.bin"
    blob.write_bytes(b"\x00\x01binary")
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "nocol.parquet")
    empty = write_jsonl(tmp_path / "empty.jsonl", [])
    return [
        {"name": "good", "data_files": str(good)},
        {"name": "lines", "data_files": str(lines)},
        {"name": "missing", "data_files": [str(tmp_path / "nowhere.txt"), str(good)]},
        {"name": "blob", "data_files": [str(blob), str(good)]},
        {"name": "nocol", "data_files": [str(tmp_path / "nocol.parquet"), str(good)]},
        {"name": "empty", "data_files": str(empty)},
    ]


def test_bad_input_skipped_and_counted_when_asked(tmp_path):
    sources = _bad_inputs(tmp_path)
    prepared = prepare_data(config(tmp_path, sources=sources, on_bad_input="skip", deduplication="none"))
    skipped = report(prepared)["skipped_inputs"]
    assert skipped == {
        "bad_json_lines": 1,
        "missing_column": 2,
        "missing_files": 1,
        "binary_files": 1,
        "empty_sources": 1,
    }
    assert sorted(set(documents(prepared))) == ["good one", "good two", "kept"]
    assert prepared.manifest["skipped_inputs"]["bad_json_lines"] == 1


@pytest.mark.parametrize(
    "source, expected",
    [
        (1, "lines.jsonl:2 is not valid JSON; fix or remove this line, or set data.on_bad_input: skip"),
        (2, "nowhere.txt not found"),
        (3, "blob.bin looks like a binary file"),
        (4, "nocol.parquet has no column 'text'"),
        (5, "data source 'empty' has no documents"),
    ],
)
def test_bad_input_is_a_one_line_error_by_default(tmp_path, source, expected):
    sources = _bad_inputs(tmp_path)
    with pytest.raises(UsageError) as info:
        prepare_data(config(tmp_path, sources=[sources[0], sources[source]]))
    assert expected in str(info.value) and "\n" not in str(info.value)
    assert not any((tmp_path / "cache").iterdir())  # nothing half-written is left


def test_missing_column_line_is_named_with_the_fix_that_fits(tmp_path):
    """A file whose first record lacks the field is read with the wrong data.text_column; one whose later
    record lacks it has one bad record, which changing the column would not fix."""
    lines = tmp_path / "lines.jsonl"
    lines.write_text('{"text": "kept"}\n{"body": "no text"}\n', encoding="utf-8")
    with pytest.raises(
        UsageError,
        match=r"lines.jsonl:2 has no 'text' field \(its fields: 'body'\); earlier records have it: fix or remove",
    ):
        prepare_data(config(tmp_path, data_files=str(lines)))
    lines.write_text('{"content": "no text", "repo": "r", "path": "p"}\n{"text": "kept"}\n', encoding="utf-8")
    with pytest.raises(
        UsageError,
        match=r"lines.jsonl:1 has no 'text' field \(its fields: 'content', 'repo', 'path'\); set data.text_column$",
    ):
        prepare_data(config(tmp_path, data_files=str(lines)))
    wide = {f"f{i}": i for i in range(11)}
    for first, said in (
        (wide, "its fields: 'f0', 'f1', 'f2', 'f3', 'f4', 'f5', 'f6', 'f7' and 3 more"),
        ({}, "the object is empty"),
        ("just a string", "the line is a JSON string, not an object"),
        (42, "the line is a JSON number, not an object"),
        (None, "the line is a JSON null, not an object"),
    ):
        lines.write_text(json.dumps(first) + "\n", encoding="utf-8")
        with pytest.raises(UsageError) as info:
            prepare_data(config(tmp_path, data_files=str(lines)))
        assert f"lines.jsonl:1 has no 'text' field ({said}); set data.text_column" in str(info.value)


def test_summary_is_printed(tmp_path, capsys):
    path = write_jsonl(tmp_path / "d.jsonl", ["one doc", "one doc", "two docs"])
    prepare_data(config(tmp_path, data_files=str(path)))
    err = capsys.readouterr().err
    assert "3 documents in -> 2 out" in err and "exact_duplicates 1" in err
