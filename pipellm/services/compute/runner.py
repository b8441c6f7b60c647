"""Model runner: owns the weights, the KV cache and the device; executes scheduled steps.

Start-up (`ModelRunner.__init__`), in order: torch's backend and threads, the weights with
their quantization, the length heads' probe, the KV cache's size then the cache, the decode
CUDA graphs (on a GPU, captured over that cache). A step (`launch`): the KV moves, the merged
forward, then `sampling` turns the logits into tokens, logprobs and top rows.
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace

import torch

from pipellm.kernels import set_backend, take_rows
from pipellm.kernels.cpu import isa, set_isa
from pipellm.services.compute import sampling
from pipellm.services.compute.batch import build_batch
from pipellm.services.compute.core.step import ScheduledStep, Work
from pipellm.services.compute.cuda_graphs import DecodeGraphs
from pipellm.services.compute.drafter import Drafter
from pipellm.services.compute.inflight import InFlight
from pipellm.services.compute.kv import element
from pipellm.services.compute.kv.kv_cache import KVCache
from pipellm.services.compute.kv.sizing import gpu_kv_budget
from pipellm.services.compute.length.head import is_checkpoint, probe_dim, probe_matrix
from pipellm.services.compute.lora.attach import attach_adapters, detach_adapter
from pipellm.services.compute.model import quantization, smoothing
from pipellm.services.compute.model.llama import LlamaModel
from pipellm.services.compute.model.weights import load_weights
from pipellm.services.compute.pooling.forward import hidden_states
from pipellm.services.compute.pooling.scoring import yes_no_rows
from pipellm.services.compute.structured import start_mask
from pipellm.shared.config import EngineConfig
from pipellm.shared.gguf.reader import is_gguf
from pipellm.shared.lora import parse_lora_modules
from pipellm.shared.model_config import ModelConfig
from pipellm.shared.scoring import ScoringConfig

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def resolve_dtype(name: str, model_config: ModelConfig, model: str,
                  device: torch.device) -> torch.dtype:
    """--dtype: "auto" is the checkpoint's, but for a GGUF file (which has none) on a CPU that
    computes in bfloat16 natively at the chosen ISA level (`isa.native_bf16`): bfloat16, as
    vLLM runs on CPU (docs/usage.md says what it gains)."""
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cpu" and is_gguf(model) and isa.native_bf16():
        return torch.bfloat16
    return _DTYPES[model_config.dtype]


class ModelRunner:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, max_model_len: int,
                 ranks=None):
        """`ranks`: this process's tp.group.Ranks with --tensor-parallel-size over 1 (its
        shard of the weights and of the KV heads; rank 0 broadcasts each step), else None."""
        self.model_config, self.max_model_len = model_config, max_model_len
        self.ranks = ranks
        _configure_torch(config, ranks)
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, model_config, config.model, self.device)
        self.quant, self.model = _load_model(config, model_config, self.device, self.dtype,
                                             max_model_len, ranks)
        # a draft model whole on rank 0 alone: its proposals reach the others in the batch
        draft, draft_kv = _draft_model(config, model_config, self.device, self.dtype,
                                       max_model_len) if ranks is None or ranks.leader else \
            (None, None)
        # self.model.cfg: a tensor-parallel rank's has its share of the KV heads
        kv_shape = element.kv_shape(config, self.model.cfg, self.dtype, self.device)
        # a slot holds the target's K/V and, with a draft model, the draft's
        self.kv_bytes_per_token = sum(KVCache.bytes_per_token(**s) for s in (kv_shape, draft_kv)
                                      if s is not None)
        self.probe_dim, self.probe = _length_probe(config, model_config.hidden_size, self.device)
        self.probe_every = config.length_refine_every
        self.summary = {}  # what start-up reports (published with the engine stats)
        self.capacity = self._kv_capacity(config, kv_shape)
        if ranks is not None:
            self.capacity = ranks.agree(self.capacity)
        self.kv, self.graphs = self._kv_cache_and_graphs(config, kv_shape)
        self.drafter = None if draft is None else Drafter(draft, KVCache(
            capacity=self.kv.k.shape[1], device=self.device, **draft_kv), self.device)
        self.summary |= self._describe(kv_shape["kv_dtype"])
        if ranks is not None:  # the whole group's weights and cache
            self.summary |= ranks.describe(str(self.device), self.model.weight_bytes(),
                                           self.capacity * self.kv_bytes_per_token,
                                           self.model.experts)
        log.info("KV cache: %d slots on %s (%s)", self.capacity, self.device, self.kv.k.dtype)

    def _kv_capacity(self, config: EngineConfig, kv_shape: dict) -> int:
        """KV slots: --kv-cache-tokens, else what the GPU's memory budget or, on a CPU,
        --kv-cache-gib holds (at least 1)."""
        if config.kv_cache_tokens > 0:
            return config.kv_cache_tokens
        per_token = self.kv_bytes_per_token
        if self.device.type == "cuda":
            tokens = min(config.scheduler.max_batched_tokens, self.max_model_len)
            budget = gpu_kv_budget(self.model, kv_shape, tokens, config.scheduler.max_running,
                                   config.gpu_memory_utilization, self.device)
            self.summary["gpu_memory"] = budget.describe()
            return max(int(budget.kv // per_token), 1)
        return max(int(config.kv_cache_gib * 2**30 // per_token), 1)

    def _kv_cache_and_graphs(self, config: EngineConfig, kv_shape: dict
                             ) -> tuple[KVCache, DecodeGraphs | None]:
        """The cache of `capacity` slots and, on a GPU with Triton kernels, the decode graphs
        (the reference kernels sync with the host); with graphs, one more slot: the padding
        rows' (no request owns slot `capacity`)."""
        use_graphs = self.device.type == "cuda" and not config.enforce_eager and \
            config.kernels != "reference"
        kv = KVCache(capacity=self.capacity + use_graphs, device=self.device, **kv_shape)
        graphs = DecodeGraphs(self.model, kv, config.scheduler.max_running, self.max_model_len,
                              pad_slot=self.capacity) if use_graphs else None
        return kv, graphs

    def _describe(self, kv_dtype: str) -> dict:
        """What start-up reports of the device, the weights and the cache."""
        return {"device": str(self.device), "dtype": str(self.dtype).removeprefix("torch."),
                "kv_dtype": kv_dtype, "quantization": self.quant.name,
                "weights_gib": round(self.model.weight_bytes() / 2**30, 3),
                "kv_gib": round(self.capacity * self.kv_bytes_per_token / 2**30, 3),
                "cuda_graphs": self.graphs.sizes[-1] if self.graphs else 0}

    simulated = False

    @property
    def asynchronous(self) -> bool:
        """Whether `launch` returns before the device has run the step (a GPU's stream)."""
        return self.device.type == "cuda"

    @torch.inference_mode()
    def launch(self, step: ScheduledStep, prev: InFlight | None = None) -> InFlight:
        """Queue one step: KV moves, the merged forward, one sampled token per step.sampled.
        `prev`: the step before, if its results are not committed yet (its sampled ids feed
        this step's inputs on the device). The host does not wait for the device here."""
        for src, dst, n in step.moves:
            self.kv.move(src, dst, n)
            if self.drafter is not None:
                self.drafter.kv.move(src, dst, n)
        sampled, offsets = step.sampled, step.offsets
        # the grammars' bitmask, filled while the forward runs
        mask = start_mask(sampled, {it.seq: it.drafts for it in step.of(Work.VERIFY)})
        batch = build_batch(step, self.device, prev, self.model.lora_slots)
        out = InFlight(step)
        if self.drafter is not None:  # its tokens into the verify rows, then the target's
            out.drafts = self.drafter.propose(step, batch)
        if self.ranks is not None:  # the other ranks run the same forward (tp/step.py)
            from pipellm.services.compute.tp.step import StepInputs, broadcast

            broadcast(StepInputs.of(step.moves, batch))
        if self.graphs is not None and batch.lora is None and self.graphs.fits(batch):
            logits, hidden = self.graphs.run(batch)  # [S, vocab], [S, hidden]
        else:
            logits, hidden = self.model.forward_hidden(batch, self.kv)  # [S + R, ...]
        if self.drafter is not None:
            self.drafter.mirror(batch)
        if sampled and self.probe is not None:
            self._probe(out, hidden, step)
        if batch.prompt_spans:
            out.prompt = sampling.prompt_rows(logits[len(sampled):], batch.prompt_spans)
        if sampled:
            logits = logits[: len(sampled)]
            sampling.suppress_stop_tokens(logits, sampled, offsets)
            out.top = sampling.top_rows(logits, [s.top_count for s in sampled])
            out.tokens, out.logprobs = sampling.sample(logits, sampled, self.device, mask,
                                                       offsets)
        return out.seal()

    def pooled_hidden(self, batch, rows: torch.Tensor | None = None,
                      moves: list[tuple[int, int, int]] = ()) -> torch.Tensor:
        """A pooling forward's final-normed hidden states of `rows` (pooling/forward.py), after
        the KV `moves` (src, dst, n), the other tensor-parallel ranks doing both beside this
        one."""
        if self.ranks is not None:
            from pipellm.services.compute.tp.step import StepInputs, broadcast

            broadcast(StepInputs.pooling(moves, batch, rows))
        for src, dst, n in moves:
            self.kv.move(src, dst, n)
        return hidden_states(self.model, batch, self.kv, rows)

    def attach_adapter(self, module, max_rank: int) -> None:
        """Serve LoRA adapter `module` (pipellm.shared.lora.LoraModule) from now on, on every
        tensor-parallel rank (each its slice); LoraError where it cannot be served."""
        self._tell_ranks(module=module, max_rank=max_rank)
        attach_adapters(self.model, [module], max_rank)

    def detach_adapter(self, name: str) -> None:
        """Stop serving LoRA adapter `name`, on every tensor-parallel rank."""
        self._tell_ranks(name=name)
        detach_adapter(self.model, name)

    def _tell_ranks(self, **change) -> None:
        """Rank 0: the other tensor-parallel ranks make the same adapter change."""
        if self.ranks is not None:
            from pipellm.services.compute.tp.step import AdapterChange, broadcast

            broadcast(AdapterChange(**change))

    def close(self) -> None:
        """Stop the other tensor-parallel ranks (rank 0; nothing to do without them)."""
        if self.ranks is not None:
            self.ranks.close()

    def _probe(self, out: InFlight, hidden: torch.Tensor, step: ScheduledStep) -> None:
        """The probes [C, r] of the sampled rows that are length checkpoints (launched
        before Scheduler.advance: a row's token goes at index len(seq.token_ids); of a
        speculative verify, its first row only; none of a beam search)."""
        rows = [i for i, (item, j) in enumerate(step.rows) if j == 0 and item.kind is not Work.BEAM
                and is_checkpoint(item.seq.num_output, self.probe_every)]
        if rows:
            out.probe_rows = rows
            out.probes = take_rows(hidden, rows).float() @ self.probe


def _configure_torch(config: EngineConfig, ranks=None) -> None:
    """The kernels' backend (--kernels), their ISA level on a CPU (--cpu-isa) and torch's CPU
    threads (--threads; a tensor-parallel rank's default: its share of the cores)."""
    set_backend(config.kernels)
    set_isa(config.cpu_isa)
    if config.threads > 0:  # on a small CPU, leave cores to the other services
        torch.set_num_threads(config.threads)
    elif ranks is not None:
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // ranks.local))


def _load_model(config: EngineConfig, model_config: ModelConfig, device: torch.device,
                dtype: torch.dtype, max_model_len: int, ranks=None
                ) -> tuple[quantization.Quantization, LlamaModel]:
    """The quantization method (--quantization) and the model, its weights loaded for it,
    with the --lora-modules adapters beside them; a tensor-parallel rank's shard of it."""
    quant = quantization.resolve(config.quantization, config.model, device, dtype,
                                 config.int4_group_size)
    if ranks is not None:
        from pipellm.services.compute.tp.model import load_parallel

        return quant, load_parallel(config, model_config, device, dtype, quant, max_model_len,
                                    ranks)
    weights = load_weights(config.model, dtype, device, keep_int4=quant.keeps_gguf_blocks)
    if config.pooling:  # a yes/no reranker's score rows, taken from its LM head
        yes_no_rows(ScoringConfig.from_dir(config.model, config.hf_overrides, config.convert),
                    config.model, weights)
    scales = smoothing.smooth(model_config, weights, device) \
        if quant.int8_activations else None  # W8A8: SmoothQuant, calibrated at load
    model = LlamaModel(model_config, weights, device, max_model_len, quant)
    model.smoothing = scales
    if config.enable_lora:
        attach_adapters(model, parse_lora_modules(config.lora_modules), config.max_lora_rank)
    return quant, model


def _draft_model(config: EngineConfig, target: ModelConfig, device: torch.device,
                 dtype: torch.dtype, max_model_len: int) -> tuple[LlamaModel | None, dict | None]:
    """The draft model of --speculative-config {"model": PATH}, loaded as the target is
    (--quantization, --dtype), and its KV shape; (None, None) without one."""
    spec = config.scheduler.speculative
    if spec is None or spec.model is None:
        return None, None
    draft = ModelConfig.from_path(spec.model)
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"the draft model's vocabulary ({draft.vocab_size} tokens) is not the "
                         f"target's ({target.vocab_size}): it must share the target's tokenizer")
    _, model = _load_model(replace(config, model=spec.model), draft, device, dtype,
                           max_model_len)
    return model, element.kv_shape(config, draft, dtype, device)


def _length_probe(config: EngineConfig, hidden: int, device: torch.device
                  ) -> tuple[int, torch.Tensor | None]:
    """(r, the length heads' probe [hidden, r] of a checkpoint row's hidden state, or None
    without --hidden-length)."""
    dim = probe_dim(hidden, config.length_probe_dim)
    if not config.hidden_length:
        return dim, None
    return dim, torch.from_numpy(probe_matrix(hidden, dim)).to(device)
