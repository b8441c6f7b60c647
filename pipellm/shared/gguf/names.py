"""A GGUF file's tensors in Hugging Face terms: their HF names (llama.cpp's `blk.3.attn_q.weight`
is `model.layers.3.self_attn.q_proj.weight`), and the check that every tensor of a file has one
and a type we read, without reading the tensors (no torch: `pipellm up` runs it before any
service starts; pipellm/services/compute/model/gguf_weights.py loads them)."""

from __future__ import annotations

from pipellm.shared.gguf.hf import architecture
from pipellm.shared.gguf.reader import GGUFError, GGUFFile, open_gguf
from pipellm.shared.model_config import ModelLoadError

_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight",
           "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
_LAYER = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
          "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
          "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
          "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}

_QK_NORMS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
# Gemma's sandwich norms; llama.cpp's `ffn_norm` is Gemma's pre_feedforward_layernorm
_SANDWICH = {"post_attention_norm": "post_attention_layernorm",
             "ffn_norm": "pre_feedforward_layernorm",
             "post_ffw_norm": "post_feedforward_layernorm"}
_ARCH_LAYER = {"qwen3": _QK_NORMS, "gemma2": _SANDWICH, "gemma3": {**_SANDWICH, **_QK_NORMS},
               "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
               "qwen3moe": {**_QK_NORMS, "ffn_gate_inp": "mlp.gate"},
               "olmoe": {**_QK_NORMS, "ffn_gate_inp": "mlp.gate"},  # q/k norms: [H * D]
               "llama": {"ffn_gate_inp": "block_sparse_moe.gate"}}  # Mixtral
# stacked experts: GGUF name -> (HF module, {stack: expert's weight}) per architecture
_MLP_EXPERTS = ("mlp", {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj",
                        "ffn_down_exps": "down_proj"})
_EXPERTS = {"qwen3moe": _MLP_EXPERTS, "olmoe": _MLP_EXPERTS,
            "llama": ("block_sparse_moe", {"ffn_gate_exps": "w1", "ffn_up_exps": "w3",
                                           "ffn_down_exps": "w2"})}
NOT_WEIGHTS = {"phi3": ("rope_factors_long.weight", "rope_factors_short.weight")}


def hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight` in a GGUF file of
    architecture `arch`; None if unknown."""
    if gguf_name in _GLOBAL:
        return _GLOBAL[gguf_name]
    parts = gguf_name.split(".")
    layer = {**_LAYER, **_ARCH_LAYER.get(arch, {})}
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in layer:
        return f"model.layers.{parts[1]}.{layer[parts[2]]}.{parts[3]}"
    return None


def kept_int4(gguf_name: str) -> bool:
    """Whether a Q4_0/Q4_1 tensor is kept as blocks under --quantization int4: the decoder's
    matrices, but for the MoE router (`ffn_gate_inp`, float as in vLLM; llama.cpp's converter
    stores it F32)."""
    return gguf_name.startswith("blk.") and ".ffn_gate_inp." not in gguf_name


def expert_names(gguf_name: str, arch: str, n_experts: int) -> list[str] | None:
    """`blk.3.ffn_up_exps.weight` -> the HF names of its n_experts slices, in order
    (`model.layers.3.mlp.experts.{e}.up_proj.weight`); None if not an expert stack."""
    parts = gguf_name.split(".")
    module, stacks = _EXPERTS.get(arch, ("", {}))
    if len(parts) != 4 or parts[0] != "blk" or parts[2] not in stacks:
        return None
    p = f"model.layers.{parts[1]}.{module}.experts"
    return [f"{p}.{e}.{stacks[parts[2]]}.{parts[3]}" for e in range(n_experts)]


def check_gguf(path) -> None:
    """Raise ModelLoadError if the file's tensors cannot be loaded (names, types, truncation),
    without reading them: what `pipellm serve` checks before any service starts."""
    try:
        check_tensors(path)
    except GGUFError as exc:
        raise ModelLoadError(str(exc)) from None


def check_tensors(path) -> tuple[GGUFFile, dict[str, str], dict[str, int] | None]:
    """(file, GGUF -> HF tensor names, heads per permuted projection or None)."""
    gguf = open_gguf(path)
    arch, _, permuted = architecture(gguf)
    gguf.check_types()
    q_heads = gguf.require(f"{arch}.attention.head_count")
    heads = {"q_proj": q_heads, "k_proj": gguf.get(f"{arch}.attention.head_count_kv", q_heads)}
    return gguf, _tensor_names(gguf, arch), heads if permuted else None


def _tensor_names(gguf: GGUFFile, arch: str) -> dict[str, str | list[str]]:
    """GGUF -> HF name, or the HF names of its experts for a stacked expert tensor."""
    names = {}
    for src, info in gguf.tensors.items():
        if src in NOT_WEIGHTS.get(arch, ()):
            continue
        name = hf_name(src, arch) or expert_names(src, arch, info.shape[0])
        if name is None:
            raise GGUFError(f"{gguf.path}: tensor '{src}' is not part of a Llama-family model")
        names[src] = name
    return names
