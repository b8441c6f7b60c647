"""The GPU suite's serving side by side, in the parts that need no GPU: vLLM's CUDA build carried
in parts (bench/vllm_gpu.py) and joined again, the two servers' commands and the load they get
(bench/gpu_serve.py, run for real against pipellm on the CPU), and the report's table and
targets (bench/gpu_report.py)."""

from __future__ import annotations

import json
import os
import tarfile

import pytest

from bench import gpu_report, gpu_serve, vllm_gpu
from pipellm.loadgen import cli


def last_json(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


def _bundle(path, tmp_path, size: int) -> bytes:
    """A tar.xz of one file of `size` random (incompressible) bytes; the bytes."""
    payload = os.urandom(size)
    (tmp_path / "payload.bin").write_bytes(payload)
    with tarfile.open(path, "w:xz") as tar:
        tar.add(tmp_path / "payload.bin", arcname="vllm/payload.bin")
    return payload


def test_vllm_bundle_travels_in_parts_and_joins_checked(tmp_path, monkeypatch):
    monkeypatch.setattr(vllm_gpu, "PART_MIB", 1)
    monkeypatch.setattr(vllm_gpu, "LAST_MIB", 1)
    bundle, carry, parts, site = (tmp_path / "b.tar.xz", tmp_path / "carry",
                                  tmp_path / "parts", tmp_path / "site")
    payload = _bundle(bundle, tmp_path, (5 << 20) // 2)  # 2.5 MiB: parts of 1, 1, ~0.5
    sizes = vllm_gpu.split(bundle, carry)
    assert len(sizes) == 3 and sum(sizes) == bundle.stat().st_size
    assert sorted(p.name for p in carry.iterdir()) == ["p0", "p1", "p2"]
    calls = vllm_gpu.plan(sizes)
    assert '".vllm/p0"' in calls[0] and '".whl", ".vllm/p2"' in calls[-1]
    assert "vllm_serve" in calls[-1] and len(calls) == 3

    # one call carries one part; before the last, unpack names what is missing
    assert vllm_gpu.status(parts)["missing"] == "all (no part received yet)"
    for k in (0, 1, 2):
        one = tmp_path / f"call{k}"
        (one / f"p{k}").mkdir(parents=True)
        for f in (carry / f"p{k}").iterdir():
            (one / f"p{k}" / f.name).write_bytes(f.read_bytes())
        state = vllm_gpu.recv(one, parts)
        assert len(state["have"]) == k + 1
        if k < 2:
            with pytest.raises(SystemExit, match=r"missing.*\.002"):
                vllm_gpu.unpack(parts, site)
    assert vllm_gpu.unpack(parts, site) == site
    assert (site / "vllm" / "payload.bin").read_bytes() == payload
    assert vllm_gpu.unpack(parts, site) == site  # once per machine: a second call is free


def test_vllm_bundle_refuses_a_damaged_part(tmp_path, monkeypatch):
    monkeypatch.setattr(vllm_gpu, "PART_MIB", 1)
    monkeypatch.setattr(vllm_gpu, "LAST_MIB", 1)
    bundle, carry = tmp_path / "b.tar.xz", tmp_path / "carry"
    _bundle(bundle, tmp_path, 3 << 19)
    vllm_gpu.split(bundle, carry)
    part = next((carry / "p1").glob("*.001"))
    part.write_bytes(part.read_bytes()[:-1] + b"\0")
    with pytest.raises(SystemExit, match="does not match its manifest"):
        vllm_gpu.recv(carry, tmp_path / "parts")


def test_vllm_pins_name_every_wheel_once():
    pins = vllm_gpu.pins()
    names = [p.split("==")[0] for p in pins]
    assert "vllm==0.24.0" in pins and len(names) == len(set(names))
    assert not {"torch", "triton", "numpy", "flashinfer-cubin"} & set(names)  # the image's
    assert vllm_gpu._wheel_pin("partial_json_parser-0.2.1.1.post7-py3-none-any.whl") == \
        "partial-json-parser==0.2.1.1.post7"


def test_both_servers_get_the_same_requests(tmp_path):
    args = gpu_serve.parse_args(["--workloads", "sg,sg4,sg16", "--sampling", "greedy,sampled"])
    model, out = tmp_path / "m", tmp_path / "r.json"
    ours = gpu_serve.make_server(args, model, 8001, tmp_path / "p.log")
    assert ours.argv[1:4] == ["-m", "pipellm.services.cli", "up"] and "cuda" in ours.argv
    args.server = "vllm"
    theirs = gpu_serve.make_server(args, model, 8002, tmp_path / "v.log")
    assert theirs.argv[1:5] == ["-m", "vllm.entrypoints.cli.main", "serve", str(model)]
    assert theirs.argv[theirs.argv.index("--dtype") + 1] == "bfloat16"
    assert theirs.env["PYTHONPATH"] == str(vllm_gpu.SITE)
    assert theirs.ready_url == "http://127.0.0.1:8002/v1/models"
    assert "--quantization" not in theirs.argv  # bf16 unless asked
    args.quantization = "fp8"  # both quantize the bf16 weights at load
    fp8 = gpu_serve.make_server(args, model, 8002, tmp_path / "v.log").argv
    assert fp8[fp8.index("--quantization") + 1] == "fp8"
    args.server = "pipellm"
    fp8 = gpu_serve.make_server(args, model, 8001, tmp_path / "p.log").argv
    assert fp8[fp8.index("--quantization") + 1] == "fp8"
    sg = gpu_serve.bench_argv(args, "sg", "greedy", 8002, model, out)
    assert sg[sg.index("--num-prompts") + 1] == "1000"
    assert sg[sg.index("--request-rate") + 1] == "inf"
    sg4s = gpu_serve.bench_argv(args, "sg4", "sampled", 8002, model, out)
    assert sg4s[sg4s.index("--request-rate") + 1] == "4"
    assert sg4s[sg4s.index("--num-prompts") + 1] == "120"
    ep = cli.endpoint(cli.parser().parse_args(sg4s[3:]))  # after python -m pipellm.loadgen.cli
    assert (ep.extra_body, ep.ignore_eos) == ({"temperature": 0.7, "top_p": 0.9}, True)
    with pytest.raises(SystemExit):
        gpu_serve.parse_args(["--workloads", "sg,sg8"])


def test_gpu_serve_drives_pipellm_end_to_end_on_the_cpu(demo_model_dir, capsys):
    """The step's whole path (server up, warm-ups, ShareGPT at once and at a rate, greedy and
    sampled, the JSON line) on the demo model; the GPU runs the same with --device cuda."""
    rc = gpu_serve.main(["--device", "cpu", "--model-dir", str(demo_model_dir), "--context",
                         "512", "--workloads", "sg,sg16", "--sampling", "greedy,sampled",
                         "--sharegpt-prompts", "6", "--rate-prompts", "4", "--warmup-prompts",
                         "2", "--ready-timeout", "300"])
    out = last_json(capsys.readouterr().out)
    assert rc == 0 and out["server"] == "pipellm" and out["startup_s"] > 0
    assert out["gpu_memory_mib"]["parent_pid"].isdigit()  # processes: {} without nvidia-smi
    assert out["model"].startswith("llama 4 layers x 128, vocab 1000")
    assert sorted(out["runs"]) == ["sg", "sg-s", "sg16", "sg16-s"]
    for name, row in out["runs"].items():
        assert (row["completed"], row["failed"]) == (6 if name.startswith("sg-") or name == "sg"
                                                     else 4, 0), name
        assert row["output_throughput"] > 0 and row["median_tpot_ms"] > 0
    # compute's stats lines of the runs that lasted past one interval (2 s)
    assert any(line.startswith("Avg prompt throughput:") and "decode rows" in line
               for row in out["runs"].values() for line in row["engine"])


def _serve(runs: dict) -> dict:
    keys = ("output_throughput", "median_ttft_ms", "median_tpot_ms")
    return {"runs": {name: dict(zip(keys, vals, strict=True)) for name, vals in runs.items()}}


def test_gpu_report_puts_pipellm_beside_vllm(tmp_path, capsys):
    ours = _serve({"sg": (9000.0, 300.0, 20.0), "sg4": (500.0, 40.0, 7.0),
                   "sg-s": (8000.0, 320.0, 22.0)})
    ours["gpu_memory_mib"] = {"parent_pid": "7", "processes": {"9": 120000}}
    ours["runs"]["sg"]["engine"] = ["Avg prompt throughput: 9.0 tokens/s, Avg generation "
                                    f"throughput: {g} tokens/s, ..." for g in (5.0, 80.5, 7.0)]
    theirs = _serve({"sg": (10000.0, 250.0, 18.0), "sg4": (500.0, 35.0, 7.7),
                     "sg-s": (7000.0, 300.0, 24.0), "sg16": (1.0, 1.0, 1.0)})
    (tmp_path / "serve_sg.json").write_text(json.dumps(ours))
    (tmp_path / "vllm_serve.json").write_text(json.dumps(theirs))
    (tmp_path / "serve_sg_fp8.json").write_text(json.dumps(_serve({"sg": (9500.0, 1, 2)})))
    (tmp_path / "vllm_serve_fp8.json").write_text(json.dumps(_serve({"sg": (9000.0, 1, 2)})))
    gpu_report.main([str(tmp_path)])
    text = capsys.readouterr().out
    out = last_json(text)
    assert out["figures"]["vs_vllm_throughput"] == 0.9  # the lower of sg and sg-s
    assert out["figures"]["vs_vllm_tpot"] == 1.1
    assert out["verdicts"]["vs_vllm_throughput"] == "NOT met"
    assert out["verdicts"]["vs_vllm_tpot"] == "met"
    assert "| sg | 9000 | 10000 | 300 / 20.0 | 250 / 18.0 |" in text
    assert "| fp8 sg | 9500 | 9000 | 1 / 2.0 | 1 / 2.0 |" in text
    assert "sg16" not in text  # a run only one server completed is not compared
    assert "the `pipellm up` parent (pid 7) 0 MiB" in text
    assert "serve_sg sg, compute's busiest stats line: Avg prompt throughput: 9.0 tokens/s, " \
        "Avg generation throughput: 80.5 tokens/s" in text
