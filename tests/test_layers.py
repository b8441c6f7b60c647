"""Compute's import picture: every arrow points down a floor (or stays in its room).

Floors, lowest first: `core/` (the types every room uses), then `kv/`, then `model/`,
`length/`, `speculative/` (the proposers) and `beam/`, then `scheduling/`, the grammars
(`structured`) and the LoRA adapters' loading (`lora`), then the step's device-side helpers
(and `pooling`, which builds a prefill-only batch of its own, and `step_stats`, what the steps
ran), then tensor parallelism (`tp`: a rank's model, with its adapters and scoring rows), then
the runners, the engine, and the process and backend wiring on top (and the simulated cluster
of engines, `sim_cluster`). A module may import its own room or lower floors.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "pipellm" / "services" / "compute"
FLOORS = {
    "core": 0,
    "kv": 1,
    "model": 2, "length": 2, "speculative": 2, "beam": 2,
    "scheduling": 3, "inflight": 3, "structured": 3, "lora": 3,
    "batch": 4, "cuda_graphs": 4, "sampling": 4, "drafter": 4, "pooling": 4, "step_stats": 4,
    "tp": 5,
    "runner": 6, "sim": 6,
    "engine": 7,
    "backend": 8, "warmup": 8, "compute_core": 8, "embed_core": 8,
    "service": 9, "sim_cluster": 9, "tp_worker": 9, "tp_node": 9,
}


def _room(module: str) -> str:
    """pipellm.services.compute.<room>[.rest] -> room."""
    return module.split(".")[3]


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and \
                node.module.startswith("pipellm.services.compute."):
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("pipellm.services.compute."))
    return out


def test_every_compute_module_has_a_floor():
    rooms = {p.stem if p.parent == ROOT else p.relative_to(ROOT).parts[0]
             for p in ROOT.rglob("*.py") if p.name != "__init__.py" or p.parent != ROOT}
    assert rooms <= set(FLOORS), f"give these a floor: {sorted(rooms - set(FLOORS))}"


def test_no_import_runs_back_up():
    upward = []
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT)
        if rel == Path("__init__.py"):
            continue
        room = rel.parts[0].removesuffix(".py")
        for target in _imports(path):
            other = _room(target)
            if other != room and FLOORS[other] >= FLOORS[room]:
                upward.append(f"{rel} -> {target}")
    assert not upward, "imports that run up or sideways:\n" + "\n".join(sorted(upward))
