"""llama.cpp's C++ server (`llama-server`), the CPU peer for GGUF models: find it, or build it.

`llama-server` is OpenAI-compatible and batches continuously over `-np` parallel slots (`-c` is
the total context, split across them); it honours `ignore_eos` on /v1/completions, so
pipellm-bench drives it like pipellm and vLLM. (The Python package's own server is a
different, one-request-at-a-time wrapper: not the peer.)

Two builds (`VARIANTS`), each in a build directory of its own under the cache
(`~/.cache/pipellm/peers/llama.cpp`):

    native   build/        GGML_NATIVE=ON: for this CPU (AVX-512, VNNI and BF16 where it has
                           them) but AMX off: its AMX matmul dies (SIGILL) on the Q4_1 GGUF
    avx2     build-avx2/   GGML_NATIVE=OFF, AVX/AVX2/FMA/F16C on, AVX-512 off: llama.cpp as it
                           runs on an AVX2-only CPU, measured on an AVX-512 one

Where a variant is looked for, in order: `--llamacpp-bin` (or `--llamacpp-avx2-bin`), its
environment variable ($LLAMA_SERVER, $LLAMA_SERVER_AVX2), its build under the cache, and for
native only `llama-server` on PATH (a cached build configured with other flags does not count).
Else it is built from the llama.cpp source that the `llama-cpp-python` sdist on the package
index carries (vendor/llama.cpp); about 7 minutes a variant on 2 idle cores:

    pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36
    cmake -S .../vendor/llama.cpp -B CACHE/build[-avx2] <the variant's flags> -DLLAMA_CURL=OFF ...
    cmake --build CACHE/build[-avx2] --target llama-server -j2

    python -m bench.llamacpp [--variant native|avx2|both] [--llamacpp-bin PATH] [--cache-dir DIR]
        [--no-build]

prints where each server is (building it first if needed).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tarfile
from pathlib import Path

from bench.common import run_step

SDIST = "llama-cpp-python==0.3.36"
CACHE_DIR = Path("~/.cache/pipellm/peers/llama.cpp").expanduser()
BINARY = Path("build/bin/llama-server")  # under the cache dir (native; avx2: build-avx2/...)
ENV_VAR = "LLAMA_SERVER"
COMMON_FLAGS = ["-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
                "-DCMAKE_BUILD_TYPE=Release"]
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"  # gcc: these win over -march=native
VARIANTS = {  # name -> its own cmake flags
    "native": ["-DGGML_NATIVE=ON", f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}"],
    "avx2": ["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON",
             "-DGGML_F16C=ON", "-DGGML_AVX512=OFF"],
}
READY_PATH = "/health"  # 503 while the model loads, 200 once it takes requests


def say(msg: str) -> None:
    print(f"[llama.cpp] {msg}", file=sys.stderr, flush=True)


def build_dir(variant: str = "native") -> str:
    """The variant's build directory under the cache: build, build-avx2."""
    return "build" if variant == "native" else f"build-{variant}"


def binary(cache_dir: Path = CACHE_DIR, variant: str = "native") -> Path:
    return cache_dir / build_dir(variant) / BINARY.relative_to("build")


def env_var(variant: str = "native") -> str:
    return ENV_VAR if variant == "native" else f"{ENV_VAR}_{variant.upper()}"


def find_server(explicit: str | None = None, cache_dir: Path = CACHE_DIR,
                variant: str = "native") -> Path | None:
    """`explicit` if given (FileNotFoundError if it is not an executable), else the first
    llama-server of `variant` that exists: its environment variable, the cache, PATH (native
    only: a llama-server on PATH was built for who knows which CPU)."""
    usable = lambda c: bool(c) and Path(c).is_file() and os.access(c, os.X_OK)
    if explicit:
        if not usable(explicit):
            raise FileNotFoundError(f"no executable llama-server at {explicit}")
        return Path(explicit)
    cached = binary(cache_dir, variant)
    candidates = [os.environ.get(env_var(variant)),
                  None if stale(cache_dir, variant) else str(cached),
                  shutil.which("llama-server") if variant == "native" else None]
    return next((Path(c) for c in candidates if usable(c)), None)


def stale(cache_dir: Path, variant: str = "native") -> bool:
    """Whether the variant's build under the cache was configured with other flags than
    VARIANTS' (then it is built again)."""
    cache = cache_dir / build_dir(variant) / "CMakeCache.txt"
    if not cache.is_file():
        return False
    have = {}  # NAME:TYPE=VALUE lines
    for ln in cache.read_text(errors="replace").splitlines():
        key, eq, value = ln.partition("=")
        if eq and ":" in key and not ln.startswith(("//", "#")):
            have[key.split(":", 1)[0]] = value
    want = dict(f.removeprefix("-D").split("=", 1) for f in VARIANTS[variant])
    if diff := [k for k, v in want.items() if have.get(k, "").upper() != v.upper()]:
        say(f"not using {cache.parent}: configured with other {', '.join(diff)}")
    return bool(diff)


def fetch_source(cache_dir: Path) -> Path:
    """The llama.cpp source tree of the sdist, downloaded and unpacked under the cache."""
    src = cache_dir / "src"
    name = SDIST.replace("-", "_").replace("==", "-")  # llama_cpp_python-0.3.36
    tree = src / name / "vendor" / "llama.cpp"
    if (tree / "CMakeLists.txt").is_file():
        say(f"source already unpacked: {tree}")
        return tree
    src.mkdir(parents=True, exist_ok=True)
    say(f"downloading the {SDIST} sdist (llama.cpp's source is in it)")
    run_step([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
         "-d", str(src), SDIST])
    archive = next(src.glob(f"{name}.tar.gz"), None)
    if archive is None:
        raise RuntimeError(f"pip download left no {name}.tar.gz in {src}")
    with tarfile.open(archive) as tar:
        tar.extractall(src, filter="data")
    if not (tree / "CMakeLists.txt").is_file():
        raise RuntimeError(f"{archive.name} has no vendor/llama.cpp source")
    say(f"unpacked {archive.name} -> {tree}")
    return tree


def build_server(cache_dir: Path = CACHE_DIR, jobs: int = 2, variant: str = "native") -> Path:
    """Configure and build llama-server of `variant` from the sdist's source into its build
    directory under `cache_dir`."""
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            raise RuntimeError(f"building llama.cpp needs {tool} (apt-get install cmake g++)")
    tree = fetch_source(cache_dir)
    build, flags = cache_dir / build_dir(variant), VARIANTS[variant] + COMMON_FLAGS
    say(f"configuring: cmake -S {tree} -B {build} {' '.join(flags)}")
    run_step(["cmake", "-S", str(tree), "-B", str(build), *flags])
    say(f"building llama-server ({variant}) with {jobs} jobs (about 7 minutes on 2 cores)")
    run_step(["cmake", "--build", str(build), "--target", "llama-server", f"-j{jobs}"])
    built = binary(cache_dir, variant)
    if not built.is_file():
        raise RuntimeError(f"the build finished without {built}")
    say(f"built {built}")
    return built


def ensure_server(explicit: str | None = None, cache_dir: Path = CACHE_DIR,
                  build: bool = True, jobs: int = 2, variant: str = "native") -> Path:
    """A llama-server of `variant` to run: found, else built (unless `build` is False)."""
    found = find_server(explicit, cache_dir, variant)
    if found is not None:
        say(f"using {found} ({variant})")
        return found
    if not build:
        raise FileNotFoundError(f"llama-server ({variant}) not found (give its path or let it "
                                "build)")
    say(f"llama-server ({variant}) not found (${env_var(variant)}, "
        f"{binary(cache_dir, variant)}{', PATH' if variant == 'native' else ''}): building it")
    return build_server(cache_dir, jobs, variant)


def server_argv(binary: str | Path, gguf: str | Path, port: int, threads: int = 2,
                slots: int = 16, ctx: int = 32768) -> list[str]:
    """`llama-server` on `gguf`: `threads` threads, `slots` parallel slots sharing `ctx`."""
    return [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
            "-t", str(threads), "-np", str(slots), "-c", str(ctx)]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variant", choices=(*VARIANTS, "both"), default="native")
    p.add_argument("--llamacpp-bin", default=None, help="with one --variant only")
    p.add_argument("--cache-dir", type=Path, default=CACHE_DIR)
    p.add_argument("--no-build", action="store_true", help="only look, never build")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    args = p.parse_args(argv)
    for variant in VARIANTS if args.variant == "both" else [args.variant]:
        explicit = None if args.variant == "both" else args.llamacpp_bin
        print(ensure_server(explicit, args.cache_dir, not args.no_build, args.jobs, variant))


if __name__ == "__main__":
    main()
