r"""Tokenizers: byte-level BPE trained on the corpus, char-level for small experiments, or a user's file.

All three are Hugging Face `tokenizers` objects saved as one `tokenizer.json`, so every tokenizer
loads the same way, runs in Rust, and exports to `transformers` unchanged.

The BPE pre-split. GPT-2's byte-level regex keeps runs of letters (\p{L}) together but cuts at
combining marks (\p{M}), so the Devanagari vowel signs and viramas, Tamil vowel signs and pulli, Thai
vowels and tone marks fall out of their words ("भारत" -> भ | ा | रत): BPE can never merge across a
cut, and Indic text takes far more tokens than it needs (see bench/README.md, "Text in every
script"). `PRE_SPLIT` is GPT-2's regex with \p{M} kept in letter runs (as the large-vocabulary
tokenizers of later models do) and zero-width (non-)joiners kept between letters (Indic and Persian
words hold them); on text without combining marks it splits exactly as GPT-2's does, so English and
code tokenize as with GPT-2's pre-split. The byte-level alphabet stays (every byte is a token), so
any input, in any script, round-trips exactly.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from pathlib import Path

from tokenizers import Regex, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

from .errors import UsageError

EOT = "<|endoftext|>"
UNK = "<unk>"
TOKENIZER_FILE = "tokenizer.json"
# GPT-2's pre-split: 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
_WORD = r"[\p{L}\p{M}]+(?:[\x{200C}\x{200D}]+[\p{L}\p{M}]+)*"
PRE_SPLIT = rf"'s|'t|'re|'ve|'m|'ll|'d| ?{_WORD}| ?\p{{N}}+| ?[^\s\p{{L}}\p{{M}}\p{{N}}]+|\s+(?!\S)|\s+"


def byte_level_pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    """`PRE_SPLIT`, then GPT-2's byte-to-character mapping (no second regex pass)."""
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRE_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


class Tokenizer:
    """A thin wrapper that fixes the end-of-text token and the on-disk format."""

    def __init__(self, backend: HFTokenizer):
        self.backend = backend
        eot = backend.token_to_id(EOT)
        if eot is None:
            backend.add_special_tokens([EOT])
            eot = backend.token_to_id(EOT)
        self.eot_id: int = eot

    # -- construction ---------------------------------------------------------------------------

    @classmethod
    def train_bpe(cls, texts: Iterable[str], vocab_size: int, max_chars: int) -> Tokenizer:
        """Byte-level BPE (GPT-2 style, marks kept with their letters) trained on at most `max_chars` characters of `texts`."""
        backend = HFTokenizer(models.BPE())
        backend.pre_tokenizer = byte_level_pre_tokenizer()
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
        # (?m) makes "." match newlines too (Oniguruma syntax): every character is its own piece.
        backend.pre_tokenizer = pre_tokenizers.Split(Regex("(?m)."), behavior="isolated")
        backend.decoder = decoders.Fuse()
        backend.add_special_tokens([EOT])
        return cls(backend)

    @classmethod
    def load(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        file = path / TOKENIZER_FILE if path.is_dir() else path
        if not file.is_file():
            raise UsageError(f"tokenizer not found at {path}; pass a tokenizer.json file or a folder holding one")
        try:
            return cls(HFTokenizer.from_file(str(file)))
        except Exception as exc:  # tokenizers raises plain Exception for malformed JSON
            raise UsageError(f"{file} is not a valid tokenizer.json ({str(exc).splitlines()[0]})") from None

    def save(self, directory: str | Path) -> Path:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        file = directory / TOKENIZER_FILE
        tmp = file.with_suffix(".json.tmp")
        tmp.write_text(self.to_json(), encoding="utf-8")
        tmp.replace(file)
        return file

    # -- use ------------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.backend.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def to_json(self) -> str:
        return self.backend.to_str()

    def fingerprint(self) -> str:
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:16]


def vocabulary_mismatch(source_json: str, ours_json: str) -> tuple[int, int]:
    """(tokens of ours that the source lacks or numbers otherwise, tokens of ours): the rows of an
    embedding trained with `source_json` that would be read for the wrong token, or for none."""
    try:
        source = HFTokenizer.from_str(source_json).get_vocab(with_added_tokens=True)
    except Exception as exc:  # tokenizers raises plain Exception for malformed JSON
        raise UsageError(f"not a valid tokenizer.json ({str(exc).splitlines()[0][:120]})") from None
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
