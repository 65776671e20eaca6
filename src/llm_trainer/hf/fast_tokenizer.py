"""Our tokenizer as a transformers `PreTrainedTokenizerFast`: one rule for the special tokens, used by
`Tokenizer.as_transformers` and by the export (`interop.export_to_hf`), so code written for
transformers gets the same tokenizer in memory as from an exported folder.

transformers is an optional dependency (`pip install 'llm-trainer[hf]'`); it is imported lazily.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, models

from ..errors import UsageError


def require_transformers():
    """The transformers module, or a one-line UsageError saying how to install it."""
    try:
        import transformers
    except ImportError:
        raise UsageError("transformers is not installed; install it with: pip install 'llm-trainer[hf]'") from None
    return transformers


def unknown_token(backend: Tokenizer) -> str | None:
    """The unknown token of the tokenizer's model where it has one in its vocabulary (the char
    tokenizer's `<unk>`, a WordPiece's `[UNK]`, a Unigram model's by its `unk_id`); None for byte-level
    BPE, which never needs one."""
    if isinstance(backend.model, models.Unigram):  # it names its unknown token by id, in its JSON only
        unk_id = json.loads(backend.to_str())["model"].get("unk_id")
        return backend.id_to_token(unk_id) if isinstance(unk_id, int) else None
    unknown = getattr(backend.model, "unk_token", None)
    return unknown if unknown and backend.token_to_id(unknown) is not None else None


def special_tokens(backend: Tokenizer, end_of_text: str) -> dict[str, str]:
    """bos, eos and pad are end-of-text (one token starts, ends and pads documents, as in training). unk
    is end-of-text too for byte-level BPE, which never needs one. The char tokenizer's `<unk>` is not
    declared: transformers would make it an added token that its text matches, so a `<unk>` written in
    the text would read as one token there and as five characters here. Empty when the tokenizer has
    no end-of-text."""
    if backend.token_to_id(end_of_text) is None:
        return {}
    names = ("bos_token", "eos_token", "pad_token") + (("unk_token",) if unknown_token(backend) is None else ())
    return {name: end_of_text for name in names}


def fast_tokenizer(backend: Tokenizer, end_of_text: str, model_max_length: int | None = None):
    """`backend` (a `tokenizers.Tokenizer`, copied) as a `PreTrainedTokenizerFast` with `special_tokens`,
    padding on the right, truncation at `model_max_length` (None: no limit), and `encode_plus`."""
    tf = require_transformers()
    limit = {} if model_max_length is None else {"model_max_length": model_max_length}
    specials = special_tokens(backend, end_of_text)
    if backend.post_processor is not None:  # the model trained on ids without what it adds (a BOS, [CLS] ... [SEP])
        backend = Tokenizer.from_str(backend.to_str())
        backend.post_processor = None
    tokenizer = tf.PreTrainedTokenizerFast(tokenizer_object=backend, padding_side="right", **limit, **specials)
    # transformers 5 no longer has encode_plus / batch_encode_plus, which code written for 4.x calls (the
    # lesson's dataset does); in 4.x both were __call__ on one text / a batch of texts.
    for name in ("encode_plus", "batch_encode_plus"):
        if not hasattr(tokenizer, name):
            setattr(tokenizer, name, tokenizer.__call__)
    return tokenizer


def save_tokenizer(backend: Tokenizer, eot: str, directory: Path, max_seq_len: int | None) -> int | None:
    """Write `backend` as a PreTrainedTokenizerFast that truncates at `max_seq_len`; returns the id of
    `eot` (end-of-text; None if absent). The export and `Tokenizer.save_pretrained` both write this."""
    eot_id = backend.token_to_id(eot)
    specials = special_tokens(backend, eot)
    tokenizer = fast_tokenizer(backend, eot, max_seq_len)
    tokenizer.save_pretrained(str(directory))
    # transformers 5 names its class TokenizersBackend and writes no special_tokens_map.json; name the class
    # both 4.x and 5 know, and write the map that older readers look for.
    config_path = directory / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text())
    tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    special_map = directory / "special_tokens_map.json"
    if not special_map.is_file():
        special_map.write_text(json.dumps(specials, indent=2) + "\n")
    return eot_id
