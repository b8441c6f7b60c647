"""n-gram (prompt lookup) speculative decoding on CPU: pipellm with and without it, and llama.cpp's
server with and without its own prompt-lookup speculation.

Model, machine and server setups as in bench/vs_peers.py (whose helpers start them): SmolLM2's
Q4_1 GGUF, the project's default model. `--servers`:

    pipellm         `pipellm up` on the GGUF with no flags: no speculation
    pipellm-ngram   the same plus --speculative-config SPEC_CONFIG (default {"method": "ngram",
                    "num_speculative_tokens": 6, "prompt_lookup_min": 2, "prompt_lookup_max": 5})
    llamacpp        `llama-server` on the GGUF, 2 threads: 1 slot for the concurrency-1 runs, a
                    server of its own with --llamacpp-slots (16) slots for the others
    llamacpp-ngram  the same plus LLAMACPP_SPEC (default: --spec-type ngram-simple, lookup
                    n-gram 3, draft m-gram 6: llama.cpp's prompt lookup at pipellm's sizes)

Workloads (chat requests; the same prompts for every server and every round, picked from
the repository's ShareGPT file by --seed; lengths counted with the model's tokenizer):

    grounded   input-grounded: "Repeat the following text exactly" or "Rewrite the following
               text, changing nothing but correcting its spelling", then a passage: a ShareGPT
               assistant answer of --passage-min..--passage-max tokens (at least --max-tokens,
               so that every measured token can be a copy of the prompt), mostly ASCII
    sharegpt   ShareGPT first-turn questions of 4 to 1024 tokens, mostly ASCII

Every request is greedy (temperature 0) and generates exactly --max-tokens (128) tokens
(ignore_eos), so every server does the same work. Each round starts each server in turn (fresh,
never two at once), warms it (one request alone, then --warmup-prompts at once, prompts of their
own) and drives it with the `openai` client (AsyncOpenAI, streaming, include_usage) at two
concurrencies: 1 (--b1-requests, 8, one after the other) and --concurrency (16; --requests, 32,
that many in flight), with disjoint prompt sets. Per (server, workload, concurrency): output tok/s
(completion tokens / wall time), mean TPOT (per request: time after its first content token /
(tokens - 1)), mean TTFT; the draft acceptance rate (pipellm: deltas of
vllm:spec_decode_num_{draft,accepted}_tokens_total on /metrics around the run; llama.cpp: the
draft_n / draft_n_accepted of each response's timings); and the fraction of greedy outputs that
are identical, with speculation and without, prompt by prompt in the same round.

Reported: medians over the rounds, the ratios pipellm-ngram / pipellm, llamacpp-ngram /
llamacpp and pipellm-ngram / llamacpp-ngram, and the targets: at concurrency 1 on grounded,
pipellm-ngram >= 1.5x pipellm's tok/s with identical outputs; on sharegpt, at every
concurrency, no more than 5% slower (>= 0.95x).

    python -m bench.speculative [--rounds 3] [--quick] [--servers pipellm,pipellm-ngram,...]
        [--concurrency 16] [--max-tokens 128] [--llamacpp-bin PATH] [--no-build]

`--quick`: 1 round, 2 requests at concurrency 1, 8 at 4, 64 tokens each, and the llama.cpp rows
only if llama-server is already there (never built). Per-request records (runs.json: texts,
timings) and server logs go to `--results-dir`; the last line printed is one JSON object with
the headline figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import statistics
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # also runnable as `python bench/speculative.py`
    sys.path.insert(0, str(ROOT))

import openai  # noqa: E402

from bench import llamacpp, servers  # noqa: E402
from bench.common import log, machine  # noqa: E402
from bench.smol_model import default_gguf, expand_gguf  # noqa: E402
from bench.vs_peers import _names, _server_flags, make_server  # noqa: E402
from pipellm.loadgen.datasets import SHAREGPT_FILE, default_data_dir, sharegpt_pairs  # noqa: E402

SERVERS = ("pipellm", "pipellm-ngram", "llamacpp", "llamacpp-ngram")
WORKLOADS = ("grounded", "sharegpt")
SPEC_CONFIG = json.dumps({"method": "ngram", "num_speculative_tokens": 6,
                          "prompt_lookup_min": 2, "prompt_lookup_max": 5})
LLAMACPP_SPEC = ("--spec-type ngram-simple --spec-ngram-simple-size-n 3 "
                 "--spec-ngram-simple-size-m 6")
INSTRUCTIONS = ("Repeat the following text exactly:\n\n{}",
                "Rewrite the following text, changing nothing but correcting its spelling:"
                "\n\n{}")
PAIRS = (("pipellm-ngram", "pipellm"), ("llamacpp-ngram", "llamacpp"),
         ("pipellm-ngram", "llamacpp-ngram"))  # ratios reported: first / second
STATS = ("tok_s", "tpot_ms", "ttft_ms", "accept_rate")
DRAFTS, ACCEPTED = ("vllm:spec_decode_num_draft_tokens_total",
                    "vllm:spec_decode_num_accepted_tokens_total")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    a = p.add_argument
    _server_flags(a)
    a("--servers", type=lambda s: _names(s, SERVERS, "server"), default=",".join(SERVERS),
      help=f"comma-separated, of {', '.join(SERVERS)} (default: all)")
    a("--workloads", type=lambda s: _names(s, WORKLOADS, "workload"), default=",".join(WORKLOADS))
    a("--spec-config", default=SPEC_CONFIG, help="--speculative-config of pipellm-ngram")
    a("--llamacpp-spec", default=LLAMACPP_SPEC, help="the llama-server flags of llamacpp-ngram")
    a("--rounds", type=int, default=3, help="fresh starts of every server")
    a("--quick", action="store_true", help="smoke run: 1 round, 2 + 8 requests of 64 tokens, "
      "concurrency 4; llama.cpp only if already built")
    a("--concurrency", type=int, default=16, help="requests in flight of the batched runs")
    a("--requests", type=int, default=32, help="requests of each batched run")
    a("--b1-requests", type=int, default=8, help="requests of each concurrency-1 run")
    a("--max-tokens", type=int, default=128, help="tokens every request generates (ignore_eos)")
    a("--passage-min", type=int, default=100, help="grounded passages' least tokens (raised to "
      "--max-tokens)")
    a("--passage-max", type=int, default=300, help="grounded passages' most tokens")
    a("--warmup-prompts", type=int, default=4, help="unmeasured requests sent at once to a fresh "
      "server (after one alone)")
    a("--gguf", type=Path, default=None, help="default: the project's default model")
    a("--work-dir", type=Path, default=Path("~/.cache/pipellm/vs_vllm").expanduser(),
      help="where the GGUF's HF expansion (its tokenizer) is kept (shared by the bench scripts)")
    a("--results-dir", type=Path, default=None, help="default: WORK_DIR/speculative/<time>")
    a("--sharegpt-path", type=Path, default=default_data_dir() / SHAREGPT_FILE)
    a("--ready-timeout", type=float, default=900.0, help="seconds for a server to start")
    a("--request-timeout", type=float, default=600.0, help="seconds for one request")
    a("--seed", type=int, default=0, help="picks the prompts")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.b1_requests, args.requests, args.concurrency = 1, 2, 8, 4
        args.max_tokens, args.warmup_prompts = min(args.max_tokens, 64), min(args.warmup_prompts, 2)
    if min(args.rounds, args.concurrency, args.requests, args.b1_requests, args.max_tokens) < 1:
        p.error("--rounds, --concurrency, --requests, --b1-requests and --max-tokens must be "
                "at least 1")
    args.levels = sorted({1, args.concurrency})
    args.results_dir = args.results_dir or args.work_dir / "speculative" / time.strftime(
        "%Y%m%d-%H%M%S")
    return args


def _mostly_ascii(text: str) -> bool:
    return sum(c.isascii() for c in text) >= 0.98 * len(text)


def pick_prompts(pairs: list[tuple[str, str]], count, args: argparse.Namespace) -> dict:
    """{workload: {"warmup" | concurrency: [prompt, ...]}}: disjoint sets of each workload's
    candidates (shuffled by --seed; repeated if too few), `count(text)` its tokens."""
    lo = max(args.passage_min, args.max_tokens)
    cands = {
        "grounded": [INSTRUCTIONS[i % len(INSTRUCTIONS)].format(ans.strip())
                     for i, ans in enumerate(a for _, a in pairs if _mostly_ascii(a)
                                             and lo <= count(a) <= args.passage_max)],
        "sharegpt": [q for q, _ in pairs if _mostly_ascii(q) and 4 <= count(q) <= 1024],
    }
    sizes = {"warmup": args.warmup_prompts, **{c: args.b1_requests if c == 1 else args.requests
                                               for c in args.levels}}
    out = {}
    for wl in args.workloads:
        xs = cands[wl]
        if not xs:
            raise ValueError(f"{args.sharegpt_path}: no {wl} prompts")
        random.Random(args.seed).shuffle(xs)
        need = sum(sizes.values())
        if need > len(xs):
            log(f"{wl}: {len(xs)} prompts for {need} requests: some repeat")
        xs = [xs[i % len(xs)] for i in range(need)]
        out[wl], at = {}, 0
        for key, n in sizes.items():
            out[wl][key], at = xs[at:at + n], at + n
    return out


def make(args: argparse.Namespace, name: str, port: int, log_path: Path,
         slots: int | None = None) -> servers.Server:
    """Server `name` (one of SERVERS): vs_peers' pipellm or llamacpp, plus its speculation."""
    llama = name.startswith("llamacpp")
    server = make_server(args, "llamacpp" if llama else "pipellm", port, log_path, slots)
    if name == "pipellm-ngram":
        server.argv += ["--speculative-config", args.spec_config]
    elif name == "llamacpp-ngram":
        server.argv += shlex.split(args.llamacpp_spec)
    server.name = name
    return server


def launches(args: argparse.Namespace, name: str) -> list[tuple[int | None, list[int]]]:
    """(llama.cpp slots or None, concurrencies) of each start of `name` in a round."""
    if not name.startswith("llamacpp"):
        return [(None, args.levels)]
    return [(1 if c == 1 else args.llamacpp_slots, [c]) for c in args.levels]


def spec_counts(metrics_text: str) -> tuple[float, float]:
    """(draft tokens, accepted tokens) of a Prometheus text page (0 where absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    values = {s.name: s.value for f in text_string_to_metric_families(metrics_text)
              for s in f.samples}
    return values.get(DRAFTS, 0.0), values.get(ACCEPTED, 0.0)


def scrape(port: int) -> tuple[float, float] | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            return spec_counts(r.read().decode())
    except (OSError, ValueError):
        return None


def http_client(timeout_s: float):
    """The openai client's own HTTP client with a new connection per request: llama-server
    closes a kept-alive connection after a few requests, which the next request on it meets as
    a connection error (the same for every server, so no server pays for it alone)."""
    try:
        import httpx2 as httpx  # what this openai package is built on
    except ImportError:
        import httpx
    return openai.DefaultAsyncHttpxClient(
        timeout=timeout_s, limits=httpx.Limits(max_connections=1000, max_keepalive_connections=0))


async def one(client, model: str, prompt: str, max_tokens: int) -> dict:
    """One streamed greedy chat request of exactly `max_tokens` tokens: its record."""
    rec = dict(ttft=None, tokens=0, error=None, drafts=None, accepted=None)
    text, timings, t0 = [], None, time.perf_counter()
    try:
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
            temperature=0, stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True})
        async for chunk in stream:
            for c in chunk.choices:
                if c.delta and c.delta.content:
                    rec["ttft"] = rec["ttft"] or time.perf_counter() - t0
                    text.append(c.delta.content)
            if chunk.usage:
                rec["tokens"] = chunk.usage.completion_tokens
            timings = (chunk.model_extra or {}).get("timings") or timings  # llama.cpp's
    except openai.APIError as e:
        rec["error"] = f"{type(e).__name__}: {e}"[:300]
    rec["e2e"], rec["text"] = time.perf_counter() - t0, "".join(text)
    if timings:
        rec["tokens"] = rec["tokens"] or timings.get("predicted_n", 0)
        rec["drafts"], rec["accepted"] = timings.get("draft_n"), timings.get("draft_n_accepted")
    return rec


def _mean(xs) -> float | None:
    return statistics.fmean(xs) if (xs := [x for x in xs if x is not None]) else None


def _median(xs) -> float | None:
    return statistics.median(xs) if (xs := [x for x in xs if x is not None]) else None


def _ms(seconds: float | None, nd: int) -> float | None:
    return None if seconds is None else round(1000 * seconds, nd)


async def run(client, model: str, prompts: list[str], conc: int, max_tokens: int) -> dict:
    """`prompts` with `conc` in flight: throughput, mean TPOT and TTFT, the records."""
    gate = asyncio.Semaphore(conc)

    async def gated(p: str) -> dict:
        async with gate:
            return await one(client, model, p, max_tokens)

    t0 = time.perf_counter()
    recs = list(await asyncio.gather(*(gated(p) for p in prompts)))
    wall = time.perf_counter() - t0
    tokens = sum(r["tokens"] for r in recs)
    tpot = _mean((r["e2e"] - r["ttft"]) / (r["tokens"] - 1) for r in recs
                 if r["ttft"] and r["tokens"] > 1)
    out = dict(requests=len(recs), tokens=tokens, wall_s=round(wall, 2),
               tok_s=round(tokens / wall, 1), tpot_ms=_ms(tpot, 2),
               ttft_ms=_ms(_mean(r["ttft"] for r in recs), 1),
               errors=sum(r["error"] is not None for r in recs),
               short=sum(r["error"] is None and r["tokens"] < max_tokens for r in recs),
               records=recs)
    if any(r["drafts"] is not None for r in recs):
        out["drafts"] = sum(r["drafts"] or 0 for r in recs)
        out["accepted"] = sum(r["accepted"] or 0 for r in recs)
    return out


async def drive(args, name: str, port: int, levels: list[int], prompts: dict,
                rep: int) -> list[dict]:
    """Warm the server on `port`, then every workload at every concurrency of `levels`."""
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                                max_retries=0, timeout=args.request_timeout,
                                http_client=http_client(args.request_timeout))
    rows = []
    async with client:
        model = (await client.models.list()).data[0].id
        warm = [p for wl in args.workloads for p in prompts[wl]["warmup"]]
        if warm:
            recs = [await one(client, model, warm[0], 16)]
            recs += await asyncio.gather(*(one(client, model, p, 32) for p in warm))
            if bad := [r["error"] for r in recs if r["error"]]:
                log(f"{name} warm-up errors: {bad}")
        for conc in levels:
            for wl in args.workloads:
                before = scrape(port) if name.startswith("pipellm") else None
                res = await run(client, model, prompts[wl][conc], conc, args.max_tokens)
                after = before and scrape(port)
                if before and after:
                    res["drafts"], res["accepted"] = after[0] - before[0], after[1] - before[1]
                res["accept_rate"] = (round(res["accepted"] / res["drafts"], 3)
                                      if res.get("drafts") else None)
                rows.append(dict(server=name, workload=wl, conc=conc, rep=rep,
                                 ok=res["errors"] == 0, **res))
                log(f"{name} {wl} c{conc}: {res['tok_s']} tok/s, TPOT {res['tpot_ms']} ms, "
                    f"TTFT {res['ttft_ms']} ms, acceptance {res['accept_rate']}, "
                    f"{res['errors']} errors, {res['short']} short")
    return rows


def serve(args, name: str, slots: int | None, levels: list[int], prompts: dict,
          rep: int) -> list[dict]:
    """Start `name` fresh, measure it at `levels`, stop it: its rows (failed ones: ok False)."""
    port = servers.free_port()
    tag = name + (f"-np{slots}" if slots else "")
    server = make(args, name, port, args.results_dir / f"{tag}-rep{rep}.log", slots)
    args.commands.setdefault(tag, shlex.join("PORT" if x == str(port) else x
                                             for x in server.argv))
    log(f"round {rep + 1}/{args.rounds}: starting {tag} on port {port}")
    rows = []
    try:
        with servers.running(server, args.ready_timeout) as startup_s:
            log(f"{tag} ready after {startup_s:.0f} s")
            rows = asyncio.run(drive(args, name, port, levels, prompts, rep))
    except servers.ServerError as exc:
        log(f"{tag}: {exc}")
    except (openai.APIError, OSError) as exc:
        log(f"{tag}: {type(exc).__name__}: {exc}")
    done = {(r["workload"], r["conc"]) for r in rows}
    return rows + [dict(server=name, workload=wl, conc=c, rep=rep, ok=False)
                   for c in levels for wl in args.workloads if (wl, c) not in done]


def cell(wl: str, conc: int) -> str:
    return f"{wl}_c{conc}"


def same_output(rows: list[dict], a: str, b: str) -> dict:
    """{cell: fraction of prompts whose outputs from `a` and `b` are identical (same rounds),
    or None}."""
    out = {}
    for key in dict.fromkeys(cell(r["workload"], r["conc"]) for r in rows):
        same = total = 0
        for ra in rows:
            if ra["server"] != a or not ra.get("records") or cell(ra["workload"],
                                                                   ra["conc"]) != key:
                continue
            rb = next((r for r in rows if r["server"] == b and r.get("records") and r["rep"] ==
                       ra["rep"] and cell(r["workload"], r["conc"]) == key), None)
            if rb is not None:
                pairs = list(zip(ra["records"], rb["records"], strict=True))
                total += len(pairs)
                same += sum(x["text"] == y["text"] and not x["error"] and not y["error"]
                            for x, y in pairs)
        out[key] = round(same / total, 3) if total else None
    return out


def summarize(rows: list[dict]) -> dict:
    """Medians over the rounds per server and cell, the ratios of PAIRS and output equality."""
    per: dict = {}
    for name in dict.fromkeys(r["server"] for r in rows):
        per[name] = {}
        for key in dict.fromkeys(cell(r["workload"], r["conc"]) for r in rows
                                 if r["server"] == name):
            runs = [r for r in rows if r["server"] == name and cell(r["workload"], r["conc"])
                    == key]
            ok = [r for r in runs if r["ok"]]
            c = {k: _median(r.get(k) for r in ok) for k in STATS}
            c.update(runs_ok=len(ok), runs=len(runs),
                     errors=sum(r.get("errors", 0) for r in runs),
                     short=sum(r.get("short", 0) for r in runs))
            per[name][key] = c
    ratios, same = {}, {}
    for a, b in PAIRS:
        if a in per and b in per:
            ratios[f"{a}/{b}"] = {key: {m: (round(per[a][key][m] / per[b][key][m], 3)
                                            if per[a][key][m] and per[b].get(key, {}).get(m)
                                            else None) for m in ("tok_s", "tpot_ms")}
                                  for key in per[a]}
            if a.split("-")[0] == b:  # with and without speculation, the same engine
                same[f"{a}/{b}"] = same_output(rows, a, b)
    return dict(servers=per, ratios=ratios, same_output=same)


def check_targets(summary: dict, levels: list[int]) -> list[dict]:
    """The issue's two targets on pipellm-ngram / pipellm: passed True, False, or None (not
    measured)."""
    r = summary["ratios"].get("pipellm-ngram/pipellm", {})
    same = summary["same_output"].get("pipellm-ngram/pipellm", {})
    g = r.get(cell("grounded", 1), {}).get("tok_s")
    eq = same.get(cell("grounded", 1))
    sg = [r.get(cell("sharegpt", c), {}).get("tok_s") for c in levels]
    worst = None if not sg or None in sg else min(sg)
    return [
        dict(target="grounded, concurrency 1: pipellm-ngram >= 1.5x pipellm tok/s, identical "
             "greedy outputs", ratio=g, same_output=eq,
             passed=None if g is None or eq is None else g >= 1.5 and eq == 1.0),
        dict(target=f"sharegpt, concurrency {' and '.join(map(str, levels))}: pipellm-ngram "
             ">= 0.95x pipellm tok/s (the worst)", ratio=worst,
             passed=None if worst is None else worst >= 0.95),
    ]


def _fmt(x, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def print_report(summary: dict, checks: list[dict], commands: dict[str, str]) -> None:
    print(f"{'server':<15} {'cell':<12} {'tok/s':>8} {'TPOT ms':>8} {'TTFT ms':>8} "
          f"{'accept':>7} {'runs ok':>8} {'errors':>6} {'short':>6}")
    for name, cells in summary["servers"].items():
        for key, c in cells.items():
            print(f"{name:<15} {key:<12} {_fmt(c['tok_s']):>8} {_fmt(c['tpot_ms'], '.2f'):>8} "
                  f"{_fmt(c['ttft_ms']):>8} {_fmt(c['accept_rate'], '.2f'):>7} "
                  f"{c['runs_ok']:>4}/{c['runs']:<3} {c['errors']:>6} {c['short']:>6}")
    print("\nratios (tok/s: higher is better; TPOT: lower is better), identical outputs:")
    for pair, cells in summary["ratios"].items():
        same = summary["same_output"].get(pair, {})
        for key, r in cells.items():
            eq = f"  identical {_fmt(same.get(key), '.0%')}" if pair in summary[
                "same_output"] else ""
            print(f"  {pair:<30} {key:<12} tok/s {_fmt(r['tok_s'], '.2f'):>5}x  TPOT "
                  f"{_fmt(r['tpot_ms'], '.2f'):>5}x{eq}")
    print()
    for c in checks:
        verdict = {True: "PASS", False: "MISS", None: "n/a"}[c["passed"]]
        print(f"target: {c['target']}: {verdict} ({_fmt(c['ratio'], '.2f')}x"
              + (f", identical {_fmt(c['same_output'], '.0%')}" if "same_output" in c else "")
              + ")")
    for tag, cmd in commands.items():
        print(f"command, {tag}: {cmd}")


def prepare(args: argparse.Namespace) -> str | None:
    """Resolve the model, its tokenizer directory and llama-server (built unless --quick or
    --no-build); drops the llama.cpp rows, with the reason returned, when there is none."""
    args.gguf = (args.gguf or default_gguf()).resolve()
    args.hf_dir = expand_gguf(args.gguf, args.work_dir)
    args.results_dir.mkdir(parents=True, exist_ok=True)
    args.commands, note = {}, None
    if any(s.startswith("llamacpp") for s in args.servers):
        try:
            if args.quick or args.no_build:
                found = llamacpp.find_server(args.llamacpp_bin)
                if found is None:
                    raise FileNotFoundError("llama-server not found (not built with --quick or "
                                            "--no-build)")
                args.llamacpp_bin = str(found)
            else:
                args.llamacpp_bin = str(llamacpp.ensure_server(args.llamacpp_bin))
        except (FileNotFoundError, RuntimeError) as exc:
            note = f"llama.cpp rows skipped: {exc}"
            args.servers = [s for s in args.servers if not s.startswith("llamacpp")]
            print(note)
    return note


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    servers.terminate_on_sigterm()
    t0 = time.monotonic()
    note = prepare(args)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(args.hf_dir / "tokenizer.json"))
    count = lambda text: len(tok.encode(text, add_special_tokens=False).ids)  # noqa: E731
    prompts = pick_prompts(sharegpt_pairs(args.sharegpt_path), count, args)
    lens = {wl: round(statistics.fmean(count(p) for k, ps in d.items() if k != "warmup"
                                       for p in ps)) for wl, d in prompts.items()}
    print(f"machine: {machine()}; GGUF {args.gguf}; servers {','.join(args.servers)}; "
          f"mean prompt tokens {lens}; results in {args.results_dir}")
    rows = [row for rep in range(args.rounds) for name in args.servers
            for slots, levels in launches(args, name)
            for row in serve(args, name, slots, levels, prompts, rep)]
    (args.results_dir / "runs.json").write_text(json.dumps(rows, indent=1))
    summary = summarize(rows)
    checks = check_targets(summary, args.levels)
    print(f"\nmedians of {args.rounds} round(s); {args.max_tokens} tokens a request (greedy, "
          f"EOS ignored); concurrency 1: {args.b1_requests} requests one after the other; "
          f"concurrency {args.concurrency}: {args.requests} requests; llama.cpp slots 1 and "
          f"{args.llamacpp_slots}")
    print_report(summary, checks, args.commands)
    head = dict(summary=summary, targets=checks,
                passed=sum(c["passed"] is True for c in checks), of=len(checks),
                servers=args.servers, commands=args.commands, rounds=args.rounds,
                requests={"1": args.b1_requests, str(args.concurrency): args.requests},
                max_tokens=args.max_tokens, mean_prompt_tokens=lens, llamacpp_note=note,
                quick=args.quick, seconds=round(time.monotonic() - t0),
                results_dir=str(args.results_dir), machine=machine(),
                load_avg=round(os.getloadavg()[0], 2))
    print(json.dumps(head))
    return head


if __name__ == "__main__":
    main()
