"""ZeroMQ plumbing: typed PUSH/PULL endpoints over the codec.

Sync endpoints serve the tokenizer, compute and detokenizer loops (compute polls with a zero
timeout while it has work, so a step never waits on a socket); `AsyncReceiver`/`AsyncSender`
serve the gateway's asyncio loop. Addresses are zmq URLs: ipc://path or tcp://host:port.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio

from pipellm.shared.codec import DecodeError, decode, encode

log = logging.getLogger(__name__)
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)  # plain ints: `&` on pyzmq's enums builds
# a Python enum object a call


def _socket(ctx: zmq.Context, kind: int, addr: str, bind: bool) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if kind == zmq.PUSH:
        sock.setsockopt(zmq.SNDHWM, 0)  # never drop or block on a slow peer's queue
    else:
        sock.setsockopt(zmq.RCVHWM, 0)
    (sock.bind if bind else sock.connect)(addr)
    return sock


def _decode(data: bytes) -> Any | None:
    try:
        return decode(data)
    except DecodeError as e:  # a bad peer must not take the service down
        log.warning("dropping message: %s", e)
        return None


class Sender:
    def __init__(self, ctx: zmq.Context, addr: str, bind: bool = False):
        self.sock = _socket(ctx, zmq.PUSH, addr, bind)

    def send(self, msg: Any) -> None:
        self.sock.send(encode(msg), copy=False)


class Receiver:
    def __init__(self, ctx: zmq.Context, addr: str, bind: bool = True):
        self.sock = _socket(ctx, zmq.PULL, addr, bind)

    def recv(self, timeout_ms: int | None = None) -> Any | None:
        """One message, waiting up to timeout_ms (None: forever); None on timeout."""
        if timeout_ms is not None and not self.sock.poll(timeout_ms):
            return None
        return _decode(self.sock.recv(copy=False).bytes)

    def drain(self) -> list[Any]:
        """Every message already queued, without waiting."""
        out = []
        while True:
            try:
                data = self.sock.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return out
            msg = _decode(data.bytes)
            if msg is not None:
                out.append(msg)


class Senders:
    """PUSH sockets by destination address, connected on first use (replies to gateways)."""

    def __init__(self, ctx: zmq.Context):
        self.ctx = ctx
        self._by_addr: dict[str, Sender] = {}

    def send(self, addr: str, msg: Any) -> None:
        sender = self._by_addr.get(addr)
        if sender is None:
            sender = self._by_addr[addr] = Sender(self.ctx, addr)
        sender.send(msg)


class AsyncSender:
    def __init__(self, ctx: zmq.asyncio.Context, addr: str, bind: bool = False):
        self.sock = _socket(ctx, zmq.PUSH, addr, bind)

    async def send(self, msg: Any, wait_ms: int = 0) -> bool:
        """Queue msg; if no peer is connected to take it, wait up to wait_ms for one.
        False if none came (the caller decides whether that is an error)."""
        data = encode(msg)
        for attempt in range(2):
            try:
                await self.sock.send(data, flags=zmq.NOBLOCK, copy=False)
                return True
            except zmq.Again:
                if attempt or not wait_ms or not await self.sock.poll(wait_ms, zmq.POLLOUT):
                    return False
        return False


class AsyncReceiver:
    """A PULL socket read on the asyncio loop: each time its FD signals, every message queued is
    handed to `handle` in order, with no Future per message (zmq.asyncio's recv makes one). The
    FD is edge-triggered, so a wake-up drains until ZMQ_EVENTS shows nothing left."""

    def __init__(self, ctx: zmq.Context, addr: str, bind: bool = True):
        self.sock = _socket(zmq.Context.shadow(ctx.underlying), zmq.PULL, addr, bind)

    async def serve(self, handle: Callable[[Any], None]) -> None:
        """Deliver every message to `handle` until cancelled; a handler's error is logged and
        the next message delivered."""
        loop = asyncio.get_running_loop()
        fd = self.sock.getsockopt(zmq.FD)
        loop.add_reader(fd, self._drain, handle)
        try:
            self._drain(handle)  # what came before the reader was added
            await loop.create_future()  # never done: the reader delivers
        finally:
            loop.remove_reader(fd)

    def _drain(self, handle: Callable[[Any], None]) -> None:
        while self.sock.getsockopt(_EVENTS) & _POLLIN:
            msg = _decode(self.sock.recv(zmq.NOBLOCK))
            if msg is None:
                continue
            try:
                handle(msg)
            except Exception:  # noqa: BLE001 - one bad message must not stop the rest
                log.exception("handling %s failed", type(msg).__name__)


class Fanout:
    """One message to every one of several peers: control messages to every compute process
    (the one holding a request is not known where aborts come from)."""

    def __init__(self, senders: list[Sender]):
        self.senders = senders

    def send(self, msg: Any) -> None:
        for s in self.senders:
            s.send(msg)


class AsyncFanout:
    def __init__(self, senders: list[AsyncSender]):
        self.senders = senders

    async def send(self, msg: Any, wait_ms: int = 0) -> bool:
        """True if every peer took it (AsyncSender.send)."""
        sent = [await s.send(msg, wait_ms) for s in self.senders]
        return all(sent)
