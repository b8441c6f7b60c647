"""`--speculative-config`: vLLM's flag and JSON keys, parsed and checked once at start-up.

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
     "prompt_lookup_max": 4, "disable_by_batch_size": 4}

n-gram (prompt lookup) speculation proposes, for a request about to decode, the tokens that
followed the latest earlier occurrence of its last n tokens (n from prompt_lookup_max down to
prompt_lookup_min) in its prompt or output; no second model.

    {"model": PATH, "num_speculative_tokens": 4}    ("method": "draft_model" may be given)

A draft model (a small model sharing the target's vocabulary, a GGUF file or HF directory)
proposes its k greedy tokens, in the compute process beside the target
(pipellm/services/compute/drafter.py).

`disable_by_batch_size` (vLLM's key): no drafts while more than this many requests run. Extra
rows are nearly free while a step is memory-bound and cost their share once it is
compute-bound; on this project's 2-core CPU speculation stopped paying between 4 and 16
running requests (docs/benchmarks.md), hence the default of 4 where vLLM's is "never"; on a
GPU the simulator puts the break-even near 32 (bench/spec_sim.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from pipellm.shared.settings import json_object

_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model",
         "disable_by_batch_size")
DISABLE_BY_BATCH_SIZE = 4


@dataclass(frozen=True)
class SpeculativeConfig:
    """k tokens proposed per decode step by n-gram lookup with n in [n_min, n_max], or by the
    draft model at `model`, while at most disable_by_batch_size requests run."""

    num_speculative_tokens: int
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    disable_by_batch_size: int = DISABLE_BY_BATCH_SIZE
    method: str = "ngram"  # or "draft_model"
    model: str | None = None  # the draft model's path (method draft_model)

    @classmethod
    def parse(cls, text: str | None) -> SpeculativeConfig | None:
        """The config of a --speculative-config JSON object (None: no speculation); a
        ValueError names the key that is wrong."""
        if not text:
            return None
        raw = json_object("--speculative-config", text)
        unknown = sorted(set(raw) - set(_KEYS))
        if unknown:
            raise ValueError(f"--speculative-config: unknown key {unknown[0]!r} (known: "
                             f"{', '.join(_KEYS)})")
        model = raw.get("model")
        method = raw.get("method", "ngram" if model is None else "draft_model")
        if method not in ("ngram", "draft_model") or (method == "draft_model") != \
                isinstance(model, str):
            raise ValueError("--speculative-config: method \"ngram\" (no model), or a draft "
                             "model: {\"model\": PATH} with method \"draft_model\" or none; "
                             f"got method {method!r} and model {model!r}")
        k = _positive(raw, "num_speculative_tokens", None)
        lo = _positive(raw, "prompt_lookup_min", 1)
        hi = _positive(raw, "prompt_lookup_max", max(lo, 4))
        if lo > hi:
            raise ValueError("--speculative-config: prompt_lookup_min must be <= "
                             "prompt_lookup_max")
        return cls(k, lo, hi, _positive(raw, "disable_by_batch_size", DISABLE_BY_BATCH_SIZE),
                   method, model)


def _positive(raw: dict, key: str, default: int | None) -> int:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"--speculative-config: {key!r} must be a positive integer, got "
                         f"{value!r}")
    return value
