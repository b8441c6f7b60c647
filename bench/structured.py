"""Structured outputs (JSON-schema constrained decoding) on CPU: pipellm against vLLM's CPU build.

Servers and model as in bench/vs_peers.py (whose helpers start them): `pipellm` is `pipellm up`
on the default GGUF with no flags; `vllm` is its vllm-bf16 (`vllm serve` on the GGUF's float32
HF expansion, --dtype bfloat16, the model on both cores). Schemas: data/json_schemas.json (22
{name, prompt, schema}; none with keywords vLLM's xgrammar backend refuses, such as
uniqueItems), the same requests for both. Each round starts each server in turn (fresh, never
two at once), warms it (free text, throwaway schemas, then one 1-token request per schema of
the set so that the mixes run on compiled grammars, unless --no-prime) and drives it with the
`openai` client (AsyncOpenAI, streaming, include_usage; TTFT: to the first content token; TPOT:
after it):

    ttft   --fresh-schemas schemas no cache has seen (a base schema plus a required property
           with a random name): one request alone (first time: compiled), then the same
           request again (cached); the median TTFT of each
    mix    --num-prompts chat requests at once (rate inf), temperature 0, --max-tokens, with
           100%, 50% and 0% of them (in that order) carrying response_format json_schema
           (schema i % 22 with its prompt; the others: the same prompts, free text, each
           generating exactly as many tokens as its constrained twin did at 100%: max_tokens
           = that count, ignore_eos), so that every mix does the same work; output tok/s =
           completion tokens / wall time

A constrained output that finishes with "stop" must parse (json.loads) and validate (jsonschema,
FormatChecker); invalid outputs, "length" finishes and failed requests are counted apart.
Reported: medians over the rounds, and the targets: at 100% structured, pipellm's output tok/s
>= 0.9x its own at 0% and >= vLLM's at 100%; every pipellm output valid.

    python -m bench.structured [--rounds 3] [--quick] [--servers pipellm,vllm]
        [--num-prompts 64] [--max-tokens 256] [--fresh-schemas 5] [--install-vllm]

Per-request records (runs.json) and server logs go to `--results-dir`; the last line printed is
one JSON object with the headline figures.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import random
import shlex
import statistics
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # also runnable as `python bench/structured.py`
    sys.path.insert(0, str(ROOT))

import jsonschema  # noqa: E402
import openai  # noqa: E402

from bench import servers  # noqa: E402
from bench.common import log, machine  # noqa: E402
from bench.vs_peers import _server_flags, make_server, prepare  # noqa: E402

SERVERS = {"pipellm": "pipellm", "vllm": "vllm-bf16"}  # --servers name -> vs_peers' server
MIXES = (100, 50, 0)  # % of a mix's requests with a json_schema response_format
VERDICTS = ("valid", "invalid", "length", "error")


def _servers(text: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    if bad := [s for s in names if s not in SERVERS]:
        raise argparse.ArgumentTypeError(f"unknown server {bad}: choose from {', '.join(SERVERS)}")
    return [SERVERS[s] for s in names]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    a = p.add_argument
    _server_flags(a)
    a("--servers", type=_servers, default="pipellm,vllm",
      help="comma-separated, of pipellm (its default configuration), vllm (vllm-bf16)")
    a("--rounds", type=int, default=3, help="fresh starts of every server")
    a("--quick", action="store_true", help="smoke run: 1 round, 16 requests of at most 64 "
      "tokens, 2 fresh schemas, 2 warm-up requests")
    a("--num-prompts", type=int, default=64, help="requests of each mix, sent at once")
    a("--max-tokens", type=int, default=256, help="max_tokens of the mixes' requests")
    a("--fresh-schemas", type=int, default=5, help="schemas of the TTFT test")
    a("--ttft-max-tokens", type=int, default=16, help="max_tokens of the TTFT test's requests")
    a("--warmup-prompts", type=int, default=4, help="unmeasured requests to a fresh server "
      "(every other one constrained by a throwaway schema)")
    a("--no-prime", action="store_true", help="do not compile the set's schemas before the "
      "mixes (each then pays for its first sight of a schema)")
    a("--schemas", type=Path, default=ROOT / "data/json_schemas.json", help="the schema set")
    a("--gguf", type=Path, default=None, help="default: the project's default model")
    a("--work-dir", type=Path, default=Path("~/.cache/pipellm/vs_vllm").expanduser(),
      help="where the GGUF's HF expansion is kept (shared with bench/vs_peers.py)")
    a("--results-dir", type=Path, default=None, help="default: WORK_DIR/structured/<time>")
    a("--ready-timeout", type=float, default=900.0, help="seconds for a server to start")
    a("--request-timeout", type=float, default=1800.0, help="seconds for one request")
    a("--seed", type=int, default=0, help="picks a mix's constrained requests")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.num_prompts, args.max_tokens = 1, 16, min(args.max_tokens, 64)
        args.fresh_schemas, args.warmup_prompts = 2, min(args.warmup_prompts, 2)
    if args.rounds < 1 or args.num_prompts < 1:
        p.error("--rounds and --num-prompts must be at least 1")
    args.results_dir = args.results_dir or args.work_dir / "structured" / time.strftime(
        "%Y%m%d-%H%M%S")
    return args


def fresh_schema(item: dict, tag: str) -> dict:
    """`item`'s schema (one with top-level properties) plus a required string property `tag`."""
    schema = copy.deepcopy(item["schema"])
    schema["properties"][tag] = {"type": "string", "maxLength": 8}
    schema["required"] = [*schema.get("required", []), tag]
    return schema


def verdict(rec: dict, schema: dict | None) -> str:
    """valid/invalid (a constrained "stop" output), length, error; "free" (unconstrained)."""
    if rec["error"] or rec["finish"] is None:
        return "error"
    if schema is None:
        return "free"
    if rec["finish"] != "stop":
        return "length" if rec["finish"] == "length" else "error"
    try:
        jsonschema.validate(json.loads(rec["text"]), schema,
                            format_checker=jsonschema.FormatChecker())
    except (ValueError, jsonschema.ValidationError) as e:
        rec["why"] = str(e).splitlines()[0][:200]
        return "invalid"
    return "valid"


async def one(client, model: str, item: dict, schema: dict | None, max_tokens: int,
              exact: bool = False) -> dict:
    """One streamed chat request: its record (TTFT, completion tokens, finish, text, verdict).
    `exact`: generate exactly max_tokens (ignore_eos)."""
    kw = {} if schema is None else {"response_format": {"type": "json_schema", "json_schema": {
        "name": item["name"], "schema": schema, "strict": True}}}
    if exact:
        kw["extra_body"] = {"ignore_eos": True}
    rec = dict(name=item["name"], constrained=schema is not None, ttft=None, tokens=0,
               finish=None, error=None)
    text, t0 = [], time.perf_counter()
    try:
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": item["prompt"]}],
            max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, **kw)
        async for chunk in stream:
            for c in chunk.choices:
                if c.delta and c.delta.content:
                    rec["ttft"] = rec["ttft"] or time.perf_counter() - t0
                    text.append(c.delta.content)
                rec["finish"] = c.finish_reason or rec["finish"]
            if chunk.usage:
                rec["tokens"] = chunk.usage.completion_tokens
    except openai.APIError as e:
        rec["error"] = f"{type(e).__name__}: {e}"[:300]
    rec["text"], rec["e2e"] = "".join(text), time.perf_counter() - t0
    rec["verdict"] = verdict(rec, schema)
    return rec


def _median(xs) -> float | None:
    return statistics.median(xs) if (xs := [x for x in xs if x is not None]) else None


def tally(recs: list[dict], wall_s: float | None = None) -> dict:
    out = {v: sum(r["verdict"] == v for r in recs) for v in VERDICTS}
    out.update(requests=len(recs), constrained=sum(r["constrained"] for r in recs),
               tokens=sum(r["tokens"] for r in recs), records=recs)
    for key, xs in (("ttft_ms", (r["ttft"] for r in recs)), ("tpot_ms", (
            (r["e2e"] - r["ttft"]) / (r["tokens"] - 1) for r in recs if r["ttft"] and
            r["tokens"] > 1))):
        x = _median(xs)
        out[key] = None if x is None else round(1000 * x, 1)
    if wall_s:
        out.update(wall_s=round(wall_s, 2), tok_s=round(out["tokens"] / wall_s, 1))
    return out


async def run_mix(client, model: str, items: list[dict], pct: int, args,
                  lengths: list[int] | None = None) -> dict:
    """--num-prompts requests at once, pct% of them constrained (the same ones every run);
    `lengths`: the tokens each request generated constrained, which the free ones then
    generate exactly (None: --max-tokens, ending where they end)."""
    n = args.num_prompts
    on = set(random.Random(args.seed).sample(range(n), round(n * pct / 100)))
    reqs = [(items[i % len(items)], i in on) for i in range(n)]
    t0 = time.perf_counter()
    recs = await asyncio.gather(*(
        one(client, model, it, it["schema"], args.max_tokens) if c else
        one(client, model, it, None, max(lengths[i], 1) if lengths else args.max_tokens,
            exact=lengths is not None) for i, (it, c) in enumerate(reqs)))
    return tally(list(recs), time.perf_counter() - t0)


async def run_ttft(client, model: str, items: list[dict], args) -> dict:
    """TTFT of a never-seen schema, alone, then of the same request again."""
    bases = [it for it in items if "properties" in it["schema"]]
    first, cached = [], []
    for k in range(args.fresh_schemas):
        item = bases[k % len(bases)]
        schema = fresh_schema(item, "f" + uuid.uuid4().hex[:8])
        for recs in (first, cached):
            recs.append(await one(client, model, item, schema, args.ttft_max_tokens))
    return dict(first=tally(first), cached=tally(cached))


async def drive(args, port: int, items: list[dict]) -> dict:
    """Warm the server on `port`, then its TTFT test and its mixes."""
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                                max_retries=0, timeout=args.request_timeout)
    async with client:
        model = (await client.models.list()).data[0].id
        bases = [it for it in items if "properties" in it["schema"]]
        warm = await asyncio.gather(*(one(client, model, it, fresh_schema(it, f"w{k}") if k % 2
                                          else None, min(32, args.max_tokens))
                                      for k, it in enumerate(bases[:args.warmup_prompts])))
        if not args.no_prime:  # every schema of the set compiled, one request each
            warm += await asyncio.gather(*(one(client, model, it, it["schema"], 1)
                                           for it in items))
        if bad := [r["error"] for r in warm if r["verdict"] == "error"]:
            log(f"warm-up errors: {bad}")
        out = dict(ttft=await run_ttft(client, model, items, args), mixes={})
        log(f"TTFT first {out['ttft']['first']['ttft_ms']} ms, cached "
            f"{out['ttft']['cached']['ttft_ms']} ms")
        lengths = None
        for pct in MIXES:  # 100% first: its lengths are what the free requests generate
            m = out["mixes"][str(pct)] = await run_mix(client, model, items, pct, args, lengths)
            lengths = lengths or [r["tokens"] for r in m["records"]]
            log(f"{pct}% structured: {m['tok_s']} tok/s, TPOT {m['tpot_ms']} ms, " + ", ".join(
                f"{m[v]} {v}" for v in VERDICTS))
    return out


def serve(args, name: str, rep: int, items: list[dict]) -> dict:
    """Start `name` fresh, measure it, stop it: one row."""
    port = servers.free_port()
    server = make_server(args, name, port, args.results_dir / f"{name}-rep{rep}.log")
    args.commands.setdefault(name, shlex.join("PORT" if x == str(port) else x
                                              for x in server.argv))
    log(f"round {rep + 1}/{args.rounds}: starting {name} on port {port}")
    row = dict(server=name, rep=rep, ok=False)
    try:
        with servers.running(server, args.ready_timeout) as startup_s:
            log(f"{name} ready after {startup_s:.0f} s")
            row.update(asyncio.run(drive(args, port, items)), ok=True,
                       startup_s=round(startup_s, 1))
    except servers.ServerError as exc:
        log(f"{name}: {exc}")
    return row


def summarize(rows: list[dict], names: list[str]) -> dict:
    """Per server: medians over its rounds, verdicts summed over every measured request."""
    out = {}
    for name in names:
        ok = [r for r in rows if r["server"] == name and r["ok"]]
        runs = [t for r in ok for t in (*r["mixes"].values(), *r["ttft"].values())]
        s = {f"{k}_{p}": _median(r["mixes"][str(p)][k] for r in ok)
             for k in ("tok_s", "tpot_ms") for p in MIXES}
        s.update({f"ttft_{k}_ms": _median(r["ttft"][k]["ttft_ms"] for r in ok)
                  for k in ("first", "cached")})
        s.update({v: sum(t[v] for t in runs) for v in VERDICTS})
        s["rounds_failed"] = sum(r["server"] == name and not r["ok"] for r in rows)
        s["invalid_examples"] = [dict(name=x["name"], why=x.get("why"), text=x["text"][:200])
                                 for t in runs for x in t["records"]
                                 if x["verdict"] == "invalid"][:3]
        out[name] = s
    return out


def check_targets(summary: dict) -> list[dict]:
    p, v = summary.get("pipellm"), summary.get("vllm-bf16")
    if p is None:
        return []

    def ratio(a, b):
        return None if a is None or not b else round(a / b, 3)
    own, peer = ratio(p["tok_s_100"], p["tok_s_0"]), ratio(p["tok_s_100"], v and v["tok_s_100"])
    return [
        dict(target="pipellm 100% structured >= 0.9x its 0%", ratio=own,
             passed=None if own is None else own >= 0.9),
        dict(target="pipellm 100% structured >= vllm-bf16 100%", ratio=peer,
             passed=None if peer is None else peer >= 1.0),
        dict(target="every pipellm output valid", ratio=None,
             passed=not (p["invalid"] or p["error"] or p["rounds_failed"])),
    ]


def print_report(summary: dict, checks: list[dict]) -> None:
    cols = [*(f"tok_s_{p}" for p in MIXES), "ttft_first_ms", "ttft_cached_ms", *VERDICTS]
    print(f"{'server':<10}" + "".join(f"{c:>15}" for c in cols) + f"{'100%/0%':>9}")
    for name, s in summary.items():
        cells = "".join("-".rjust(15) if s[c] is None else f"{s[c]:>15}" for c in cols)
        r = s["tok_s_100"] / s["tok_s_0"] if s["tok_s_0"] and s["tok_s_100"] else None
        print(f"{name:<10}{cells}{'-' if r is None else f'{r:.2f}':>9}")
        for x in s["invalid_examples"]:
            print(f"    invalid {x['name']}: {x['why']}: {x['text']!r}")
    for c in checks:
        ratio = "" if c["ratio"] is None else f" ({c['ratio']:.2f}x)"
        print(f"target: {c['target']}: {({True: 'PASS', False: 'FAIL'}).get(c['passed'], 'n/a')}"
              f"{ratio}")


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    servers.terminate_on_sigterm()
    t0 = time.monotonic()
    prepare(args)
    items = json.loads(args.schemas.read_text(encoding="utf-8"))  # the same for every server
    print(f"machine: {machine()}; GGUF {args.gguf}; HF {args.hf_dir}; {len(items)} schemas; "
          f"servers {','.join(args.servers)}; results in {args.results_dir}")
    rows = [serve(args, name, rep, items) for rep in range(args.rounds) for name in args.servers]
    (args.results_dir / "runs.json").write_text(json.dumps(rows, indent=1))
    summary = summarize(rows, args.servers)
    checks = check_targets(summary)
    print(f"\nmedians of {args.rounds} round(s); {args.num_prompts} requests at once per mix, "
          f"max_tokens {args.max_tokens}, temperature 0; TTFT of {args.fresh_schemas} fresh "
          f"schemas; valid/invalid/length/error: requests of every mix and TTFT test")
    print_report(summary, checks)
    head = dict(summary=summary, targets=checks,
                passed=sum(c["passed"] is True for c in checks), of=len(checks),
                servers=args.servers, commands=args.commands, rounds=args.rounds,
                num_prompts=args.num_prompts, max_tokens=args.max_tokens,
                fresh_schemas=args.fresh_schemas, quick=args.quick,
                seconds=round(time.monotonic() - t0), results_dir=str(args.results_dir),
                machine=machine(), load_avg=round(os.getloadavg()[0], 2))
    print(json.dumps(head))
    return head


if __name__ == "__main__":
    main()
