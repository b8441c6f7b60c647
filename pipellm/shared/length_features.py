"""Request features for the output-length predictor: a short list of stable hashed ids.

`length_features` runs in the tokenizer process (it has the prompt text and ids); the ids travel
in the request's messages to the detokenizer, which teaches the predictor the true length at
finish. Every id is an unsigned 32-bit int from blake2b (never Python's salted `hash()`), so the
same request gives the same ids in every process, on every machine, after every restart. Each id
names one (group, value) pair, salted with the model name (a different model writes differently
long answers to the same prompt):

- `h` / `t`: distinct words (lowercased letters and digits, common function words left out) of
  the first `HEAD_WORDS` and of the last `TAIL_WORDS` words of the prompt text: the instruction
  ("write an essay", "translate", "in one word", "explain") sits mostly at either end;
- `w1` / `w2`: the first word and the first two words (including function words);
- `tp` / `tpl`: the first `TEMPLATE_IDS` and `TEMPLATE_IDS_LONG` prompt token ids: a repeated
  system prompt or template (and, for short prompts, the exact prompt);
- `pl`: the prompt length in tokens, half-log2 buckets; `mt`: max_tokens, log2 buckets;
- `na`, `cpt`, `code`, `nl`, `q`: share of non-ASCII text (UTF-8 bytes per character),
  characters per token, code markers, number of lines, whether the prompt ends in "?".

Cost: ~50-100 us a request; of a long prompt only both ends are read for words.

At most `MAX_FEATURES` ids, no duplicates.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from hashlib import blake2b

HEAD_WORDS = 32
TAIL_WORDS = 16
TEMPLATE_IDS = 16
TEMPLATE_IDS_LONG = 64
MAX_WORD_CHARS = 24
MAX_FEATURES = HEAD_WORDS + TAIL_WORDS + 12
_SCAN_CHARS = 2000  # of a long prompt, only the first and the last this many characters

_WORD = re.compile(r"[^\W_]+")
STOPWORDS = frozenset(
    "a an the and or but if then so of to in on at by for with from into about as is are was "
    "were be been being am do does did it its this that these those there their they them i me "
    "my we our us you your he she his her will would can could should shall may might have has "
    "had not no also just than very some any all more most such".split()
)


def _words(text: str) -> list[str]:
    return [w[:MAX_WORD_CHARS] for w in _WORD.findall(text.lower())]


def _hid(salt: bytes, *parts: object) -> int:
    data = salt + b"\x1f".join(str(p).encode("utf-8", "surrogatepass") for p in parts)
    return int.from_bytes(blake2b(data, digest_size=4).digest(), "little")


def _ids_key(ids: Sequence[int]) -> str:
    return ",".join(map(str, ids))


def length_features(prompt_text: str, prompt_ids: Sequence[int], max_tokens: int,
                    model: str) -> list[int]:
    """Hashed feature ids of one request (see the module docstring); stable across processes."""
    salt = model.encode("utf-8", "surrogatepass") + b"\x1e"
    text = prompt_text or ""
    if len(text) <= 2 * _SCAN_CHARS:
        words = _words(text)
        head, tail = words[:HEAD_WORDS], words[max(HEAD_WORDS, len(words) - TAIL_WORDS):]
    else:  # a long prompt: only its ends are read (the first tail word may be cut: dropped)
        words = _words(text[:_SCAN_CHARS])
        head, tail = words[:HEAD_WORDS], _words(text[-_SCAN_CHARS:])[1:][-TAIL_WORDS:]
    n_ids = max(len(prompt_ids), 1)
    keys: list[tuple] = []
    seen: set[tuple[str, str]] = set()
    for group, span in (("h", head), ("t", tail)):
        for w in span:
            if w not in STOPWORDS and (group, w) not in seen:
                seen.add((group, w))
                keys.append((group, w))
    if words:
        keys.append(("w1", words[0]))
        keys.append(("w2", " ".join(words[:2])))
    keys.append(("tp", _ids_key(prompt_ids[:TEMPLATE_IDS])))
    if len(prompt_ids) > TEMPLATE_IDS:
        keys.append(("tpl", _ids_key(prompt_ids[:TEMPLATE_IDS_LONG])))
    keys.append(("pl", int(2 * math.log2(n_ids))))
    keys.append(("mt", max(int(max_tokens), 1).bit_length()))
    sample = text[:_SCAN_CHARS]  # UTF-8 bytes past one per character: the share of non-ASCII
    keys.append(("na", min(int(10 * (len(sample.encode("utf-8", "surrogatepass")) - len(sample))
                               / max(len(sample), 1)), 8)))
    keys.append(("cpt", min(int(4 * len(text) / n_ids), 40)))
    keys.append(("code", ("```" in text) + 2 * (text.count(";") > 2) + 4 * (text.count("{") > 1)))
    keys.append(("nl", min(text.count("\n"), 255).bit_length()))
    keys.append(("q", text.rstrip().endswith("?")))
    out = list(dict.fromkeys(_hid(salt, *key) for key in keys))  # distinct, in order
    return out[:MAX_FEATURES]
