"""The bench client against Loom's real server (packaged SmolLM2, a subprocess on a free loopback
port), and against servers that fail: counts exact, statistics re-derived from the timestamps,
failures counted without hanging the run."""

from __future__ import annotations

import json
import re
import socket
import sys
import threading

import pytest

from loom.bench.datasets import synthetic_prompts
from loom.bench.metrics import compute_metrics
from loom.bench.request import RequestInput, RequestRecord
from loom.bench.runner import BenchConfig, run_benchmark, server_model
from loom.bench.server_proc import ServerProcess
from loom.entrypoints.cli import main
from loom.net import free_port

pytestmark = pytest.mark.slow  # a real `loom serve` subprocess

NUM, CONC, IN_LEN, OUT_LEN, MAX_LEN = 6, 3, 8, 8, 64


@pytest.fixture(scope="module")
def server(request, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("server") / "serve.log"
    cmd = [sys.executable, "-m", "loom.entrypoints.cli", "serve", "--port", str(port),
           "--max-model-len", str(MAX_LEN), "--kv-cache-memory", str(32 << 20),
           "--disable-log-requests", "--timeout-graceful-shutdown", "1"]
    with ServerProcess(cmd, f"http://127.0.0.1:{port}", log_path=log) as proc:
        request.getfixturevalue("tokenizer")  # loads while the server starts
        proc.wait_healthy(timeout=240)
        yield proc.base_url


def _inputs(tokenizer, n: int = NUM, seed: int = 0) -> list[RequestInput]:
    prompts = synthetic_prompts(tokenizer, n, IN_LEN, OUT_LEN, seed)
    return [RequestInput(i, p.prompt, p.prompt_len, p.output_len) for i, p in enumerate(prompts)]


def _percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks, written out (numpy's default method)."""
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _independent_stats(records: list[RequestRecord]) -> dict[str, list[float]]:
    ttft, itl, tpot, e2el = [], [], [], []
    for r in records:
        times = r.chunk_times
        ttft.append(times[0] - r.start)
        itl += [times[i] - times[i - 1] for i in range(1, len(times))]
        e2el.append(r.end - r.start)
        tpot.append((r.end - times[0]) / (r.output_tokens - 1))
    return {"ttft": ttft, "itl": itl, "tpot": tpot, "e2el": e2el}


def test_counts_and_every_statistic_from_the_timestamps(server, tokenizer) -> None:
    cfg = BenchConfig(server, server_model(server), concurrency=CONC, disable_tqdm=True)
    res = run_benchmark(cfg, _inputs(tokenizer), tokenizer)
    recs = res.records
    assert [r.index for r in recs] == list(range(NUM))
    assert all(r.success for r in recs), [r.error for r in recs]
    assert all(r.usage_reported and r.output_tokens == OUT_LEN for r in recs)
    assert all(r.prompt_tokens == IN_LEN for r in recs)
    for r in recs:  # timestamps ordered and inside the request; at most one chunk per token
        assert r.start < r.chunk_times[0] and r.chunk_times == sorted(r.chunk_times)
        assert r.chunk_times[-1] <= r.end <= res.duration
        assert 1 <= len(r.chunk_times) <= OUT_LEN
    # never more than CONC requests in flight
    assert max(sum(o.start <= r.start < o.end for o in recs) for r in recs) <= CONC

    m = compute_metrics(recs, res.duration)
    assert (m["completed"], m["failed"]) == (NUM, 0)
    assert m["total_output_tokens"] == NUM * OUT_LEN and m["total_input_tokens"] == NUM * IN_LEN
    assert m["short_outputs"] == 0
    assert m["output_throughput"] == pytest.approx(NUM * OUT_LEN / res.duration)
    assert m["request_throughput"] == pytest.approx(NUM / res.duration)
    assert m["total_token_throughput"] == pytest.approx(NUM * (IN_LEN + OUT_LEN) / res.duration)
    for figure, values in _independent_stats(recs).items():
        ms = [v * 1000 for v in values]
        assert m[f"mean_{figure}_ms"] == pytest.approx(sum(ms) / len(ms))
        assert m[f"median_{figure}_ms"] == pytest.approx(_percentile(ms, 50))
        assert m[f"p90_{figure}_ms"] == pytest.approx(_percentile(ms, 90))
        assert m[f"p99_{figure}_ms"] == pytest.approx(_percentile(ms, 99))


def test_failed_requests_are_counted(server, tokenizer) -> None:
    inputs = _inputs(tokenizer, 4, seed=1)
    too_long = "word " * (MAX_LEN * 2)
    inputs[1] = RequestInput(1, too_long, MAX_LEN * 2, OUT_LEN)
    cfg = BenchConfig(server, server_model(server), concurrency=2, disable_tqdm=True)
    res = run_benchmark(cfg, inputs, tokenizer)
    assert [r.success for r in res.records] == [True, False, True, True]
    assert res.records[1].status_code == 400 and res.records[1].error.startswith("HTTP 400")
    m = compute_metrics(res.records, res.duration)
    assert (m["completed"], m["failed"], m["total_output_tokens"]) == (3, 1, 3 * OUT_LEN)

    wrong = BenchConfig(server, "no-such-model", concurrency=2, disable_tqdm=True)
    res = run_benchmark(wrong, inputs[:3], tokenizer)
    assert all(not r.success and r.status_code == 404 for r in res.records)
    assert compute_metrics(res.records, res.duration)["failed"] == 3


def test_cli_serve_and_chat_against_loom(server, tmp_path, capsys) -> None:
    out = tmp_path / "r.json"
    main(["bench", "serve", "--base-url", server, "--num-prompts", "3", "--concurrency", "2",
          "--input-len", str(IN_LEN), "--output-len", "4", "--endpoint", "chat",
          "--result-json", str(out), "--disable-tqdm", "--goodput", "ttft:60000"])
    text = capsys.readouterr().out
    assert re.search(r"Successful requests:\s+3\n", text) and "Mean TTFT (ms):" in text
    data = json.loads(out.read_text())
    assert data["completed"] == 3 and data["total_output_tokens"] == 12
    assert data["request_goodput"] == pytest.approx(data["request_throughput"])
    assert len(data["records"]) == 3

    with pytest.raises(SystemExit) as e:  # every request fails: exit 1, results still written
        main(["bench", "serve", "--base-url", server, "--model", "nope", "--num-prompts", "2",
              "--input-len", "4", "--output-len", "2", "--result-json", str(out),
              "--disable-tqdm"])
    assert e.value.code == 1
    assert json.loads(out.read_text())["failed"] == 2
    assert "2 request(s) failed" in capsys.readouterr().out


class _BadServer:
    """Loopback server that streams one SSE chunk and then drops the connection (`mode="die"`),
    or accepts and never answers (`mode="silent"`)."""

    def __init__(self, mode: str) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.mode, self.conns = mode, []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)
            if self.mode == "die":
                conn.recv(65536)
                chunk = b'data: {"choices": [{"text": "hi"}]}\n\n'
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                             b"Transfer-Encoding: chunked\r\n\r\n"
                             + f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
                conn.close()

    def close(self) -> None:
        self.sock.close()
        for c in self.conns:
            c.close()


@pytest.mark.parametrize("mode", ["die", "silent"])
def test_dying_or_silent_server_does_not_hang(mode) -> None:
    bad = _BadServer(mode)
    try:
        cfg = BenchConfig(bad.url, "m", concurrency=2, request_timeout=1.0, disable_tqdm=True)
        inputs = [RequestInput(i, "hello", 1, 4) for i in range(3)]
        res = run_benchmark(cfg, inputs)
    finally:
        bad.close()
    assert len(res.records) == 3 and not any(r.success for r in res.records)
    assert res.duration < 60  # a hang guard, not a speed claim
    m = compute_metrics(res.records, res.duration)
    assert m["failed"] == 3
    # A server dying mid-body surfaces as either httpx error, depending on timing.
    expected = ("RemoteProtocolError", "ReadError") if mode == "die" else ("timed out",)
    assert all(any(e in r.error for e in expected) for r in res.records), [r.error for r in res.records]


def test_unreachable_server_fails_every_request_quickly() -> None:
    cfg = BenchConfig(f"http://127.0.0.1:{free_port()}", "m", concurrency=2, disable_tqdm=True)
    res = run_benchmark(cfg, [RequestInput(i, "x", 1, 2) for i in range(4)])
    assert all("cannot connect" in r.error for r in res.records) and res.duration < 60
