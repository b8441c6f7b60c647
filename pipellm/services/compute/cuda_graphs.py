"""CUDA graphs of decode-only steps (nano-vllm's `capture_cudagraph`, mini-sglang's
`engine/graph.py`): the whole forward of a batch of B decode tokens is captured once per B in
GRAPH_SIZES, and a step of n <= max(B) decodes replays the smallest B >= n, its inputs copied
into the graph's static buffers and the rows past n padded. Mixed and prefill steps run eagerly.

Padding rows write their K/V into `pad_slot` (one KV row no request ever owns) and attend over
that row alone, so they change nothing a request reads. The decode attention's grid is sized at
capture for `max_seq_len` (the context length), or for a sliding-window layer its window: the
splits past a sequence's length are empty. The windows are Python ints fixed per layer
(`LlamaModel.windows`, Triton constants), so each layer's captured launch keeps its own.
`--enforce-eager` (vLLM's flag) turns graphs off.
"""

from __future__ import annotations

import logging

import torch

from pipellm.services.compute.core.batch import ForwardBatch

log = logging.getLogger(__name__)
# vLLM's capture sizes stop at 512 too: larger decode steps run eagerly, their launches hidden
# behind the long step, and each graph keeps its own [B, vocab] logits
GRAPH_SIZES = (1, 2, 4, 8, *range(16, 257, 16), *range(288, 513, 32))


class DecodeGraphs:
    """Graphs of `model.forward_hidden` for decode batches up to `max_batch` rows, at most
    GRAPH_SIZES[-1] (GPU only)."""

    def __init__(self, model, kv, max_batch: int, max_seq_len: int, pad_slot: int):
        self.model, self.kv, self.pad_slot = model, kv, pad_slot
        max_batch = min(max_batch, GRAPH_SIZES[-1])
        self.sizes = [b for b in GRAPH_SIZES if b < max_batch] + [max_batch]
        n, dev = self.sizes[-1], kv.k.device
        self.max_seq_len = max_seq_len
        # static inputs: [n] each; a replay of size b reads rows [:b]
        self.ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.slots = torch.full((n,), pad_slot, dtype=torch.int64, device=dev)
        self.rows = torch.arange(n, dtype=torch.int64, device=dev)
        self.starts = torch.full((n,), pad_slot, dtype=torch.int32, device=dev)
        self.lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # the outputs replays write: logits [b, vocab] float32, hidden states [b, hidden]
        self.outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._capture()

    def _batch(self, b: int) -> ForwardBatch:
        empty = self.starts[:0]
        return ForwardBatch(
            input_ids=self.ids[:b], positions=self.positions[:b], slots=self.slots[:b],
            logits_indices=self.rows[:b], num_decodes=b, decode_starts=self.starts[:b],
            decode_lens=self.lens[:b], prefill_cu=self.starts[:1] * 0, prefill_starts=empty,
            prefill_lens=empty, max_decode_len=self.max_seq_len, max_chunk_len=0,
            prompt_spans=[])

    @torch.inference_mode()
    def _capture(self) -> None:
        """Largest first, all in one memory pool; warm-up runs on a side stream (Triton
        compiles, the allocator settles), as PyTorch's CUDA graph docs do it."""
        pool = None
        side = torch.cuda.Stream()
        for b in reversed(self.sizes):
            batch = self._batch(b)
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    self.model.forward(batch, self.kv)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[b] = self.model.forward_hidden(batch, self.kv)
            pool = graph.pool()
            self.graphs[b] = graph
        torch.cuda.synchronize()
        log.info("CUDA graphs captured for decode batches %s", self.sizes)

    def fits(self, batch: ForwardBatch) -> bool:
        """Whether `batch` is a decode-only step a graph can run."""
        n = batch.num_decodes
        return 0 < n == batch.input_ids.shape[0] <= self.sizes[-1] and not batch.prompt_spans

    def run(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Replay the smallest graph that holds `batch`; -> (logits [n, vocab], hidden
        [n, hidden]), views of the graph's outputs: valid until the next replay."""
        n = batch.num_decodes
        b = next(s for s in self.sizes if s >= n)
        for static, value in ((self.ids, batch.input_ids), (self.positions, batch.positions),
                              (self.slots, batch.slots), (self.starts, batch.decode_starts),
                              (self.lens, batch.decode_lens)):
            static[:n].copy_(value, non_blocking=True)
        if b > n:  # the padding rows: a token at position 0 in the pad slot
            self.ids[n:b].zero_()
            self.positions[n:b].zero_()
            self.slots[n:b].fill_(self.pad_slot)
            self.starts[n:b].fill_(self.pad_slot)
            self.lens[n:b].fill_(1)
        self.graphs[b].replay()
        logits, hidden = self.outputs[b]
        return logits[:n], hidden[:n]
