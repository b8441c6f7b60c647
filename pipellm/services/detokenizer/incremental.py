"""Incremental detokenization: token ids in, text deltas out, never splitting a character.

The technique is the "prefix offset / read offset" one of vLLM and TGI. We keep only a window
of ids: `window[:read]` is left context whose text was already emitted (the previous delta's
ids, or the last prompt ids), `window[read:]` the ids not emitted yet. Each step decodes the
window; the new text is what follows the decoding of `window[:read]`, emitted only once it does
not end in U+FFFD (a character still missing bytes); the window then slides to start at `read`.
Decoding a window instead of the whole output keeps the work per token O(1) amortized.

Exactness: the deltas plus `flush()` equal `tokenizer.decode(output_ids)` exactly (without
prompt ids) when the decoder is *local*: the text of a window that starts on a character
boundary ends with the text of its last tokens, independent of how far back the window starts,
apart from the window's first token. That holds for byte-level BPE (GPT-2/Llama-3 style) and for
sentencepiece-style Metaspace + ByteFallback decoders (Llama-2 style; the strip of the first
token's leading space is the same in both decodings of a window) on outputs that are valid
UTF-8. Known exceptions: decoders whose cleanup looks ahead (WordPiece `cleanup=True` turns
" ' " into "'"), and ByteFallback runs that are *invalid* UTF-8 (the whole-sequence decode turns
a whole invalid byte run into U+FFFD, including characters already emitted), and more than
MAX_HELD ids without completing a character (never valid UTF-8: we then emit the U+FFFD rather
than grow the window). The stream is then still complete but may differ in U+FFFD.
With prompt ids the deltas equal `decode(prompt + output)[len(decode(prompt)):]` (so the first
token keeps its leading space), assuming the prompt ends on a character boundary.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer

REPLACEMENT = "\ufffd"  # what a lossy UTF-8 decode shows for a character still missing bytes
PROMPT_CONTEXT = 5  # prompt tokens kept as left context, as in vLLM
MAX_BACKUP = 8  # extra prompt tokens tried to start the context on a character boundary
MAX_HELD = 32  # tokens held back before giving up on completing a character (invalid ids)


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas that never split a character."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        """`prompt_ids` (optional) seed the left context; they are never emitted themselves."""
        self._tok = tokenizer
        self._skip = skip_special_tokens
        # Skipped special tokens never reach the decoder, so dropping them here is exact; it
        # also guarantees that a window never starts with tokens that decode to nothing, which
        # would otherwise shift a sentencepiece leading-space strip onto a later token.
        added = tokenizer.get_added_tokens_decoder().items() if skip_special_tokens else ()
        self._special = frozenset(i for i, t in added if t.special)
        self._ids: list[int] = self._context(self._keep(prompt_ids))  # the window
        self._read = len(self._ids)  # window[:read] was emitted (or is prompt)
        self._prefix_text = self._decode(self._ids)  # == decode(window[:read])
        self._pieces: list[str] = []

    def add(self, token_ids: Sequence[int]) -> str:
        """Append generated ids; return the new text they complete ('' if none yet)."""
        before = len(self._ids)
        self._ids.extend(self._keep(token_ids))
        if len(self._ids) == self._read:
            return ""
        new_text = self._decode(self._ids)
        if not new_text.endswith(REPLACEMENT) and len(new_text) > len(self._prefix_text):
            return self._advance(new_text, len(self._ids))
        if new_text.endswith(REPLACEMENT):
            # A chunk of several ids may end mid-character. The unfinished character spans at
            # most the last 3 ids (each id is >= 1 byte), so commit the longest clean prefix.
            for end in range(len(self._ids) - 1, max(before, len(self._ids) - 4), -1):
                text = self._decode(self._ids[:end])
                if not text.endswith(REPLACEMENT) and len(text) > len(self._prefix_text):
                    return self._advance(text, end)
        # Valid UTF-8 completes a character within 4 ids; past MAX_HELD the ids are invalid,
        # and we emit the replacement characters rather than grow the window forever.
        if len(self._ids) - self._read > MAX_HELD:
            return self._advance(new_text, len(self._ids))
        return ""

    def flush(self) -> str:
        """End of request: return any held-back remainder (U+FFFD where ids are invalid)."""
        if len(self._ids) == self._read:
            return ""
        return self._advance(self._decode(self._ids), len(self._ids))

    @property
    def text(self) -> str:
        """All text emitted so far by `add` and `flush`."""
        return "".join(self._pieces)

    def _advance(self, new_text: str, end: int) -> str:
        """Emit the text of window[read:end] (`new_text` decodes window[:end]); slide on."""
        # Invariant kept: the emitted text is the decoding of all output ids before the window's
        # `read`, and `read` sits on a character boundary, so every window starts cleanly.
        delta = new_text[len(self._prefix_text) :]
        self._prefix_text = self._decode(self._ids[self._read : end])
        del self._ids[: self._read]  # memory and decode work stay O(window), not O(output)
        self._read = end - self._read
        if delta:
            self._pieces.append(delta)
        return delta

    def _context(self, prompt: list[int]) -> list[int]:
        """The last few prompt ids, starting on a character boundary (no leading U+FFFD)."""
        # A context starting mid-character is harmless for byte-level BPE but not for
        # ByteFallback, whose decoder turns the whole byte run, output included, into U+FFFD.
        start = max(0, len(prompt) - PROMPT_CONTEXT)
        floor = max(0, start - MAX_BACKUP)
        while start > floor and self._clipped(prompt[start:]):
            start -= 1  # back up to the character's first byte...
        while start < len(prompt) and self._clipped(prompt[start:]):
            start += 1  # ...or, if the caller sent only a short tail, skip its partial bytes
        return prompt[start:]

    def _clipped(self, ids: list[int]) -> bool:
        return self._decode(ids).startswith(REPLACEMENT)

    def _keep(self, ids: Sequence[int]) -> list[int]:
        return [i for i in ids if i not in self._special]

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=self._skip)
