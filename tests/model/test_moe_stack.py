"""Mixtures of experts on the one-call C decoder stack (decoder_q8.c's MoE op: the router, the
top-k route, each active expert's gated MLP over its tokens' rows, the weighted sum, the shared
expert behind its gate, or ungated): tiny Qwen3-MoE (a dense layer among the sparse ones),
Qwen2-MoE (its shared expert), Mixtral, Granite 3's, Granite 4.0-H's (Mamba2 layers, an
ungated shared expert; its decode steps), LFM2-MoE's (a sigmoid router with a choice bias
and a scaling factor; short convolutions) and Nemotron-H's (relu^2 experts, one block a
layer) in one mixed paged batch. On int8-grid weights with the fp32 kernels the stack's
logits are transformers' to fp32 tolerance and its greedy tokens transformers'; with this
CPU's default kernels, and with K-quant experts from GGUF, the per-module path gives the
stack's bits."""

from __future__ import annotations

import pytest
import torch

from loom.loader.model_loader import load_model
from loom.loader.resolve import resolve_model
from loom.models.q8_decoder import Q8Decoder
from tests.cpu_kernels import require_cpu_kernels
from tests.model.test_arch_stack import (_mixed_batch, _on_grid, _sampling_rows,
                                         match_transformers, transformers_model)
from tests.tiny_models import make_tiny_model

# the shared expert's width a multiple of 32 (the int8 grid's groups), as real models have (the
# tiny default, 48, the stack refuses: MoeForCausalLM.c_stack_refusal)
SHAPES = {"qwen2-moe": dict(shared_expert_intermediate_size=64),
          "granite4-h-moe": dict(shared_intermediate_size=64),
          # (routing without groups: the stack's; Nemotron 3 Nano's has one group)
          "nemotron-h-moe": dict(moe_shared_expert_intermediate_size=64, n_group=1,
                                 topk_group=1)}


def stack_and_module(loaded) -> tuple[tuple, tuple, list, list]:
    """The mixed batch and the sampling rows on the stack, then on the per-module path."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # decode in one OpenMP region needs a team, even on one core
    try:
        stack, stack_rows = _mixed_batch(loaded, loaded.config.vocab_size), _sampling_rows(loaded)
        assert isinstance(loaded.model.model.stack, Q8Decoder), "the C stack did not run"
        assert loaded.model.model.stack.moes, "no mixture of experts on the stack"
        loaded.model.model.stack = False  # the per-module path, same weights and kernels
        module, module_rows = _mixed_batch(loaded, loaded.config.vocab_size), _sampling_rows(loaded)
    finally:
        torch.set_num_threads(threads)
    return stack, module, stack_rows, module_rows


def _same_bits(stack, module, stack_rows, module_rows) -> None:
    assert all(torch.equal(stack[1][r], module[1][r]) for r in stack[1])
    assert all(a is not None and torch.equal(a, b) for a, b in zip(stack_rows, module_rows))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen3-moe", "qwen2-moe", "mixtral", "granite-moe",
                                  "granite4-h-moe", "lfm2-moe", "nemotron-h-moe"])
def test_moe_stack_matches_transformers_on_grid_weights(tmp_path, name) -> None:
    require_cpu_kernels()
    folder = _on_grid(make_tiny_model(name, tmp_path / name, **SHAPES.get(name, {})))
    ref = transformers_model(folder)
    loaded = load_model(resolve_model(str(folder)), "float32", quantization="int8",
                        batch_invariant=True)
    stack, module, stack_rows, module_rows = stack_and_module(loaded)
    _same_bits(stack, module, stack_rows, module_rows)
    match_transformers(ref, *stack, 1e-4)


@pytest.mark.slow
def test_moe_stack_default_kernels_and_kquant_experts(tmp_path) -> None:
    """This CPU's default kernels (bf16 past 8 rows, VNNI decode where it has them) on
    Qwen2-MoE; then a GGUF Qwen2-MoE whose experts are Q4_K / Q5_K / Q6_K blocks: the stack
    gives the module path's bits."""
    from tests.model.test_moe_gguf import moe_gguf

    require_cpu_kernels()
    folder = make_tiny_model("qwen2-moe", tmp_path / "q", **SHAPES["qwen2-moe"])
    _same_bits(*stack_and_module(load_model(resolve_model(str(folder)), "float32",
                                            quantization="int8")))
    path, _ = moe_gguf(tmp_path / "gguf", "qwen2-moe")
    _same_bits(*stack_and_module(load_model(resolve_model(str(path)), "float32")))
