"""Compile the Triton launches a CPU test makes for an H100/H200 (sm_90), without a GPU.

`record_launches()` records every kernel launch made under the interpreter (its kernel and the
arguments it was called with), without running it; `compile_sm90(specs)` compiles them for
sm_90 through Triton's own compiler and ptxas in a process without the interpreter, and returns
the register and local-memory (spill) use cuobjdump reads from each binary, and the opcodes of
its longest loop. What only the compiler rejects (globals that are not constexpr, unsupported
ops) fails here, where the interpreter runs it happily.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

TARGET = GPUTarget("cuda", 90, 32)
_TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16",
          torch.int8: "i8", torch.uint8: "u8", torch.int32: "i32", torch.int64: "i64",
          torch.bool: "i1", torch.float8_e4m3fn: "fp8e4nv"}
_OPTIONS = ("num_warps", "num_stages")


@dataclass
class Launch:
    fn: object  # the kernel's Python function
    args: dict  # parameter name -> value
    options: dict  # num_warps, num_stages


@contextlib.contextmanager
def record_launches():
    """Yields a list that fills with the Launch of every interpreted kernel launch. The kernels
    do not run (interpreted, they would take minutes at a GPU benchmark's shapes): their
    outputs keep whatever was allocated, and the specs depend only on arguments' types, sizes
    and alignment."""
    launches: list[Launch] = []
    run = InterpretedFunction.run

    def recording(self, *args, grid, warmup, **kwargs):
        names = JITFunction(self.fn).arg_names  # the positional arguments come first
        options = {k: kwargs.pop(k) for k in _OPTIONS if k in kwargs}
        positional = dict(zip(names[:len(args)], args, strict=True))
        launches.append(Launch(self.fn, {**positional, **kwargs}, options))

    InterpretedFunction.run = recording
    try:
        yield launches
    finally:
        InterpretedFunction.run = run


def _signature(jit: JITFunction, args: dict) -> tuple[dict, dict, dict]:
    """Triton's JIT specialization of the arguments: types, constexprs (ints equal to 1 become
    the constant 1) and the 16-divisibility hints of pointers and ints that vectorize loads."""
    sig, consts, aligned = {}, {}, []
    for i, p in enumerate(jit.params):
        v = args.get(p.name, p.default)
        if p.is_constexpr or (type(v) is int and v == 1 and not p.do_not_specialize):
            sig[p.name], consts[p.name] = "constexpr", v
        elif isinstance(v, torch.Tensor):
            sig[p.name] = "*" + _TYPES[v.dtype]
            aligned += [i] if v.data_ptr() % 16 == 0 else []
        elif isinstance(v, bool):
            sig[p.name] = "i1"
        elif isinstance(v, int):
            sig[p.name] = "i32" if -2**31 <= v < 2**31 else "i64"
            aligned += [i] if v % 16 == 0 and not p.do_not_specialize else []
        elif isinstance(v, float):
            sig[p.name] = "fp32"
        else:
            raise TypeError(f"{p.name}: no Triton type for {type(v).__name__}")
    return sig, consts, {str(i): True for i in aligned}


def spec(launch: Launch) -> dict:
    """A launch as JSON: the kernel's module and name, its signature, constexprs, the indices
    of its 16-aligned arguments, and options."""
    sig, consts, aligned = _signature(JITFunction(launch.fn), launch.args)
    return dict(module=launch.fn.__module__, name=launch.fn.__name__, signature=sig,
                constexprs=consts, aligned=aligned, options=launch.options)


def compile_sm90(specs: list[dict]) -> list[dict]:
    """Each spec compiled for sm_90 in fresh processes, one a core (kernels imported as
    compiled, not interpreted, functions): {"regs", "spill" (stack bytes per thread), "loop"
    (`loop_ops`)} or {"error"}, in the order of `specs`."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    n = min(len(specs), os.cpu_count() or 1)
    shares = [specs[i::n] for i in range(n)]
    procs = [subprocess.Popen([sys.executable, "-m", "tests.sm90"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for _ in shares]  # one compiler process a core, each given every n-th spec
    outs = [p.communicate(json.dumps(share)) for p, share in zip(procs, shares, strict=True)]
    for p, (_, err) in zip(procs, outs, strict=True):
        if p.returncode:
            raise RuntimeError(f"tests.sm90 exited {p.returncode}: {err[-2000:]}")
    results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    return [results[i % n][i // n] for i in range(len(specs))]


def loop_ops(sass: str) -> dict[str, int]:
    """The opcodes (predicates and modifiers dropped) of the longest loop in a kernel's SASS,
    the span from a backward branch's target to the branch, counted."""
    line = r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9]*)([^;]*);"  # [@P0] OP.X ...;
    ops = [(int(m.group(1), 16), m.group(2), m.group(3)) for m in re.finditer(line, sass)]
    loops = [(int(t.group(1), 16), addr) for addr, op, rest in ops if op == "BRA"
             and (t := re.search(r"0x([0-9a-f]+)", rest)) and int(t.group(1), 16) < addr]
    if not loops:
        return {}
    lo, hi = max(loops, key=lambda span: span[1] - span[0])
    return dict(Counter(op for addr, op, _ in ops if lo <= addr <= hi))


def _compile_one(s: dict) -> dict:
    jit = getattr(importlib.import_module(s["module"]), s["name"])
    try:
        attrs = {(int(i),): [["tt.divisibility", 16]] for i in s.get("aligned", {})}
        kernel = triton.compile(ASTSource(fn=jit, signature=s["signature"],
                                          constexprs=s["constexprs"], attrs=attrs),
                                target=TARGET, options=s["options"])
    except Exception as exc:  # reported per kernel, asserted by the test
        return {"error": f"{type(exc).__name__}: {exc}"[:2000]}
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage, sass = (subprocess.run([cuobjdump, flag, f.name], check=True, capture_output=True,
                                      text=True).stdout for flag in ("--dump-resource-usage",
                                                                     "-sass"))
    regs, stack = (int(re.search(rf"{key}:(\d+)", usage).group(1)) for key in ("REG", "STACK"))
    return {"regs": regs, "spill": stack, "loop": loop_ops(sass)}


if __name__ == "__main__":
    print(json.dumps([_compile_one(s) for s in json.load(sys.stdin)]))
