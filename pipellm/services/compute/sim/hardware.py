"""GPUs and model shapes for the simulated backend: datasheet numbers, nothing measured.

`GpuSpec` holds what a roofline needs (HBM bandwidth, dense tensor-core peaks, memory);
`ModelSpec` the shape of a Llama-family decoder, from its Hugging Face `config.json`, with the
parameter counts derived from it; with `num_experts` > 0 a mixture-of-experts one (Mixtral,
Qwen3-MoE): each sparse layer's MLP is `num_experts` experts of width `expert_intermediate` and
a router, and a token runs `experts_per_tok` of them (`active_params` vs all `params`).
`gpu("h100")` / `model("llama-3-8b")` look them up by name (any case) and fail with a
`ValueError` listing the choices.

Memory: `memory_bytes` is what CUDA reports as the device's total memory
(`torch.cuda.get_device_properties().total_memory`), which is what the real runner sizes its KV
cache from, not the marketing figure ("80 GB" H100 -> 79.1 GiB usable).
"""

from __future__ import annotations

from dataclasses import dataclass

GiB = 2**30


@dataclass(frozen=True)
class GpuSpec:
    name: str
    bandwidth: float  # HBM bytes/s (datasheet)
    bf16_flops: float  # dense (no sparsity) bf16 tensor-core FLOP/s
    fp8_flops: float | None  # dense fp8 FLOP/s; None: no fp8 tensor cores
    int8_flops: float  # dense int8 tensor-core OP/s
    memory_bytes: int  # total device memory as CUDA reports it
    label: str = ""

    def peak_flops(self, dtype: str) -> float:
        """Peak of the tensor cores that run matmuls with `dtype` weights (W8A8 for int8/fp8;
        weight-only int4 dequantizes to bf16)."""
        if dtype == "fp8":
            if self.fp8_flops is None:
                raise ValueError(f"{self.name} has no fp8 tensor cores")
            return self.fp8_flops
        if dtype == "int8":
            return self.int8_flops
        return self.bf16_flops


GPUS: dict[str, GpuSpec] = {g.name: g for g in (
    GpuSpec("h100", 3.35e12, 989.4e12, 1978.9e12, 1978.9e12, int(79.1 * GiB),
            "H100 SXM 80 GB HBM3"),
    GpuSpec("h200", 4.8e12, 989.4e12, 1978.9e12, 1978.9e12, int(139.8 * GiB),
            "H200 SXM 141 GB HBM3e"),
    GpuSpec("a100", 2.039e12, 312e12, None, 624e12, int(79.2 * GiB), "A100 SXM 80 GB HBM2e"),
    GpuSpec("a100-40gb", 1.555e12, 312e12, None, 624e12, int(39.4 * GiB), "A100 SXM 40 GB"),
    GpuSpec("h100-pcie", 2.0e12, 756e12, 1513e12, 1513e12, int(79.1 * GiB), "H100 PCIe 80 GB"),
    GpuSpec("l40s", 0.864e12, 362.05e12, 733e12, 733e12, int(44.4 * GiB), "L40S 48 GB GDDR6"),
)}


@dataclass(frozen=True)
class ModelSpec:
    """A Llama-family decoder's shape (Llama 2/3, Mistral, Qwen2/3, and the MoE Mixtral and
    Qwen3-MoE), as in its config.json. Dense unless `num_experts` > 0."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int  # a dense MLP's width (intermediate_size)
    vocab: int
    context: int  # max_position_embeddings (what the server lets a request span)
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    tie_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2
    qk_norm: bool = False  # Qwen3: an RMSNorm (head_dim weights) on q and one on k
    num_experts: int = 0  # routed experts per sparse layer (num_local_experts); 0: dense
    experts_per_tok: int = 0  # top-k experts each token runs (num_experts_per_tok)
    expert_intermediate: int = 0  # one expert's MLP width (moe_intermediate_size)
    first_dense_layers: int = 0  # leading layers with a dense MLP (first_k_dense_replace)

    def __post_init__(self):
        if self.num_experts and not (0 < self.experts_per_tok <= self.num_experts
                                     and self.expert_intermediate > 0
                                     and 0 <= self.first_dense_layers <= self.layers):
            raise ValueError(f"{self.name}: bad expert shape")

    @property
    def attn_params(self) -> int:
        """Matmul weights of one layer's attention: q, k, v, o."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return self.hidden * (q + 2 * kv) + q * self.hidden

    @property
    def expert_params(self) -> int:
        """One expert's MLP (gate, up, down) in one sparse layer."""
        return 3 * self.hidden * self.expert_intermediate

    @property
    def sparse_layers(self) -> int:
        """Layers whose MLP is the experts (0 for a dense model)."""
        return self.layers - self.first_dense_layers if self.num_experts else 0

    @property
    def dense_linear_params(self) -> int:
        """Matmul weights every token runs: attention, and the dense layers' MLPs."""
        dense_mlp = 3 * self.hidden * self.intermediate
        return self.layers * self.attn_params + (self.layers - self.sparse_layers) * dense_mlp

    @property
    def linear_params(self) -> int:
        """Matmul weights of all decoder layers, every expert included (what int8/fp8/int4
        quantization shrinks; the router stays bf16, as in vLLM)."""
        return (self.dense_linear_params
                + self.sparse_layers * self.num_experts * self.expert_params)

    @property
    def active_linear_params(self) -> int:
        """Matmul weights one token runs: the dense ones and its top-k experts per layer."""
        return (self.dense_linear_params
                + self.sparse_layers * self.experts_per_tok * self.expert_params)

    @property
    def router_params(self) -> int:
        """The routers' gate weights (num_experts x hidden per sparse layer)."""
        return self.sparse_layers * self.num_experts * self.hidden

    @property
    def layer_small_params(self) -> int:
        """Vectors of one layer: two RMSNorm weights (+ the q/k/v biases of Qwen2, the q/k
        norms of Qwen3)."""
        bias = (self.heads + 2 * self.kv_heads) * self.head_dim if self.qkv_bias else 0
        return 2 * self.hidden + bias + (2 * self.head_dim if self.qk_norm else 0)

    @property
    def small_params(self) -> int:
        return self.layers * self.layer_small_params + self.hidden  # + the final norm

    @property
    def embed_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def lm_head_params(self) -> int:
        return self.vocab * self.hidden  # the same tensor as the embedding when tied

    @property
    def params(self) -> int:
        """All parameters, every expert included (Llama-3-8B: 8,030,261,248)."""
        head = 0 if self.tie_embeddings else self.lm_head_params
        return (self.embed_params + self.linear_params + self.router_params + self.small_params
                + head)

    @property
    def active_params(self) -> int:
        """Parameters one token uses: all but the experts it does not run (= params if
        dense)."""
        idle = self.num_experts - self.experts_per_tok
        return self.params - self.sparse_layers * idle * self.expert_params

    @property
    def kv_elems_per_token(self) -> int:
        """K and V elements one token adds to the cache (all layers)."""
        return 2 * self.layers * self.kv_heads * self.head_dim


def _llama2(name, layers, hidden, heads, inter):
    return ModelSpec(name, layers, hidden, heads, heads, hidden // heads, inter, 32000, 4096,
                     (2,), 1)


def _llama3(name, layers, hidden, heads, inter, context=8192):
    return ModelSpec(name, layers, hidden, heads, 8, 128, inter, 128256, context,
                     (128001, 128008, 128009), 128000)


MODELS: dict[str, ModelSpec] = {m.name: m for m in (
    _llama2("llama-2-7b", 32, 4096, 32, 11008),
    _llama2("llama-2-13b", 40, 5120, 40, 13824),
    ModelSpec("llama-2-70b", 80, 8192, 64, 8, 128, 28672, 32000, 4096, (2,), 1),
    _llama3("llama-3-8b", 32, 4096, 32, 14336),
    _llama3("llama-3.1-8b", 32, 4096, 32, 14336, context=131072),
    _llama3("llama-3-70b", 80, 8192, 64, 28672),
    # Mistral-7B v0.3 (v0.2 shape, 32768-token vocab; no sliding window from v0.2 on)
    ModelSpec("mistral-7b", 32, 4096, 32, 8, 128, 14336, 32768, 32768, (2,), 1),
    ModelSpec("qwen2-7b", 28, 3584, 28, 4, 128, 18944, 152064, 32768, (151643, 151645), None,
              qkv_bias=True),
    ModelSpec("tinyllama-1.1b", 22, 2048, 32, 4, 64, 5632, 32000, 2048, (2,), 1),
    # Llama-3.2-1B: a draft model of the Llama 3 family (same tokenizer); 1.24 B params, tied
    ModelSpec("llama-3.2-1b", 16, 2048, 32, 8, 64, 8192, 128256, 131072,
              (128001, 128008, 128009), 128000, tie_embeddings=True),
    # MoE. Qwen3-30B-A3B: 128 experts of width 768, top-8, in all 48 layers (intermediate_size
    # 6144 is unused: no dense layer); 30,532,122,624 params, 3,353,032,704 active (HF: "30.5B,
    # 3.3B activated"); attention 0.91 B, experts 29.0 B, embedding + LM head 0.62 B.
    ModelSpec("qwen3-30b-a3b", 48, 2048, 32, 4, 128, 6144, 151936, 40960, (151643, 151645),
              None, qk_norm=True, num_experts=128, experts_per_tok=8, expert_intermediate=768),
    # Mixtral-8x7B v0.1: 8 experts of width 14336, top-2, in all 32 layers; 46,702,792,704
    # params, 12,879,925,248 active (Mistral: "46.7B, 12.9B active"). No sliding window.
    ModelSpec("mixtral-8x7b", 32, 4096, 32, 8, 128, 14336, 32000, 32768, (2,), 1,
              num_experts=8, experts_per_tok=2, expert_intermediate=14336),
)}


def gpu(name: str) -> GpuSpec:
    try:
        return GPUS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown GPU {name!r}; choices: {', '.join(GPUS)}") from None


def model(name: str) -> ModelSpec:
    try:
        return MODELS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; choices: {', '.join(MODELS)}") from None
