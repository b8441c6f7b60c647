"""Reranking: pipellm's pooling runner against vLLM's CPU build's, on the same model and machine
with the same client (issue 50).

Model: SmolLM2-135M-Instruct as a yes/no reranker, the score sigmoid(logit["yes"] -
logit["no"]) at the last token (what `classifier_from_token` makes of a causal LM): pipellm
serves its GGUF, vLLM the GGUF's HF expansion in bf16 on every core (`--runner pooling
--convert classify`, `"method": "from_2_way_softmax"`). Both get the same `/v1/rerank` bodies,
formatted by the client in Qwen3-Reranker's format as vLLM's example script formats them: the
query is the system line, the instruction and a ShareGPT prompt's first 200 characters; each
document a ShareGPT answer's first --doc-chars characters and the empty thinking block. Each of
--reranks reranks has --docs documents of its own (no document sent twice; the format's
beginning is the same in all, which vLLM's prefix cache may keep), sent one rerank at a time
after one warm-up rerank of other texts. Reported: documents/s and the median seconds of a
rerank per server (medians over the rounds), pipellm's ratio to vLLM, and how far vLLM's scores
follow pipellm's (Pearson over every document; the share of reranks with the same best
document). Target: pipellm ahead.

    python -m bench.rerank [--rounds 3] [--reranks 8] [--docs 32] [--doc-chars 1000]

The last line printed is one JSON object with the headline figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # also runnable as `python bench/rerank.py`
    sys.path.insert(0, str(ROOT))

from bench import servers, vs_peers  # noqa: E402
from bench.common import log, machine  # noqa: E402
from pipellm.loadgen.datasets import SHAREGPT_FILE, default_data_dir, sharegpt_pairs  # noqa: E402

SERVERS = ("pipellm", "vllm-bf16")
SYSTEM = ('<|im_start|>system\nJudge whether the Document meets the requirements based on the '
          'Query and the Instruct provided. Note that the answer can only be "yes" or "no".'
          '<|im_end|>\n<|im_start|>user\n')  # Qwen3-Reranker's format, its model card's
INSTRUCT = "Given a web search query, retrieve relevant passages that answer the query"
SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
YES_NO = {"architectures": ["LlamaForSequenceClassification"],
          "classifier_from_token": ["no", "yes"]}
VLLM_YES_NO = {**YES_NO, "method": "from_2_way_softmax"}  # vLLM's name for that rule


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--servers", default=",".join(SERVERS), help="of " + ", ".join(SERVERS))
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--reranks", type=int, default=8)
    p.add_argument("--docs", type=int, default=32, help="documents a rerank")
    p.add_argument("--doc-chars", type=int, default=1000)
    return vs_peers.with_own_flags(p, argv)


def bodies(reranks: int, docs: int, doc_chars: int) -> list[dict]:
    """`reranks` + 1 /v1/rerank bodies (the first for the warm-up), no text in two of them."""
    pairs = sharegpt_pairs(default_data_dir() / SHAREGPT_FILE)
    n = reranks + 1
    questions = list(dict.fromkeys(q[:200] for q, _ in pairs if q.strip()))[:n]
    answers = list(dict.fromkeys(a[:doc_chars] for _, a in pairs if a.strip()))[n:]
    if len(questions) < n or len(answers) < n * docs:
        raise SystemExit(f"{n} questions and {n * docs} answers asked for, the data has "
                         f"{len(questions)} and {len(answers)}")
    return [{"query": f"{SYSTEM}<Instruct>: {INSTRUCT}\n<Query>: {q}\n<Document>: ",
             "documents": [a + SUFFIX for a in answers[i * docs:(i + 1) * docs]]}
            for i, q in enumerate(questions)]


def rerank(url: str, body: dict) -> tuple[float, list[float]]:
    """(seconds, each document's score in document order) of one /v1/rerank."""
    import urllib.request

    req = urllib.request.Request(url + "/v1/rerank", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as r:
        results = json.load(r)["results"]
    seconds = time.perf_counter() - t0
    return seconds, [x["relevance_score"] for x in sorted(results, key=lambda x: x["index"])]


def make_server(args, name: str, port: int, log_path: Path) -> servers.Server:
    args.pipellm_extra = f"--hf-overrides '{json.dumps(YES_NO)}'"
    args.vllm_extra = ("--runner pooling --convert classify "
                       f"--hf-overrides '{json.dumps(VLLM_YES_NO)}'")
    return vs_peers.make_server(args, name, port, log_path)


def serve(args, name: str, work: list[dict], rep: int) -> tuple[list[float], list[list[float]]]:
    """Start `name`, warm it up on work[0], rerank the rest one at a time: (seconds of each
    rerank, the scores of each); both empty where the server or a request failed."""
    port = servers.free_port()
    tag = f"{name}-rep{rep}"
    server = make_server(args, name, port, args.results_dir / f"{tag}.log")
    args.commands[name] = vs_peers.command(server, port)
    url, seconds, scores = f"http://127.0.0.1:{port}", [], []
    try:
        with servers.running(server, args.ready_timeout) as startup_s:
            log(f"{tag} ready after {startup_s:.0f} s")
            rerank(url, work[0])
            for body in work[1:]:
                s, sc = rerank(url, body)
                seconds.append(s)
                scores.append(sc)
            log(f"{name}: {len(seconds) * args.docs / sum(seconds):.1f} documents/s, "
                f"a rerank {statistics.median(seconds):.2f} s")
    except (servers.ServerError, OSError) as exc:  # a failed server reports nothing
        log(f"{tag}: {exc}")
        return [], []
    return seconds, scores


def agreement(ours: list[list[float]], theirs: list[list[float]]) -> dict[str, float]:
    """Pearson of the two servers' scores over every document, and the share of reranks whose
    best document is the same."""
    a, b = np.asarray(ours).ravel(), np.asarray(theirs).ravel()
    same = [int(np.argmax(x) == np.argmax(y)) for x, y in zip(ours, theirs, strict=True)]
    return {"pearson": round(float(np.corrcoef(a, b)[0, 1]), 4),
            "same_best": round(sum(same) / len(same), 3)}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    servers.terminate_on_sigterm()
    t0 = time.monotonic()
    vs_peers.prepare(args)
    work = bodies(args.reranks, args.docs, args.doc_chars)
    print(f"machine: {machine()}; {args.reranks} reranks of {args.docs} documents "
          f"(<= {args.doc_chars} chars); results in {args.results_dir}")
    rates = {s: [] for s in args.servers}
    latency = {s: [] for s in args.servers}
    scores: dict[str, list] = {}
    for rep in range(args.rounds):
        for s in args.servers:
            seconds, sc = serve(args, s, work, rep)
            if seconds:
                rates[s].append(len(seconds) * args.docs / sum(seconds))
                latency[s].append(statistics.median(seconds))
                scores.setdefault(s, sc)
    med = {s: {"docs_per_s": round(statistics.median(r), 2),
               "rerank_s": round(statistics.median(latency[s]), 3)} for s, r in rates.items() if r}
    print("\n| server | documents/s | seconds a rerank |\n|---|---|---|")
    for s, m in med.items():
        print(f"| {s} | {m['docs_per_s']:.1f} | {m['rerank_s']:.2f} |")
    ours = med.get("pipellm")
    ratios = {p: round(ours["docs_per_s"] / m["docs_per_s"], 2)
              for p, m in med.items() if ours and p != "pipellm"}
    agree = {p: agreement(scores["pipellm"], sc) for p, sc in scores.items()
             if p != "pipellm" and "pipellm" in scores}
    print(f"pipellm / peer (documents/s): {ratios} (target > 1); scores against pipellm's: "
          f"{agree}")
    out = {"bench": "rerank", "machine": machine(), "rounds": args.rounds,
           "reranks": args.reranks, "docs": args.docs, "vs_peers": ratios, "agreement": agree,
           "servers": med, "commands": args.commands,
           "seconds": round(time.monotonic() - t0)}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
