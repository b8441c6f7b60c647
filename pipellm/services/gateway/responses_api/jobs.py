"""Background responses: each runs in a task of the gateway that started it, not of any HTTP
request; its output goes to the store delta by delta (run.Run.background). A gateway that
restarts continues the ones it was running (`resume`): each is submitted again with the tokens
its record holds, as a restarted compute's requests are (inflight.Registry's Resume).
`follow` streams a background response's events from the store, from any sequence number on,
while it runs or after.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time

from aiohttp import web

from pipellm.services.gateway.errors import APIError
from pipellm.services.gateway.inflight import Registry
from pipellm.services.gateway.responses_api.output import ResponseOutput
from pipellm.services.gateway.responses_api.run import CANCEL_STATUS, Run, feed, sse
from pipellm.services.gateway.responses_api.store import TERMINAL, ResponseStore
from pipellm.shared.choice import ChoiceId
from pipellm.shared.messages import Abort, Delta

log = logging.getLogger("pipellm.gateway")
POLL_S = 0.05  # how often a follower reads the store for new records
STALL_S = 120.0  # a follower gives up (with an error event) after this long without one
CANCEL_WAIT_S = 5.0  # a cancelled response's task has this long to end on its own


class Jobs:
    def __init__(self, gateway, store: ResponseStore, parse):
        self.gw, self.store, self.parse = gateway, store, parse
        self.tasks: dict[str, asyncio.Task] = {}  # response id -> its task
        self.inflights: dict[str, object] = {}  # response id -> its task's Inflight

    async def start(self, run: Run, attempt: int = 0, records: list[dict] | None = None):
        """Submit `run` and generate it in a task; `records`: its output so far (a resume,
        whose choice continues as attempt `attempt`)."""
        rid, obj = run.request_record["rid"], run.obj
        seed = run.request_record.get("seed")
        if records is None:
            await self.store.save(obj, run.request_record, run.parsed.input_items)
        await self.store.running(obj["id"], True)
        try:
            inflight = await self.gw.submit(run.req, rid, seed, send=records is None)
        except APIError:
            if records is None:  # refused (not ready, ...): nothing to keep
                await self.store.delete(obj["id"])
            raise
        if records is None:
            run.request_record["seed"] = inflight.tokenize[0].params.seed
        else:
            self._continue(run, inflight, attempt, records)
        obj["status"] = "in_progress"
        await self.store.save(obj, dict(run.request_record, attempt=attempt))
        self.inflights[obj["id"]] = inflight
        self.tasks[obj["id"]] = asyncio.create_task(self._run(run, inflight))

    def _continue(self, run: Run, inflight, attempt: int, records: list[dict]) -> None:
        """The choice as the records have it, resumed as `attempt` (the tokenizers get it)."""
        c = inflight.choices[0]
        for r in records:
            feed(run.out, r)
            c.text.append(r["t"])
            if r["r"]:
                c.reasoning.append(r["r"])
            c.token_ids.extend(r["ids"])
        c.attempt = attempt
        if records and records[-1]["last"]:  # it had all its tokens: it ends here
            inflight.deltas.put_nowait(Delta(inflight.request_id + c.id_suffix,
                                             finish_reason="stop"))
            inflight.tokenize = [dataclasses.replace(inflight.tokenize[0], resume=[])]
            return
        resume = Registry._resume_choice(inflight, inflight.tokenize[0], c)
        inflight.tokenize = [dataclasses.replace(inflight.tokenize[0],
                                                 resume=[resume] if resume else [])]

    async def _run(self, run: Run, inflight) -> None:
        rid = inflight.request_id
        try:
            resumed = inflight.tokenize and inflight.tokenize[0].resume
            if resumed and not await self.gw.send_tokenize(inflight.tokenize[0]):
                inflight.fail("No tokenizer worker is connected to continue the response.")
            await run.background(inflight)
        except Exception:  # the store is down: logged, the record stays in progress
            log.exception("background response %s failed", run.obj["id"])
        finally:
            if run.obj["status"] == "cancelled":
                await self.gw._abort_ids([rid], "aborted")
            self.gw.registry.remove(rid)
            self.tasks.pop(run.obj["id"], None)
            self.inflights.pop(run.obj["id"], None)
            with contextlib.suppress(APIError):
                await self.store.running(run.obj["id"], False)

    async def cancel_local(self, response_id: str) -> bool:
        """Stop the task of a response this gateway runs (False: none here): its queue of
        deltas gets a cancel error, which its loop ends on (writing the cancelled end), and
        only a task that has not ended CANCEL_WAIT_S later is cancelled outright."""
        task, inflight = self.tasks.get(response_id), self.inflights.get(response_id)
        if task is None:
            return False
        if inflight is not None:
            inflight.fail("cancelled by the client", CANCEL_STATUS)
            await asyncio.wait({task}, timeout=CANCEL_WAIT_S)
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        return True

    async def cancel(self, record: dict) -> dict:
        """Cancel a background response: the one this gateway runs stops (its record says
        cancelled); a finished one is answered as it is."""
        obj = record["response"]
        if record["state"] in TERMINAL or not await self.cancel_local(obj["id"]):
            return obj
        return (await self.store.load(obj["id"]))["response"]

    async def snapshot(self, record: dict) -> dict:
        """A running background response as it stands: its output so far."""
        obj = record["response"]
        out = replay(self.parse, record)
        for r in await self.store.records(obj["id"]):
            if "end" not in r:
                feed(out, r)
        return out.snapshot()

    async def resume(self) -> None:
        """Continue the background responses this server was running when it stopped."""
        for response_id in await self.store.running_ids():
            if response_id in self.tasks:
                continue
            record = await self.store.load(response_id)
            if record is None or record["state"] in TERMINAL or record["request"] is None:
                await self.store.running(response_id, False)
                continue
            request, obj = record["request"], record["response"]
            records = await self.store.records(response_id)
            if any("end" in r for r in records):
                await self.store.running(response_id, False)
                continue
            attempt = int(request.get("attempt", 0)) + 1
            await self.gw.to_control.send(Abort(request["rid"] + str(
                ChoiceId("", 0, attempt - 1))))  # the lost attempt, if compute still runs it
            run = Run(self.gw, self.parse(request["body"], request["history"]),
                      dict(obj, output=[]), self.store, request)
            log.info("continuing background response %s (%d deltas stored)", response_id,
                     len(records))
            await self.start(run, attempt, records)


def replay(parse, record: dict, **fields) -> ResponseOutput:
    """A stored response's output before its first delta (its request parsed again, its
    object with `fields` changed), to feed its records to."""
    request = record["request"]
    return ResponseOutput(parse(request["body"], request["history"]).req,
                          dict(record["response"], output=[], **fields))


async def follow(request: web.Request, store: ResponseStore, parse, response_id: str,
                 after: int) -> web.StreamResponse:
    """Stream a background response's events with sequence_number > `after`: those its
    records give now, then new ones as they are written, until its end."""
    record = await store.load(response_id)
    out = replay(parse, record, status="in_progress")
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                       "Cache-Control": "no-cache"})
    await resp.prepare(request)
    pending, read, last = out.start(), 0, time.monotonic()
    while True:
        for event in pending:
            if event["sequence_number"] > after:
                await resp.write(sse(event))
        if pending and pending[-1]["type"] in ("response.completed", "response.incomplete",
                                               "response.failed", "response.cancelled"):
            break
        records = await store.records(response_id, read)
        read += len(records)
        pending = []
        for r in records:
            pending += out.finish(r["end"], r["usage"], r.get("error")) if "end" in r \
                else feed(out, r)
        if records:
            last = time.monotonic()
        elif time.monotonic() - last > STALL_S:
            await resp.write(sse({"type": "error", "sequence_number": out.seq,
                                  "code": "stalled", "message": "the background response has "
                                  f"made no progress for {STALL_S:.0f} s"}))
            break
        else:
            await asyncio.sleep(POLL_S)
    await resp.write_eof()
    return resp
