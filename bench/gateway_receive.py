"""The gateway's receive loop: CPU per message of pipellm/shared/transport.AsyncReceiver (now: the
socket's FD on the asyncio loop, each wake-up draining every queued message) against a baseline
measured in the same run, the loop the gateway ran before (zmq.asyncio's `await recv()`, one
Future per message).

A real zmq PUSH in another process sends one-token DeltaBatch messages, as the detokenizer
sends them at batch 1, either paced (--gap-ms apart: one stream) or in one burst; the
receiving process decodes each and hands it to a handler that counts it. Reported: us of the
receiving process's CPU per message (time.process_time from the first message to the last),
medians of --rounds, variants alternating.

    python -m bench.gateway_receive [--messages 3000] [--gap-ms 2] [--rounds 3]

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
from array import array
from pathlib import Path

import zmq
import zmq.asyncio

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # also runnable as `python bench/gateway_receive.py`
    sys.path.insert(0, str(ROOT))

from bench.common import log  # noqa: E402
from pipellm.shared.codec import decode, encode  # noqa: E402
from pipellm.shared.messages import Delta, DeltaBatch, Tokens  # noqa: E402
from pipellm.shared.transport import AsyncReceiver  # noqa: E402


def send(addr: str, messages: int, gap_s: float) -> None:
    """The detokenizer's side: `messages` one-token batches, gap_s apart (0: a burst)."""
    sock = zmq.Context().socket(zmq.PUSH)
    sock.connect(addr)
    time.sleep(0.3)  # the receiver is serving before the first message
    for i in range(messages):
        one = Tokens("cmpl-1:0", i, array("i", [i % 49152]), array("f", [-0.25]))
        sock.send(encode(DeltaBatch([Delta("cmpl-1:0", " word", one, num_prompt=190,
                                           num_output=i + 1)])))
        if gap_s:
            time.sleep(gap_s)
    sock.close(linger=-1)


async def baseline(ctx: zmq.asyncio.Context, addr: str, handle) -> None:
    """The gateway's loop before: a zmq.asyncio PULL socket awaited once per message."""
    sock = ctx.socket(zmq.PULL)
    sock.bind(addr)
    try:
        while True:
            handle(decode((await sock.recv(copy=False)).bytes))
    finally:
        sock.close(0)


async def now(ctx: zmq.asyncio.Context, addr: str, handle) -> None:
    inbox = AsyncReceiver(ctx, addr)
    try:
        await inbox.serve(handle)
    finally:
        inbox.sock.close(0)


async def receive(serve, messages: int, gap_s: float, work: str) -> float:
    """us of this process's CPU per message while `serve` takes `messages` from a sender."""
    addr = f"ipc://{work}/gw"
    got, marks = [0], {}
    done = asyncio.get_running_loop().create_future()

    def handle(msg: DeltaBatch) -> None:
        got[0] += 1
        if got[0] == 1:
            marks["start"] = time.process_time()
        if got[0] == messages and not done.done():
            marks["end"] = time.process_time()
            done.set_result(None)

    task = asyncio.create_task(serve(zmq.asyncio.Context.instance(), addr, handle))
    sender = mp.get_context("spawn").Process(target=send, args=(addr, messages, gap_s))
    sender.start()
    await asyncio.wait_for(done, timeout=60 + messages * gap_s * 2)
    task.cancel()
    sender.join()
    return (marks["end"] - marks["start"]) * 1e6 / (messages - 1)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--messages", type=int, default=3000)
    p.add_argument("--gap-ms", type=float, default=2.0, help="paced mode's gap (a burst too)")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    result: dict = {"messages": args.messages}
    with tempfile.TemporaryDirectory() as work:
        for mode, gap_s in (("paced", args.gap_ms / 1e3), ("burst", 0.0)):
            us = {"now": [], "baseline": []}
            for r in range(args.rounds):
                for name, serve in (("baseline", baseline), ("now", now)):
                    us[name].append(asyncio.run(receive(serve, args.messages, gap_s, work)))
                    log(f"{mode} round {r + 1} {name}: {us[name][-1]:.1f} us/message")
            med = {k: statistics.median(v) for k, v in us.items()}
            ratio = med["baseline"] / med["now"]
            print(f"{mode:6s} now {med['now']:.1f} us/message, baseline {med['baseline']:.1f}: "
                  f"baseline / now {ratio:.2f}x")
            result[mode] = {"now_us": round(med["now"], 2),
                            "baseline_us": round(med["baseline"], 2), "ratio": round(ratio, 2)}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
