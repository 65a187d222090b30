"""Engine argument defaults that depend on where the engine runs."""

from __future__ import annotations

import argparse

from loom.engine.args import SERVE_CPU_BATCHED_TOKENS, EngineArgs
from loom.entrypoints.cli import add_engine_args, engine_kwargs


def test_cli_step_budget_is_smaller_on_the_cpu_unless_given() -> None:
    """`loom serve` leaves the step budget unset: 512 tokens on the CPU (a long prefill step
    stalls every running stream), 2048 on CUDA; the LLM class keeps 2048; a given value wins."""
    p = argparse.ArgumentParser()
    add_engine_args(p)
    args = EngineArgs(**engine_kwargs(p.parse_args(["m"])))
    assert args.max_num_batched_tokens is None
    assert args.resolved_max_num_batched_tokens("cpu") == SERVE_CPU_BATCHED_TOKENS == 512
    assert args.resolved_max_num_batched_tokens("cuda") == 2048
    given = EngineArgs(**engine_kwargs(p.parse_args(["m", "--max-num-batched-tokens", "96"])))
    assert given.resolved_max_num_batched_tokens("cpu") == 96
    assert EngineArgs().resolved_max_num_batched_tokens("cpu") == 2048
