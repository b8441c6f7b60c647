"""vLLM's CUDA build on the device machine, carried in parts.

The device tool carries 64 MiB a call to a machine that reaches no package index, and vLLM with
what the device image lacks is ~170 MiB as xz. So the bundle travels in parts, one a call, while
the machine stays warm (files outside the working tree are kept between a warm machine's calls):

    python -m bench.vllm_gpu pack      # HERE: bench/vllm_gpu.txt's wheels, installed, trimmed,
                                       # one tar.xz split into .vllm/p0 .. .vllm/pN (git-ignored);
                                       # prints the calls that carry them
    python -m bench.vllm_gpu recv      # THERE: each carried .vllm/pK into /tmp/vllm-parts
                                       # (bench/gpu_suite.sh does it first: a part can ride
                                       # along with any steps once .whl is installed there)
    python -m bench.vllm_gpu unpack    # THERE: all parts, checked, into /tmp/vllm-site

`vllm serve` then runs as `python3 -m vllm.entrypoints.cli.main serve` with PYTHONPATH=SITE
(bench/gpu_serve.py). TRIM lists what is left out of vLLM's own wheel: code for other GPUs,
other Pythons, and opt-in parts; nothing a dense bf16 model on sm_90 loads.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REQUIREMENTS = ROOT / "bench" / "vllm_gpu.txt"
CARRY = ROOT / ".vllm"  # git-ignored: the device tool's run carries .vllm/pK
PARTS = Path("/tmp/vllm-parts")  # THERE: kept while the machine stays warm
SITE = Path("/tmp/vllm-site")
BUNDLE = "vllm-site.tar.xz"
WHEEL_CACHE = Path("~/.cache/pipellm/peers/vllm-gpu-wheels").expanduser()
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in range(17, 40)] + ["manylinux2014_x86_64"]
TRIM = (
    "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so",  # FlashAttention 2: vLLM runs FA3 on sm_90
    "vllm/third_party/fmha_sm100",               # Blackwell attention
    "vllm/third_party/deep_gemm/_C.cpython-313-x86_64-linux-gnu.so",  # other Pythons
    "vllm/third_party/deep_gemm/_C.cpython-314-x86_64-linux-gnu.so",
    "vllm/vllm-rs",                              # the opt-in Rust frontend (VLLM_USE_RUST_FRONTEND)
    "xgrammar/lib/libxgrammar.a",                # a static library for C++ builds
    "mistral_common/data/tekken_240718.json",    # Mistral models' tokenizers
    "mistral_common/data/tekken_240911.json",
)
PART_MIB = 52   # a part beside the ~7 MiB working tree
LAST_MIB = 34   # the last part travels with .whl (~19 MiB) and runs the bench


def _pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True,
                   env={**os.environ, "PIP_CONSTRAINT": ""})


def _target_args() -> list[str]:
    plats = [a for p in PLATFORMS for a in ("--platform", p)]
    return ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp", *plats]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def build_bundle(out: Path) -> None:
    """The pinned wheels installed for Python 3.12 into one folder, trimmed, as tar.xz."""
    WHEEL_CACHE.mkdir(parents=True, exist_ok=True)
    _pip("download", "-q", "--no-deps", *_target_args(), "-d", str(WHEEL_CACHE),
         "-r", str(REQUIREMENTS))
    with tempfile.TemporaryDirectory(prefix="vllm-site-") as tmp:
        site = Path(tmp) / "site"
        wanted = {p.lower() for p in pins()}
        wheels = [str(w) for w in WHEEL_CACHE.glob("*.whl") if _wheel_pin(w.name) in wanted]
        if len(wheels) != len(wanted):
            raise SystemExit(f"{len(wanted)} pins but {len(wheels)} wheels in {WHEEL_CACHE}")
        _pip("install", "-q", "--no-deps", "--no-compile", *_target_args(), "--target",
             str(site), *wheels)
        for rel in TRIM:
            path = site / rel
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        subprocess.run(["tar", "cJf", str(out), "-C", str(site), "."], check=True,
                       env={**os.environ, "XZ_OPT": "-9e -T0"})


def pins() -> list[str]:
    """bench/vllm_gpu.txt's `name==version` lines."""
    return [line for line in REQUIREMENTS.read_text().splitlines()
            if line and not line.startswith("#")]


def _wheel_pin(filename: str) -> str:
    """`name==version` of a wheel file, the name normalized as pip spells pins here."""
    name, version = filename.split("-")[:2]
    return f"{name.replace('_', '-').lower()}=={version.lower()}"


def split(bundle: Path, carry: Path = CARRY) -> list[int]:
    """`bundle` into carry/pK/ parts (PART_MIB, the last at most LAST_MIB), each beside the
    manifest (every part's size and sha256, and the whole bundle's); the parts' sizes."""
    data, mib = bundle.read_bytes(), 1 << 20
    cuts = [0]
    while len(data) - cuts[-1] > LAST_MIB * mib:
        cuts.append(min(cuts[-1] + PART_MIB * mib, len(data)))
    if cuts[-1] < len(data):
        cuts.append(len(data))
    chunks = [data[a:b] for a, b in zip(cuts, cuts[1:], strict=False)]
    manifest = {"bundle": BUNDLE, "sha256": hashlib.sha256(data).hexdigest(), "parts": [
        {"name": f"{BUNDLE}.{k:03d}", "bytes": len(c), "sha256": hashlib.sha256(c).hexdigest()}
        for k, c in enumerate(chunks)]}
    shutil.rmtree(carry, ignore_errors=True)
    for k, (chunk, part) in enumerate(zip(chunks, manifest["parts"], strict=True)):
        folder = carry / f"p{k}"
        folder.mkdir(parents=True)
        (folder / part["name"]).write_bytes(chunk)
        (folder / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return [len(c) for c in chunks]


def recv(carry: Path = CARRY, parts: Path = PARTS) -> dict:
    """Move each carried part (checked against its manifest) into `parts`; what is there."""
    parts.mkdir(parents=True, exist_ok=True)
    for folder in sorted(carry.glob("p*")):
        manifest = json.loads((folder / "manifest.json").read_text())
        shutil.copy(folder / "manifest.json", parts / "manifest.json")
        for part in manifest["parts"]:
            src = folder / part["name"]
            if src.is_file():
                if _sha256(src) != part["sha256"]:
                    raise SystemExit(f"{src} does not match its manifest: carried again?")
                shutil.move(str(src), parts / part["name"])
    return status(parts)


def status(parts: Path = PARTS) -> dict:
    if not (parts / "manifest.json").is_file():
        return {"have": [], "missing": "all (no part received yet)"}
    manifest = json.loads((parts / "manifest.json").read_text())
    names = [p["name"] for p in manifest["parts"]]
    return {"have": [n for n in names if (parts / n).is_file()],
            "missing": [n for n in names if not (parts / n).is_file()]}


def unpack(parts: Path = PARTS, site: Path = SITE) -> Path:
    """Every part, joined and checked, extracted into `site` (once per machine)."""
    if (site / ".done").is_file():
        return site
    state = status(parts)
    if state["missing"]:
        raise SystemExit(f"vLLM parts missing on this machine: {state['missing']} (each call "
                         "that carries a part must find the machine still warm; see "
                         "`python -m bench.vllm_gpu pack`'s plan)")
    manifest = json.loads((parts / "manifest.json").read_text())
    bundle = parts / manifest["bundle"]
    with open(bundle, "wb") as out:
        for part in manifest["parts"]:
            with open(parts / part["name"], "rb") as f:
                shutil.copyfileobj(f, out)
    if _sha256(bundle) != manifest["sha256"]:
        raise SystemExit(f"{bundle} does not match the manifest's sha256")
    shutil.rmtree(site, ignore_errors=True)
    site.mkdir(parents=True)
    subprocess.run(["tar", "xJf", str(bundle), "-C", str(site)], check=True)
    bundle.unlink()
    (site / ".done").touch()
    return site


def plan(sizes: list[int]) -> list[str]:
    """Device calls that carry the parts: all but the last on their own (or beside any
    gpu_suite.sh steps, on a machine that has installed .whl), the last with .whl and the step
    that serves vLLM."""
    calls = [f'run(command="python3 -m bench.vllm_gpu recv", carry=[".vllm/p{k}"])'
             for k in range(len(sizes) - 1)]
    calls.append(f'run(command="bash bench/gpu_suite.sh vllm_serve", '
                 f'carry=[".whl", ".vllm/p{len(sizes) - 1}"])')
    return calls


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("action", choices=("pack", "recv", "unpack", "status"))
    args = p.parse_args(argv)
    if args.action == "pack":
        with tempfile.TemporaryDirectory(prefix="vllm-pack-") as tmp:
            bundle = Path(tmp) / BUNDLE
            build_bundle(bundle)
            sizes = split(bundle)
        print("\n".join(plan(sizes)))
        print(json.dumps({"parts_mib": [round(s / 2**20, 1) for s in sizes]}))
    elif args.action == "recv":
        print(json.dumps(recv()))
    elif args.action == "unpack":
        print(json.dumps({"site": str(unpack())}))
    else:
        print(json.dumps(status()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
