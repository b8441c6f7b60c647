"""Which part of the model one tensor-parallel rank holds (Megatron-LM's split).

Rank r of n holds, of every layer: q/k/v's rows of its heads (attention heads
[r H/n, (r+1) H/n), KV heads [r Hkv/n, (r+1) Hkv/n)) and gate/up's rows of its slice of the
intermediate size (column-parallel); o's and down's matching columns (row-parallel: each rank's
output is a partial sum, all-reduced). A mixture of experts' experts are split alike, each
expert's gate/up rows and down columns (tensor-parallel experts: every rank runs every expert
on its slice, the router whole; one all-reduce after the layer). With expert parallelism
(`--enable-expert-parallel`) a rank holds whole experts instead, E / n contiguous ones (experts
[r E/n, (r+1) E/n), as vLLM places them), and no part of the others: it runs its experts on
the tokens routed to them, and the same all-reduce sums the ranks' contributions. Transformers
v5's expert stacks (`mlp.experts.gate_up_proj` [E, 2I, hidden], each expert's gate rows then
its up rows; `mlp.experts.down_proj` [E, hidden, I]) are split alike: of every expert, its gate
rows part then its up rows part [E, 2I / n, hidden] and its down columns [E, hidden, I / n];
with expert parallelism the stacks' block [E / n, ...] only, cut here so that a rank never
holds the others' experts (`moe.expert_weights` takes a stack of the block's length as that
block). Embedding and LM head: its vocabulary rows [r V', (r+1) V') with V' = ceil(V / n), the
last shard padded with zero rows (its padded logits are trimmed after the gather). Norms, the
Qwen3 q/k norms ([head_dim]) and RoPE are whole on every rank; OLMoE's q/k norms over the
whole projection ([H D], [Hkv D]) are split with q's and k's rows (their RMS is all-reduced:
layers.py).

From a Hugging Face directory each rank reads only its part of each split tensor
(`ShardReader`, safetensors' slices); a GGUF file, and Phi-3's fused projections, are read
whole and sliced after loading (each part a copy, so that the whole tensors are freed); the
other ranks' experts are never read (`weights.SKIP`), or dropped after loading. A LoRA
adapter's factors are split with the projections they add to (`shard_factors`).
"""

from __future__ import annotations

import dataclasses
import re

import torch

from pipellm.kernels.int4_weight import Int4Weight
from pipellm.services.compute.model.weights import SKIP
from pipellm.shared.model_config import ModelConfig

# the layer tensors split along their rows (output features) or columns (input features):
# attention, dense MLP, and each expert's (Qwen3-MoE's names, Mixtral's w1/w3 = gate/up, w2)
_ROWS = re.compile(r"model\.layers\.\d+\.(self_attn\.[qkv]_proj|mlp\.(experts\.\d+\.)?(gate|up)"
                   r"_proj|block_sparse_moe\.experts\.\d+\.w[13])\.(weight|bias)$")
_COLUMNS = re.compile(r"model\.layers\.\d+\.(self_attn\.o_proj|mlp\.(experts\.\d+\.)?down_proj"
                      r"|block_sparse_moe\.experts\.\d+\.w2)\.weight$")
_STACKED = re.compile(r"\.experts\.(gate_up_proj|down_proj)$")  # transformers v5's stacks
_VOCAB = ("model.embed_tokens.weight", "lm_head.weight")
_EXPERT = re.compile(r"\.experts\.(\d+)\.")  # one expert's tensor, and its index
_FULL_QK_NORMS = re.compile(r"model\.layers\.\d+\.self_attn\.[qk]_norm\.weight$")  # OLMoE's
# a part of a tensor: tensor[index], or of a list of indexes their parts concatenated along
# dimension 1 (a gate_up stack's gate rows and up rows)
Index = tuple[slice, ...] | list[tuple[slice, ...]]


@dataclasses.dataclass(frozen=True)
class Shard:
    """Rank `rank` of `size` (0 <= rank < size): which slice of each split dimension it holds;
    `expert_parallel`: whole experts, E / size of them, rather than every expert's slice."""

    rank: int
    size: int
    expert_parallel: bool = False

    def part(self, total: int) -> slice:
        """This rank's slice of a dimension of `total` that `size` divides."""
        per = total // self.size
        return slice(self.rank * per, (self.rank + 1) * per)

    def vocab_rows(self, vocab: int) -> tuple[int, int]:
        """(first row, rows per rank) of a vocabulary of `vocab` rows: ceil(vocab / size) each,
        the last rank's padded."""
        per = -(-vocab // self.size)
        return self.rank * per, per

    def experts(self, total: int) -> range | None:
        """The experts this rank holds whole, of `total` that `size` divides: its contiguous
        block with expert parallelism; None without (a slice of every expert) or without
        experts (`total` 0: a dense model)."""
        if not self.expert_parallel or not total:
            return None
        part = self.part(total)
        return range(part.start, part.stop)


def check(cfg: ModelConfig, size: int, expert_parallel: bool = False) -> None:
    """ValueError, one line, where `size` ranks cannot split this model (`expert_parallel`:
    its experts whole, E / size a rank)."""
    dims = [("attention heads", cfg.num_heads), ("KV heads", cfg.num_kv_heads)]
    if _has_dense_mlp(cfg):
        dims.append(("intermediate size", cfg.intermediate_size))
    if cfg.num_experts:
        dims.append(("experts", cfg.num_experts) if expert_parallel else
                    ("experts' intermediate size", cfg.moe_intermediate_size))
    for what, n in dims:
        if n % size:
            flag = "--enable-expert-parallel with " if what == "experts" else ""
            raise ValueError(f"{flag}--tensor-parallel-size {size} does not divide the model's "
                             f"{n} {what}")


def local_config(cfg: ModelConfig, shard: Shard) -> ModelConfig:
    """The config of one rank's slice: its heads, KV heads and intermediate sizes (the
    experts' whole with expert parallelism)."""
    size = shard.size
    experts = 1 if shard.experts(cfg.num_experts) is not None else size  # their split
    dense = size if _has_dense_mlp(cfg) else experts  # Mixtral's, OLMoE's: the experts' size
    return dataclasses.replace(
        cfg, num_heads=cfg.num_heads // size, num_kv_heads=cfg.num_kv_heads // size,
        intermediate_size=cfg.intermediate_size // dense,
        moe_intermediate_size=cfg.moe_intermediate_size // experts)


def _has_dense_mlp(cfg: ModelConfig) -> bool:
    """Whether a layer of the model has a dense MLP (of intermediate_size): every layer of a
    dense model, Qwen3-MoE's dense layers; Mixtral's and OLMoE's experts are all."""
    return not all(cfg.is_moe_layer(i) for i in range(cfg.num_layers))


def holds(cfg: ModelConfig, name: str, shard: Shard) -> bool:
    """Whether rank `shard.rank` holds any of tensor `name`: all but the other ranks'
    experts under expert parallelism."""
    mine = shard.experts(cfg.num_experts)
    expert = _EXPERT.search(name) if mine is not None else None
    return expert is None or int(expert.group(1)) in mine


def shard_weights(cfg: ModelConfig, weights: dict[str, torch.Tensor], shard: Shard,
                  done: frozenset[str] | set[str] = frozenset()) -> dict[str, torch.Tensor]:
    """The tensors rank `shard.rank` holds, under the same names (see the module docstring);
    the others as they are, the other ranks' experts dropped. `weights`: the loader's, Llama's
    names and layout, whole but for the names in `done` (read as the rank's part already:
    `ShardReader`)."""
    out = {}
    for name, t in weights.items():
        if not holds(cfg, name, shard):
            continue
        part = None if name in done else part_of(cfg, name, tuple(t.shape), shard)
        out[name] = t if part is None else _cut(t, *part)
    return out


class ShardReader:
    """The loader's `take` hook (model/weights.load_weights): reads only the rank's part of
    each split tensor from a safetensors file, and remembers the names it read so, with their
    whole shapes (`taken`), for `shard_weights` to leave. Phi-3's fused projections are read
    whole (their parts are not one slice) and split after loading."""

    def __init__(self, cfg: ModelConfig, shard: Shard):
        self.cfg, self.shard = cfg, shard
        self.taken: dict[str, tuple[int, ...]] = {}

    def take(self, name: str, tensor) -> torch.Tensor | object | None:
        """The rank's part of `tensor` (a safetensors slice: `get_shape()`, indexing), None
        for a tensor it holds whole, SKIP for one it holds none of (another rank's expert)."""
        if not holds(self.cfg, name, self.shard):
            return SKIP
        shape = tuple(tensor.get_shape())
        part = part_of(self.cfg, name, shape, self.shard)
        if part is None:
            return None
        self.taken[name] = shape
        return _cut(tensor, *part)


def part_of(cfg: ModelConfig, name: str, shape: tuple[int, ...], shard: Shard
            ) -> tuple[Index, int] | None:
    """(index, rows): the rank's part of tensor `name` of `shape` is its `index` part (see
    Index), padded with zero rows to `rows` (the last vocabulary shard); None for a tensor the
    rank holds whole (a whole expert's under expert parallelism: see `holds` for the others')."""
    mine = shard.experts(cfg.num_experts)
    if mine is not None and _EXPERT.search(name):
        return None
    stack = _STACKED.search(name)
    if stack:
        return _stack_part(stack.group(1), shape, shard, mine)
    if _ROWS.search(name) or (cfg.qk_norm_full and _FULL_QK_NORMS.search(name)):
        rows = _row_part(cfg, name, shape[0], shard)
        return (rows,), rows.stop - rows.start
    if _COLUMNS.search(name):
        return (slice(None), shard.part(shape[1])), shape[0]
    if name in _VOCAB:
        start, per = shard.vocab_rows(shape[0])
        return (slice(start, start + per),), per
    return None


def _stack_part(which: str, shape: tuple[int, ...], shard: Shard, mine: range | None
                ) -> tuple[Index, int]:
    """The rank's part of transformers v5's expert stack `which` (gate_up_proj, down_proj) of
    `shape` [E, rows, cols]: its block `mine` of whole experts; else, of every expert, down's
    columns, or gate_up's gate rows part then its up rows part (`Shard.part` of each half, as of
    a per-expert gate_proj and up_proj)."""
    if mine is not None:
        return (slice(mine.start, mine.stop),), len(mine)
    if which == "down_proj":
        return (slice(None), slice(None), shard.part(shape[2])), shape[0]
    half = shape[1] // 2
    gate = shard.part(half)
    return [(slice(None), gate), (slice(None), slice(half + gate.start, half + gate.stop))], \
        shape[0]


def shard_factors(factors: dict[tuple[int, str], dict[str, torch.Tensor]], shard: Shard
                  ) -> dict[tuple[int, str], dict[str, torch.Tensor]]:
    """A LoRA adapter's factors ({(layer, PEFT module): {"A": [r, in], "B": [out, r]}}) as
    rank `shard.rank` applies them: B's rows of a column-parallel projection's (q/k/v,
    gate/up: its rows' outputs), A's columns of a row-parallel one's (o, down: its input
    slice, the delta a partial sum all-reduced with the layer's)."""
    out = {}
    for (layer, name), f in factors.items():
        if name in ("o_proj", "down_proj"):
            f = {"A": f["A"][:, shard.part(f["A"].shape[1])], "B": f["B"]}
        else:
            f = {"A": f["A"], "B": f["B"][shard.part(f["B"].shape[0])]}
        out[layer, name] = f
    return out


def _cut(tensor, index: Index, rows: int) -> torch.Tensor | Int4Weight:
    """The `index` part of `tensor` (see Index) as a tensor of its own (not a view keeping the
    whole one alive), padded with zero rows to `rows`; of INT4 blocks (a GGUF file's, kept;
    never a stack), the blocks' part."""
    if isinstance(tensor, Int4Weight):
        return _int4_part(tensor, index)
    if isinstance(index, list):
        return torch.cat([tensor[i] for i in index], dim=1)
    t = tensor[index].clone(memory_format=torch.contiguous_format)
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


def _row_part(cfg: ModelConfig, name: str, rows: int, shard: Shard) -> slice:
    """The rank's rows of a column-parallel tensor: whole heads of q, k, v; a slice of the
    intermediate size of gate, up."""
    heads = {"q_proj": cfg.num_heads, "k_proj": cfg.num_kv_heads, "v_proj": cfg.num_kv_heads}
    n = next((h for proj, h in heads.items() if f".{proj}." in name), None)
    if n is not None and rows != n * cfg.head_dim:
        raise ValueError(f"tensor '{name}' has {rows} rows; {n} heads of {cfg.head_dim} make "
                         f"{n * cfg.head_dim}")
    return shard.part(rows)


def _int4_part(w: Int4Weight, index: tuple[slice, ...]) -> Int4Weight:
    """Rows, or whole groups of columns, of INT4 blocks (values packed in pairs along a row,
    a scale and a min per group): `check_int4` makes a rank's columns whole groups."""
    rows = index[0]
    if len(index) == 1:
        return Int4Weight(*(t[rows].clone() for t in (w.packed, w.scales, w.mins)),
                          w.group_size)
    cols, g = index[1], w.group_size
    assert cols.start % g == 0 and cols.stop % g == 0, (cols, g)
    return Int4Weight(w.packed[:, cols.start // 2 : cols.stop // 2].clone(),
                      *(t[:, cols.start // g : cols.stop // g].clone()
                        for t in (w.scales, w.mins)), g)


def check_int4(cfg: ModelConfig, shard: Shard, group: int) -> None:
    """ValueError, one line, where a rank's part of a row-parallel layer's input (o's heads,
    down's intermediate slice, an expert's down) is not whole INT4 groups of `group` columns."""
    local = local_config(cfg, shard)
    for what, cols in (("attention heads' width", local.num_heads * cfg.head_dim),
                       ("intermediate size", local.intermediate_size),
                       ("experts' intermediate size", local.moe_intermediate_size)):
        if cols % group:
            raise ValueError(f"--tensor-parallel-size {shard.size} with INT4 weights: a rank's "
                             f"{cols} columns of the model's {what} are not whole groups of "
                             f"{group}")
