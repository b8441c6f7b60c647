"""One tensor-parallel rank's decoder: `LlamaModel` over the rank's shard of the weights
(`shard.py`), with its config's heads, KV heads and intermediate size those of the shard, and
the layers that cross ranks (`layers.py`) in place of o, down, the embedding and the LM head.

Everything else in the forward runs as on one process: the attention of the rank's heads over
its own KV cache (the same slots on every rank, its heads only), the norms and the residual
stream, which are whole and identical on every rank after each all-reduce. With expert
parallelism each sparse layer holds the rank's block of whole experts (`MoE`'s `experts`).
"""

from __future__ import annotations

import torch

from services.compute.model.arch import FullQKNorm
from services.compute.model.llama import LlamaModel
from services.compute.model.quantization import Quantization
from services.compute.model.weights import load_weights
from services.compute.tp.layers import GatheredHead, ParallelQKNorm, RowParallel, VocabEmbedding
from services.compute.tp.shard import Shard, ShardReader, local_config, shard_weights
from shared.model_config import ModelConfig


class ParallelLlama(LlamaModel):
    """`LlamaModel` of rank `shard.rank`, built from the loader's `weights` (the rank's parts
    kept); `forward` returns the whole logits on rank 0 only."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor],
                 device: torch.device, max_positions: int, quant: Quantization, shard: Shard,
                 read: ShardReader | None = None):
        """`weights`: the checkpoint's, whole but for those `read` read as the rank's part."""
        vocab = _vocab(weights, "model.embed_tokens.weight", read)
        head_vocab = vocab if "lm_head.weight" not in weights else \
            _vocab(weights, "lm_head.weight", read)
        done = frozenset() if read is None else frozenset(read.taken)
        super().__init__(local_config(cfg, shard), shard_weights(cfg, weights, shard, done),
                         device, max_positions, quant, shard.experts(cfg.num_experts))
        self.vocab_embed = VocabEmbedding(self.embed, shard.vocab_rows(vocab)[0])
        if self.lm_head is not None:
            self.lm_head = GatheredHead(self.lm_head, head_vocab)
        for layer in self.layers:  # the MLP: dense, or a mixture of experts (tp or ep)
            if isinstance(layer.qkv, FullQKNorm):
                layer.qkv = ParallelQKNorm(layer.qkv, shard.size)
            layer.o = RowParallel(layer.o)
            if layer.moe is None:
                layer.down = RowParallel(layer.down)
            else:
                layer.moe = RowParallel(layer.moe)

    def _embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        return self.vocab_embed(ids)


def load_parallel(config, model_config: ModelConfig, device: torch.device, dtype: torch.dtype,
                  quant: Quantization, max_positions: int, ranks) -> ParallelLlama:
    """Rank `ranks.shard.rank`'s model, its parts of a Hugging Face checkpoint read alone (a
    GGUF file's sliced after reading, Q4 blocks kept as they are under int4), quantized as
    on one rank after the split. ValueError (one line) for w8a8 and fp8, not split yet (their
    per-channel scales and SmoothQuant's calibration span a row-parallel layer's ranks)."""
    if quant.name not in ("none", "int4"):
        raise ValueError(f"--tensor-parallel-size {ranks.shard.size} runs dense or int4 "
                         f"weights: --quantization {quant.name} is not split yet")
    read = ShardReader(model_config, ranks.shard)
    weights = load_weights(config.model, dtype, device, keep_int4=quant.keeps_gguf_blocks,
                           take=read.take)
    return ParallelLlama(model_config, weights, device, max_positions, quant, ranks.shard, read)


def _vocab(weights: dict[str, torch.Tensor], name: str, read: ShardReader | None) -> int:
    """The vocabulary rows of embedding or LM head `name`: whole, or as read by `read`."""
    if read is None or name not in read.taken:
        return weights[name].shape[0]
    return read.taken[name][0]
