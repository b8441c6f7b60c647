"""The C++ CPU kernels' first build: how long a fresh machine (setup.sh, a Docker image build, a
compute start with an empty cache) compiles them, against a baseline revision's kernels.

Each round builds both from scratch, in turns, into empty extension caches
(TORCH_EXTENSIONS_DIR in a temporary folder), with `python -m pipellm.kernels.cpu`, the command
setup.sh runs: the baseline's source tree as `git archive` gives it at `--baseline`, and this
one.
Reported: each build's wall-clock seconds, the ratio baseline / this tree (above 1: this tree
builds faster), and the slowest objects of each (ninja's log). The last line is one JSON
object.

    python -m bench.kernel_build [--baseline b714119] [--rounds 1]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import log, machine  # noqa: E402

# the last revision whose kernel sources each included <torch/extension.h>
BASELINE = "b714119"


def export(rev: str, into: Path) -> Path:
    """The source tree at git revision `rev`, unpacked into `into`."""
    into.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def kernels_module(src: Path) -> str:
    """The module that builds the kernels in the source tree `src` (`python -m` it)."""
    return "pipellm.kernels.cpu" if (src / "pipellm" / "kernels").is_dir() else "kernels.cpu"


def objects(ext_dir: Path) -> dict[str, float]:
    """Seconds each object took to compile, from ninja's log in the build folder."""
    out = {}
    for ninja_log in ext_dir.rglob(".ninja_log"):
        for line in ninja_log.read_text().splitlines():
            fields = line.split("\t")
            if len(fields) == 5 and not line.startswith("#"):
                out[fields[3]] = (int(fields[1]) - int(fields[0])) / 1e3
    return out


def build(src: Path, ext: Path) -> tuple[float, dict[str, float]]:
    """Wall-clock seconds of `python -m pipellm.kernels.cpu` in the source tree `src`, into the
    empty cache `ext`, and its objects' seconds; RuntimeError if the build failed."""
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(ext), "PYTHONPATH": str(src)}
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", kernels_module(src)], cwd=src, env=env,
                          capture_output=True, text=True)
    seconds = time.perf_counter() - t
    if proc.returncode != 0 or "unavailable" in proc.stdout:
        raise RuntimeError(f"the build in {src} failed:\n{proc.stdout}\n{proc.stderr[-2000:]}")
    return seconds, objects(ext)


def slowest(objs: dict[str, float], n: int = 4) -> str:
    return ", ".join(f"{name} {s:.0f} s" for name, s in
                     sorted(objs.items(), key=lambda kv: -kv[1])[:n])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--baseline", default=BASELINE, help="git revision of the baseline kernels")
    p.add_argument("--rounds", type=int, default=1)
    args = p.parse_args()
    log(machine())
    walls: dict[str, list[float]] = {"baseline": [], "tree": []}
    objs: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="kernel-build-") as tmp:
        for r in range(args.rounds):
            baseline = export(args.baseline, Path(tmp) / f"baseline-{r}")
            for name, src in (("baseline", baseline), ("tree", ROOT)):
                ext = Path(tmp) / f"ext-{name}-{r}"
                seconds, objs[name] = build(src, ext)
                walls[name].append(seconds)
                log(f"round {r + 1} {name}: {seconds:.1f} s; slowest: {slowest(objs[name])}")
                shutil.rmtree(ext)
            shutil.rmtree(baseline)
    base, tree = (statistics.median(walls[k]) for k in ("baseline", "tree"))
    print(f"first build of the C++ CPU kernels: this tree {tree:.1f} s, baseline "
          f"({args.baseline}) {base:.1f} s: {base / tree:.2f}x faster")
    print(json.dumps({"bench": "kernel_build", "machine": machine(), "baseline": args.baseline,
                      "rounds": args.rounds, "baseline_s": round(base, 1),
                      "tree_s": round(tree, 1), "speedup": round(base / tree, 2),
                      "slowest_tree": slowest(objs["tree"]),
                      "slowest_baseline": slowest(objs["baseline"])}))


if __name__ == "__main__":
    main()
