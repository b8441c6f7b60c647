"""The sparse mixture-of-experts MLP (Qwen3-MoE, Mixtral, OLMoE): a float router [E, hidden]
(F.linear, never quantized), softmax in float32, the top k per token (renormalized with
`norm_topk_prob`), each token's output the routing-weighted sum of its k SwiGLU experts'.
The experts run fused (`pipellm/kernels/fused_moe.py`: CUDA, float experts), grouped per expert
(CPU, the quantization method's linear layers) or as transformers' loop (`--kernels reference`).
A layer may hold a contiguous block of the experts only (an expert-parallel rank,
pipellm/services/compute/tp/): it routes every token over all of them and returns the contributions
of its own, the other experts' left to the ranks that hold them (their sum is the output).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pipellm.kernels import silu_mul
from pipellm.kernels.dispatch import backend, use_triton
from pipellm.kernels.fused_moe import fused_moe
from pipellm.services.compute.model.arch import fuse
from pipellm.services.compute.model.quantization import Quantization
from pipellm.services.compute.model.weights import require
from pipellm.shared.model_config import ModelConfig
from pipellm.shared.model_config_moe import MIXTRAL

# Per architecture: the MLP's module name, the router's, and each expert's gate, up, down.
_MIXTRAL_NAMES = ("block_sparse_moe", "gate", ("w1", "w3", "w2"))
_QWEN_NAMES = ("mlp", "gate", ("gate_proj", "up_proj", "down_proj"))


def expert_names(cfg: ModelConfig, layer: int) -> tuple[str, list[tuple[str, str, str]]]:
    """(router weight name, [(gate, up, down) weight names] per expert) of a sparse layer, in
    the checkpoint's Hugging Face names (a GGUF file's stacked experts are split to these)."""
    module, router, parts = _MIXTRAL_NAMES if cfg.architecture == MIXTRAL else _QWEN_NAMES
    p = f"model.layers.{layer}.{module}."
    experts = [tuple(f"{p}experts.{e}.{n}.weight" for n in parts)
               for e in range(cfg.num_experts)]
    return f"{p}{router}.weight", experts


def mlp_layers(cfg: ModelConfig, weights: dict, layer: int, quant: Quantization,
               experts: range | None = None) -> dict:
    """LayerWeights' MLP fields of layer `layer`: `moe` for a sparse layer (gate_up, down
    None; `experts`: those it holds, None: all), else the dense gate_up [2 * inter, hidden]
    and down [hidden, inter] projections."""
    if cfg.is_moe_layer(layer):
        return dict(gate_up=None, down=None, moe=MoE(cfg, weights, layer, quant, experts))
    p = f"model.layers.{layer}.mlp."
    gate_up = fuse([require(weights, f"{p}{n}_proj.weight") for n in ("gate", "up")])
    return dict(gate_up=quant.linear(gate_up),
                down=quant.linear(require(weights, f"{p}down_proj.weight")), moe=None)


def expert_weights(cfg: ModelConfig, weights: dict, layer: int, experts: range
                   ) -> tuple[torch.Tensor, list, list]:
    """(router [E, hidden], gate_up [2I, hidden] per expert, down [hidden, I] per expert of
    `experts`) of a sparse layer: from the per-expert tensors of a checkpoint, or from
    transformers v5's in-memory stacks (`mlp.experts.gate_up_proj` [E, 2I, hidden],
    `mlp.experts.down_proj` [E, hidden, I]) where a checkpoint holds those: stacks of all E
    experts, or of the block `experts` alone (an expert-parallel rank's, cut by tp/shard.py)."""
    stacked = f"model.layers.{layer}.mlp.experts."
    if f"{stacked}gate_up_proj" in weights:
        router = require(weights, f"model.layers.{layer}.mlp.gate.weight")
        stacks = weights[f"{stacked}gate_up_proj"], require(weights, f"{stacked}down_proj")
        return router, *(list(_block(t, experts).unbind(0)) for t in stacks)
    router, names = expert_names(cfg, layer)
    names = names[experts.start:experts.stop]
    gate_up = [fuse([require(weights, g), require(weights, u)]) for g, u, _ in names]
    return require(weights, router), gate_up, [require(weights, d) for _, _, d in names]


def _block(stack: torch.Tensor, experts: range) -> torch.Tensor:
    """Experts `experts` of `stack`: the stack itself where it holds that many (those alone, or
    all E), else its rows `experts` (a stack of all E)."""
    return stack if len(stack) == len(experts) else stack[experts.start:experts.stop]


def route(x: torch.Tensor, router: torch.Tensor, top_k: int, renormalize: bool
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, hidden] -> (weights [T, k] float32, ids [T, k] int64): transformers' top-k router
    (softmax in float32 over all experts, top k, divided by their sum when `renormalize`)."""
    probs = torch.softmax(F.linear(x, router), dim=-1, dtype=torch.float32)  # [T, E]
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class MoE:
    """One layer's sparse MLP: `moe(x)`, x [T, hidden] float -> [T, hidden] in x's dtype, the
    sum over the experts it holds (all, or on an expert-parallel rank the block `held`) of
    each token's routing-weighted outputs."""

    def __init__(self, cfg: ModelConfig, weights: dict, layer: int, quant: Quantization,
                 experts: range | None = None):
        # the experts held: None for all E, else a block of them (an expert-parallel rank)
        self.held = None if experts is None or len(experts) == cfg.num_experts else experts
        self.router, gate_up, down = expert_weights(cfg, weights, layer,
                                                    self.held or range(cfg.num_experts))
        self.top_k, self.renormalize = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.w13 = self.w2 = self.experts = None
        fused = quant.name == "none" and self.held is None
        if fused and use_triton(self.router):  # the fused kernel: float stacks of all E
            self.w13, self.w2 = torch.stack(gate_up), torch.stack(down)  # [E, 2I, h], [E, h, I]
        else:  # per expert (gate_up [2I, hidden], down [hidden, I]) linear layers
            self.experts = [(quant.linear(gu), quant.linear(d))
                            for gu, d in zip(gate_up, down, strict=True)]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(x, self.router, self.top_k, self.renormalize)
        if self.w13 is not None:
            return fused_moe(x, self.w13, self.w2, weights, ids)
        if backend() == "reference":
            return experts_loop(x, weights, ids, self.experts, self.held)
        return experts_grouped(x, weights, ids, self.experts, self.held)

    def nbytes(self) -> int:
        """Bytes of the router and the experts as served."""
        tensors = [self.router] + ([self.w13, self.w2] if self.w13 is not None else [])
        experts = sum(layer.nbytes() for pair in self.experts or () for layer in pair)
        return experts + sum(t.numel() * t.element_size() for t in tensors)


def experts_loop(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                 experts: list, held: range | None = None) -> torch.Tensor:
    """Reference: transformers' loop. For each expert (`experts`: those `held` names, None:
    all, from 0), the tokens that chose it, their SwiGLU output times the routing weight,
    added in ascending expert order."""
    out = torch.zeros_like(x)
    for e, (gate_up, down) in zip(held or range(len(experts)), experts, strict=True):
        tok, slot = torch.where(ids == e)  # [n] each
        if tok.numel() == 0:
            continue
        y = down(silu_mul(gate_up(x[tok]))) * weights[tok, slot, None]
        out.index_add_(0, tok, y.to(out.dtype))
    return out


def experts_grouped(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                    experts: list, held: range | None = None) -> torch.Tensor:
    """The CPU path: the (token, slot) pairs sorted by expert (stable, so each token's
    contributions still add in ascending expert order, as in `experts_loop`), the tokens
    gathered once, one GEMM pair per expert on its contiguous run, one scatter-add back.
    `experts`: those `held` names (None: all, from 0); the pairs routed to others are left
    out."""
    k = ids.shape[1]
    flat, pairs = ids.reshape(-1), None  # [T * k] the expert of pair p = t * k + j
    if held is not None:  # an expert-parallel rank: the pairs routed to its experts only
        pairs = torch.nonzero((flat >= held.start) & (flat < held.stop)).squeeze(1)  # [P]
        flat = flat[pairs] - held.start
    order = torch.argsort(flat, stable=True)  # [P] pairs grouped by expert
    counts = torch.bincount(flat, minlength=len(experts)).tolist()  # host sync: CPU path
    if pairs is not None:
        order = pairs[order]  # as indices t * k + j again
    tokens = order // k  # [P] the token of each sorted pair
    xs = x[tokens]  # [P, hidden] rows in expert order
    outs, start = [], 0
    for (gate_up, down), n in zip(experts, counts, strict=True):
        if n:
            outs.append(down(silu_mul(gate_up(xs[start:start + n]))))  # [n, hidden]
            start += n
    if not outs:
        return torch.zeros_like(x)
    y = torch.cat(outs) * weights.reshape(-1)[order, None]  # [P, hidden] float32
    return torch.zeros_like(x).index_add_(0, tokens, y.to(x.dtype))
