"""Model runner: owns the weights, the KV cache and the device; executes scheduled steps."""

from __future__ import annotations

import logging

import torch

from kernels import apply_penalties, set_backend, to_device, token_stats
from kernels.kv_quant import KV_GROUP
from services.compute.batch import build_batch
from services.compute.core.sequence import Sequence
from services.compute.core.step import ScheduledStep
from services.compute.cuda_graphs import DecodeGraphs
from services.compute.inflight import InFlight, PromptRows, TopRows, to_host
from services.compute.kv.kv_cache import KVCache
from services.compute.kv.sizing import gpu_kv_budget
from services.compute.length.head import is_checkpoint, probe_dim, probe_matrix
from services.compute.model import quantization, smoothing
from services.compute.model.llama import LlamaModel
from services.compute.model.weights import load_weights
from services.compute.sampling_batch import SamplingBatch
from shared.config import EngineConfig
from shared.model_config import ModelConfig

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


class ModelRunner:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, max_model_len: int):
        self.model_config, self.max_model_len = model_config, max_model_len
        set_backend(config.kernels)
        if config.threads > 0:  # on a small CPU, leave cores to the other services
            torch.set_num_threads(config.threads)
        self.device = resolve_device(config.device)
        self.dtype = _DTYPES[model_config.dtype if config.dtype == "auto" else config.dtype]
        self.quant = quantization.resolve(config.quantization, config.model, self.device,
                                          self.dtype, config.int4_group_size)
        weights = load_weights(config.model, self.dtype, self.device,
                               keep_int4=self.quant.keeps_gguf_blocks)
        if self.quant.int8_activations:  # W8A8: SmoothQuant, calibrated at load
            smoothing.smooth(model_config, weights, self.device)
        self.model = LlamaModel(model_config, weights, self.device, max_model_len, self.quant)
        del weights
        kv_dtype = config.kv_cache_dtype
        _check_kv_dtype(kv_dtype, model_config.head_dim, self.device)
        per_token = KVCache.bytes_per_token(model_config.num_layers, model_config.num_kv_heads,
                                            model_config.head_dim, self.dtype, kv_dtype)
        self.kv_bytes_per_token = per_token
        kv_shape = dict(num_layers=model_config.num_layers, num_kv_heads=model_config.num_kv_heads,
                        head_dim=model_config.head_dim, dtype=self.dtype, kv_dtype=kv_dtype)
        # [hidden, r]: the length heads' probe of a checkpoint row's hidden state
        self.probe_dim = probe_dim(model_config.hidden_size, config.length_probe_dim)
        self.probe = torch.from_numpy(probe_matrix(
            model_config.hidden_size, self.probe_dim)).to(self.device) \
            if config.hidden_length else None
        self.probe_every = config.length_refine_every
        self.summary = {}  # what start-up reports (published with the engine stats)
        self.capacity = self._kv_capacity(config, per_token, kv_shape)
        use_graphs = self.device.type == "cuda" and not config.enforce_eager and \
            config.kernels != "reference"  # the reference kernels sync with the host
        # with graphs, one more slot: the padding rows' (no request owns slot `capacity`)
        self.kv = KVCache(capacity=self.capacity + use_graphs, device=self.device, **kv_shape)
        self.graphs = DecodeGraphs(self.model, self.kv, config.max_running, max_model_len,
                                   pad_slot=self.capacity) if use_graphs else None
        self.summary |= {"device": str(self.device), "dtype": str(self.dtype).removeprefix(
            "torch."), "kv_dtype": kv_dtype,
            "quantization": self.quant.name,
            "weights_gib": round(self.model.weight_bytes() / 2**30, 3),
            "kv_gib": round(self.capacity * per_token / 2**30, 3),
            "cuda_graphs": self.graphs.sizes[-1] if self.graphs else 0}
        log.info("KV cache: %d slots on %s (%s)", self.capacity, self.device,
                 self.kv.k.dtype)

    def _kv_capacity(self, config: EngineConfig, per_token: int, kv_shape: dict) -> int:
        if config.kv_cache_tokens > 0:
            return config.kv_cache_tokens
        if self.device.type == "cuda":
            tokens = min(config.max_batched_tokens, self.max_model_len)
            budget = gpu_kv_budget(self.model, kv_shape, tokens, config.max_running,
                                   config.gpu_memory_utilization, self.device)
            self.summary["gpu_memory"] = budget.describe()
            return max(int(budget.kv // per_token), 1)
        return max(int(config.kv_cache_gib * 2**30 // per_token), 1)

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
        sampled = step.sampled
        batch = build_batch(step, self.device, prev)
        if self.graphs is not None and self.graphs.fits(batch):
            logits, hidden = self.graphs.run(batch)  # [S, vocab], [S, hidden]
        else:
            logits, hidden = self.model.forward_hidden(batch, self.kv)  # [S + R, ...]
        out = InFlight(step)
        if sampled and self.probe is not None:
            self._probe(out, hidden, step)
        if batch.prompt_spans:
            out.prompt = _prompt_rows(logits[len(sampled):], batch.prompt_spans)
        if sampled:
            logits = logits[: len(sampled)]
            _suppress_stop_tokens(logits, sampled)
            out.top = _top_rows(logits, [s.params.top_logprobs for s in sampled])
            out.tokens, out.logprobs = self._sample(logits, sampled)
        return out.seal()

    def _probe(self, out: InFlight, hidden: torch.Tensor, step: ScheduledStep) -> None:
        """The probes [C, r] of the sampled rows that are length checkpoints (launched
        before Scheduler.advance: a row's token goes at index len(seq.token_ids))."""
        rows = [i for i, seq in enumerate(step.sampled)
                if is_checkpoint(len(seq.token_ids) - seq.num_prompt, self.probe_every)]
        if rows:
            out.probe_rows = rows
            out.probes = hidden[rows].float() @ self.probe

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]):
        """Sample one token per row of `logits` [S, vocab] for `seqs`; no host sync."""
        raw = None
        if any(s.params.shapes_logits for s in seqs):  # else no such work at all
            raw = logits  # logprobs stay those of the model's own distribution
            logits = logits.float()
            if any(s.params.has_penalties for s in seqs):
                logits = self._penalize(logits, seqs)
            logits = _add_logit_bias(logits, seqs)
        return SamplingBatch.of(seqs, self.device).sample(logits, raw)

    def _penalize(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """Presence/frequency/repetition penalties on the rows whose params ask for them; the
        other rows get neutral values and no token statistics, so they are left bit-identical."""
        on = [s.params.has_penalties for s in seqs]
        prompts = [s.token_ids[: s.num_prompt] if o else [] for s, o in zip(seqs, on, strict=True)]
        outputs = [s.output_ids if o else [] for s, o in zip(seqs, on, strict=True)]
        prompt_mask, output_counts = token_stats(prompts, outputs, logits.shape[-1], self.device)
        ps = [s.params for s in seqs]
        pen = torch.tensor([[p.presence_penalty for p in ps], [p.frequency_penalty for p in ps],
                            [p.repetition_penalty for p in ps]], dtype=torch.float32)
        pen = to_device(pen, self.device)
        return apply_penalties(logits, prompt_mask, output_counts, pen[0], pen[1], pen[2])


def _check_kv_dtype(kv_dtype: str, head_dim: int, device: torch.device) -> None:
    """ValueError (a start-up message) where --kv-cache-dtype cannot run."""
    if kv_dtype == "int8" and head_dim % KV_GROUP:
        raise ValueError(f"--kv-cache-dtype int8 needs head_dim a multiple of {KV_GROUP}")
    if kv_dtype == "fp8" and device.type == "cuda" and \
            torch.cuda.get_device_capability(device) < (8, 9):
        raise ValueError(f"--kv-cache-dtype fp8 needs FP8 conversions (compute capability 8.9+: "
                         f"Ada, Hopper); {torch.cuda.get_device_name(device)} has "
                         f"{torch.cuda.get_device_capability(device)}: use int8")


def _add_logit_bias(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """logits [S, vocab] float, plus each row's logit_bias (one scatter for the whole step)."""
    cells = [(row, t, b) for row, s in enumerate(seqs) for t, b in s.params.logit_bias]
    if not cells:
        return logits
    rows, ids, biases = zip(*cells, strict=True)
    index = torch.tensor([rows, ids], dtype=torch.int64).to(logits.device, non_blocking=True)
    values = torch.tensor(biases, dtype=logits.dtype).to(logits.device, non_blocking=True)
    return logits.index_put((index[0], index[1]), values, accumulate=True)


def _suppress_stop_tokens(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """min_tokens: a request may not stop before it has generated that many tokens."""
    for row, s in enumerate(seqs):
        if s.num_output < s.params.min_tokens and s.stop_ids:
            logits[row, list(s.stop_ids)] = float("-inf")


def _top_k(logprobs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, values) [R, k] of the k most likely tokens of each row of `logprobs` [R, vocab],
    best first, copied to the host without waiting."""
    values, ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], logprobs[:, :0].long())
    return to_host(ids), to_host(values)


def _top_rows(logits: torch.Tensor, ks: list[int]) -> TopRows | None:
    """The ks[i] most likely tokens of the rows i of `logits` [S, vocab] where ks[i] > 0."""
    rows = [i for i, k in enumerate(ks) if k]
    if not rows:
        return None
    ids, values = _top_k(logits[rows].float().log_softmax(-1), max(ks))
    return TopRows(rows, [ks[i] for i in rows], ids, values)


def _prompt_rows(logits: torch.Tensor, spans: list[tuple[Sequence, int, int]]) -> PromptRows:
    """logits [R, vocab]: the rows before the prompt tokens of `spans` (see ForwardBatch)."""
    targets = [t for seq, start, n in spans for t in seq.token_ids[start : start + n]]
    logprobs = logits.float().log_softmax(-1)  # [R, vocab]
    index = to_device(torch.tensor(targets, dtype=torch.int64)[:, None], logits.device)
    ids, values = _top_k(logprobs, max(seq.params.prompt_logprobs for seq, _, _ in spans))
    return PromptRows(spans, to_host(logprobs.gather(1, index)[:, 0]), ids, values)
