"""`loom bench` without a server: prompts of exact lengths, SSE parsing, metrics, CLI errors."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import httpx
import numpy as np
import pytest

from loom.bench import server_proc
from loom.bench.datasets import DatasetError, load_jsonl, normal_token_ids, synthetic_prompts
from loom.bench.metrics import SLOError, compute_metrics, format_report, notes, parse_goodput
from loom.bench.request import RequestInput, RequestRecord
from loom.bench.runner import BenchConfig, BenchError, _arrival_gaps, root_url, run_benchmark
from loom.bench.sweep import SweepPlan, parse_concurrencies, parse_servers, plot_sweep
from loom.entrypoints.cli import main


def test_synthetic_prompts_have_exact_lengths_and_are_reproducible(tokenizer) -> None:
    vocab = normal_token_ids(tokenizer)
    assert not set(tokenizer.hf.all_special_ids) & set(vocab.tolist())
    for length in (1, 8, 128, 300):
        prompts = synthetic_prompts(tokenizer, 5, length, 16, seed=3, vocab=vocab)
        for p in prompts:
            assert len(tokenizer.encode(p.prompt, add_special_tokens=False)) == length
            assert p.prompt_len == length and p.output_len == 16
        assert len({p.prompt for p in prompts}) == 5
    a = synthetic_prompts(tokenizer, 3, 32, 4, seed=7, vocab=vocab)
    b = synthetic_prompts(tokenizer, 3, 32, 4, seed=7, vocab=vocab)
    c = synthetic_prompts(tokenizer, 3, 32, 4, seed=8, vocab=vocab)
    assert a == b and a != c


def test_jsonl_dataset(tmp_path, tokenizer) -> None:
    f = tmp_path / "d.jsonl"
    f.write_text('{"prompt": "hello world"}\n\n{"prompt": "a b c", "output_len": 3}\n')
    items = load_jsonl(f, tokenizer, 5, 10)
    assert [i.prompt for i in items] == ["hello world", "a b c"] * 2 + ["hello world"]
    assert [i.output_len for i in items[:2]] == [10, 3] and items[0].prompt_len == 2
    with pytest.raises(DatasetError, match="not found"):
        load_jsonl(tmp_path / "missing.jsonl", tokenizer, 1, 1)
    f.write_text('{"text": "x"}\n')
    with pytest.raises(DatasetError, match=":1: each line needs"):
        load_jsonl(f, tokenizer, 1, 1)
    f.write_text("not json\n")
    with pytest.raises(DatasetError, match="not JSON"):
        load_jsonl(f, tokenizer, 1, 1)


def _sse(*events: dict | str) -> bytes:
    return b"".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n".encode()
                    for e in events)


def _stream_handler(request: httpx.Request) -> httpx.Response:
    body = json.loads(request.content)
    if body["model"] == "bad":
        return httpx.Response(404, json={"error": {"message": "model bad does not exist"}})
    if body["model"] == "plain":
        return httpx.Response(200, json={"choices": [{"text": "hi"}]})
    n = body["max_tokens"]
    chunks = [{"choices": [{"index": 0, "text": f" t{i}", "finish_reason": None}]}
              for i in range(n)]
    chunks[-1]["choices"][0]["finish_reason"] = "length"
    if body["model"] == "usage":
        chunks.append({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": n}})
    return httpx.Response(200, headers={"content-type": "text/event-stream"},
                          content=_sse(*chunks, "[DONE]"))


def _run(model: str, n: int = 4, out: int = 3, concurrency: int | None = 2):
    cfg = BenchConfig("http://test", model, concurrency=concurrency, disable_tqdm=True)
    inputs = [RequestInput(i, "p", 4, out) for i in range(n)]
    return run_benchmark(cfg, inputs, None, httpx.MockTransport(_stream_handler))


def test_stream_parsing_and_usage() -> None:
    res = _run("usage")
    assert all(r.success and r.usage_reported for r in res.records)
    m = compute_metrics(res.records, res.duration)
    assert (m["completed"], m["failed"], m["total_output_tokens"], m["total_input_tokens"]) \
        == (4, 0, 12, 20)
    r = res.records[0]
    assert len(r.chunk_times) == 3 and r.generated_text == " t0 t1 t2"
    assert r.finish_reason == "length" and r.start <= r.chunk_times[0] <= r.end
    res = _run("nousage")  # counted as one token per chunk without a tokenizer
    assert all(r.output_tokens == 3 and not r.usage_reported for r in res.records)
    assert any("did not report usage" in line for line in notes(compute_metrics(
        res.records, res.duration), True))


def test_errors_and_no_streaming_are_failed_requests() -> None:
    res = _run("bad")
    assert [r.success for r in res.records] == [False] * 4
    assert res.records[0].error == "HTTP 404: model bad does not exist"
    m = compute_metrics(res.records, res.duration)
    assert m["failed"] == 4 and m["median_ttft_ms"] is None
    assert "n/a" in format_report(m)
    res = _run("plain", n=1)
    assert "did not stream" in res.records[0].error


def _rec(start: float, times: list[float], end: float, tokens: int) -> RequestRecord:
    return RequestRecord(0, 4, tokens, start=start, end=end, chunk_times=times,
                         output_tokens=tokens, success=True)


def test_metrics_by_hand() -> None:
    recs = [_rec(0.0, [0.1, 0.2, 0.4], 0.5, 3), _rec(0.5, [0.8, 0.9, 1.0], 1.0, 4)]
    m = compute_metrics(recs, 2.0, {"ttft": 150.0})
    assert m["output_throughput"] == pytest.approx(3.5)
    assert m["mean_ttft_ms"] == pytest.approx(200.0) and m["median_ttft_ms"] == pytest.approx(200)
    assert m["p99_ttft_ms"] == pytest.approx(100 + 200 * 0.99)
    # TPOT: (0.5 - 0.1) / 2 = 0.2 and (0.5 - 0.3) / 3
    assert m["mean_tpot_ms"] == pytest.approx((200 + 200 / 3) / 2)
    assert sorted(np.round([0.1, 0.2, 0.1, 0.1], 6)) == pytest.approx(
        sorted(np.round([g for r in recs for g in r.itl], 6)))
    assert m["mean_e2el_ms"] == pytest.approx(500.0)
    assert m["request_goodput"] == pytest.approx(0.5)  # only the first meets TTFT <= 150 ms
    assert m["short_outputs"] == 0


def test_parsers() -> None:
    assert parse_goodput(["ttft:500", "tpot:50"]) == {"ttft": 500.0, "tpot": 50.0}
    for bad in (["ttft"], ["foo:1"], ["ttft:x"], ["e2el:-1"]):
        with pytest.raises(SLOError):
            parse_goodput(bad)
    assert parse_servers(["a=http://x:1", "b=http://y:2"]) == {"a": "http://x:1", "b": "http://y:2"}
    with pytest.raises(ValueError):
        parse_servers(["nourl"])
    assert parse_concurrencies("1, 4,16") == (1, 4, 16)
    with pytest.raises(ValueError):
        parse_concurrencies("1,0")
    assert root_url("http://h:1/v1/") == "http://h:1"
    with pytest.raises(BenchError):
        root_url("h:1")
    with pytest.raises(BenchError):
        BenchConfig("http://h", "m", endpoint="embeddings")
    gaps = _arrival_gaps(1000, 10.0, 0)
    assert gaps[0] == 0 and gaps == _arrival_gaps(1000, 10.0, 0)
    assert np.mean(gaps[1:]) == pytest.approx(0.1, rel=0.1)
    assert _arrival_gaps(3, math.inf, 0) == [0.0] * 3
    plan = SweepPlan((1, 32), repeats=2)
    assert plan.num_prompts(1) == 4 and plan.num_prompts(32) == 32
    assert len({plan.seed_for(lv, r) for lv in range(2) for r in range(2)}) == 4


def test_plot(tmp_path) -> None:
    med = {"output_throughput": 10.0, "median_ttft_ms": 5.0, "p99_ttft_ms": 9.0}
    res = {"a": {"levels": [{"concurrency": c, "median": med} for c in (1, 4)]},
           "b": {"levels": [{"concurrency": 1, "median": {**med, "median_ttft_ms": None}}]}}
    plot_sweep(res, tmp_path / "p.png", "t")
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("argv,message", [
    (["serve", "--base-url", "http://127.0.0.1:9", "--model", "m"], "cannot reach"),
    (["serve", "--base-url", "127.0.0.1:9"], "must start with http"),
    (["sweep", "--server", "x"], "use NAME=URL"),
    (["serve", "--goodput", "ttft"], "bad --goodput"),
    (["startup"], "give the server command"),
    (["serve", "--dataset", "/nonexistent.jsonl"], "dataset file not found"),
    (["throughput", "--dataset", "/nonexistent.jsonl"], "dataset file not found"),
])
def test_cli_bad_input_is_a_clear_error(argv, message, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        main(["bench", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize("argv", [["serve", "--num-prompts", "0"], ["serve", "--concurrency", "x"],
                                  ["serve", "--endpoint", "embeddings"], ["nope"]])
def test_cli_bad_flags(argv, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        main(["bench", *argv])
    assert e.value.code == 2 and "usage:" in capsys.readouterr().err


# A process that starts one child; each holds 64 MiB of touched memory and has spent 0.3 s of
# CPU time before it says "ready" (the child first), then waits for its stdin to close.
TREE = """
import subprocess, sys, time
held = bytearray(64 << 20)
held[::4096] = b"x" * len(held[::4096])
while time.process_time() < 0.3:
    pass
if sys.argv[1] == "parent":
    child = subprocess.Popen([sys.executable, sys.argv[0], "child"], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline() == "ready\\n"
print("ready", flush=True)
sys.stdin.read()
"""


def test_server_process_tree_figures(tmp_path) -> None:
    """tree_rss / tree_pss / tree_cpu_seconds sum a process and its child (psutil), and
    machine_busy_seconds counts the time they spent."""
    script = tmp_path / "tree.py"
    script.write_text(TREE)
    busy0 = server_proc.machine_busy_seconds()
    proc = subprocess.Popen([sys.executable, str(script), "parent"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "ready\n"
        tree = server_proc.process_tree(proc.pid)
        assert len(tree) == 2 and tree[0].pid == proc.pid
        mib = 2**20
        rss = server_proc.tree_rss(proc.pid)
        assert 2 * 64 * mib <= rss <= 2 * 200 * mib
        assert 2 * 64 * mib <= server_proc.tree_pss(proc.pid) <= rss + 16 * mib
        assert server_proc.tree_cpu_seconds(proc.pid) >= 2 * 0.3 - 0.05  # clock ticks
        assert server_proc.machine_busy_seconds() - busy0 >= 2 * 0.3 - 0.05
    finally:
        proc.stdin.close()
        proc.wait(timeout=60)
    assert server_proc.process_tree(proc.pid) == []
    assert server_proc.tree_rss(proc.pid) == 0
