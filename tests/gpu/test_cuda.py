"""The CUDA path: the same paged forward on a GPU, against the CPU fp32 reference.
Skipped where torch sees no GPU."""

from __future__ import annotations

import pytest
import torch

from loom import SamplingParams
from loom.loader.model_loader import load_model
from loom.loader.resolve import resolve_model
from tests.paged_batch import PagedBatch, rel_err
from tests.tiny_models import make_tiny_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")]


@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral"])
def test_cuda_fp32_logits_match_cpu(tmp_path, arch) -> None:
    folder = make_tiny_model(arch, tmp_path / arch)
    ids = torch.randint(0, 256, (37,), generator=torch.Generator().manual_seed(0)).tolist()
    cpu = PagedBatch(load_model(resolve_model(str(folder)), "float32", "cpu")).step({"r": ids})["r"]
    gpu_model = load_model(resolve_model(str(folder)), "float32", "cuda")
    batch = PagedBatch(gpu_model, device=torch.device("cuda"))
    gpu = batch.step({"r": ids})["r"].cpu()
    assert rel_err(gpu, cpu) < 1e-3


def test_cuda_bf16_engine_greedy_agrees_with_fp32() -> None:
    from loom import LLM

    prompts = ["The capital of France is", "def fibonacci(n):", "Water boils at"]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in LLM(device="cpu", dtype="float32").generate(prompts, params)]
    got = [o.outputs[0].token_ids for o in LLM(device="cuda").generate(prompts, params)]
    agree = sum(a[0] == b[0] for a, b in zip(ref, got))
    assert agree == len(prompts)  # first greedy token survives bf16 on every prompt
