"""`loom` command line: serve, generate, chat."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

from loom.config import KV_CACHE_DTYPES
from loom.sampling_params import SamplingParams, SamplingParamsError
from loom.threads import set_num_threads


def add_engine_args(p: argparse.ArgumentParser, positional_model: bool = True) -> None:
    """Engine flags shared by every subcommand, with vLLM's names."""
    p.add_argument(*(["model"] if positional_model else ["--model"]),
                   **({"nargs": "?"} if positional_model else {}), default=None,
                   help="a .gguf file, a Hugging Face folder, a repo id in the local HF cache, or "
                        "nothing for the packaged SmolLM2-135M-Instruct")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights and activations dtype (auto: float32 on CPU, bfloat16 on CUDA)")
    p.add_argument("--device", default="auto", help="cpu, cuda or auto")
    p.add_argument("--quantization", default=None, choices=["fp16", "int4", "int8"],
                   help="weight-only quantized linear layers for faster CPU decode: int8 "
                        "(Loom's kernel: groups of 32 with scale and minimum, fp32 "
                        "activations; keeps GGUF 4-bit weights exactly, fastest up to ~8 "
                        "streams), fp16 (fbgemm, fp32 activations; near lossless, fastest "
                        "from ~16 streams up) or int4 (groups of 32, bf16 activations). The "
                        "output projection takes fp16, or int8 when int8 loads it from a GGUF "
                        "block format"),
    p.add_argument("--int8-batch-kernel", default="avx", choices=["avx", "amx", "bf16", "auto"],
                   help="with --quantization int8, the kernel for steps of more than 8 rows "
                        "(prompts, many streams): avx (a request's bits do not depend on its "
                        "batch), amx (Intel AMX tiles, fp32-level precision, 2-3x faster there; "
                        "needs a CPU with AMX-BF16), bf16 (AVX512-BF16 dot products, bf16 "
                        "precision, ~1.7-2x faster there; e.g. AMD Zen 4) or auto (amx where the "
                        "CPU has it, else avx)")
    p.add_argument("--int8-decode-kernel", default="avx", choices=["avx", "vnni"],
                   help="with --quantization int8, the kernel for steps of up to 8 rows (decode "
                        "of a few streams): avx (fp32 activations; a request's bits do not "
                        "depend on its batch) or vnni (AVX512-VNNI integer dot products with "
                        "activations split into two int8 digits a group of 32: near fp32 "
                        "precision, ~7%% faster at one stream, 15%% at 8; e.g. AMD Zen 4, Intel "
                        "Ice Lake and later)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + output in tokens (default: the model's context length)")
    p.add_argument("--max-num-seqs", type=int, default=256, help="most requests in one step")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="token budget of one step (prefill chunks + decodes); default 512 on "
                        "the CPU (a long prefill step stalls every running stream), 2048 on CUDA")
    p.add_argument("--kv-cache-memory", type=int, default=None,
                   help="bytes for the KV cache (default: half the free memory, capped at need)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="K/V storage: auto (the model's dtype), float16 (half the bytes, like "
                        "llama.cpp's default) or int8 (groups of 32 with an fp32 scale and minimum: "
                        "62.5%% of float16's bytes); attention computes in fp32")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV cache of shared prompt prefixes")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    p.add_argument("--num-gpu-blocks-override", type=int, default=None,
                   help="exact number of KV-cache blocks (testing)")
    p.add_argument("--seed", type=int, default=0, help="global random seed")
    p.add_argument("--chat-template", default=None,
                   help="a Jinja chat template (file path or the template text) replacing the model's")
    p.add_argument("--num-threads", type=int, default=None,
                   help="torch CPU threads (default: one per core). The CLI also defaults "
                        "OpenMP to a short spin (OMP_WAIT_POLICY=ACTIVE GOMP_SPINCOUNT=1000) "
                        "unless either is set; on cores shared with busy processes set "
                        "OMP_WAIT_POLICY=PASSIVE")


def engine_kwargs(ns: argparse.Namespace) -> dict[str, Any]:
    template = ns.chat_template
    if template is not None and not ("{%" in template or "{{" in template):
        with open(template) as f:
            template = f.read()
    return dict(
        dtype=ns.dtype, device=ns.device, quantization=ns.quantization,
        int8_batch_kernel=ns.int8_batch_kernel,
        int8_decode_kernel=ns.int8_decode_kernel,
        max_model_len=ns.max_model_len,
        max_num_seqs=ns.max_num_seqs, max_num_batched_tokens=ns.max_num_batched_tokens,
        kv_cache_memory=ns.kv_cache_memory, kv_cache_dtype=ns.kv_cache_dtype,
        enable_prefix_caching=ns.enable_prefix_caching,
        block_size=ns.block_size, num_gpu_blocks_override=ns.num_gpu_blocks_override,
        seed=ns.seed, chat_template=template,
    )


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--n", type=int, default=1, help="samples per prompt")
    p.add_argument("--ignore-eos", action="store_true")
    so = p.add_argument_group("structured output (at most one)")
    so.add_argument("--json-schema", default=None,
                    help="constrain to this JSON schema (JSON text, or @path to a file)")
    so.add_argument("--json-object", action="store_true", help="constrain to any JSON object")
    so.add_argument("--regex", default=None, help="constrain to this regular expression")
    so.add_argument("--choice", action="append", default=None,
                    help="constrain to one of these strings (repeatable)")
    so.add_argument("--grammar", default=None,
                    help="constrain to this Lark or GBNF grammar (text, or @path to a file)")


def _text_or_file(value: str) -> str:
    if not value.startswith("@"):
        return value
    try:
        return Path(value[1:]).read_text()
    except OSError as e:
        raise SystemExit(f"error: cannot read {value[1:]}: {e}") from None


def sampling_params(ns: argparse.Namespace) -> SamplingParams:
    constraints = {
        "json": ns.json_schema and _text_or_file(ns.json_schema),
        "json_object": ns.json_object or None,
        "regex": ns.regex,
        "choice": ns.choice,
        "grammar": ns.grammar and _text_or_file(ns.grammar),
    }
    structured = {k: v for k, v in constraints.items() if v is not None} or None
    return SamplingParams(
        n=ns.n, max_tokens=ns.max_tokens, temperature=ns.temperature, top_p=ns.top_p,
        top_k=ns.top_k, min_p=ns.min_p, repetition_penalty=ns.repetition_penalty,
        presence_penalty=ns.presence_penalty, frequency_penalty=ns.frequency_penalty,
        seed=ns.sampling_seed, stop=ns.stop, ignore_eos=ns.ignore_eos,
        structured_outputs=structured,
    )


def _read_prompts(ns: argparse.Namespace) -> list[dict[str, Any]]:
    """Prompts from arguments, or JSONL lines with "prompt" (text or token ids) or "messages"."""
    items: list[dict[str, Any]] = [{"prompt": p} for p in ns.prompts]
    if ns.input:
        with (sys.stdin if ns.input == "-" else open(ns.input)) as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    item = json.loads(line)
                except json.JSONDecodeError as e:
                    raise SystemExit(f"{ns.input}:{n}: not JSON: {e}") from None
                if not isinstance(item, dict) or not ("prompt" in item or "messages" in item):
                    raise SystemExit(f"{ns.input}:{n}: needs a \"prompt\" or \"messages\" field")
                items.append(item)
    if not items:
        raise SystemExit("no prompts: give them as arguments or with --input FILE.jsonl")
    return items


def cmd_generate(ns: argparse.Namespace) -> None:
    from loom.engine.llm import LLM
    from loom.engine.llm_engine import InvalidRequestError

    try:
        params = sampling_params(ns)
    except SamplingParamsError as e:
        raise SystemExit(f"error: {e}") from None
    items = _read_prompts(ns)
    llm = LLM(ns.model, **engine_kwargs(ns))
    tok = llm.get_tokenizer()
    prompts = [it["prompt"] if "prompt" in it else tok.encode_chat(it["messages"]) for it in items]
    if ns.chat:
        prompts = [tok.encode_chat([{"role": "user", "content": p}]) if isinstance(p, str) else p
                   for p in prompts]
    try:
        outputs = llm.generate(prompts, params)
    except InvalidRequestError as e:
        raise SystemExit(f"error: {e}") from None
    out = sys.stdout if ns.output in (None, "-") else open(ns.output, "w")
    with out:
        for item, res in zip(items, outputs):
            record = {
                "prompt": item.get("prompt", item.get("messages")),
                "outputs": [{"text": o.text, "token_ids": o.token_ids,
                             "finish_reason": o.finish_reason} for o in res.outputs],
                "num_prompt_tokens": len(res.prompt_token_ids),
            }
            out.write(json.dumps(record, ensure_ascii=False) + "\n")


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(prog="loom", description="Loom LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate from prompts (arguments or JSONL), JSONL out")
    gen.add_argument("prompts", nargs="*", default=[], help="prompt texts")
    gen.add_argument("--input", "-i", default=None, help="JSONL file of prompts ('-' = stdin)")
    gen.add_argument("--output", "-o", default=None, help="JSONL results file (default: stdout)")
    gen.add_argument("--chat", action="store_true", help="wrap text prompts in the chat template")
    add_engine_args(gen, positional_model=False)
    add_sampling_args(gen)
    gen.set_defaults(func=cmd_generate)

    from loom.entrypoints.openai.cli_args import add_serve_parser

    add_serve_parser(sub)
    from loom.bench.cli import add_bench_parser

    add_bench_parser(sub)
    ns = parser.parse_args(argv)
    if getattr(ns, "num_threads", None) is not None:
        if ns.num_threads < 1:
            parser.error(f"--num-threads must be at least 1, got {ns.num_threads}")
        set_num_threads(ns.num_threads)
    ns.func(ns)


if __name__ == "__main__":
    main()
