"""Settings: frozen dataclasses resolved once at start-up from CLI flags and env vars.

Every field `foo_bar` of a config class is the flag `--foo-bar` and the env var
`PIPELLM_FOO_BAR`; precedence: flag > env var > default. This is the only place that reads them.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SimConfig:
    """The modelled GPU of `--backend sim` (services/compute/sim). Its fields are the flags
    `--sim-<field>` and env vars `PIPELLM_SIM_<FIELD>`."""

    gpu: str = "h100"  # h100 | h200 | a100 | ... (services/compute/sim/hardware.py)
    model: str = "llama-3-8b"  # llama-2-7b | llama-2-13b | llama-3-8b | mistral-7b | ...
    kv_dtype: str = "bf16"  # bf16 | int8 | fp8 (KV bytes per element 2 / 1 / 1)
    weight_dtype: str = "bf16"  # bf16 | int8 | fp8 (W8A8) | int4 (weight-only)
    eff_bw: float = 0.8  # fraction of HBM bandwidth reached
    eff_flops: float = 0.6  # fraction of peak tensor FLOP/s reached
    overhead_ms: float = 1.0  # per-step time outside the roofline (launches, host)
    clock: str = "real"  # real (sleep the step time) | virtual (advance a clock)

    def __post_init__(self):
        if self.clock not in ("real", "virtual"):
            raise ValueError(f"--sim-clock must be real or virtual, not {self.clock!r}")


@dataclass(frozen=True)
class EngineConfig:
    model: str = ""  # HF model directory or GGUF file; empty: SmolLM2 (shared/default_model.py)
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto (the checkpoint's) | float32 | bfloat16 | float16
    max_model_len: int = 0  # 0: the model's max_position_embeddings
    max_batched_tokens: int = 512  # tokens per merged step
    max_running: int = 256  # requests in the running batch
    kv_cache_tokens: int = 0  # KV slots; 0: sized from memory (see below)
    kv_cache_gib: float = 1.0  # CPU: KV cache size when kv_cache_tokens is 0
    gpu_memory_utilization: float = 0.9  # CUDA: fraction of total memory for weights + KV
    kv_policy: str = "predicted"  # predicted | max | paged (sim only); see scheduling/scheduler.py
    default_predicted_len: int = 128  # predicted output length until the predictor knows better
    kv_min_grow: int = 16  # minimum growth of a KV segment that ran out
    kv_reserve_quantile: float = 0.5  # predicted: a new segment holds this quantile of the length
    kv_grow_quantile: float = 0.9  # predicted: an outgrown segment regrows to this (conditional)
    kv_peak_quantile: float = 0.9  # predicted: admission keeps the future peak at this in memory
    kv_reserve_horizon: int = 64  # predicted: reserve at most this many output slots ahead (0: all)
    kv_admission: str = "auto"  # peak (future KV peak must fit) | fit | auto (peak if predicted)
    batching: str = "merged"  # merged (dynamic, merged steps) | static (a baseline)
    kernels: str = "auto"  # auto (Triton on CUDA, PyTorch reference on CPU) | triton | reference
    threads: int = 0  # CPU threads for torch in compute; 0: torch's default
    backend: str = "torch"  # torch (the model) | sim (modelled GPU: services/compute/sim)
    sim: SimConfig = field(default_factory=SimConfig)  # --sim-* flags

    def __post_init__(self):
        """The scheduler's settings (kv_policy, kv_admission, batching, the quantiles) are
        checked once, by SchedulerConfig.of, which `pipellm` calls at start-up."""
        if self.kv_policy == "paged" and self.backend != "sim":
            raise ValueError("--kv-policy paged is a baseline of the simulator (--backend sim): "
                             "the kernels read contiguous KV segments")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"--dtype must be auto, float32, bfloat16 or float16: {self.dtype!r}")
        if self.kernels not in ("auto", "triton", "reference"):
            raise ValueError(f"--kernels must be auto, triton or reference, not {self.kernels!r}")
        if self.backend not in ("torch", "sim"):
            raise ValueError(f"--backend must be torch or sim, not {self.backend!r}")
        if self.default_predicted_len < 1:
            raise ValueError("--default-predicted-len must be at least 1")


@dataclass(frozen=True)
class ServiceConfig:
    """Wiring of the four services. Empty addresses: ipc sockets under `run_dir`."""

    host: str = "127.0.0.1"  # gateway HTTP
    port: int = 8000
    served_model_name: str = ""  # empty: the model directory's (GGUF file's) name
    redis_url: str = ""  # empty with `pipellm up`: an embedded redis-server
    redis_dir: str = ""  # embedded redis: persist here (learned lengths survive `up` restarts)
    run_dir: str = ""  # where ipc sockets live; empty: a temp dir chosen by `pipellm up`
    tokenizer_addr: str = ""  # gateway PUSH (bind) -> tokenizer workers PULL (connect)
    compute_addr: str = ""  # tokenizers PUSH -> compute PULL (bind)
    control_addr: str = ""  # gateway, detokenizer PUSH -> compute PULL (bind): aborts, stops
    detokenizer_addr: str = ""  # compute PUSH -> detokenizer PULL (bind)
    gateway_addr: str = ""  # detokenizer, tokenizer PUSH -> this gateway's PULL (bind)
    tokenizer_workers: int = field(default=0, metadata={"help": (
        "tokenizer processes; 0 (default): 2 on a machine with 4 or more cores, else 1")})
    max_pending: int = 512  # requests in flight at the gateway before it answers 429
    max_body_bytes: int = 8 * 2**20
    max_prompt_bytes: int = field(default=0, metadata={"help": (
        "largest prompt (UTF-8 bytes of the completion prompt, or of all chat message "
        "contents) the gateway accepts, else 400; 0 (default): 16 bytes per token of the "
        "context length, at least 64 KiB")})
    request_ttl_s: int = 3600  # how long a finished request's state stays in Redis
    heartbeat_s: float = 0.5
    length_predictor: bool = True  # predict output lengths (Redis) and learn them at finish

    def __post_init__(self):
        if self.tokenizer_workers < 0:
            raise ValueError("--tokenizer-workers must be 0 (automatic) or more")
        if self.max_prompt_bytes < 0:
            raise ValueError("--max-prompt-bytes must be 0 (automatic) or more")
        if self.tokenizer_workers == 0:  # resolved once: children inherit the number (env_for)
            object.__setattr__(self, "tokenizer_workers", auto_tokenizer_workers())

    def prompt_bytes_limit(self, max_model_len: int) -> int:
        """The prompt size cap in bytes: --max-prompt-bytes, or when 0, 16 bytes per token of
        the context length but at least 64 KiB (tokens are rarely over 8 bytes of text)."""
        return self.max_prompt_bytes or max(16 * max_model_len, 64 * 1024)

    def addr(self, name: str) -> str:
        """The zmq address of channel `name` (tokenizer, compute, control, detokenizer, gateway)."""
        given = getattr(self, f"{name}_addr")
        if given:
            return given
        if not self.run_dir:
            raise ValueError(f"--{name}-addr or --run-dir must be set")
        return f"ipc://{self.run_dir}/{name}.sock"


def auto_tokenizer_workers(cores: int | None = None) -> int:
    """Tokenizer workers by default: 2 with at least 4 cores (usable by this process), else 1
    (on 2 cores a second worker would only take CPU from compute)."""
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
            os.cpu_count() or 1)
    return 2 if cores >= 4 else 1


def add_config_args(parser: argparse.ArgumentParser, cls: type) -> None:
    """Add one flag per field of the dataclass `cls`, defaulting to its env var or field default."""
    for dest, f, typ in _leaf_fields(cls):
        env = os.environ.get(_env_name(dest))
        default = f.default if env is None else _parse(typ, env)
        flag = "--" + dest.replace("_", "-")
        help = f.metadata.get("help")
        if typ is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default,
                                help=help)
        else:
            parser.add_argument(flag, type=typ, default=default, help=help)


def config_from_args(cls: type, args: argparse.Namespace, **overrides):
    """Build the frozen config `cls` from parsed flags (and explicit overrides, named as in
    `with_settings`)."""
    values = {dest: getattr(args, dest) for dest, _, _ in _leaf_fields(cls) if hasattr(args, dest)}
    return _build(cls, {**values, **overrides})


def with_settings(config, **changes):
    """`config` with some settings changed, each named as its flag's destination:
    `with_settings(c, sim_clock="virtual")` is --sim-clock, so it sets `c.sim.clock`."""
    return _build(type(config), {**settings(config), **changes})


def settings(config, prefix: str = "") -> dict:
    """Every setting of `config`, named as its flag's destination (`sim_clock`)."""
    out = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            out.update(settings(value, f"{prefix}{f.name}_"))
        else:
            out[prefix + f.name] = value
    return out


def env_for(config) -> dict[str, str]:
    """The PIPELLM_* env vars that reproduce `config` in a child process."""
    return {_env_name(dest): str(int(value)) if isinstance(value, bool) else str(value)
            for dest, value in settings(config).items()}


def _leaf_fields(cls: type, prefix: str = ""):
    """(destination, field, type) of each setting of `cls`; a field holding a config class
    (EngineConfig.sim) contributes its own settings, named with its name as a prefix."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        typ = _base_type(hints[f.name])
        if dataclasses.is_dataclass(typ):
            yield from _leaf_fields(typ, f"{prefix}{f.name}_")
        else:
            yield prefix + f.name, f, typ


def _build(cls: type, values: dict, prefix: str = ""):
    if not prefix and (unknown := values.keys() - {d for d, _, _ in _leaf_fields(cls)}):
        raise TypeError(f"{cls.__name__} has no setting {', '.join(sorted(unknown))}")
    kwargs = {}
    for f in dataclasses.fields(cls):
        typ = _base_type(typing.get_type_hints(cls)[f.name])
        if dataclasses.is_dataclass(typ):
            kwargs[f.name] = _build(typ, values, f"{prefix}{f.name}_")
        elif prefix + f.name in values:
            kwargs[f.name] = values[prefix + f.name]
    return cls(**kwargs)


def _env_name(field_name: str) -> str:
    return "PIPELLM_" + field_name.upper()


def _base_type(hint) -> type:
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    return hint


def _parse(typ: type, text: str):
    if typ is bool:
        return text.strip().lower() in ("1", "true", "yes", "on")
    return typ(text)
