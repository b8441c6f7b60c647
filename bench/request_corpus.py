"""Request bodies in the shapes vLLM's own OpenAI-server tests send, replayed against pipellm
and vLLM's CPU build: same model (SmolLM2-135M-Instruct expanded to float32, served by both in
float32), greedy, one request at a time. Per body: both status codes, and where both answered
200, whether the texts (and token ids, where asked for) are the same.

    python -m bench.request_corpus [--servers pipellm-fp32,vllm-fp32]

Prints a markdown table (one row per body) and, last, one JSON line: the counts of same
status, same text, and the rows that differ.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import servers, vs_peers  # noqa: E402
from bench.common import isa, log, machine  # noqa: E402

MODEL = "smol"
MSG = [{"role": "user", "content": "Name a color."}]
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
G = {"temperature": 0, "max_tokens": 12}
CORPUS: list[tuple[str, str, dict]] = [  # (name, endpoint, body)
    ("completion", "completions", {"prompt": "The capital of France is", **G}),
    ("batched prompts", "completions", {"prompt": ["One", "Two three"], **G}),
    ("token-id prompt", "completions", {"prompt": [1, 504, 3458], **G}),
    ("batched token ids", "completions", {"prompt": [[1, 504], [1, 3458, 28]], **G}),
    ("echo + logprobs", "completions", {"prompt": "Hello there", "echo": True, "logprobs": 2,
                                        **G}),
    ("max_tokens 0 echo", "completions", {"prompt": "Hello there", "echo": True,
                                          "logprobs": 1, "max_tokens": 0, "temperature": 0}),
    ("n=2 greedy", "completions", {"prompt": "A list:", "n": 2, **G}),
    ("best_of", "completions", {"prompt": "A list:", "best_of": 3, "n": 1, **G}),
    ("stop string", "completions", {"prompt": "1, 2, 3,", "stop": [","], **G}),
    ("include_stop_str_in_output", "completions", {"prompt": "1, 2, 3,", "stop": [","],
                                                   "include_stop_str_in_output": True, **G}),
    ("skip_special_tokens false", "completions", {"prompt": "Hi", "skip_special_tokens": False,
                                                  **G}),
    ("bad_words", "completions", {"prompt": "The capital of France is",
                                  "bad_words": ["Paris"], **G}),
    ("allowed_token_ids", "completions", {"prompt": "Hi", "allowed_token_ids": [28, 29, 30],
                                          **G}),
    ("logit_bias", "completions", {"prompt": "Hi", "logit_bias": {"28": 100}, **G}),
    ("truncate_prompt_tokens", "completions", {"prompt": "a b c d e f g h",
                                               "truncate_prompt_tokens": 3, **G}),
    ("return_token_ids", "completions", {"prompt": "Hi", "return_token_ids": True, **G}),
    ("min_tokens + ignore_eos", "completions", {"prompt": "Hi", "min_tokens": 5,
                                                "ignore_eos": True, **G}),
    ("stop_token_ids", "completions", {"prompt": "1 2 3", "stop_token_ids": [216], **G}),
    ("guided_choice", "completions", {"prompt": "Yes or no?", "guided_choice": ["yes", "no"],
                                      **G}),
    ("guided_regex", "completions", {"prompt": "A number:", "guided_regex": "[0-9]{3}", **G}),
    ("response_format json_schema", "completions", {
        "prompt": "A person as JSON:", "temperature": 0, "max_tokens": 60,
        "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {
            "type": "object", "properties": {"name": {"type": "string", "maxLength": 10}},
            "required": ["name"], "additionalProperties": False}}}}),
    ("chat", "chat/completions", {"messages": MSG, **G}),
    ("chat developer role", "chat/completions", {
        "messages": [{"role": "developer", "content": "Be brief."}, *MSG], **G}),
    ("chat logprobs top 3", "chat/completions", {"messages": MSG, "logprobs": True,
                                                 "top_logprobs": 3, **G}),
    ("chat add_generation_prompt false", "chat/completions", {
        "messages": MSG, "add_generation_prompt": False, **G}),
    ("chat continue_final_message", "chat/completions", {
        "messages": [*MSG, {"role": "assistant", "content": "My favorite color is"}],
        "continue_final_message": True, "add_generation_prompt": False, **G}),
    ("chat echo", "chat/completions", {
        "messages": [*MSG, {"role": "assistant", "content": "Blue"}], "echo": True,
        "continue_final_message": True, "add_generation_prompt": False, **G}),
    ("chat tool_choice named", "chat/completions", {
        "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [TOOL],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "temperature": 0, "max_tokens": 40}),
    ("chat unknown key", "chat/completions", {"messages": MSG, "not_a_field": 1, **G}),
    ("bad: n=0", "completions", {"prompt": "Hi", "n": 0}),
    ("bad: temperature -1", "completions", {"prompt": "Hi", "temperature": -1}),
    ("bad: top_p 0", "completions", {"prompt": "Hi", "top_p": 0}),
    ("bad: no prompt", "completions", {"max_tokens": 5}),
    ("bad: empty messages", "chat/completions", {"messages": []}),
    ("bad: logprobs 21", "completions", {"prompt": "Hi", "logprobs": 21}),
    ("bad: wrong model", "completions", {"prompt": "Hi", "model": "other"}),
]


def post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, json.dumps({"model": MODEL, **body}).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        try:
            return e.code, json.loads(e.read())
        except ValueError:
            return e.code, {}


def outputs(answer: dict) -> list:
    """What to compare of a 200 answer: each choice's text (or message) and token ids."""
    out = []
    for c in answer.get("choices", []):
        msg = c.get("message") or {}
        calls = [(t["function"]["name"], json.loads(t["function"]["arguments"]))
                 for t in msg.get("tool_calls") or []]
        out.append((c.get("text", msg.get("content")), calls, c.get("token_ids")))
    return out


def _gist(status: int, body: dict) -> str:
    """An answer in a line: its error message, or its outputs."""
    if status != 200:
        return str((body.get("error") or {}).get("message", body))[:200]
    return json.dumps(outputs(body))[:200]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--servers", default="pipellm-fp32,vllm-fp32")
    a = p.parse_args(argv)
    args = vs_peers.parse_args(["--servers", a.servers, "--rounds", "1"])
    args.vllm_extra += f" --served-model-name {MODEL}"
    args.pipellm_extra += f" --served-model-name {MODEL} --generation-config vllm"
    vs_peers.prepare(args)
    answers: dict[str, list] = {}
    for name in args.servers:
        port = servers.free_port()
        server = vs_peers.make_server(args, name, port, args.results_dir / f"{name}.log")
        try:
            with servers.running(server, args.ready_timeout):
                answers[name] = [post(f"http://127.0.0.1:{port}/v1/{ep}", body)
                                 for _, ep, body in CORPUS]
        except servers.ServerError as exc:
            log(f"{name}: {exc}")
    if len(answers) != 2:
        sys.exit("both servers must answer")
    ours, theirs = (answers[n] for n in args.servers)
    rows, same_status, same_text, both_ok = [], 0, 0, 0
    print(f"| request | {args.servers[0]} | {args.servers[1]} | same output |\n|---|---|---|---|")
    for (name, _, _), (s1, b1), (s2, b2) in zip(CORPUS, ours, theirs, strict=True):
        same = None
        if s1 == s2 == 200:
            both_ok += 1
            same = outputs(b1) == outputs(b2)
            same_text += same
        same_status += s1 == s2
        row = dict(request=name, status=[s1, s2], same_output=same)
        if s1 != s2 or same is False:  # what each said
            row["answers"] = [_gist(s1, b1), _gist(s2, b2)]
        rows.append(row)
        print(f"| {name} | {s1} | {s2} | {'-' if same is None else 'yes' if same else 'no'} |")
    result = dict(machine=machine(), isa=isa(), requests=len(CORPUS), same_status=same_status,
                  both_200=both_ok, same_output=same_text,
                  differ=[r for r in rows if r["status"][0] != r["status"][1]
                          or r["same_output"] is False])
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
