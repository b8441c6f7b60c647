"""Which part of the model one tensor-parallel rank holds (Megatron-LM's split).

Rank r of n holds, of every layer: q/k/v's rows of its heads (attention heads
[r H/n, (r+1) H/n), KV heads [r Hkv/n, (r+1) Hkv/n)) and gate/up's rows of its slice of the
intermediate size (column-parallel); o's and down's matching columns (row-parallel: each rank's
output is a partial sum, all-reduced). Embedding and LM head: its vocabulary rows [r V', (r+1) V')
with V' = ceil(V / n), the last shard padded with zero rows (its padded logits are trimmed after
the gather). Norms, the Qwen3 q/k norms ([head_dim]) and RoPE are whole on every rank.

The checkpoint is read whole and sliced after loading (each shard a copy, so that the whole
tensors are freed); loading only a rank's shard is a later step.
"""

from __future__ import annotations

import dataclasses
import re

import torch

from shared.model_config import ModelConfig

# the layer tensors split along their rows (output features) or columns (input features)
_ROWS = re.compile(
    r"model\.layers\.\d+\.(self_attn\.[qkv]_proj|mlp\.(gate|up)_proj)\.(weight|bias)$")
_COLUMNS = re.compile(r"model\.layers\.\d+\.(self_attn\.o_proj|mlp\.down_proj)\.weight$")
_VOCAB = ("model.embed_tokens.weight", "lm_head.weight")


@dataclasses.dataclass(frozen=True)
class Shard:
    """Rank `rank` of `size` (0 <= rank < size): which slice of each split dimension it holds."""

    rank: int
    size: int

    def part(self, total: int) -> slice:
        """This rank's slice of a dimension of `total` that `size` divides."""
        per = total // self.size
        return slice(self.rank * per, (self.rank + 1) * per)

    def vocab_rows(self, vocab: int) -> tuple[int, int]:
        """(first row, rows per rank) of a vocabulary of `vocab` rows: ceil(vocab / size) each,
        the last rank's padded."""
        per = -(-vocab // self.size)
        return self.rank * per, per


def check(cfg: ModelConfig, size: int) -> None:
    """ValueError, one line, where `size` ranks cannot split this model."""
    for what, n in (("attention heads", cfg.num_heads), ("KV heads", cfg.num_kv_heads),
                    ("intermediate size", cfg.intermediate_size)):
        if n % size:
            raise ValueError(f"--tensor-parallel-size {size} does not divide the model's {n} "
                             f"{what}")
    if cfg.num_experts:
        raise ValueError(f"--tensor-parallel-size {size}: mixture-of-experts models are not "
                         "split yet")
    if cfg.qk_norm_full:  # a norm over the whole q and k: across ranks
        raise ValueError(f"--tensor-parallel-size {size}: {cfg.architecture}'s q/k norms span "
                         "every head and are not split yet")


def local_config(cfg: ModelConfig, size: int) -> ModelConfig:
    """The config of one rank's slice: its heads, KV heads and intermediate size."""
    return dataclasses.replace(cfg, num_heads=cfg.num_heads // size,
                               num_kv_heads=cfg.num_kv_heads // size,
                               intermediate_size=cfg.intermediate_size // size)


def shard_weights(cfg: ModelConfig, weights: dict[str, torch.Tensor], shard: Shard
                  ) -> dict[str, torch.Tensor]:
    """The tensors rank `shard.rank` holds, under the same names (see the module docstring);
    the others as they are. `weights`: the loader's, whole, Llama's names and layout."""
    out = {}
    for name, t in weights.items():
        if _ROWS.search(name):
            t = t[_row_part(cfg, name, t.shape[0], shard)].clone()
        elif _COLUMNS.search(name):
            t = t[:, shard.part(t.shape[1])].clone()
        elif name in _VOCAB:
            t = vocab_part(t, shard)
        out[name] = t
    return out


def vocab_part(t: torch.Tensor, shard: Shard) -> torch.Tensor:
    """The rank's vocabulary rows of an embedding or LM head [V, hidden], zero-padded to
    ceil(V / size) rows."""
    start, per = shard.vocab_rows(t.shape[0])
    part = t[start : start + per]
    if part.shape[0] == per:
        return part.clone()
    return torch.cat([part, part.new_zeros(per - part.shape[0], *t.shape[1:])])


def _row_part(cfg: ModelConfig, name: str, rows: int, shard: Shard) -> slice:
    """The rank's rows of a column-parallel tensor: whole heads of q, k, v; a slice of the
    intermediate size of gate, up."""
    heads = {"q_proj": cfg.num_heads, "k_proj": cfg.num_kv_heads, "v_proj": cfg.num_kv_heads}
    n = next((h for proj, h in heads.items() if f".{proj}." in name), None)
    if n is not None and rows != n * cfg.head_dim:
        raise ValueError(f"tensor '{name}' has {rows} rows; {n} heads of {cfg.head_dim} make "
                         f"{n * cfg.head_dim}")
    return shard.part(rows)
