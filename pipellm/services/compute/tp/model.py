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
import torch.distributed as dist

from pipellm.services.compute.lora.attach import attach_adapters
from pipellm.services.compute.model import smoothing
from pipellm.services.compute.model.arch import FullQKNorm
from pipellm.services.compute.model.linear.lora import LoraLinear
from pipellm.services.compute.model.llama import LlamaModel
from pipellm.services.compute.model.moe import MoE, expert_names
from pipellm.services.compute.model.quantization import Quantization
from pipellm.services.compute.model.weights import load_weights
from pipellm.services.compute.pooling.scoring import yes_no_rows
from pipellm.services.compute.tp.layers import (
    GatheredHead,
    ParallelQKNorm,
    RowParallel,
    VocabEmbedding,
    vocab_rows,
)
from pipellm.services.compute.tp.quantized import (
    SCALED,
    ScaledSlice,
    int8_activation,
    replicated_max,
)
from pipellm.services.compute.tp.shard import (
    Shard,
    ShardReader,
    local_config,
    shard_factors,
    shard_weights,
)
from pipellm.shared.lora import parse_lora_modules
from pipellm.shared.model_config import ModelConfig
from pipellm.shared.scoring import ScoringConfig


class ParallelLlama(LlamaModel):
    """`LlamaModel` of rank `shard.rank`, built from `weights`, the rank's parts
    (`shard_weights`), and `vocab`: the whole embedding's and LM head's rows; `forward`
    returns the whole logits on rank 0 only. `lora`: o and down are LoraLinear layers (their
    adapters' deltas partial sums, all-reduced with the base's)."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor],
                 device: torch.device, max_positions: int, quant: Quantization, shard: Shard,
                 vocab: tuple[int, int], lora: bool = False):
        super().__init__(local_config(cfg, shard), weights, device, max_positions, quant,
                         shard.experts(cfg.num_experts))
        self.shard = shard
        row = (lambda linear: LoraLinear(linear, reduce=dist.all_reduce)) if lora else \
            RowParallel
        self.vocab_embed = VocabEmbedding(self.embed, shard.vocab_rows(vocab[0])[0])
        if self.lm_head is not None:
            self.lm_head = GatheredHead(self.lm_head, vocab[1])
        scaled = quant.name in SCALED  # o and down quantized with the whole rows' scales
        if scaled and self.int8_act:
            self.act = int8_activation(cfg.hidden_act)
        for i, layer in enumerate(self.layers):  # the MLP: dense, or a mixture of experts
            p = f"model.layers.{i}."
            if isinstance(layer.qkv, FullQKNorm):
                layer.qkv = ParallelQKNorm(layer.qkv, shard.size)
            layer.o = row(ScaledSlice(quant.name, weights[f"{p}self_attn.o_proj.weight"])
                          if scaled else layer.o)
            if layer.moe is not None:
                if scaled and layer.moe.held is None:  # experts split: down's scales whole
                    _scale_experts(layer.moe, self.cfg, weights, i, quant.name)
                layer.moe = RowParallel(layer.moe)
            else:
                layer.down = row(ScaledSlice(quant.name, weights[f"{p}mlp.down_proj.weight"])
                                 if scaled else layer.down)

    def own_factors(self, factors: dict) -> dict:
        return shard_factors(factors, self.shard)

    def _embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        return self.vocab_embed(ids)


def load_parallel(config, model_config: ModelConfig, device: torch.device, dtype: torch.dtype,
                  quant: Quantization, max_positions: int, ranks) -> ParallelLlama:
    """Rank `ranks.shard.rank`'s model, its parts of a Hugging Face checkpoint read alone (a
    GGUF file's sliced after reading, Q4 blocks kept as they are under int4), quantized after
    the split (W8A8's and FP8's row-parallel layers with the whole rows' scales, W8A8's
    weights smoothed first: quantized.py), with its slices of the --lora-modules adapters."""
    shard = ranks.shard
    read = ShardReader(model_config, shard)
    whole = load_weights(config.model, dtype, device, keep_int4=quant.keeps_gguf_blocks,
                         take=read.take)
    embed = _vocab(whole, "model.embed_tokens.weight", read)
    vocab = (embed, embed if "lm_head.weight" not in whole else
             _vocab(whole, "lm_head.weight", read))
    weights = shard_weights(model_config, whole, shard, frozenset(read.taken))
    del whole
    if config.pooling:  # a yes/no reranker's score rows, from every rank's part of the head
        start = shard.vocab_rows(vocab[1])[0]
        yes_no_rows(ScoringConfig.from_dir(config.model, config.hf_overrides, config.convert),
                    config.model, weights, lambda head, ids: vocab_rows(head, start, vocab[1], ids))

    def float_model(w: dict[str, torch.Tensor], positions: int) -> ParallelLlama:
        """The rank's float model, which SmoothQuant calibrates on."""
        return ParallelLlama(model_config, w, device, positions, Quantization(), shard, vocab)

    scales = smoothing.smooth(model_config, weights, device, float_model, replicated_max) \
        if quant.int8_activations else None
    model = ParallelLlama(model_config, weights, device, max_positions, quant, shard, vocab,
                          config.enable_lora)
    model.smoothing = scales
    if config.enable_lora:
        attach_adapters(model, parse_lora_modules(config.lora_modules), config.max_lora_rank)
    return model


def _scale_experts(moe: MoE, cfg: ModelConfig, weights: dict[str, torch.Tensor], layer: int,
                   name: str) -> None:
    """`moe`'s experts, split across the ranks under method `name` (W8A8, FP8): each one's
    down over the rank's columns with the whole rows' scales, its output a partial sum; from
    the per-expert tensors, or transformers v5's down stack [E, hidden, I / n]."""
    stack = weights.get(f"model.layers.{layer}.mlp.experts.down_proj")
    downs = list(stack.unbind(0)) if stack is not None else \
        [weights[d] for _, _, d in expert_names(cfg, layer)[1]]
    moe.experts = [(gate_up, ScaledSlice(name, d))
                   for (gate_up, _), d in zip(moe.experts, downs, strict=True)]


def _vocab(weights: dict[str, torch.Tensor], name: str, read: ShardReader) -> int:
    """The vocabulary rows of embedding or LM head `name`: whole, or as read by `read`."""
    if name not in read.taken:
        return weights[name].shape[0]
    return read.taken[name][0]
