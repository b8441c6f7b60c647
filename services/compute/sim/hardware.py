"""GPUs and model shapes for the simulated backend: datasheet numbers, nothing measured.

`GpuSpec` holds what a roofline needs (HBM bandwidth, dense tensor-core peaks, memory);
`ModelSpec` the shape of a Llama-family decoder, from its Hugging Face `config.json`, with the
parameter counts derived from it. `gpu("h100")` / `model("llama-3-8b")` look them up by name
and fail with a `ValueError` listing the choices.

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
    """A Llama-family decoder's shape (Llama 2/3, Mistral, Qwen2), as in its config.json."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    context: int  # max_position_embeddings (what the server lets a request span)
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    tie_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2

    @property
    def layer_linear_params(self) -> int:
        """Matmul weights of one decoder layer: q, k, v, o and gate, up, down."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return self.hidden * (q + 2 * kv) + q * self.hidden + 3 * self.hidden * self.intermediate

    @property
    def layer_small_params(self) -> int:
        """Vectors of one layer: two RMSNorm weights (+ the q/k/v biases of Qwen2)."""
        bias = (self.heads + 2 * self.kv_heads) * self.head_dim if self.qkv_bias else 0
        return 2 * self.hidden + bias

    @property
    def linear_params(self) -> int:
        """Matmul weights of all decoder layers (what int8/fp8/int4 quantization shrinks)."""
        return self.layers * self.layer_linear_params

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
        """All parameters (Llama-3-8B: 8,030,261,248)."""
        head = 0 if self.tie_embeddings else self.lm_head_params
        return self.embed_params + self.linear_params + self.small_params + head

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
