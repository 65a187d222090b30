"""`loom generate`: prompts (arguments or JSONL) through the LLM class, JSONL out."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from loom.engine.arg_utils import HelpFormatter, add_dataclass_args, from_namespace
from loom.engine.args import EngineArgs
from loom.sampling_params import SamplingParams, SamplingParamsError


def register(sub: Any) -> argparse.ArgumentParser:
    """Register `loom generate` on the `loom` subcommand parser."""
    gen = sub.add_parser("generate", help="generate from prompts (arguments or JSONL), JSONL out",
                         formatter_class=HelpFormatter)
    gen.add_argument("prompts", nargs="*", default=[], help="prompt texts")
    gen.add_argument("--input", "-i", default=None, help="JSONL file of prompts ('-' = stdin)")
    gen.add_argument("--output", "-o", default=None, help="JSONL results file (default: stdout)")
    gen.add_argument("--chat", action="store_true", help="wrap text prompts in the chat template")
    add_dataclass_args(gen, EngineArgs, skip=("served_model_name",))
    add_sampling_args(gen)
    gen.set_defaults(func=cmd_generate)
    return gen


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
    llm = LLM(**asdict(from_namespace(EngineArgs, ns)))
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
