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
- `na`, `cpt`, `code`, `nl`, `q`: share of non-ASCII characters, characters per token, code
  markers, number of lines, whether the prompt ends in a question mark.

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

_WORD = re.compile(r"[^\W_]+")
STOPWORDS = frozenset(
    "a an the and or but if then so of to in on at by for with from into about as is are was "
    "were be been being am do does did it its this that these those there their they them i me "
    "my we our us you your he she his her will would can could should shall may might have has "
    "had not no also just than very some any all more most such".split()
)


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
    words = [w[:MAX_WORD_CHARS] for w in _WORD.findall(text.lower())]
    n_ids = max(len(prompt_ids), 1)
    keys: list[tuple] = []
    seen: set[tuple[str, str]] = set()
    for group, span in (("h", words[:HEAD_WORDS]),
                        ("t", words[max(HEAD_WORDS, len(words) - TAIL_WORDS):])):
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
    non_ascii = sum(1 for c in text if ord(c) > 127) / max(len(text), 1)
    keys.append(("na", min(int(non_ascii * 10), 5)))
    keys.append(("cpt", min(int(4 * len(text) / n_ids), 40)))
    keys.append(("code", ("```" in text) + 2 * (text.count(";") > 2) + 4 * (text.count("{") > 1)))
    keys.append(("nl", min(text.count("\n"), 255).bit_length()))
    keys.append(("q", text.rstrip().endswith("?")))
    out = list(dict.fromkeys(_hid(salt, *key) for key in keys))  # distinct, in order
    return out[:MAX_FEATURES]
