"""Keep servers of different models registered with vllm-router in its multi-model mode.

vllm-router (0.1.17) routes by a request's `model` field only with `--enable-igw`, and in that
mode it ignores `--worker-urls`: workers join through its API (`POST /workers` with the URL and
the model's name), and a restarted router has none. This loop registers each given server once
its /health is green and it lists the name it was given on /v1/models (a name no request would
reach it by is an error, said once), then checks every `interval_s` that the router still lists
it, registering it again when not.

    python -m pipellm.services.router_workers --router http://router:8000 \
        --worker http://generate:8000=smollm2 --worker http://embed:8000=smollm2-embed

Standard library only: it runs in any image with Python (compose.rag.yaml: the compute one).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

log = logging.getLogger("pipellm.router_workers")


@dataclass(frozen=True)
class Worker:
    url: str  # the server's base URL as the router reaches it
    model: str  # its served model name: requests whose `model` is this go to it

    @classmethod
    def parse(cls, spec: str) -> Worker:
        """`URL=MODEL` (the model may not be empty)."""
        url, sep, model = spec.rpartition("=")
        if not sep or not url.startswith(("http://", "https://")) or not model:
            raise ValueError(f"--worker {spec!r}: expected URL=MODEL, e.g. "
                             "http://generate:8000=smollm2")
        return cls(url.rstrip("/"), model)


def _call(method: str, url: str, body: dict | None = None, timeout_s: float = 5):
    """(status, parsed JSON or text); status 0 when nothing answered."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"},
                                 method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    except OSError:
        return 0, None
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


def registered(router: str) -> dict[str, str] | None:
    """The router's workers, URL -> model name (None while it does not answer)."""
    status, body = _call("GET", router + "/workers")
    if status != 200 or not isinstance(body, dict):
        return None
    return {w["url"].rstrip("/"): w.get("model_id", "") for w in body.get("workers", [])}


def ready(worker: Worker) -> bool:
    """Whether the server is healthy and serves `worker.model` (ValueError when it serves
    other names only: it would never get a request)."""
    if _call("GET", worker.url + "/health")[0] != 200:
        return False
    status, body = _call("GET", worker.url + "/v1/models")
    if status != 200 or not isinstance(body, dict):
        return False
    names = [m.get("id") for m in body.get("data", [])]
    if worker.model not in names:
        raise ValueError(f"{worker.url} serves {names}, not {worker.model!r}")
    return True


def sync(router: str, workers: list[Worker], warned: set[Worker]) -> list[Worker]:
    """One pass: register each ready worker the router does not list (or lists under another
    name: removed first). Returns the workers it still lacks."""
    have = registered(router)
    if have is None:
        return list(workers)
    missing = []
    for w in workers:
        if have.get(w.url) == w.model:
            continue
        try:
            if not ready(w):
                missing.append(w)
                continue
        except ValueError as e:
            if w not in warned:
                log.error("%s", e)
                warned.add(w)
            missing.append(w)
            continue
        if w.url in have:  # under another name (e.g. registered by hand): replace it
            _call("DELETE", f"{router}/workers/{urllib.request.quote(w.url, safe='')}")
        status, body = _call("POST", router + "/workers", {"url": w.url, "model_id": w.model})
        if status == 200:
            log.info("registered %s for model %s", w.url, w.model)
        else:
            log.warning("router refused %s: %s %s", w.url, status, body)
            missing.append(w)
    return missing


def run(router: str, workers: list[Worker], interval_s: float = 5, once: bool = False,
        timeout_s: float = 0) -> int:
    """Register `workers` with `router`; with `once`, until all are (exit 0), or 1 after
    `timeout_s` (0: no limit). Without, forever (a restarted router gets them back)."""
    router = router.rstrip("/")
    deadline = time.monotonic() + timeout_s if timeout_s else None
    warned: set[Worker] = set()
    while True:
        missing = sync(router, workers, warned)
        if once and not missing:
            return 0
        if deadline is not None and time.monotonic() > deadline:
            log.error("not registered: %s", ", ".join(w.url for w in missing))
            return 1
        time.sleep(interval_s)


def _worker(spec: str) -> Worker:
    try:
        return Worker.parse(spec)
    except ValueError as e:  # argparse shows this one's message, not "invalid value"
        raise argparse.ArgumentTypeError(str(e)) from None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pipellm.services.router_workers",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--router", required=True, help="vllm-router's URL (run with --enable-igw)")
    p.add_argument("--worker", action="append", required=True, type=_worker,
                   metavar="URL=MODEL", help="a server and the model name it serves; repeat")
    p.add_argument("--interval-s", type=float, default=5, help="seconds between checks")
    p.add_argument("--once", action="store_true", help="exit once all are registered")
    p.add_argument("--timeout-s", type=float, default=0, help="give up after (0: never)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s router-workers %(levelname)s %(message)s")
    return run(args.router, args.worker, args.interval_s, args.once, args.timeout_s)


if __name__ == "__main__":
    sys.exit(main())
