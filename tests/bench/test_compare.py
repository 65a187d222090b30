"""benchmarks/compare.py's parts that need no server: the engines' command lines, peers that are
not installed, the weight bytes read per token, the table's ratios and the issues' goals, and
the 1.7B shape's layout. (The servers themselves: `bash benchmarks/run_side_by_side.sh --quick`.)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from safetensors.torch import save_file

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH / "peers"))

import compare  # noqa: E402
import compare_engines  # noqa: E402
import compare_figures  # noqa: E402
import fold_results  # noqa: E402
import make_shape  # noqa: E402

from tests.gguf_files import _permute  # noqa: E402


def test_loom_runs_with_no_flags_unless_asked() -> None:
    ns = compare.parse_args([])
    cmd = compare_engines.loom_command(8123, ns)
    assert cmd[1:] == ["serve", "--port", "8123"]
    assert ns.engines.split(",") == ["loom", "llama.cpp", "ik_llama.cpp", "vllm"]
    ns = compare.parse_args(["--model", "m.gguf", "--loom-args", "--max-model-len 2048"])
    assert compare_engines.loom_command(1, ns)[1:] == ["serve", "m.gguf", "--port", "1",
                                                       "--max-model-len", "2048"]
    assert ns.goals == "none" and compare.parse_args([]).goals == "135m"


def test_unknown_engine_is_a_clear_error(capsys) -> None:
    with pytest.raises(SystemExit):
        compare.parse_args(["--engines", "loom,llamacpp"])
    assert "unknown engine(s) llamacpp" in capsys.readouterr().err


def test_peers_not_installed_are_skipped_with_the_reason(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("LOOM_PEERS", str(tmp_path))
    ns = compare.parse_args([])
    for name in ("llama.cpp", "ik_llama.cpp", "vllm"):
        with pytest.raises(compare_engines.NotInstalled, match="not installed"):
            compare_engines.MAKERS[name](1, ns)
    (tmp_path / "vllm-cpu" / "bin").mkdir(parents=True)
    (tmp_path / "vllm-cpu" / "bin" / "python").write_text("")
    ns = compare.parse_args(["--model", "other.gguf"])
    with pytest.raises(compare_engines.NotInstalled, match="--vllm-model"):
        compare_engines.vllm_engine(1, ns)


@pytest.mark.parametrize("name,folder,flag", [("llama.cpp", "llama-cpp", "--llama-args"),
                                               ("ik_llama.cpp", "ik-llama-cpp", "--ik-args")])
def test_llama_server_builds_get_the_same_flags(tmp_path, monkeypatch, name, folder,
                                                flag) -> None:
    monkeypatch.setenv("LOOM_PEERS", str(tmp_path))
    server = tmp_path / folder / "bin" / "llama-server"
    server.parent.mkdir(parents=True)
    server.write_text("#!/bin/sh\necho 'version: 1 (abc)'\n")
    server.chmod(0o755)
    ns = compare.parse_args(["--model", "x.gguf", "--concurrency", "1,16", "--threads", "2",
                             f"{flag}=-rtr"])
    eng = compare_engines.MAKERS[name](8000, ns)
    assert eng.name == name and "version: 1 (abc)" in eng.version
    tail = ["--no-repack"] if "amx_int8" in compare_engines._cpu_flags() and name == "llama.cpp" \
        else []
    assert eng.cmd[1:] == ["-m", "x.gguf", "--host", "127.0.0.1", "--port", "8000", "-np", "16",
                           "-cb", "-t", "2", "-c", str(16 * 512), "-rtr", *tail]


def _write_gguf(path: Path, untied: bool) -> None:
    from gguf.quants import quantize

    w = GGUFWriter(str(path), "llama")
    w.add_string("tokenizer.chat_template", "long metadata " * 100)
    w.add_array("tokenizer.ggml.tokens", ["x", "yy", "zzz"])
    w.add_array("tokenizer.ggml.scores", [0.5, 1.5, 2.5])
    w.add_tensor("token_embd.weight", np.zeros((64, 32), np.float16))
    if untied:
        w.add_tensor("output.weight", np.zeros((64, 32), np.float32))
    q8 = quantize(np.ones((8, 64), np.float32), GGMLQuantizationType.Q8_0)
    w.add_tensor("blk.0.attn_q.weight", q8, raw_dtype=GGMLQuantizationType.Q8_0)
    w.add_tensor("blk.0.attn_norm.weight", np.zeros(32, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("untied", [False, True])
def test_weight_bytes_of_a_gguf(tmp_path, untied) -> None:
    path = tmp_path / "m.gguf"
    _write_gguf(path, untied)
    tensors = GGUFReader(str(path)).tensors
    assert compare_figures._gguf_tensors(path) == [
        (t.name, int(t.n_elements), int(t.tensor_type)) for t in tensors]
    # a decode reads every tensor once, but of an untied embedding table one row a token
    q8 = 8 * 64 // 32 * 34
    expect = 64 * 32 * 4 + q8 + 32 * 4 if untied else 64 * 32 * 2 + q8 + 32 * 4
    assert compare_figures.weight_bytes(path) == expect
    assert expect == sum(int(t.n_bytes) for t in tensors
                         if not (untied and t.name == "token_embd.weight"))


def test_weight_bytes_of_real_files_and_hf_folders(tmp_path) -> None:
    from loom.loader.resolve import default_gguf_path

    path = default_gguf_path()  # tied: every tensor counts
    assert 0.97 < compare_figures.weight_bytes(path) / path.stat().st_size < 1.0
    hf = tmp_path / "hf"
    hf.mkdir()
    save_file({"model.embed_tokens.weight": torch.zeros(64, 32, dtype=torch.bfloat16),
               "model.norm.weight": torch.zeros(32)}, str(hf / "model.safetensors"))
    assert compare_figures.weight_bytes(hf) == 64 * 32 * 2 + 32 * 4  # tied: the head
    save_file({"lm_head.weight": torch.zeros(64, 32)}, str(hf / "head.safetensors"))
    assert compare_figures.weight_bytes(hf) == 32 * 4 + 64 * 32 * 4
    assert compare_figures.weight_bytes(tmp_path / "absent") is None


def _summary(health: float, rss: int, tps: dict[int, float], ttft: float,
             tpot: float | None = None) -> dict:
    return {"health_s": health, "peak_rss_bytes": rss, "levels": [
        {"concurrency": c, "median": {"output_throughput": v, "median_ttft_ms": ttft,
                                      "median_tpot_ms": tpot, "failed": 0}}
        for c, v in tps.items()]}


def test_table_holds_loom_against_the_best_peer_and_goals_say_met() -> None:
    summary = {
        "Loom": _summary(2.0, 900 << 20, {1: 120.0, 32: 300.0}, 100.0),
        "llama.cpp": _summary(0.7, 1000 << 20, {1: 60.0, 32: 120.0}, 400.0),
        "ik_llama.cpp": _summary(1.0, 800 << 20, {1: 80.0, 32: 40.0}, 300.0),
        "vLLM": _summary(90.0, 4000 << 20, {1: 20.0, 32: 200.0}, 250.0),
    }
    lines = compare.table(summary, [1, 32])
    assert lines[0].endswith("| Loom/vLLM | Loom/best peer |")
    row = next(ln for ln in lines if ln.startswith("| output tokens/s @ C=1 "))
    assert row.split("|")[-2].strip() == "1.50"  # 120 / ik_llama.cpp's 80
    row = next(ln for ln in lines if ln.startswith("| TTFT p50 @ C=32"))
    assert row.split("|")[-2].strip() == "0.40"  # 100 / vLLM's 250, lower is better
    goals = compare_figures.goal_lines(summary, "135m")
    assert goals[0].endswith("against ik_llama.cpp's 80, 1.50x: **met**")
    assert goals[1].endswith("against vLLM's 200, 1.50x: **not met**")
    assert goals[2].endswith("against vLLM's 250, 0.40x: **met**")
    assert goals[3] == "- start-up until /health (s), < 3: Loom 2: **met**"
    assert goals[4].endswith("against llama.cpp's 1000 MiB, 0.90x: **met**")
    alone = compare_figures.goal_lines({"Loom": summary["Loom"]}, "gemma")
    assert alone == ["- one stream, output tokens/s, >= 1.5x llama.cpp: not measured"]


def test_bandwidth_share_is_one_stream_bytes_over_the_machine_s() -> None:
    """Decode steps a second (1000 / TPOT, not output tokens/s, which counts the prompt's time
    too) times the weight bytes, over the read bandwidth."""
    rounds = [{"Loom": {**_summary(2.0, 1, {1: 8.0, 16: 50.0}, 100.0, tpot=100.0)}}]
    s = compare.summarize(rounds, "Loom", wbytes=10**9, bandwidth=40e9)
    assert s["bandwidth_share"] == pytest.approx(0.25)
    assert compare.summarize(rounds, "Loom")["bandwidth_share"] is None
    assert compare_figures.read_bandwidth(1 << 24, repeats=1) > 1e8


def test_shape_is_smollm2_1_7b_and_its_hf_folder_undoes_the_permutation() -> None:
    plan = make_shape.tensor_plan(make_shape.CONFIG)
    assert sum(int(np.prod(shape)) for _, shape, _ in plan) == 1_711_376_384
    assert {make_shape.hf_name(n) for n, _, _ in plan} >= {
        "model.embed_tokens.weight", "model.layers.23.mlp.down_proj.weight",
        "model.layers.0.self_attn.q_proj.weight", "model.norm.weight"}
    w = np.arange(2 * 8 * 3, dtype=np.float32).reshape(16, 3)
    assert np.array_equal(make_shape._unpermute(_permute(w, 2), 2), w)
    assert json.loads(json.dumps(make_shape.CONFIG))["rope_theta"] == 130000.0


def test_the_8b_shape_is_llama_3_8b_s_body_with_an_untied_head() -> None:
    _, _, cfg = make_shape.SHAPES["llama3-8b"]
    plan = make_shape.tensor_plan(cfg)
    shapes = {n: shape for n, shape, _ in plan}
    assert sum(int(np.prod(shape)) for shape in shapes.values()) == 7_382_241_280
    assert shapes["blk.31.attn_k.weight"] == (8 * 128, 4096)  # grouped-query: 8 KV heads
    assert shapes["blk.0.ffn_down.weight"] == (4096, 14336)
    assert shapes["output.weight"] == shapes["token_embd.weight"] == (49152, 4096)
    assert make_shape.hf_name("output.weight") == "lm_head.weight"
    assert make_shape.SHAPES["smollm2-1.7b"][2] is make_shape.CONFIG


def test_a_run_with_no_engine_installed_writes_a_report_saying_so(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("LOOM_PEERS", str(tmp_path / "peers"))
    real = compare.time.strftime  # one day for both runs, even across midnight
    monkeypatch.setattr(compare.time, "strftime",
                        lambda fmt, *t: "2026-12-03" if fmt == "%Y-%m-%d" else real(fmt, *t))
    compare.main(["--engines", "llama.cpp,ik_llama.cpp,vllm", "--quick", "--no-bandwidth",
                  "--wait-quiet", "0", "--label", "m-1.7b-shape", "--out-dir", str(tmp_path)])
    md = next(tmp_path.glob("*-m-1.7b-shape.md"))  # the label's dot is no suffix
    text = md.read_text()
    for name in ("llama.cpp", "ik_llama.cpp", "vllm"):
        assert f"- {name}: not installed" in text
    data = json.loads(md.with_name(md.name.removesuffix(".md") + ".json").read_text())
    assert len(data["skipped"]) == 3 and data["rounds"] == [{}]
    # a second run of the label that day goes beside the first, which stays as it was
    compare.main(["--engines", "vllm", "--quick", "--no-bandwidth", "--wait-quiet", "0",
                  "--label", "m-1.7b-shape", "--out-dir", str(tmp_path)])
    second = md.with_name(md.name.removesuffix(".md") + "-2.md")
    assert "- vllm: not installed" in second.read_text() and md.read_text() == text


def test_prune_keeps_the_newest_run_of_each_machine_and_model(tmp_path) -> None:
    """Every AMD VM's report reads "AMD EPYC, 2 logical cores": runs are told apart by their
    names' machine label and model, so a new 1.7B run leaves the 135M's and the other VM's."""
    cpu = "- CPU: AMD EPYC, 2 logical cores\n"
    for stem in ("2026-12-03-amd-zen3-avx2-2c-smollm2-135m-q4_1-2",
                 "2026-12-03-amd-zen3-avx2-2c-smollm2-1.7b-shape-q4_k_m-3",
                 "2026-12-04-amd-zen3-avx2-2c-smollm2-1.7b-shape-q4_k_m",
                 "2026-12-03-amd-avx512-2c-smollm2-1.7b-shape-q4_k_m",
                 "2026-12-02-amd-avx512-2c-smollm2-1.7b-shape-q4_k_m-c6ee8a3"):
        (tmp_path / f"{stem}.json").write_text("{}")
        (tmp_path / f"{stem}.md").write_text(cpu)
    assert fold_results.newest_runs(tmp_path) == {
        "2026-12-03-amd-zen3-avx2-2c-smollm2-135m-q4_1-2",
        "2026-12-04-amd-zen3-avx2-2c-smollm2-1.7b-shape-q4_k_m",
        "2026-12-03-amd-avx512-2c-smollm2-1.7b-shape-q4_k_m"}


def test_a_dated_note_without_a_report_json_is_neither_folded_nor_pruned(tmp_path) -> None:
    """Only compare.py's runs (.md beside .json) are side-by-side reports: a dated note's tables
    (the AArch64 instruction counts) are not engines' figures, and --prune keeps the note."""
    table = "- CPU: AMD EPYC, 2 logical cores\n\n| shape | rows | sdot kernel |\n|---|---|---|\n"
    note = tmp_path / "2026-12-07-aarch64-insns-qemu.md"
    note.write_text(table + "| 576 x 576, 4 | 1 | 0.763 |\n| 576 x 576, 4 | 4 | 1.893 |\n")
    old, new = (f"2026-12-0{day}-amd-zen3-avx2-2c-smollm2-135m-q4_1" for day in (3, 4))
    for stem in (old, new):
        (tmp_path / f"{stem}.json").write_text("{}")
        (tmp_path / f"{stem}.md").write_text(
            "- CPU: AMD EPYC, 2 logical cores\n\n| figure | Loom |\n|---|---|\n"
            "| output tokens/s @ C=1 ↑ | 64.7 |\n")
    assert fold_results.rows_of(note) == []
    assert fold_results.main(["--results", str(tmp_path), "--prune"]) == 0
    assert note.exists() and (tmp_path / f"{new}.md").exists()
    assert not (tmp_path / f"{old}.md").exists()  # an older report of the same subject: folded
    history = (tmp_path / "history.csv").read_text()
    assert "aarch64-insns" not in history and f"{old},Loom: output tokens/s @ C=1,64.7" in history
