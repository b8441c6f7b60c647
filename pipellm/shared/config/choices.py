"""The settings' choices (str enums parsed once at start-up) and their --help groups."""

from __future__ import annotations

import enum

# --help groups
MODEL, SCHEDULING, QUANTIZATION, SERVER, WIRING, SIMULATOR, LORA = (
    "model", "scheduling and KV cache", "quantization", "server", "services wiring",
    "simulator (--backend sim)", "LoRA adapters")


class KVPolicyName(enum.StrEnum):
    """--kv-policy: how a request's KV segment is sized (pipellm/services/compute/scheduling/
    kv_policy.py)."""

    PREDICTED = "predicted"
    MAX = "max"
    PAGED = "paged"


class BackendName(enum.StrEnum):
    """--backend: what runs a step (pipellm/services/compute/backend.py, the one place that
    asks)."""

    TORCH = "torch"  # the model's weights on a CPU or GPU
    SIM = "sim"  # a modelled GPU, no weights


class RunnerName(enum.StrEnum):
    """--runner: what the server serves (vLLM's flag): generation, or pooled embeddings
    (pipellm/services/compute/pooling; the gateway's /v1/embeddings)."""

    GENERATE = "generate"
    POOLING = "pooling"


class ConvertName(enum.StrEnum):
    """--convert (vLLM's): what a generation model's checkpoint is served as; embed: a pooling
    server (the same as --runner pooling); classify: a pooling server scoring with the
    checkpoint's sequence classification head (pipellm/shared/scoring.py); reward: a pooling server
    giving every token's output on /pooling (pipellm/services/compute/pooling/reward.py)."""

    AUTO = "auto"
    NONE = "none"
    EMBED = "embed"
    CLASSIFY = "classify"
    REWARD = "reward"


class Batching(enum.StrEnum):
    """--batching: merged (dynamic) steps, or the static-batching baseline."""

    MERGED = "merged"
    STATIC = "static"


class SchedulingPolicyName(enum.StrEnum):
    """--scheduling-policy: the order waiting requests are served in
    (pipellm/services/compute/scheduling/policy.py)."""

    FCFS = "fcfs"
    PRIORITY = "priority"
    PREDICTED = "predicted"


class Admission(enum.StrEnum):
    """--kv-admission: what must fit for a waiting request to be admitted
    (pipellm/services/compute/scheduling/admission.py)."""

    AUTO = "auto"
    PEAK = "peak"
    AGGREGATE = "aggregate"
    FIT = "fit"


def parse_choice(name: str, choices: type[enum.StrEnum], value) -> enum.StrEnum:
    """`value` (text or a member) as a member of `choices`; else ValueError naming the flag."""
    try:
        return choices(value)
    except ValueError:
        allowed = tuple(c.value for c in choices)
        raise ValueError(f"--{name.replace('_', '-')} must be one of {allowed}, not "
                         f"{value!r}") from None
