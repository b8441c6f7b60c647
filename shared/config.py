"""Settings: frozen dataclasses resolved once at start-up from CLI flags and env vars.

Every setting `foo_bar` is the flag `--foo-bar` and the env var `PIPELLM_FOO_BAR` (flag > env
var > default; the machinery is `shared/settings.py`); where vLLM has the same thing, its flag
name works too. This is the only place that declares them.
"""

from __future__ import annotations

import enum
import json
import os
from dataclasses import dataclass

from shared.generation_config import parse_override
from shared.lora import check_adapters, parse_lora_modules
from shared.scoring import names_classifier, parse_overrides
from shared.settings import setting
from shared.speculative import SpeculativeConfig

MODEL, SCHEDULING, QUANTIZATION, SERVER, WIRING, SIMULATOR, LORA = (
    "model", "scheduling and KV cache", "quantization", "server", "services wiring",
    "simulator (--backend sim)", "LoRA adapters")


@dataclass(frozen=True)
class SimConfig:
    """The modelled GPU of `--backend sim` (services/compute/sim): flags `--sim-<field>`."""

    gpu: str = setting("h100", "GPU to model: h100, h200, a100, l40s, ... "
                       "(services/compute/sim/hardware.py)", group=SIMULATOR)
    model: str = setting("llama-3-8b", "model to model: llama-2-7b, llama-2-13b, llama-3-8b, "
                         "mistral-7b, ...", group=SIMULATOR)
    kv_dtype: str = setting("bf16", "KV cache element: bf16, int8 or fp8 (2 / 1 / 1 bytes)",
                            group=SIMULATOR)
    weight_dtype: str = setting("bf16", "weights: bf16, int8, fp8 (W8A8) or int4 (weight-only)",
                                group=SIMULATOR)
    # eff_bw and overhead_ms: fitted to the decode steps measured on an H200 (bench/gpu_report.py)
    eff_bw: float = setting(0.76, "fraction of HBM bandwidth reached", group=SIMULATOR)
    eff_flops: float = setting(0.6, "fraction of peak tensor FLOP/s reached", group=SIMULATOR)
    overhead_ms: float = setting(0.4, "per-step time outside the roofline (launches, host)",
                                 group=SIMULATOR)
    paged_attn_slowdown: float = setting(
        1.0, "--kv-policy paged: attention KV reads cost this many times the contiguous "
        "kernel's (a block-table lookup per page; bench/kernels.py measures it on a GPU)",
        group=SIMULATOR)
    clock: str = setting("real", "real (sleep each step's modelled time) or virtual (advance a "
                         "clock)", group=SIMULATOR)

    def __post_init__(self):
        if self.clock not in ("real", "virtual"):
            raise ValueError(f"--sim-clock must be real or virtual, not {self.clock!r}")
        if self.paged_attn_slowdown <= 0:
            raise ValueError("--sim-paged-attn-slowdown must be > 0")


class KVPolicyName(enum.StrEnum):
    """--kv-policy: how a request's KV segment is sized (services/compute/scheduling/
    kv_policy.py)."""

    PREDICTED = "predicted"
    MAX = "max"
    PAGED = "paged"


class BackendName(enum.StrEnum):
    """--backend: what runs a step (services/compute/backend.py, the one place that asks)."""

    TORCH = "torch"  # the model's weights on a CPU or GPU
    SIM = "sim"  # a modelled GPU, no weights


class RunnerName(enum.StrEnum):
    """--runner: what the server serves (vLLM's flag): generation, or pooled embeddings
    (services/compute/pooling; the gateway's /v1/embeddings)."""

    GENERATE = "generate"
    POOLING = "pooling"


class ConvertName(enum.StrEnum):
    """--convert (vLLM's): what a generation model's checkpoint is served as; embed: a pooling
    server (the same as --runner pooling); classify: a pooling server scoring with the
    checkpoint's sequence classification head (shared/scoring.py); reward: a pooling server
    giving every token's output on /pooling (services/compute/pooling/reward.py)."""

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
    (services/compute/scheduling/policy.py)."""

    FCFS = "fcfs"
    PRIORITY = "priority"
    PREDICTED = "predicted"


class Admission(enum.StrEnum):
    """--kv-admission: what must fit for a waiting request to be admitted
    (services/compute/scheduling/admission.py)."""

    AUTO = "auto"
    PEAK = "peak"
    AGGREGATE = "aggregate"
    FIT = "fit"


@dataclass(frozen=True)
class SchedulerConfig:
    """The scheduler's settings (services/compute/scheduling/scheduler.py says what they
    mean). `EngineConfig.scheduler`, flat: the flags keep their names (`--max-running`)."""

    max_batched_tokens: int = setting(512, "tokens per merged prefill+decode step",
                                      group=SCHEDULING, alias="max-num-batched-tokens")
    max_running: int = setting(256, "requests in the running batch", group=SCHEDULING,
                               alias="max-num-seqs")
    kv_policy: KVPolicyName = setting(KVPolicyName.PREDICTED, "KV segment per request sized "
                                      "by: predicted (its predicted output length), max "
                                      "(max_tokens) or paged (sim only)", group=SCHEDULING)
    kv_min_grow: int = setting(16, "minimum growth of a KV segment that ran out",
                               group=SCHEDULING)
    kv_reserve_quantile: float = setting(0.5, "predicted: a new segment holds this quantile of "
                                         "the output length", group=SCHEDULING)
    kv_grow_quantile: float = setting(0.9, "predicted: an outgrown segment regrows to this "
                                      "quantile, given the output so far", group=SCHEDULING)
    kv_peak_quantile: float = setting(0.9, "predicted: admission keeps the future KV peak at "
                                      "this quantile in memory", group=SCHEDULING)
    kv_reserve_horizon: int = setting(64, "predicted: reserve at most this many output slots "
                                      "ahead; 0: the whole quantile", group=SCHEDULING)
    kv_admission: Admission = setting(Admission.AUTO, "peak (the future KV peak, each request "
                                      "at its --kv-peak-quantile, must fit), aggregate (that "
                                      "quantile of the total future KV demand must fit), fit "
                                      "(the reservation must) or auto (aggregate with "
                                      "--kv-policy predicted)", group=SCHEDULING)
    enable_prefix_caching: bool = setting(False, "keep finished requests' KV cached (evicted "
                                          "least recently used when memory is needed); a "
                                          "prompt starting with a cached prefix copies its KV "
                                          "instead of recomputing it", group=SCHEDULING)
    batching: Batching = setting(Batching.MERGED, "merged (dynamic, merged steps) or static "
                                 "(a baseline)", group=SCHEDULING)
    scheduling_policy: SchedulingPolicyName = setting(
        SchedulingPolicyName.FCFS, "fcfs (arrival order), priority (a request's priority, lower "
        "first, then arrival; vLLM's) or predicted (priority, then the shortest predicted "
        "remaining work, aged so that no request waits past --max-queue-delay-ms); under "
        "priority and predicted a more urgent waiting request preempts the least urgent "
        "running one when KV or --max-running binds", group=SCHEDULING)
    max_queue_delay_ms: float = setting(
        30000.0, "predicted: a waiting request's aging bound; once it has waited this long it "
        "goes before every request younger than it (below the queueing delay of a load, the "
        "policy is FCFS there)", group=SCHEDULING)
    max_queue_delay_factor: float = setting(
        0.0, "predicted: a waiting request's aging bound is also at most this multiple of its "
        "own predicted service time (its prefill chunks plus its predicted output tokens, one "
        "step each, at the measured step time): overdue requests go first, earliest deadline "
        "first; 0: --max-queue-delay-ms alone", group=SCHEDULING)
    speculative_config: str | None = setting(
        None, "speculative decoding, vLLM's JSON: '{\"method\": \"ngram\", "
        "\"num_speculative_tokens\": 4, \"prompt_lookup_min\": 2, \"prompt_lookup_max\": 4}' "
        "(drafts by prompt lookup, verified in one step; turns the overlap schedule off), or "
        "a draft model: '{\"model\": PATH, \"num_speculative_tokens\": 4}'",
        group=SCHEDULING)

    def __post_init__(self):
        # the one place the choices are checked; a value is the enum or its text, equal to
        # each other (str-valued enums): compare with ==, never `is`
        for name, choices in (("kv_policy", KVPolicyName), ("kv_admission", Admission),
                              ("batching", Batching),
                              ("scheduling_policy", SchedulingPolicyName)):
            _choice(name, choices, getattr(self, name))
        if self.enable_prefix_caching and self.kv_policy == KVPolicyName.PAGED:
            raise ValueError(f"--enable-prefix-caching needs contiguous segments; the "
                             f"{self.kv_policy} KV policy has none")
        if not 1 <= self.max_running <= self.max_batched_tokens:
            raise ValueError("need 1 <= max_running <= max_batched_tokens")
        if not self.max_queue_delay_ms > 0:
            raise ValueError("--max-queue-delay-ms must be > 0")
        if not self.max_queue_delay_factor >= 0:
            raise ValueError("--max-queue-delay-factor must be >= 0")
        for q in (self.kv_reserve_quantile, self.kv_grow_quantile, self.kv_peak_quantile):
            if not 0 < q <= 1:
                raise ValueError("quantiles must be in (0, 1]")
        self.speculative  # noqa: B018  (a malformed --speculative-config fails at start-up)

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """--speculative-config, parsed (None: no speculation)."""
        return SpeculativeConfig.parse(self.speculative_config)


def _choice(name: str, choices: type[enum.StrEnum], value) -> enum.StrEnum:
    """`value` (text or a member) as a member of `choices`; else ValueError naming the flag."""
    try:
        return choices(value)
    except ValueError:
        allowed = tuple(c.value for c in choices)
        raise ValueError(f"--{name.replace('_', '-')} must be one of {allowed}, not "
                         f"{value!r}") from None


@dataclass(frozen=True)
class EngineConfig:
    """The model and how compute runs it."""

    model: str = setting("", "Hugging Face model directory or GGUF file; empty: "
                         "SmolLM2-135M-Instruct (fetched once), else the built-in demo model",
                         group=MODEL)
    device: str = setting("auto", "auto (CUDA if there is one, else CPU), cpu, cuda or cuda:N",
                          group=MODEL)
    dtype: str = setting("auto", "weights and activations: auto (the checkpoint's), float32, "
                         "bfloat16 or float16", group=MODEL)
    max_model_len: int = setting(0, "context length (prompt + output tokens); 0: the model's",
                                 group=MODEL)
    chat_template: str = setting("", "Jinja chat template, a file, the template itself or a "
                                 "built-in one's name (chatml_tools: ChatML with tools in the "
                                 "Hermes format); empty: the model's own", group=MODEL)
    generation_config: str = setting(
        "auto", "sampling defaults (temperature, top_p, top_k, min_p, repetition_penalty, "
        "max_new_tokens as max_tokens) for requests that leave them unset: auto (the model's "
        "generation_config.json; a GGUF file's general.sampling.* metadata; for the default "
        "model, its model card's recommendation), vllm (none: the API's own) or a directory "
        "holding a generation_config.json", group=MODEL)
    override_generation_config: str | None = setting(
        None, "JSON object overriding or adding to those defaults, e.g. '{\"temperature\": "
        "0.5}'; its max_new_tokens (as that of a --generation-config directory) also caps "
        "every request's max_tokens", group=MODEL)
    kernels: str = setting("auto", "auto (Triton on CUDA, the CPU kernels on CPU), triton or "
                           "reference (PyTorch)", group=MODEL)
    cpu_isa: str = setting("auto", "x86 level of the C++ CPU kernels: auto (the best this CPU "
                           "runs), avx2, avx512, avx512_vnni or amx (bf16 tiles for steps with "
                           "many rows); a lower level to test or compare it", group=MODEL)
    threads: int = setting(0, "torch CPU threads in compute; 0: one per core", group=MODEL)
    tensor_parallel_size: int = setting(
        1, "ranks (processes) one model is split across, Megatron-style (vLLM's flag): rank 0 "
        "schedules and broadcasts each step, every rank runs its shard of the forward "
        "(torch.distributed, gloo on CPU); with --threads, threads per rank", group=MODEL)
    enable_expert_parallel: bool = setting(
        False, "with --tensor-parallel-size N over 1, a mixture of experts' experts whole, "
        "E / N contiguous ones a rank (vLLM's flag; attention still split, the layer's output "
        "one all-reduce); a dense model ignores it, as vLLM does", group=MODEL)
    nnodes: int = setting(1, "machines the --tensor-parallel-size ranks span (torchrun's name), "
                          "as many ranks on each; every machine runs the same command with its "
                          "--node-rank", group=MODEL)
    node_rank: int = setting(0, "this machine's place among --nnodes: 0 serves (rank 0 and the "
                             "services), another runs only its ranks, following rank 0's "
                             "restarts", group=MODEL)
    master_addr: str = setting("127.0.0.1", "with --nnodes over 1: the address of node 0, "
                               "where the ranks meet (torchrun's name)", group=MODEL)
    master_port: int = setting(0, "with --nnodes over 1: the port on node 0 where the ranks "
                               "meet; 0 (one machine only): a free one. With "
                               "--data-parallel-size D, replica d's ranks meet on --master-port "
                               "+ d (D ports from it)", group=MODEL)
    backend: BackendName = setting(BackendName.TORCH, "torch (run the model) or sim (a modelled "
                                   "GPU, no weights)", group=MODEL)
    runner: RunnerName = setting(RunnerName.GENERATE, "generate (chat, completions, ...) or "
                                 "pooling (embeddings of the model's last hidden states, pooled "
                                 "as its sentence-transformers config says: /v1/embeddings "
                                 "only)", group=MODEL)
    convert: ConvertName = setting(ConvertName.AUTO, "vLLM's: embed serves the model as an "
                                   "embedder (the same as --runner pooling), classify as a "
                                   "classifier / cross-encoder (its score head), reward as a "
                                   "reward model (every token's score head output, else hidden "
                                   "state, on /pooling); auto or none: as --runner says",
                                   group=MODEL)
    hf_overrides: str = setting("", "vLLM's JSON over the model's config.json, for scoring "
                                "only (a pooling server): architectures, num_labels, id2label, "
                                "classifier_from_token, is_original_qwen3_reranker (a "
                                "Qwen3-Reranker's yes/no rule)", group=MODEL)
    pooler_config: str = setting("", "vLLM's JSON over the model's pooling (a pooling server): "
                                 '{"pooling_type": "LAST"|"MEAN"|"CLS", "normalize": true}',
                                 group=MODEL)
    scheduler: SchedulerConfig = setting(default_factory=SchedulerConfig, flat=True)
    kv_cache_tokens: int = setting(0, "KV cache slots (tokens); 0: sized from memory",
                                   group=SCHEDULING)
    kv_cache_gib: float = setting(1.0, "CPU: KV cache size when --kv-cache-tokens is 0",
                                  group=SCHEDULING)
    gpu_memory_utilization: float = setting(0.9, "CUDA: fraction of GPU memory for weights + "
                                            "KV cache", group=SCHEDULING)
    default_predicted_len: int = setting(128, "predicted output length until the predictor "
                                         "knows better", group=SCHEDULING)
    hidden_length: bool = setting(False, "after prefill, predict each request's output length "
                                  "from the model's own hidden state, learned online from "
                                  "finished requests (in Redis when served); off by default: "
                                  "in the ablation it gains no QPS so far (docs/benchmarks.md)",
                                  group=SCHEDULING)
    length_refine_every: int = setting(32, "hidden-state length prediction: predict the remaining "
                                       "length again every this many generated tokens; 0: after "
                                       "prefill only", group=SCHEDULING)
    length_probe_dim: int = setting(0, "hidden-state length prediction: the heads' features, the "
                                    "hidden state's random projection to this many; the "
                                    "model's hidden size: the hidden state itself; 0: that up "
                                    "to 1024 wide, else 512", group=SCHEDULING)
    enforce_eager: bool = setting(False, "CUDA: run every step eagerly (no CUDA graphs of "
                                  "decode steps)", group=MODEL)
    overlap_schedule: str = setting("auto", "schedule and launch step N+1 while the device runs "
                                    "step N: on, off, or auto (on where steps run "
                                    "asynchronously: CUDA)", group=SCHEDULING)
    kv_cache_dtype: str = setting("auto", "KV cache elements: auto (the model's dtype), int8 "
                                  "(groups of 8 with an fp16 scale: 1.25 bytes a value) or fp8 "
                                  "(e4m3, scale 1: one byte; GPUs of compute capability 8.9+, "
                                  "or CPU)", group=QUANTIZATION)
    quantization: str = setting("auto", "weights: none, w8a8 (INT8 weights and activations), "
                                "int4 (INT4 weight-only; a GGUF file's Q4 blocks as they are), "
                                "fp8 (e4m3; GPUs of compute capability 8.9+, or CPU); auto: int4 "
                                "for a Q4_0/Q4_1 GGUF file, else none", group=QUANTIZATION)
    int4_group_size: int = setting(32, "int4: values per scale and min when pipellm quantizes "
                                   "a float weight (32, 64 or 128)", group=QUANTIZATION)
    enable_lora: bool = setting(False, "serve LoRA adapters (--lora-modules) beside the base "
                                "model's weights, requests naming one as their model",
                                group=LORA)
    lora_modules: str = setting("", "LoRA adapters (PEFT directories), whitespace-separated: "
                                "name=path or a JSON object {\"name\", \"path\", "
                                "\"base_model_name\"} (or a JSON list of them)", group=LORA,
                                many=True)
    max_loras: int = setting(1, "LoRA adapters the running batch holds requests of: a request "
                             "of another adapter waits its turn in line", group=LORA)
    max_lora_rank: int = setting(16, "largest LoRA rank served: an adapter over it is refused "
                                 "at start-up", group=LORA)
    max_cpu_loras: int | None = setting(None, "LoRA adapters loaded at once (--lora-modules and "
                                        "loaded at run time), at least --max-loras; unset: any "
                                        "number (each is resident on the device)", group=LORA)
    sim: SimConfig = setting(default_factory=SimConfig)

    def __post_init__(self):
        """The scheduler's own settings are checked by SchedulerConfig; here what they must
        agree on with the engine's."""
        _choice("backend", BackendName, self.backend)
        self._check_runner()
        if self.scheduler.speculative_config and self.backend == BackendName.SIM:
            raise ValueError("--speculative-config is not modelled by the simulator "
                             "(--backend sim)")
        if self.scheduler.kv_policy == KVPolicyName.PAGED and self.backend != BackendName.SIM:
            raise ValueError("--kv-policy paged is a baseline of the simulator (--backend sim): "
                             "the kernels read contiguous KV segments")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"--dtype must be auto, float32, bfloat16 or float16: {self.dtype!r}")
        if self.kernels not in ("auto", "triton", "reference"):
            raise ValueError(f"--kernels must be auto, triton or reference, not {self.kernels!r}")
        if self.cpu_isa != "auto":  # checked against this CPU now, not in compute's start-up
            from kernels.cpu.isa import choose, cpu_levels

            choose(self.cpu_isa, cpu_levels())
        if self.kv_cache_dtype not in ("auto", "int8", "fp8"):
            raise ValueError(f"--kv-cache-dtype must be auto, int8 or fp8, not "
                             f"{self.kv_cache_dtype!r}")
        if self.overlap_schedule not in ("auto", "on", "off"):
            raise ValueError(f"--overlap-schedule must be auto, on or off, not "
                             f"{self.overlap_schedule!r}")
        if self.quantization not in ("auto", "none", "w8a8", "int4", "fp8"):
            raise ValueError("--quantization must be auto, none, w8a8, int4 or fp8, not "
                             f"{self.quantization!r}")
        if self.length_refine_every < 0 or self.length_probe_dim < 0:
            raise ValueError("--length-refine-every and --length-probe-dim must be >= 0")
        if self.int4_group_size not in (32, 64, 128):
            raise ValueError(f"--int4-group-size must be 32, 64 or 128: {self.int4_group_size}")
        if self.default_predicted_len < 1:
            raise ValueError("--default-predicted-len must be at least 1")
        if not self.generation_config:
            raise ValueError("--generation-config must be auto, vllm or a directory")
        parse_override(self.override_generation_config)  # a malformed one fails at start-up
        self._check_lora()
        self._check_tensor_parallel()

    @property
    def pooling(self) -> bool:
        """Whether this server serves pooled embeddings and scores, not generation (--runner
        pooling, --convert embed, classify or reward, or --hf-overrides naming a classification
        architecture, as vLLM picks its runner)."""
        return (self.runner == RunnerName.POOLING
                or self.convert in (ConvertName.EMBED, ConvertName.CLASSIFY, ConvertName.REWARD)
                or names_classifier(self.hf_overrides))

    @property
    def reward(self) -> bool:
        """Whether this pooling server is a reward model's (--convert reward): per-token
        outputs on /pooling only."""
        return self.convert == ConvertName.REWARD

    def _check_runner(self) -> None:
        """--runner and --convert parsed; what a pooling server cannot do fails at start-up."""
        _choice("runner", RunnerName, self.runner)
        _choice("convert", ConvertName, self.convert)
        if not self.pooling:
            if self.hf_overrides:
                raise ValueError("--hf-overrides goes with --runner pooling (it names a "
                                 "scoring head)")
            return
        parse_overrides(self.hf_overrides)  # a malformed one fails at start-up
        if self.reward and self.pooler_config:
            raise ValueError("--pooler-config does not go with --convert reward (a reward model "
                             "gives every token's output, unnormalized)")
        for flag, on in (("--backend sim", self.backend == BackendName.SIM),
                         ("--speculative-config", bool(self.scheduler.speculative_config)),
                         ("--enable-lora", self.enable_lora),
                         ("--enable-prefix-caching", self.scheduler.enable_prefix_caching),
                         ("--hidden-length", self.hidden_length)):
            if on:
                raise ValueError(f"{flag} does not go with --runner pooling (embeddings run "
                                 "prefill only)")

    def _check_tensor_parallel(self) -> None:
        """What --tensor-parallel-size cannot run with fails at start-up (the model's shapes
        are checked where it is read: services/compute/tp/shard.py)."""
        if self.tensor_parallel_size < 1:
            raise ValueError("--tensor-parallel-size must be at least 1")
        if not 0 <= self.node_rank < self.nnodes or \
                self.tensor_parallel_size % self.nnodes:
            raise ValueError(f"--nnodes {self.nnodes} must divide --tensor-parallel-size "
                             f"{self.tensor_parallel_size}, and --node-rank be below it")
        if self.nnodes > 1 and not 0 < self.master_port < 65536:
            raise ValueError("--nnodes over 1 needs --master-port: the port on node 0 where "
                             "the ranks meet")
        if self.tensor_parallel_size == 1:
            if self.enable_expert_parallel:
                raise ValueError("--enable-expert-parallel needs --tensor-parallel-size over 1 "
                                 "(the ranks the experts are spread over)")
            return
        for flag, on in (("--backend sim", self.backend == BackendName.SIM),
                         ("--device cuda", self.device.startswith("cuda"))):
            if on:
                raise ValueError(f"--tensor-parallel-size {self.tensor_parallel_size} does not "
                                 f"go with {flag} yet (CPU ranks over gloo)")

    def _check_lora(self) -> None:
        """--lora-modules parsed and every adapter's rank read now: a bad one fails at
        start-up (shared/lora.py)."""
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ValueError("--max-loras and --max-lora-rank must be at least 1")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError("--max-cpu-loras must be at least --max-loras")
        if self.lora_modules and not self.enable_lora:
            raise ValueError("--lora-modules needs --enable-lora")
        if self.enable_lora and self.backend == BackendName.SIM:
            raise ValueError("--enable-lora is not modelled by the simulator (--backend sim)")
        if self.enable_lora:
            check_adapters(parse_lora_modules(self.lora_modules), self.max_cpu_loras,
                           self.max_lora_rank)


# services/gateway/tool_formats.PARSERS' names (tests/test_tool_formats.py checks it)
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "pythonic", "qwen3_coder")


@dataclass(frozen=True)
class ServiceConfig:
    """The HTTP server and the wiring of the four services. Empty addresses: ipc sockets
    under `run_dir`."""

    host: str = setting("127.0.0.1", "address the HTTP server listens on", group=SERVER)
    port: int = setting(8000, "HTTP port", group=SERVER)
    served_model_name: str = setting("", "the model's name in the API; empty: the model "
                                     "directory's (GGUF file's) name", group=SERVER)
    api_key: str = setting("", "if set, /v1/* and the utility endpoints need the header "
                           "'Authorization: Bearer KEY'", group=SERVER)
    allowed_origins: str = setting("*", "CORS: origins allowed to call the API from a browser, "
                                   "comma-separated or a JSON list; empty: no CORS headers",
                                   group=SERVER)
    seed: int | None = setting(None, "requests without a seed draw theirs from this seed "
                               "(reproducible runs); unset: from the OS", group=SERVER)
    max_pending: int = setting(512, "requests in flight at the gateway before it answers 429",
                               group=SERVER)
    strict_request_fields: bool = setting(False, "answer a request key the API does not know "
                                          "with a 400; by default it is ignored and logged, "
                                          "as vLLM does", group=SERVER)
    enable_auto_tool_choice: bool | None = setting(
        None, "tool_choice \"auto\": the model decides whether to call tools; its output is "
        "parsed by --tool-call-parser; unset: on unless --tool-call-parser is given without "
        "it (vLLM's rule)", group=SERVER)
    tool_call_parser: str = setting("", "how the model writes tool calls: hermes "
                                    "(<tool_call>{...}</tool_call>), llama3_json, mistral, "
                                    "pythonic or qwen3_coder; empty: "
                                    "the one its chat template writes (hermes where the "
                                    "template renders no tools: they are then described in "
                                    "the system message, llama.cpp's fallback)", group=SERVER)
    reasoning_parser: str = setting("", "split a reasoning model's chat answers into reasoning "
                                    "and content: qwen3 (reasoning only after an opening "
                                    "<think>) or deepseek_r1 (reasoning until </think>); "
                                    "SGLang's deepseek-r1 and qwen3-thinking too", group=SERVER)
    default_chat_template_kwargs: str = setting(
        "", "a JSON object of chat template variables for every chat request (a request's "
        "chat_template_kwargs win key by key), e.g. '{\"enable_thinking\": false}'",
        group=SERVER)
    allow_runtime_lora_updating: bool = setting(
        False, "with --enable-lora: POST /v1/load_lora_adapter and /v1/unload_lora_adapter "
        "(vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING=true works too)", group=LORA)
    responses_store_ttl: int = setting(
        7 * 86400, "seconds a stored /v1/responses response (store: true) stays in Redis "
        "after its last write, for previous_response_id, GET and background polling",
        group=SERVER)
    responses_store_max_bytes: int = setting(
        16 * 2**20, "largest stored response (its object, input and output); a larger one is "
        "answered but not stored (its `store` says false)", group=SERVER)
    max_body_bytes: int = setting(8 * 2**20, "largest request body, else 413", group=SERVER)
    max_prompt_bytes: int = setting(0, "largest prompt (UTF-8 bytes of the prompt, or of all "
                                    "chat messages), else 400; 0: 16 bytes per token of the "
                                    "context length, at least 64 KiB", group=SERVER)
    length_predictor: bool = setting(True, "predict output lengths (in Redis) and learn them "
                                     "as requests finish", group=SCHEDULING)
    redis_url: str = setting("", "Redis for request state and the length predictor; empty "
                             "with `pipellm serve`: an embedded redis-server", group=WIRING)
    redis_dir: str = setting("", "embedded Redis: persist here (learned lengths survive "
                             "restarts)", group=WIRING)
    run_dir: str = setting("", "where ipc sockets live; empty: a temporary directory",
                           group=WIRING)
    tokenizer_addr: str = setting("", "zmq: gateway PUSH (bind) -> tokenizers PULL",
                                  group=WIRING)
    compute_addr: str = setting("", "zmq: tokenizers PUSH -> compute PULL (bind)", group=WIRING)
    control_addr: str = setting("", "zmq: gateway, detokenizer PUSH -> compute PULL (bind): "
                                "aborts, stops", group=WIRING)
    detokenizer_addr: str = setting("", "zmq: compute PUSH -> detokenizer PULL (bind)",
                                    group=WIRING)
    gateway_addr: str = setting("", "zmq: detokenizer, tokenizers PUSH -> gateway PULL (bind)",
                                group=WIRING)
    tokenizer_workers: int = setting(0, "tokenizer processes; 0: 2 with 4 or more cores, else 1",
                                     group=WIRING)
    request_ttl_s: int = setting(3600, "seconds a finished request's state stays in Redis",
                                 group=WIRING)
    heartbeat_s: float = setting(0.5, "seconds between each service's heartbeats", group=WIRING)
    data_parallel_size: int = setting(
        1, "compute processes, one per device (vLLM's --data-parallel-size): with CUDA, "
        "devices 0..N-1 of those visible; on a CPU each gets its share of the cores. A "
        "tokenizer sends each request to the one with the lowest predicted KV demand; with "
        "--nnodes, each is a group across the machines and every node takes the same D",
        group=WIRING)
    data_parallel_routing: str = setting(
        "auto", "how a tokenizer picks the compute process: predicted-load (the lowest "
        "predicted KV demand), predicted-load-affinity (the same, preferring the one that "
        "cached the prompt's prefix), cache-aware (SGLang router's rule), round-robin; auto: "
        "predicted-load-affinity with --enable-prefix-caching, else predicted-load",
        group=WIRING)
    data_parallel_rank: int = setting(0, "this compute process's rank (set by pipellm serve)",
                                      group=WIRING)
    server_id: str = setting("", "this server's name in Redis (its services' heartbeats and "
                             "engine stats), so that servers behind a router may share one "
                             "Redis; empty: `pipellm serve` takes <host>-<port>", group=WIRING)

    def __post_init__(self):
        if self.tool_call_parser not in ("", *TOOL_CALL_PARSERS):
            raise ValueError(f"--tool-call-parser must be one of {', '.join(TOOL_CALL_PARSERS)}")
        if self.reasoning_parser:
            from shared.reasoning import parser

            parser(self.reasoning_parser)  # ValueError naming the choices
        if self.default_chat_template_kwargs:
            try:
                kwargs = json.loads(self.default_chat_template_kwargs)
            except ValueError:
                kwargs = None
            if not isinstance(kwargs, dict):
                raise ValueError("--default-chat-template-kwargs must be a JSON object")
        if self.tokenizer_workers < 0:
            raise ValueError("--tokenizer-workers must be 0 (automatic) or more")
        from shared.routing import POLICIES

        if self.data_parallel_routing not in ("auto", *POLICIES):
            raise ValueError(f"--data-parallel-routing must be auto or one of "
                             f"{', '.join(POLICIES)}")
        if not 0 <= self.data_parallel_rank < self.data_parallel_size:
            raise ValueError("--data-parallel-size must be at least 1 (and a rank below it)")
        if self.max_prompt_bytes < 0:
            raise ValueError("--max-prompt-bytes must be 0 (automatic) or more")
        self.origins()  # a malformed --allowed-origins fails at start-up

    def prompt_bytes_limit(self, max_model_len: int) -> int:
        """The prompt size cap in bytes: --max-prompt-bytes, or when 0, 16 bytes per token of
        the context length but at least 64 KiB (tokens are rarely over 8 bytes of text)."""
        return self.max_prompt_bytes or max(16 * max_model_len, 64 * 1024)

    @property
    def tokenizers(self) -> int:
        """Tokenizer processes to run: --tokenizer-workers, or by the machine's cores if 0."""
        return self.tokenizer_workers or auto_tokenizer_workers()

    def origins(self) -> frozenset[str]:
        """--allowed-origins: comma-separated, or a JSON list as vLLM takes it; "*" for any."""
        value = self.allowed_origins.strip()
        if not value.startswith("["):
            items = value.split(",")
        else:
            try:
                items = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"--allowed-origins is not a JSON list: {exc}") from None
            if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
                raise ValueError("--allowed-origins must be a list of strings")
        return frozenset(i.strip().rstrip("/") for i in items if i.strip())

    def routing_policy(self, prefix_caching: bool) -> str:
        """The routing policy's name (--data-parallel-routing, auto resolved)."""
        if self.data_parallel_routing != "auto":
            return self.data_parallel_routing
        return "predicted-load-affinity" if prefix_caching else "predicted-load"

    @property
    def server(self) -> str:
        """server_id, or "default" (services started alone without one)."""
        return self.server_id or "default"

    def addr(self, name: str, rank: int = 0) -> str:
        """The zmq address of channel `name` (tokenizer, compute, control, detokenizer,
        gateway); of compute process `rank`'s for compute and control: a given tcp address's
        port plus the rank, or its own ipc socket."""
        given = getattr(self, f"{name}_addr")
        if given and rank:
            host, _, port = given.rpartition(":")
            if not given.startswith("tcp://") or not port.isdigit():
                raise ValueError(f"--{name}-addr with --data-parallel-size needs tcp://HOST:PORT")
            return f"{host}:{int(port) + rank}"
        if given:
            return given
        if not self.run_dir:
            raise ValueError(f"--{name}-addr or --run-dir must be set")
        return f"ipc://{self.run_dir}/{name}{f'-{rank}' if rank else ''}.sock"


def auto_tokenizer_workers(cores: int | None = None) -> int:
    """Tokenizer workers by default: 2 with at least 4 cores (usable by this process), else 1
    (on 2 cores a second worker would only take CPU from compute)."""
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
            os.cpu_count() or 1)
    return 2 if cores >= 4 else 1


def replica_master_port(engine: EngineConfig, replica: int) -> int:
    """The port where data-parallel replica `replica`'s tensor-parallel ranks meet:
    --master-port + replica (each replica is its own torch.distributed group, its store on
    node 0); 0 without --master-port (one machine: each replica's store takes a free port).
    Node 0's supervisor and the other nodes' tp_node both derive it here."""
    return engine.master_port + replica if engine.master_port else 0


def check_replicas(engine: EngineConfig, data_parallel_size: int) -> None:
    """ValueError, one line, where --data-parallel-size replicas would meet on a port past
    65535 (replica_master_port)."""
    last = replica_master_port(engine, data_parallel_size - 1)
    if last > 65535:
        raise ValueError(f"--master-port {engine.master_port} with --data-parallel-size "
                         f"{data_parallel_size}: replica d meets on --master-port + d, and "
                         f"{last} is past 65535")
