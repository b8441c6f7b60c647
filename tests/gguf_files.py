"""GGUF files written in tests with `gguf.GGUFWriter`, the way llama.cpp's converter writes them.

from tests.gguf_files import write_gguf
write_gguf(path, hf_model, qtype=GGMLQuantizationType.Q4_1)   # a tiny HF model as a GGUF file
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter
from gguf.gguf_writer import GGUFValue
from gguf.quants import quantize

from pipellm.shared.demo_model import CHAT_TEMPLATE
from pipellm.shared.gguf.names import hf_name
from tests.hf_models import demo_tokenizer

Q = GGMLQuantizationType


@dataclass(frozen=True)
class RawTensor:
    """Bytes stored as they are: `data` uint8 [rows, row bytes] of `qtype` (the writer derives
    the element shape from the byte shape)."""

    data: np.ndarray
    qtype: GGMLQuantizationType


def permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of Q/K rows (HF rotate-half -> interleaved)."""
    return (w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


_LAYER_TENSORS = ("attn_q", "attn_k", "attn_v", "attn_output", "attn_norm", "ffn_norm",
                  "ffn_gate", "ffn_up", "ffn_down", "attn_q_norm", "attn_k_norm", "attn_qkv",
                  "post_attention_norm", "post_ffw_norm")
GEMMA = ("gemma2", "gemma3")


def num_experts(cfg) -> int:
    """A transformers config's expert count (0: a dense model)."""
    return getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None) or 0


def _expert_tensors(hf: str, tensor) -> dict[str, np.ndarray] | None:
    """llama.cpp's names for one of transformers v5's in-memory MoE tensors (router
    `mlp.gate.weight` -> ffn_gate_inp; `mlp.experts.gate_up_proj` [E, 2I, H] -> ffn_gate_exps,
    ffn_up_exps [E, I, H]; `mlp.experts.down_proj` -> ffn_down_exps), None for other tensors."""
    parts = hf.split(".")
    if len(parts) < 5 or parts[:2] != ["model", "layers"] or parts[3] != "mlp":
        return None
    w, blk = tensor.detach().float().numpy(), f"blk.{parts[2]}"
    rest = ".".join(parts[4:])
    if rest == "gate.weight":
        return {f"{blk}.ffn_gate_inp.weight": w}
    if rest == "experts.gate_up_proj":
        gate, up = np.split(w, 2, axis=1)
        return {f"{blk}.ffn_gate_exps.weight": gate, f"{blk}.ffn_up_exps.weight": up}
    if rest == "experts.down_proj":
        return {f"{blk}.ffn_down_exps.weight": w}
    return None


def gguf_tensors(model, arch: str = "llama") -> dict[str, np.ndarray]:
    """GGUF-named float32 tensors of an HF model, Q/K permuted for the llama architecture (as
    convert_hf_to_gguf does: not for qwen2, qwen3, phi3), with Phi-3's LongRoPE factors as
    the tensors rope_factors_{long,short} (its generate_extra_tensors) and Gemma's RMSNorm
    weights w stored as 1 + w."""
    cfg = model.config
    from_hf = {}
    for i in range(cfg.num_hidden_layers):
        for short in _LAYER_TENSORS:
            for kind in ("weight", "bias"):
                name = f"blk.{i}.{short}.{kind}"
                from_hf[hf_name(name, arch)] = name
    for name in ("token_embd.weight", "output_norm.weight", "output.weight"):
        from_hf[hf_name(name, arch)] = name
    heads = {"q_proj": cfg.num_attention_heads, "k_proj": cfg.num_key_value_heads}
    out = {}
    for hf, tensor in model.state_dict().items():
        if hf == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if num_experts(cfg) and (experts := _expert_tensors(hf, tensor)) is not None:
            out |= experts
            continue
        w = tensor.detach().float().numpy()
        for proj, n in heads.items():
            if arch == "llama" and f".{proj}." in hf:
                w = permute(w, n)
        if arch in GEMMA and hf.endswith("norm.weight"):
            w = w + 1
        out[from_hf[hf]] = w
    rope = getattr(cfg, "rope_parameters", None) or {}
    if arch == "phi3" and rope.get("rope_type") == "longrope":
        for kind in ("long", "short"):
            out[f"rope_factors_{kind}.weight"] = np.array(rope[f"{kind}_factor"], np.float32)
    return out


def quantized(w: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """What GGUFWriter.add_tensor takes for `qtype`: the bytes (or the float array)."""
    if qtype == Q.F32:
        return w.astype(np.float32)
    if qtype == Q.F16:
        return w.astype(np.float16)
    return quantize(w.astype(np.float32), qtype).view(np.uint8)  # BF16 comes back as uint16


def write_gguf(path: Path, model, qtype: GGMLQuantizationType = Q.F32, *, arch: str = "llama",
               meta: dict | None = None, tensors: dict[str, np.ndarray] | None = None) -> Path:
    """Write `model` (an HF model of GGUF architecture `arch`: llama (Mixtral too), qwen2,
    qwen3, phi3, qwen3moe; with the demo tokenizer) to `path` as llama.cpp's converter would:
    matrices (and expert stacks) in `qtype`, 1-D tensors in F32. `meta` overrides metadata
    keys, `tensors` GGUF tensors."""
    cfg = model.config
    w = GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    rope = cfg.rope_parameters
    w.add_rope_freq_base(float(rope.get("full_attention", rope)["rope_theta"]))
    w.add_layer_norm_rms_eps(float(cfg.rms_norm_eps))
    if getattr(cfg, "head_dim", None) is not None and arch != "phi3":  # TextModel's
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    if arch == "phi3":
        _add_phi3(w, cfg)
    elif arch in GEMMA:
        _add_gemma(w, cfg, arch)
    elif arch == "llama" and getattr(cfg, "sliding_window", None):  # Mistral with a window
        w.add_sliding_window(cfg.sliding_window)
    if num_experts(cfg):
        _add_experts(w, cfg, arch)
    _add_tokenizer(w)
    for key, value in (meta or {}).items():  # replaces what the writer already holds
        vtype = GGUFValueType.STRING if isinstance(value, str) else GGUFValueType.UINT32
        w.kv_data[0][key] = GGUFValue(value, vtype)
    for name, t in (tensors or gguf_tensors(model, arch)).items():
        if isinstance(t, RawTensor):
            w.add_tensor(name, t.data, raw_dtype=t.qtype)
        elif t.ndim == 1 or qtype == Q.F32 or ".ffn_gate_inp." in name:  # routers: F32
            w.add_tensor(name, t.astype(np.float32))
        else:
            data = quantized(t, qtype)
            w.add_tensor(name, data, raw_dtype=None if qtype == Q.F16 else qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


def _add_experts(w: GGUFWriter, cfg, arch: str) -> None:
    """What convert_hf_to_gguf adds for experts: their count and per-token count, and for
    qwen3moe their width and whether the chosen weights are renormalized."""
    w.add_expert_count(num_experts(cfg))
    w.add_expert_used_count(cfg.num_experts_per_tok)
    if arch == "qwen3moe":
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        w.add_expert_weights_norm(bool(cfg.norm_topk_prob))


def _add_phi3(w: GGUFWriter, cfg) -> None:
    """What convert_hf_to_gguf's Phi3MiniModel adds: the rotary dims, the pre-training length,
    the attention window (0: none) and, for LongRoPE, the attention factor it derives from
    max / original positions."""
    rope = cfg.rope_parameters
    original = rope.get("original_max_position_embeddings", cfg.original_max_position_embeddings)
    heads = cfg.num_attention_heads
    w.add_rope_dimension_count(int(rope.get("partial_rotary_factor", 1.0) * cfg.hidden_size)
                               // heads)
    w.add_rope_scaling_orig_ctx_len(original)
    w.add_sliding_window(cfg.sliding_window or 0)
    if rope.get("rope_type") == "longrope":
        scale = cfg.max_position_embeddings / original
        w.add_rope_scaling_attn_factors(
            math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1.0 else 1.0)


def _add_gemma(w: GGUFWriter, cfg, arch: str) -> None:
    """What convert_hf_to_gguf's Gemma2Model / Gemma3Model add: the window, the caps they keep
    (Gemma 3: the final one only) and the sliding layers' RoPE base. They write no layer
    pattern (llama.cpp assumes 2 and 6); this writes one flag per layer, as newer converters
    do for other architectures, so that tiny models may interleave differently."""
    w.add_sliding_window(cfg.sliding_window)
    if arch == "gemma2":
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
    if cfg.final_logit_softcapping:
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    if arch == "gemma3":
        w.add_rope_freq_base_swa(float(cfg.rope_parameters["sliding_attention"]["rope_theta"]))
    w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg.layer_types])


def _add_tokenizer(w: GGUFWriter) -> None:
    """The demo tokenizer as `tokenizer.ggml.*` (gpt2 byte-level BPE), BOS added, ChatML-ish
    template; <unk>, <s>, </s> are control tokens (type 3)."""
    tok = demo_tokenizer()
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in ("<unk>", "<s>", "</s>") else 1 for t in tokens])
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m
                        for m in spec["model"]["merges"]])
    w.add_bos_token_id(vocab["<s>"])
    w.add_eos_token_id(vocab["</s>"])
    w.add_add_bos_token(True)
    w.add_chat_template(CHAT_TEMPLATE)


def dequantized(model, qtype: GGMLQuantizationType, arch: str = "llama"
                ) -> dict[str, np.ndarray]:
    """GGUF-named float32 tensors as `write_gguf(..., qtype)` stores them (matrices through
    the gguf package's quantize + dequantize; still permuted)."""
    from gguf.quants import dequantize

    out = {}
    for name, t in gguf_tensors(model, arch).items():
        if ".ffn_gate_inp." in name:  # stored F32, as llama.cpp's converter does
            pass
        elif t.ndim > 1 and qtype == Q.F16:
            t = t.astype(np.float16).astype(np.float32)
        elif t.ndim > 1 and qtype != Q.F32:
            t = dequantize(quantized(t, qtype), qtype).reshape(t.shape)
        out[name] = t
    return out
