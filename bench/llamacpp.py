"""llama.cpp's C++ server (`llama-server`), the CPU peer for GGUF models: find it, or build it.

`llama-server` is OpenAI-compatible and batches continuously over `-np` parallel slots (`-c` is
the total context, split across them); it honours `ignore_eos` on /v1/completions, so
pipellm-bench drives it like pipellm and vLLM. (The Python package's own server is a
different, one-request-at-a-time wrapper: not the peer.)

Where it is looked for, in order: `--llamacpp-bin`, `$LLAMA_SERVER`, the cache
(`~/.cache/pipellm/peers/llama.cpp/build/bin/llama-server`), `llama-server` on PATH. Else it is
built from the llama.cpp source that the `llama-cpp-python` sdist on the package index carries
(vendor/llama.cpp), for this CPU (`GGML_NATIVE=ON`: AVX-512, VNNI and BF16 where the CPU has
them), into the cache; about 7 minutes on 2 cores:

    pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36
    cmake -S .../vendor/llama.cpp -B CACHE/build -DGGML_NATIVE=ON -DLLAMA_CURL=OFF ...
    cmake --build CACHE/build --target llama-server -j2

    python -m bench.llamacpp [--llamacpp-bin PATH] [--cache-dir DIR] [--no-build]

prints where the server is (building it first if needed).
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
BINARY = Path("build/bin/llama-server")  # under the cache dir
ENV_VAR = "LLAMA_SERVER"
CMAKE_FLAGS = ["-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
               "-DLLAMA_BUILD_EXAMPLES=OFF", "-DCMAKE_BUILD_TYPE=Release"]
READY_PATH = "/health"  # 503 while the model loads, 200 once it takes requests


def say(msg: str) -> None:
    print(f"[llama.cpp] {msg}", file=sys.stderr, flush=True)


def find_server(explicit: str | None = None, cache_dir: Path = CACHE_DIR) -> Path | None:
    """`explicit` if given (FileNotFoundError if it is not an executable), else the first
    llama-server that exists: $LLAMA_SERVER, the cache, PATH."""
    usable = lambda c: bool(c) and Path(c).is_file() and os.access(c, os.X_OK)
    if explicit:
        if not usable(explicit):
            raise FileNotFoundError(f"no executable llama-server at {explicit}")
        return Path(explicit)
    candidates = [os.environ.get(ENV_VAR), str(cache_dir / BINARY), shutil.which("llama-server")]
    return next((Path(c) for c in candidates if usable(c)), None)


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


def build_server(cache_dir: Path = CACHE_DIR, jobs: int = 2) -> Path:
    """Configure and build llama-server from the sdist's source into `cache_dir`/build."""
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            raise RuntimeError(f"building llama.cpp needs {tool} (apt-get install cmake g++)")
    tree = fetch_source(cache_dir)
    build = cache_dir / "build"
    say(f"configuring: cmake -S {tree} -B {build} {' '.join(CMAKE_FLAGS)}")
    run_step(["cmake", "-S", str(tree), "-B", str(build), *CMAKE_FLAGS])
    say(f"building llama-server with {jobs} jobs (about 7 minutes on 2 cores)")
    run_step(["cmake", "--build", str(build), "--target", "llama-server", f"-j{jobs}"])
    binary = cache_dir / BINARY
    if not binary.is_file():
        raise RuntimeError(f"the build finished without {binary}")
    say(f"built {binary}")
    return binary


def ensure_server(explicit: str | None = None, cache_dir: Path = CACHE_DIR,
                  build: bool = True, jobs: int = 2) -> Path:
    """A llama-server to run: found, else built (unless `build` is False)."""
    found = find_server(explicit, cache_dir)
    if found is not None:
        say(f"using {found}")
        return found
    if not build:
        raise FileNotFoundError("llama-server not found (give --llamacpp-bin or let it build)")
    say(f"llama-server not found (--llamacpp-bin, ${ENV_VAR}, {cache_dir / BINARY}, PATH): "
        "building it")
    return build_server(cache_dir, jobs)


def server_argv(binary: str | Path, gguf: str | Path, port: int, threads: int = 2,
                slots: int = 16, ctx: int = 32768) -> list[str]:
    """`llama-server` on `gguf`: `threads` threads, `slots` parallel slots sharing `ctx`."""
    return [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
            "-t", str(threads), "-np", str(slots), "-c", str(ctx)]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--llamacpp-bin", default=None)
    p.add_argument("--cache-dir", type=Path, default=CACHE_DIR)
    p.add_argument("--no-build", action="store_true", help="only look, never build")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    args = p.parse_args(argv)
    print(ensure_server(args.llamacpp_bin, args.cache_dir, not args.no_build, args.jobs))


if __name__ == "__main__":
    main()
