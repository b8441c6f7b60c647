"""The reference model for bench/vs_peers.py: SmolLM2-135M-Instruct's Q4_1 GGUF, expanded once
with transformers into a float32 Hugging Face directory (safetensors, tokenizer, chat template)
that vLLM, pipellm and transformers `generate` all load. The directory is cached: a rerun
with the same GGUF skips the expansion.
"""

from __future__ import annotations

import json
from pathlib import Path

DONE_FILE = "expanded_from.json"  # written last: its presence means the directory is complete


def default_gguf() -> Path:
    """The project's default model (pipellm/shared/default_model.py), fetched once if not cached."""
    from pipellm.shared.default_model import cached_path, fetch

    return cached_path() or fetch()


def hf_dir_for(gguf: Path, work_dir: Path) -> Path:
    """Where the float32 expansion of `gguf` lives (its name is the served model name)."""
    stem = gguf.name.removesuffix(".gguf").replace(".", "-")
    return work_dir / f"{stem}-fp32"


def expand_gguf(gguf: Path, work_dir: Path) -> Path:
    """The float32 HF directory of `gguf`, made with transformers unless already there."""
    out = hf_dir_for(gguf, work_dir)
    stamp = {"gguf": str(gguf.resolve()), "bytes": gguf.stat().st_size}
    done = out / DONE_FILE
    if done.is_file() and json.loads(done.read_text(encoding="utf-8")) == stamp:
        return out
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    transformers.logging.set_verbosity_error()
    kw = dict(gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kw)
    # transformers keeps a GGUF quantizer on the model and refuses to save it; the weights are
    # already dequantized to dense float32 tensors, so drop the quantizer and save them as such
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **kw)
    if not tokenizer.chat_template:
        raise RuntimeError(f"{gguf} has no chat template in its metadata")
    tokenizer.save_pretrained(out)  # tokenizer.json, tokenizer_config.json, chat_template.jinja
    done.write_text(json.dumps(stamp), encoding="utf-8")
    return out
