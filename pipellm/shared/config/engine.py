"""The engine's settings: the model and how compute runs it."""

from __future__ import annotations

from dataclasses import dataclass

from pipellm.shared.config.choices import (
    LORA,
    MODEL,
    QUANTIZATION,
    SCHEDULING,
    BackendName,
    ConvertName,
    KVPolicyName,
    RunnerName,
    parse_choice,
)
from pipellm.shared.config.scheduler import SchedulerConfig
from pipellm.shared.config.sim import SimConfig
from pipellm.shared.generation_config import parse_override
from pipellm.shared.lora import check_adapters, parse_lora_modules
from pipellm.shared.scoring import names_classifier, parse_overrides
from pipellm.shared.settings import setting


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
    kv_cache_dtype: str = setting("auto", "KV cache elements: auto (the model's dtype; float16 "
                                  "under a float32 model on CPU), float32, float16 (a float32 "
                                  "model on CPU: half the bytes), int8 (groups of 8 with an "
                                  "fp16 scale: 1.25 bytes a value) or fp8 (e4m3, scale 1: one "
                                  "byte; GPUs of compute capability 8.9+, or CPU)",
                                  group=QUANTIZATION)
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
        parse_choice("backend", BackendName, self.backend)
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
            from pipellm.kernels.cpu.isa import choose, cpu_levels

            choose(self.cpu_isa, cpu_levels())
        if self.kv_cache_dtype not in ("auto", "float32", "float16", "int8", "fp8"):
            raise ValueError(f"--kv-cache-dtype must be auto, float32, float16, int8 or fp8, "
                             f"not {self.kv_cache_dtype!r}")
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
        parse_choice("runner", RunnerName, self.runner)
        parse_choice("convert", ConvertName, self.convert)
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
        are checked where it is read: pipellm/services/compute/tp/shard.py)."""
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
        start-up (pipellm/shared/lora.py)."""
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
