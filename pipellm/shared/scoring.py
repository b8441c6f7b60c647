"""What a pooling server scores with: a sequence classification head, a "yes/no" logit
reranker, or nothing (an embedder only).

`ScoringConfig.from_dir(model, hf_overrides, convert)` reads the model directory's
`config.json` with vLLM's `--hf-overrides` JSON laid over it (only the keys below are taken):

- `architectures` ending in `ForSequenceClassification` (or `--convert classify`): a classifier.
  Its head is the checkpoint's `score.weight` [num_labels, hidden] over the last token's
  final-normed hidden state (HF's rule for decoder classifiers), its labels `id2label`;
- with `classifier_from_token` [no, yes] too (vLLM's Qwen3-Reranker override): the head is the
  LM head's rows of those two tokens, the score sigmoid(logit[yes] - logit[no]);
  `is_original_qwen3_reranker` formats each (query, document) pair with Qwen3-Reranker's
  documented prompt (`reranker_prompt`).

Invariants: kind is one of KINDS; `labels` has `num_labels` entries for a classifier; a yes/no
reranker has exactly two tokens and one label.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipellm.shared.settings import json_object

NONE, CLASSIFY, YES_NO = "none", "classify", "yes_no"
KINDS = (NONE, CLASSIFY, YES_NO)
OVERRIDE_KEYS = frozenset({"architectures", "classifier_from_token",
                           "is_original_qwen3_reranker", "num_labels", "id2label"})
SEQ_CLS = "ForSequenceClassification"

# Qwen3-Reranker's prompt (its model card): a system turn, the instruction, query and document
# as the user turn, an empty thinking block as the assistant's
RERANKER_PREFIX = ("<|im_start|>system\nJudge whether the Document meets the requirements based "
                   "on the Query and the Instruct provided. Note that the answer can only be "
                   "\"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n")
RERANKER_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
RERANKER_INSTRUCTION = ("Given a web search query, retrieve relevant passages that answer the "
                        "query")


@dataclass(frozen=True)
class ScoringConfig:
    kind: str = NONE
    labels: tuple[str, ...] = ()  # id2label in label order
    tokens: tuple[str, ...] = ()  # yes_no: the (no, yes) tokens
    qwen3_template: bool = False  # pairs formatted with Qwen3-Reranker's prompt

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"scoring kind {self.kind!r}: expected one of {KINDS}")

    @property
    def scores(self) -> bool:
        """Whether the model has a head (/score, /rerank, /classify are served)."""
        return self.kind != NONE

    @property
    def num_labels(self) -> int:
        return len(self.labels)

    @classmethod
    def from_dir(cls, path: str | Path, hf_overrides: str | None = None,
                 convert: str = "auto") -> ScoringConfig:
        """The scoring of the model at `path` (a GGUF file: none unless overridden);
        ValueError for an override this server does not take or a head it cannot build."""
        cfg: dict[str, Any] = {}
        file = Path(path) / "config.json"
        if file.is_file():
            cfg = json.loads(file.read_text(encoding="utf-8"))
        cfg = {**cfg, **parse_overrides(hf_overrides)}
        archs = cfg.get("architectures") or []
        arch = archs[0] if isinstance(archs, list) and archs else str(archs)
        if not arch.endswith(SEQ_CLS) and convert != "classify":
            return cls()
        tokens = cfg.get("classifier_from_token")
        if tokens is not None:
            if (not isinstance(tokens, list) or len(tokens) != 2
                    or not all(isinstance(t, str) and t for t in tokens)):
                raise ValueError("classifier_from_token must be two tokens [no, yes], got "
                                 f"{tokens!r}")
            return cls(YES_NO, ("score",), tuple(tokens),
                       bool(cfg.get("is_original_qwen3_reranker")))
        return cls(CLASSIFY, _labels(cfg))


def parse_overrides(text: str | None) -> dict[str, Any]:
    """--hf-overrides: a JSON object of the keys in OVERRIDE_KEYS; ValueError otherwise."""
    if not text:
        return {}
    value = json_object("--hf-overrides", text)
    other = sorted(set(value) - OVERRIDE_KEYS)
    if other:
        raise ValueError(f"--hf-overrides: {', '.join(other)} not supported (only "
                         f"{', '.join(sorted(OVERRIDE_KEYS))})")
    return value


def _labels(cfg: dict[str, Any]) -> tuple[str, ...]:
    """The classifier's label names in order: id2label, else LABEL_i for num_labels (HF's)."""
    id2label = cfg.get("id2label")
    if isinstance(id2label, dict) and id2label:
        try:
            by_id = {int(k): str(v) for k, v in id2label.items()}
        except (TypeError, ValueError):
            raise ValueError(f"id2label keys must be label numbers, got {id2label!r}") from None
        if sorted(by_id) != list(range(len(by_id))):
            raise ValueError(f"id2label must number the labels 0..n-1, got {sorted(by_id)}")
        return tuple(by_id[i] for i in range(len(by_id)))
    n = cfg.get("num_labels", 2)
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"num_labels must be a positive integer, got {n!r}")
    return tuple(f"LABEL_{i}" for i in range(n))


def reranker_prompt(query: str, document: str,
                    instruction: str = RERANKER_INSTRUCTION) -> str:
    """Qwen3-Reranker's prompt for one (query, document) pair, as its model card builds it."""
    return (f"{RERANKER_PREFIX}<Instruct>: {instruction}\n<Query>: {query}\n"
            f"<Document>: {document}{RERANKER_SUFFIX}")


def names_classifier(hf_overrides: str | None) -> bool:
    """Whether --hf-overrides names a sequence classification architecture (vLLM then runs the
    pooling runner); a malformed one is False here (start-up reports it)."""
    try:
        archs = parse_overrides(hf_overrides).get("architectures")
    except ValueError:
        return False
    return isinstance(archs, list) and bool(archs) and str(archs[0]).endswith(SEQ_CLS)
