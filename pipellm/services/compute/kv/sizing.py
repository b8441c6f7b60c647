"""How many KV slots the cache gets: `--kv-cache-tokens` if given; on a CPU, `--kv-cache-gib`;
on a GPU, what `--gpu-memory-utilization` of its memory leaves after the weights and the peak
of a profiling forward pass of the largest step (vLLM's way): one prefill chunk of
max_batched_tokens tokens, logits for max_running rows, over a scratch cache of that size.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from pipellm.services.compute.core.batch import ForwardBatch
from pipellm.services.compute.kv.kv_cache import KVCache

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GpuBudget:
    total: int  # bytes of device memory
    peak: int  # torch's peak allocation in the profiling pass (weights included)
    non_torch: int  # held outside torch's allocator (CUDA context, cuBLAS workspaces)
    kv: int  # what the KV cache may take

    def describe(self) -> str:
        g = 2**30
        return (f"{self.total / g:.1f} GiB device, {self.peak / g:.2f} GiB peak of a profiled "
                f"step (weights included), {self.non_torch / g:.2f} GiB outside torch: "
                f"{self.kv / g:.2f} GiB for the KV cache")


def profile_batch(tokens: int, rows: int, device: torch.device) -> ForwardBatch:
    """One prefill chunk of `tokens` tokens (ids 0) in slots [0, tokens), logits for the last
    `rows` of them."""
    ar = torch.arange(tokens, device=device)
    i32 = torch.tensor([0, tokens], dtype=torch.int32, device=device)
    return ForwardBatch(
        input_ids=torch.zeros(tokens, dtype=torch.int64, device=device), positions=ar,
        slots=ar, logits_indices=ar[tokens - rows :], num_decodes=0,
        decode_starts=i32[:0], decode_lens=i32[:0], prefill_cu=i32, prefill_starts=i32[:1],
        prefill_lens=i32[1:], max_decode_len=0, max_chunk_len=tokens, prompt_spans=[])


@torch.inference_mode()
def gpu_kv_budget(model, kv_shape: dict, tokens: int, rows: int, utilization: float,
                  device: torch.device) -> GpuBudget:
    """Profile one step of `tokens` tokens (at most the context length) and `rows` logits rows;
    kv_shape: KVCache's arguments but capacity."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    scratch = KVCache(capacity=tokens, device=device, **kv_shape)
    model.forward(profile_batch(tokens, min(rows, tokens), device), scratch)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - scratch.nbytes()
    del scratch
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    non_torch = max(total - free - torch.cuda.memory_reserved(device), 0)
    budget = GpuBudget(total, peak, non_torch, int(total * utilization) - peak - non_torch)
    log.info("GPU memory: %s", budget.describe())
    if budget.kv <= 0:
        raise ValueError(f"--gpu-memory-utilization {utilization} leaves no room for a KV cache "
                         f"({budget.describe()}): raise it, or lower --max-num-batched-tokens")
    return budget
