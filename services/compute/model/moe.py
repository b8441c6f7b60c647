"""The sparse mixture-of-experts MLP (Qwen3-MoE, Mixtral, OLMoE): a float router [E, hidden]
(F.linear, never quantized), softmax in float32, the top k per token (renormalized with
`norm_topk_prob`), each token's output the routing-weighted sum of its k SwiGLU experts'.
The experts run fused (`kernels/fused_moe.py`: CUDA, float experts), grouped per expert (CPU,
the quantization method's linear layers) or as transformers' loop (`--kernels reference`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import silu_mul
from kernels.dispatch import backend, use_triton
from kernels.fused_moe import fused_moe
from services.compute.model.arch import fuse
from services.compute.model.quantization import Quantization
from services.compute.model.weights import require
from shared.model_config import ModelConfig
from shared.model_config_moe import MIXTRAL

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


def mlp_layers(cfg: ModelConfig, weights: dict, layer: int, quant: Quantization) -> dict:
    """LayerWeights' MLP fields of layer `layer`: `moe` for a sparse layer (gate_up, down
    None), else the dense gate_up [2 * inter, hidden] and down [hidden, inter] projections."""
    if cfg.is_moe_layer(layer):
        return dict(gate_up=None, down=None, moe=MoE(cfg, weights, layer, quant))
    p = f"model.layers.{layer}.mlp."
    gate_up = fuse([require(weights, f"{p}{n}_proj.weight") for n in ("gate", "up")])
    return dict(gate_up=quant.linear(gate_up),
                down=quant.linear(require(weights, f"{p}down_proj.weight")), moe=None)


def expert_weights(cfg: ModelConfig, weights: dict, layer: int
                   ) -> tuple[torch.Tensor, list, list]:
    """(router [E, hidden], gate_up [2I, hidden] per expert, down [hidden, I] per expert) of a
    sparse layer: from the per-expert tensors of a checkpoint, or from transformers v5's
    in-memory stacks (`mlp.experts.gate_up_proj` [E, 2I, hidden], `mlp.experts.down_proj`
    [E, hidden, I]) where a checkpoint holds those."""
    stacked = f"model.layers.{layer}.mlp.experts."
    if f"{stacked}gate_up_proj" in weights:
        router = require(weights, f"model.layers.{layer}.mlp.gate.weight")
        return router, list(weights[f"{stacked}gate_up_proj"].unbind(0)), list(
            require(weights, f"{stacked}down_proj").unbind(0))
    router, names = expert_names(cfg, layer)
    gate_up = [fuse([require(weights, g), require(weights, u)]) for g, u, _ in names]
    return require(weights, router), gate_up, [require(weights, d) for _, _, d in names]


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
    """One layer's sparse MLP: `moe(x)`, x [T, hidden] float -> [T, hidden] in x's dtype."""

    def __init__(self, cfg: ModelConfig, weights: dict, layer: int, quant: Quantization):
        self.router, gate_up, down = expert_weights(cfg, weights, layer)  # [E, hidden], ...
        self.top_k, self.renormalize = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.w13 = self.w2 = self.experts = None
        if quant.name == "none" and use_triton(self.router):  # the fused kernel: float stacks
            self.w13, self.w2 = torch.stack(gate_up), torch.stack(down)  # [E, 2I, h], [E, h, I]
        else:  # per expert (gate_up [2I, hidden], down [hidden, I]) linear layers
            self.experts = [(quant.linear(gu), quant.linear(d))
                            for gu, d in zip(gate_up, down, strict=True)]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(x, self.router, self.top_k, self.renormalize)
        if self.w13 is not None:
            return fused_moe(x, self.w13, self.w2, weights, ids)
        if backend() == "reference":
            return experts_loop(x, weights, ids, self.experts)
        return experts_grouped(x, weights, ids, self.experts)

    def nbytes(self) -> int:
        """Bytes of the router and the experts as served."""
        tensors = [self.router] + ([self.w13, self.w2] if self.w13 is not None else [])
        experts = sum(layer.nbytes() for pair in self.experts or () for layer in pair)
        return experts + sum(t.numel() * t.element_size() for t in tensors)


def experts_loop(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                 experts: list) -> torch.Tensor:
    """Reference: transformers' loop. For each expert, the tokens that chose it, their SwiGLU
    output times the routing weight, added in ascending expert order."""
    out = torch.zeros_like(x)
    for e, (gate_up, down) in enumerate(experts):
        tok, slot = torch.where(ids == e)  # [n] each
        if tok.numel() == 0:
            continue
        y = down(silu_mul(gate_up(x[tok]))) * weights[tok, slot, None]
        out.index_add_(0, tok, y.to(out.dtype))
    return out


def experts_grouped(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                    experts: list) -> torch.Tensor:
    """The CPU path: the (token, slot) pairs sorted by expert (stable, so each token's
    contributions still add in ascending expert order, as in `experts_loop`), the tokens
    gathered once, one GEMM pair per expert on its contiguous run, one scatter-add back."""
    T, k = ids.shape
    flat = ids.reshape(-1)  # [T * k] the expert of pair p = t * k + j
    order = torch.argsort(flat, stable=True)  # [T * k] pairs grouped by expert
    counts = torch.bincount(flat, minlength=len(experts)).tolist()  # host sync: CPU path
    tokens = order // k  # [T * k] the token of each sorted pair
    xs = x[tokens]  # [T * k, hidden] rows in expert order
    outs, start = [], 0
    for (gate_up, down), n in zip(experts, counts, strict=True):
        if n:
            outs.append(down(silu_mul(gate_up(xs[start:start + n]))))  # [n, hidden]
            start += n
    if not outs:
        return torch.zeros_like(x)
    y = torch.cat(outs) * weights.reshape(-1)[order, None]  # [T * k, hidden] float32
    return torch.zeros_like(x).index_add_(0, tokens, y.to(x.dtype))
