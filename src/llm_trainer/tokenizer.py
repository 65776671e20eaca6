r"""Tokenizers: byte-level BPE trained on the corpus, char-level for small experiments, or a user's file.

All three are Hugging Face `tokenizers` objects saved as one `tokenizer.json`, so every tokenizer
loads the same way, runs in Rust, and exports to `transformers` unchanged (`Tokenizer.as_transformers`
hands the same tokenizer to code written for transformers).

The BPE pre-split (`data.tokenizer_pre_split`), the regex that cuts text into the pieces BPE merges
within. GPT-2's byte-level regex keeps runs of letters (\p{L}) together but cuts at combining marks
(\p{M}), so the Devanagari vowel signs and viramas, Tamil vowel signs and pulli, Thai vowels and tone
marks fall out of their words ("भारत" -> भ | ा | रत): BPE can never merge across a cut, and Indic text
takes far more tokens than it needs (see bench/README.md, "Text in every script"). Ours, `unicode`
(the default), is GPT-2's regex with \p{M} kept in letter runs (as the large-vocabulary tokenizers of
later models do) and zero-width (non-)joiners kept between letters (Indic and Persian words hold
them); on text without combining marks it splits exactly as GPT-2's does. `gpt2` and `llama3` are
those models' own regexes, character for character, for tools that know a tokenizer by its
pre-split (llama.cpp's converter reproduces those two and not ours). The byte-level alphabet stays
(every byte is a token), so any input, in any script, round-trips exactly.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Regex, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

from .errors import UsageError, first_line
from .files.atomic import write_file
from .hf.fast_tokenizer import unknown_token
from .logs import warn

EOT = "<|endoftext|>"
UNK = "<unk>"
TOKENIZER_FILE = "tokenizer.json"
# GPT-2's pre-split, as its tokenizer (and tokenizers' ByteLevel regex) has it.
GPT2_PRE_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
# LLaMA-3's pre-split, as its tokenizer.json has it: case-insensitive contractions, digits in threes.
LLAMA3_PRE_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_WORD = r"[\p{L}\p{M}]+(?:[\x{200C}\x{200D}]+[\p{L}\p{M}]+)*"
PRE_SPLIT = rf"'s|'t|'re|'ve|'m|'ll|'d| ?{_WORD}| ?\p{{N}}+| ?[^\s\p{{L}}\p{{M}}\p{{N}}]+|\s+(?!\S)|\s+"
PRE_SPLITS = {"unicode": PRE_SPLIT, "gpt2": GPT2_PRE_SPLIT, "llama3": LLAMA3_PRE_SPLIT}
# The char tokenizer's split: every character its own piece ((?m) makes "." match newlines too, in
# Oniguruma's syntax).
CHAR_SPLIT = "(?m)."
# The only regexes a tokenizer.json may hold (Split pre-tokenizers, Replace normalizers and decoders):
# those we write. The regex engine (Oniguruma) backtracks, so a crafted pattern of a few bytes costs
# tens of milliseconds per character of every text encoded; a regex cannot be told safe by running it.
KNOWN_REGEXES = frozenset({*PRE_SPLITS.values(), CHAR_SPLIT})
# Encoded and decoded once when a tokenizer.json is read, so a file whose parts fail on any text
# (the library panics) is refused as it is read, not in the middle of a run.
_PROBE = "The cat's 42 dogs \u2014 na\u00efve caf\u00e9, \u092d\u093e\u0930\u0924 \u65e5\u672c\n\t  end."


def byte_level_pre_tokenizer(pre_split: str = "unicode") -> pre_tokenizers.PreTokenizer:
    """The `pre_split` regex (a name of `PRE_SPLITS`), then GPT-2's byte-to-character mapping (no second
    regex pass): the layout of LLaMA-3's tokenizer.json, whichever regex it holds."""
    if pre_split not in PRE_SPLITS:
        raise UsageError(f"unknown BPE pre-split {pre_split!r}; choose one of {', '.join(PRE_SPLITS)}")
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRE_SPLITS[pre_split]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def pre_split_of(tokenizer_json: dict[str, Any]) -> str | None:
    """The name in `PRE_SPLITS` of the regex a byte-level BPE tokenizer.json splits with, or None (not
    one of ours, or not byte-level BPE). GPT-2's own layout (ByteLevel with its built-in regex) is `gpt2`."""
    if (tokenizer_json.get("model") or {}).get("type") != "BPE":
        return None
    pre = tokenizer_json.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    if any(step.get("type") == "ByteLevel" and step.get("use_regex", True) for step in steps):
        return "gpt2" if len(steps) == 1 else None
    patterns = [(step.get("pattern") or {}).get("Regex") for step in steps if step.get("type") == "Split"]
    if len(patterns) != 1 or not any(step.get("type") == "ByteLevel" for step in steps):
        return None
    return next((name for name, regex in PRE_SPLITS.items() if regex == patterns[0]), None)


# What code written for transformers calls on a tokenizer, which ours leaves to `as_transformers()`.
_TRANSFORMERS_NAMES = frozenset(
    {"encode_plus", "batch_encode_plus", "batch_decode", "pad", "tokenize", "apply_chat_template"}
    | {"convert_ids_to_tokens", "convert_tokens_to_ids", "get_vocab", "add_special_tokens", "backend_tokenizer"}
    | {"pad_token", "pad_token_id", "eos_token", "eos_token_id", "bos_token", "bos_token_id", "unk_token_id"}
    | {"padding_side", "truncation_side", "special_tokens_map", "all_special_ids"}
)


def warn_unseen(tokenizer: Tokenizer, text: str, where: str) -> set[str]:
    """One warning naming the pieces of `text` that `where` reads as the unknown token, which the model
    never saw in training (`Tokenizer.unseen_characters`); returns them."""
    unseen = tokenizer.unseen_characters(text)
    say_unseen(tokenizer, unseen, where)
    return unseen


def say_unseen(tokenizer: Tokenizer, unseen: set[str], where: str) -> None:
    """`warn_unseen`'s warning for pieces gathered over several texts."""
    if unseen:
        shown = " ".join(repr(ch)[1:-1] for ch in sorted(unseen)[:12]) + (" ..." if len(unseen) > 12 else "")
        what = "character(s)" if all(len(piece) == 1 for piece in unseen) else "piece(s) of text"
        warn(
            f"{where}: {len(unseen)} {what} are not in the tokenizer's vocabulary and read as "
            f"{tokenizer.unknown_token}, which the model never saw in training: {shown}"
        )


class Tokenizer:
    """A thin wrapper that fixes the end-of-text token and the on-disk format."""

    def __init__(self, backend: HFTokenizer, model_max_length: int | None = None):
        self.backend = backend
        # The model's max_seq_len where a run or checkpoint gives one: where `as_transformers()` truncates.
        self.model_max_length = model_max_length
        eot = backend.token_to_id(EOT)
        if eot is None:
            backend.add_special_tokens([EOT])
            eot = backend.token_to_id(EOT)
        self.eot_id: int = eot
        unknown = unknown_token(backend)
        self.unk_id: int | None = None if unknown is None else backend.token_to_id(unknown)
        self._chars = CharTable.of(backend, self.unk_id)

    def __getattr__(self, name: str) -> Any:
        """Reached only for a name this class lacks: one a transformers tokenizer has (`encode_plus`,
        `pad_token_id`, `batch_decode`) says where to find it, since code written for transformers gets
        ours that way first."""
        if name in _TRANSFORMERS_NAMES:
            raise AttributeError(
                f"llm-trainer's Tokenizer has no {name}; pass tokenizer.as_transformers(), the same tokenizer "
                "as a transformers PreTrainedTokenizerFast, to code written for transformers"
            )
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __call__(self, *args, **kwargs):
        """`tokenizer(texts, padding=True, return_tensors="pt")`, as code written for transformers calls
        one: said where to find it, as for the names above."""
        raise TypeError(
            "llm-trainer's Tokenizer is not called like a transformers tokenizer; use tokenizer.encode(text), or "
            "pass tokenizer.as_transformers(), the same tokenizer as a transformers PreTrainedTokenizerFast"
        )

    # -- construction ---------------------------------------------------------------------------

    @classmethod
    def train_bpe(cls, texts: Iterable[str], vocab_size: int, max_chars: int, pre_split: str = "unicode") -> Tokenizer:
        """Byte-level BPE trained on at most `max_chars` characters of `texts`, cut by the `pre_split`
        regex (a name of `PRE_SPLITS`; see the module docstring)."""
        backend = HFTokenizer(models.BPE())
        backend.pre_tokenizer = byte_level_pre_tokenizer(pre_split)
        backend.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=[EOT],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        backend.train_from_iterator(_bounded(texts, max_chars), trainer=trainer)
        return cls(backend)

    @classmethod
    def build_char(cls, texts: Iterable[str]) -> Tokenizer:
        """One token per character seen in `texts`, plus end-of-text and unknown."""
        chars: set[str] = set()
        for text in texts:
            chars.update(text)
        vocab = {EOT: 0, UNK: 1}
        for ch in sorted(chars):
            vocab[ch] = len(vocab)
        backend = HFTokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
        backend.pre_tokenizer = pre_tokenizers.Split(Regex(CHAR_SPLIT), behavior="isolated")
        backend.decoder = decoders.Fuse()
        backend.add_special_tokens([EOT])
        return cls(backend)

    @classmethod
    def load(cls, path: str | Path, model_max_length: int | None = None) -> Tokenizer:
        """The tokenizer.json at `path` (or in the folder `path`). A tokenizer file alone does not know
        its model's context: `model_max_length` is where `as_transformers()` truncates (the model's
        max_seq_len; `api.load_for_inference` sets it from the checkpoint it loads)."""
        path = Path(path)
        file = path / TOKENIZER_FILE if path.is_dir() else path
        if not file.is_file():
            raise UsageError(f"tokenizer not found at {path}; pass a tokenizer.json file or a folder holding one")
        return cls(load_backend(file), model_max_length)

    def save(self, directory: str | Path) -> Path:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        file = directory / TOKENIZER_FILE
        write_file(file, self.to_json().encode("utf-8"))
        return file

    # -- use ------------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        if self._chars is not None and (ids := self._chars.encode(text)) is not None:
            return ids
        with panics_as_errors("the tokenizer"):
            return self.backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        if self._chars is not None:
            return [self.encode(text) for text in texts]
        with panics_as_errors("the tokenizer"):
            return [e.ids for e in self.backend.encode_batch(texts, add_special_tokens=False)]

    def unseen_characters(self, text: str) -> set[str]:
        """The pieces of `text` that read as the unknown token: the characters a char tokenizer's
        vocabulary lacks, or for another tokenizer with an unknown token (a WordPiece or BPE file) the
        text of each unknown token in the encoding (a character, or a whole word). Empty for byte-level
        BPE, which reads every character."""
        if self.unk_id is None:
            return set()
        if self._chars is not None:
            return {ch for ch in set(text) if self.backend.token_to_id(ch) is None}
        with panics_as_errors("the tokenizer"):
            encoding = self.backend.encode(text, add_special_tokens=False)
        return {text[start:end] for id_, (start, end) in zip(encoding.ids, encoding.offsets) if id_ == self.unk_id}

    @property
    def unknown_token(self) -> str | None:
        """The unknown token's text (`<unk>` for the char tokenizer), or None when there is none."""
        return None if self.unk_id is None else self.backend.id_to_token(self.unk_id)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        with panics_as_errors("the tokenizer"):
            return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def to_json(self) -> str:
        return self.backend.to_str()

    def fingerprint(self) -> str:
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:16]

    def as_transformers(self, model_max_length: int | None = None):
        """This tokenizer as a transformers `PreTrainedTokenizerFast` (transformers must be installed), the
        one an export writes: `tokenizer(texts, padding=True, truncation=True, return_tensors="pt")`,
        `encode_plus` and `save_pretrained` work as in any transformers code. Padding is end-of-text on
        the right, with attention_mask 0 there (the model leaves those targets out of its loss);
        truncation=True cuts at `model_max_length`, by default the model's max_seq_len where this
        tokenizer came with a run or checkpoint (`load_for_inference`, `prepare_run`)."""
        from .hf.fast_tokenizer import fast_tokenizer

        return fast_tokenizer(self.backend, EOT, model_max_length or self.model_max_length)

    def save_pretrained(self, save_directory: str | Path) -> Path:
        """Write the files `as_transformers().save_pretrained` and an export write (`AutoTokenizer` loads
        them), truncating at `model_max_length`; returns the folder."""
        from .hf.fast_tokenizer import save_tokenizer

        directory = Path(save_directory)
        directory.mkdir(parents=True, exist_ok=True)
        save_tokenizer(self.backend, EOT, directory, self.model_max_length)
        return directory


class CharTable:
    """A char tokenizer's encoding as a table lookup: the ids `tokenizers` gives, sooner.

    Our char tokenizer (`Tokenizer.build_char`) is a WordLevel vocabulary of single characters behind a
    pre-tokenizer that cuts text into single code points, so a text's ids are its code points' ids (the
    unknown token's for one not in the vocabulary). `tokenizers` runs a regex over every character for
    that (how much slower: bench/README.md, "The form of the input"). A text that holds an added token's
    content (the end-of-text string, which `tokenizers` reads as that one token) goes to `tokenizers`.
    """

    def __init__(self, vocab: dict[str, int], unk_id: int, added: list[str]):
        singles = sorted((ord(ch), index) for ch, index in vocab.items() if len(ch) == 1)
        self.codes = np.array([code for code, _ in singles], dtype=np.uint32)  # sorted code points
        self.ids = np.array([index for _, index in singles], dtype=np.int64)
        self.unk_id = unk_id
        self.added = added

    @classmethod
    def of(cls, backend: HFTokenizer, unk_id: int | None) -> CharTable | None:
        """The table of `backend` when it is a char tokenizer of ours (as `build_char` makes one, or read
        from its tokenizer.json), else None."""
        if unk_id is None or not isinstance(backend.model, models.WordLevel):
            return None  # (before serialising: a BPE vocabulary's JSON takes tens of milliseconds)
        spec = json.loads(backend.to_str())
        if (
            spec.get("model", {}).get("type") != "WordLevel"
            or any(spec.get(part) is not None for part in ("normalizer", "post_processor", "truncation", "padding"))
            or spec.get("pre_tokenizer")
            != {"type": "Split", "pattern": {"Regex": CHAR_SPLIT}, "behavior": "Isolated", "invert": False}
            or not any(len(token) == 1 for token in spec["model"].get("vocab", {}))
        ):
            return None
        return cls(spec["model"]["vocab"], unk_id, [token["content"] for token in spec.get("added_tokens", [])])

    def encode(self, text: str) -> list[int] | None:
        """The ids of `text`; None for a text `tokenizers` must read (one holding an added token's content,
        or a lone surrogate, which it refuses)."""
        if any(token in text for token in self.added):
            return None
        try:
            raw = text.encode("utf-32-le")
        except UnicodeEncodeError:
            return None
        codes = np.frombuffer(raw, dtype="<u4")  # (N,) one code point per character
        at = np.minimum(np.searchsorted(self.codes, codes), len(self.codes) - 1)
        return np.where(self.codes[at] == codes, self.ids[at], self.unk_id).tolist()


def tokenizer_json(tokenizer: Any) -> str | None:
    """Ours, a `tokenizers.Tokenizer` or a transformers fast tokenizer, as tokenizer.json text; None for
    anything else (a slow transformers tokenizer has no tokenizer.json)."""
    for get in (
        lambda: tokenizer.to_json(),
        lambda: tokenizer.to_str(),
        lambda: tokenizer.backend_tokenizer.to_str(),
    ):
        try:
            text = get()
        except AttributeError:
            continue
        if isinstance(text, str):
            return text
    return None


def vocabulary_mismatch(source_json: str, ours_json: str, where: str = "the tokenizer.json") -> tuple[int, int]:
    """(tokens of ours that the source lacks or numbers otherwise, tokens of ours): the rows of an
    embedding trained with `source_json` (read as `where`, see `backend_from_json`) that would be read
    for the wrong token, or for none."""
    source = backend_from_json(source_json, where).get_vocab(with_added_tokens=True)
    ours = HFTokenizer.from_str(ours_json).get_vocab(with_added_tokens=True)
    return sum(source.get(token) != index for token, index in ours.items()), len(ours)


def _bounded(texts: Iterable[str], max_chars: int) -> Iterator[str]:
    seen = 0
    for text in texts:
        if seen >= max_chars:
            return
        text = text[: max_chars - seen]
        seen += len(text)
        yield text


# ----------------------------------------------------------------------------------------------
# A tokenizer.json from a file: input like any other


def load_backend(file: str | Path) -> HFTokenizer:
    """The `tokenizers.Tokenizer` of a tokenizer.json file, read under `backend_from_json`'s checks."""
    try:
        text = Path(file).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"{file} could not be read as a tokenizer.json ({exc})") from None
    return backend_from_json(text, str(file))


def backend_from_json(text: str, where: str) -> HFTokenizer:
    """The `tokenizers.Tokenizer` of a tokenizer.json's `text` (`where` names it in errors), bounded in
    what it may cost: its nesting within `limits`, every regex one of KNOWN_REGEXES, no truncation
    or padding (an encode returns every token of a text), and a probe text encoded and decoded, so a
    part that makes the library panic is refused here, in one line."""
    try:  # (not limits.parse_json: a large vocabulary's merges hold millions of values)
        parsed = json.loads(text)
    except RecursionError:
        raise UsageError(f"{where} is nested too deep to be a tokenizer.json") from None
    except ValueError as exc:
        raise UsageError(f"{where} is not a valid tokenizer.json ({exc})") from None
    unknown = next((regex for regex in _regexes(parsed) if regex not in KNOWN_REGEXES), None)
    if unknown is not None:
        shown = unknown if len(unknown) <= 60 else unknown[:57] + "..."
        raise UsageError(
            f"{where} splits text with the regex {shown!r}, not one llm-trainer writes; a regex can cost seconds "
            "per character (backtracking), so only the pre-splits of data.tokenizer_pre_split (unicode, gpt2, "
            "llama3) and the char tokenizer's are read: train the tokenizer with llm-trainer (data.tokenizer: bpe)"
        )
    with panics_as_errors(where):
        try:
            backend = HFTokenizer.from_str(text)
        except Exception as exc:  # tokenizers raises plain Exception for a malformed part
            raise UsageError(f"{where} is not a valid tokenizer.json ({first_line(exc, 120)})") from None
        backend.no_truncation()
        backend.no_padding()
        try:
            backend.decode(backend.encode(_PROBE, add_special_tokens=False).ids)
        except Exception as exc:  # a model that cannot encode text (a WordLevel vocabulary without its [UNK])
            raise UsageError(f"{where} cannot encode text ({first_line(exc, 120)}); fix or replace it") from None
    return backend


def _regexes(value: Any) -> Iterator[str]:
    """Every regex pattern ({"Regex": ...}) anywhere in a parsed tokenizer.json."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            if len(item) == 1 and "Regex" in item:  # a pattern: {"Regex": ...} or {"String": ...}
                yield item["Regex"] if isinstance(item["Regex"], str) else repr(item["Regex"])
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


@contextmanager
def panics_as_errors(where: str) -> Iterator[None]:
    """A panic inside `tokenizers` (pyo3's PanicException, a BaseException: no `except Exception` catches
    it) as a UsageError naming `where`, in one line."""
    try:
        yield
    except BaseException as exc:
        if type(exc).__name__ != "PanicException":
            raise
        detail = (str(exc).strip().splitlines() or ["a panic"])[0][:160]
        raise UsageError(
            f"{where} made the tokenizers library fail ({detail}); the tokenizer.json is damaged or was crafted: "
            "use the tokenizer the model was trained with"
        ) from None
