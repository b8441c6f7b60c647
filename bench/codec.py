"""The wire codec's cost per streamed token: encoding and decoding the DeltaBatch a step sends
the gateway (what the detokenizer and the gateway pay for every token they stream), with
pipellm/shared/codec.py as it is against a baseline measured in the same run: the same codec sending
every field, as it did before fields at their defaults stayed off the wire.

Messages: --deltas one-token deltas in a batch (a decode step's worth of streams), no logprobs.

    python -m bench.codec [--deltas 256] [--rounds 5]

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from array import array
from pathlib import Path

import msgpack

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # also runnable as `python bench/codec.py`
    sys.path.insert(0, str(ROOT))

from bench.common import log  # noqa: E402
from pipellm.shared import codec  # noqa: E402
from pipellm.shared.messages import Delta, DeltaBatch, Tokens  # noqa: E402

_NAMES: dict[type, tuple[str, ...]] = {}


def every_field(obj):
    """The baseline's encoder hook: a registered dataclass with all its init fields, their
    names looked up once per class (as the codec did)."""
    names = _NAMES.get(type(obj))
    if names is None:
        if not hasattr(obj, "__dataclass_fields__"):
            return codec._default(obj)  # arrays
        names = _NAMES[type(obj)] = tuple(n for n, f in obj.__dataclass_fields__.items()
                                          if f.init)
    out = {"_t": type(obj).__name__}
    for name in names:
        out[name] = getattr(obj, name)
    return out


def batch(n: int) -> DeltaBatch:
    return DeltaBatch([Delta(f"cmpl-{i:032x}:0.0", " word", Tokens(
        f"cmpl-{i:032x}:0.0", 300 + i, array("i", [1234 + i]), array("f", [-0.5])),
        num_prompt=200, num_output=i + 1) for i in range(n)])


def per_delta_us(fn, n: int, reps: int) -> float:
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps / n * 1e6


def measure(msg: DeltaBatch, n: int, reps: int) -> dict[str, dict[str, float]]:
    data = {"fields at defaults left out": codec.encode(msg),
            "every field (baseline)": msgpack.packb(msg, default=every_field,
                                                    use_bin_type=True)}
    encoders = {"fields at defaults left out": lambda: codec.encode(msg),
                "every field (baseline)": lambda: msgpack.packb(msg, default=every_field,
                                                                use_bin_type=True)}
    for raw in data.values():
        assert codec.decode(raw) == msg
    return {name: {"encode_us": per_delta_us(encoders[name], n, reps),
                   "decode_us": per_delta_us(lambda raw=raw: codec.decode(raw), n, reps),
                   "bytes": len(raw) / n} for name, raw in data.items()}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--deltas", type=int, default=256)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--reps", type=int, default=200, help="calls timed a round")
    args = p.parse_args(argv)
    msg = batch(args.deltas)
    rounds = [measure(msg, args.deltas, args.reps) for _ in range(args.rounds)]
    res = {name: {k: round(statistics.median(r[name][k] for r in rounds), 2)
                  for k in rounds[0][name]} for name in rounds[0]}
    now, base = res["fields at defaults left out"], res["every field (baseline)"]
    for name, r in res.items():
        log(f"{name}: encode {r['encode_us']} us, decode {r['decode_us']} us, "
            f"{r['bytes']} bytes a delta")
    ratios = {k: round(base[k] / now[k], 2) for k in now}
    print(f"medians of {args.rounds} rounds, {args.deltas} one-token deltas a batch: "
          f"baseline / now: encode {ratios['encode_us']}x, decode {ratios['decode_us']}x, "
          f"bytes {ratios['bytes']}x")
    out = {"deltas": args.deltas, "rounds": args.rounds, "per_delta": res,
           "speedup": ratios}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
