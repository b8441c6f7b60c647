"""The gateway's receiver (pipellm/shared/transport.AsyncReceiver) over real zmq sockets: every
message reaches the handler in order, whether it was queued before `serve` began or arrives in
bursts after; an undecodable message is dropped and a handler's error is logged, and neither stops
the messages behind it."""

import asyncio
import contextlib
import logging

import zmq
import zmq.asyncio

from pipellm.shared import codec
from pipellm.shared.messages import Delta, DeltaBatch
from pipellm.shared.transport import AsyncReceiver


def batch(i: int) -> bytes:
    return codec.encode(DeltaBatch([Delta(f"r:{i}", str(i))]))


def test_serve_delivers_every_message_in_order_and_survives_bad_ones(tmp_path, caplog):
    addr = f"ipc://{tmp_path}/gw"

    async def main() -> list[int]:
        ctx = zmq.asyncio.Context()
        inbox = AsyncReceiver(ctx, addr)
        push = zmq.Context.shadow(ctx.underlying).socket(zmq.PUSH)
        push.connect(addr)
        got: list[int] = []

        def handle(msg: DeltaBatch) -> None:
            i = int(msg.deltas[0].text)
            if i == 7:
                raise RuntimeError("handler broke on 7")
            got.append(i)

        for i in range(5):  # queued before anyone serves
            push.send(batch(i))
        await asyncio.sleep(0.05)
        task = asyncio.create_task(inbox.serve(handle))
        push.send(b"\xc1 not msgpack")
        for burst in (range(5, 50), range(50, 300)):
            for i in burst:
                push.send(batch(i))
            await asyncio.sleep(0)
        for _ in range(200):
            if len(got) == 299:
                break
            await asyncio.sleep(0.01)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task  # its reader removed before the socket closes
        push.close(0)
        inbox.sock.close(0)
        return got

    with caplog.at_level(logging.WARNING, logger="pipellm.shared.transport"):
        got = asyncio.run(main())
    assert got == [i for i in range(300) if i != 7]
    assert "handler broke on 7" in caplog.text and "dropping message" in caplog.text
