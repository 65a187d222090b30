"""Offline throughput, as vLLM's `bench throughput`: all prompts through `LLM.generate` at once."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from loom.bench.datasets import BenchPrompt


def run_throughput(
    prompts: Sequence[BenchPrompt], llm: Any, ignore_eos: bool = True, use_tqdm: bool = True,
) -> dict[str, Any]:
    """Generate every prompt greedily with max_tokens = its output_len; time the whole batch."""
    from loom import SamplingParams

    params = [SamplingParams(max_tokens=p.output_len, temperature=0.0, ignore_eos=ignore_eos)
              for p in prompts]
    spec = llm.engine.scheduler.spec  # speculative decoding, when asked for
    if spec is not None and spec.predictions_only:
        spec = None
    before = spec.stats.copy() if spec is not None else None
    start = time.perf_counter()
    outputs = llm.generate([p.prompt for p in prompts], params, use_tqdm=use_tqdm)
    elapsed = time.perf_counter() - start
    num_in = sum(len(o.prompt_token_ids) for o in outputs)
    num_out = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return {
        "num_requests": len(prompts), "elapsed_time": elapsed,
        "total_input_tokens": num_in, "total_output_tokens": num_out,
        "requests_per_second": len(prompts) / elapsed,
        "tokens_per_second": (num_in + num_out) / elapsed,
        "output_tokens_per_second": num_out / elapsed,
        "short_outputs": sum(len(o.outputs[0].token_ids) < p.output_len
                             for o, p in zip(outputs, prompts)),
        **({} if spec is None else {"spec_decode": _spec_delta(before, spec.stats)}),
    }


def _spec_delta(before: Any, after: Any) -> dict[str, Any]:
    """This run's speculative-decoding counts: draft tokens proposed and accepted, the
    acceptance rate overall and per draft position."""
    def sub(a: list[int], b: list[int]) -> list[int]:
        return [v - (a[i] if i < len(a) else 0) for i, v in enumerate(b)]

    proposed = after.num_draft_tokens - before.num_draft_tokens
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    acc, prop = sub(before.accepted_per_pos, after.accepted_per_pos), sub(
        before.proposed_per_pos, after.proposed_per_pos)
    return {"draft_tokens": proposed, "accepted_tokens": accepted,
            "acceptance_rate": accepted / proposed if proposed else 0.0,
            "acceptance_per_position": [a / p if p else 0.0 for a, p in zip(acc, prop)]}


def format_throughput(m: dict[str, Any]) -> str:
    return (f"Throughput: {m['requests_per_second']:.2f} requests/s, "
            f"{m['tokens_per_second']:.2f} total tokens/s, "
            f"{m['output_tokens_per_second']:.2f} output tokens/s\n"
            f"Total num prompt tokens:  {m['total_input_tokens']}\n"
            f"Total num output tokens:  {m['total_output_tokens']}\n"
            f"Elapsed: {m['elapsed_time']:.2f} s for {m['num_requests']} requests"
            + _format_spec(m.get("spec_decode")))


def _format_spec(sd: dict[str, Any] | None) -> str:
    if sd is None:
        return ""
    per_pos = ", ".join(f"{r:.2f}" for r in sd["acceptance_per_position"])
    return (f"\nSpeculative decoding: {sd['accepted_tokens']} of {sd['draft_tokens']} draft "
            f"tokens accepted ({sd['acceptance_rate']:.1%}); by position: [{per_pos}]")
