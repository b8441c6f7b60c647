"""Text <-> token ids, via a Hugging Face fast tokenizer (`tokenizer.json` or a GGUF file)."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer

from pipellm.shared.gguf.reader import GGUFError, is_gguf, open_gguf
from pipellm.shared.gguf.tokenizer import build_tokenizer

TOKENIZER_FILE = "tokenizer.json"


class TokenizerLoadError(Exception):
    """The tokenizer cannot be loaded; the message names the path and the problem."""


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load `tokenizer.json` from a model directory (or from the file path itself), or build
    the tokenizer of a GGUF file from its metadata."""
    if is_gguf(path):
        try:
            return build_tokenizer(open_gguf(path))
        except GGUFError as exc:
            raise TokenizerLoadError(str(exc)) from None
    path = Path(path)
    file = path / TOKENIZER_FILE if path.is_dir() else path
    if not file.is_file():
        hint = ""
        if path.is_dir() and (path / "tokenizer.model").is_file():
            hint = " (only a sentencepiece tokenizer.model is present, which is not supported)"
        raise TokenizerLoadError(f"{file} not found: a {TOKENIZER_FILE} is required{hint}")
    try:
        return Tokenizer.from_file(str(file))
    except Exception as exc:  # tokenizers raises a bare Exception on malformed files
        raise TokenizerLoadError(f"{file} is not a valid tokenizer file: {exc}") from exc


def encode(tok: Tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
    """Token ids of `text`; special tokens (e.g. BOS) added per the tokenizer's post-processor."""
    return tok.encode(text, add_special_tokens=add_special_tokens).ids


def decode(tok: Tokenizer, ids: list[int], skip_special_tokens: bool = True) -> str:
    """Text of `ids`, dropping special tokens such as BOS/EOS unless asked to keep them."""
    return tok.decode(list(ids), skip_special_tokens=skip_special_tokens)
