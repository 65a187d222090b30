"""The GPU path on a real GPU (skipped without one): the Triton attention kernels compiled
(not interpreted) against the torch reference at 8B-like head shapes, CUDA-graph decode against
eager decode, FP8 weights through torch._scaled_mm, the FP8 KV cache end to end."""

from __future__ import annotations

import pytest
import torch

from loom import SamplingParams
from loom.attention.backends import torch_ref, triton_attn
from loom.attention.metadata import build_attention_metadata

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or not triton_attn.available(),
                       reason="no GPU or no Triton"),
    # tests/gpu_interp turns Triton's interpreter on for its whole pytest session
    pytest.mark.skipif(triton_attn.interpreting(), reason="Triton's interpreter is on in this "
                       "session: run tests/gpu on its own to check the compiled kernels"),
]
CUDA = torch.device("cuda")


def _tiny_llama(tmp_path):
    """A tiny random Llama with a word-level tokenizer (no packaged model needed)."""
    from benchmarks.gpu.shapes import write_tokenizer
    from tests.tiny_models import make_tiny_model

    folder = make_tiny_model("llama", tmp_path / "llama")
    write_tokenizer(folder, 256)
    return folder


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("dtype,window,tol", [(torch.bfloat16, None, 1e-2),
                                              (torch.float32, None, 1e-4),
                                              (torch.bfloat16, 100, 1e-2)])
def test_kernel_matches_reference_on_gpu(dtype, window, tol) -> None:
    g = torch.Generator().manual_seed(0)
    block_size, num_blocks, heads, kv_heads, head_dim = 16, 600, 32, 8, 128
    computed, new = [0, 300, 2000, 4000, 17], [512, 77, 1, 1, 1]
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    blocks, at = [], 0
    for c, n in zip(computed, new):
        k = -(-(c + n) // block_size)
        blocks.append(perm[at : at + k])
        at += k
    md, _ = build_attention_metadata(blocks, computed, new, block_size, CUDA)
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, device=CUDA).to(dtype)
    q = torch.randn(md.num_tokens, heads, head_dim, device=CUDA).to(dtype)
    mask = torch_ref.build_mask(md, window, torch.float32)
    want = torch_ref.paged_attention(q.float(), cache.float(), md, mask, head_dim**-0.5)
    got = triton_attn.paged_attention(q, cache, md, head_dim**-0.5, window)
    assert rel(got, want) < tol
    split = triton_attn.paged_attention(q, cache, md, head_dim**-0.5, window, num_splits=8)
    assert rel(split, want) < tol


def test_cuda_graph_decode_matches_eager(tmp_path) -> None:
    from loom import LLM
    folder = _tiny_llama(tmp_path)
    prompts = [[5, 6, 7, 8] * k for k in (1, 3, 9)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    runs = {}
    for eager in (False, True):
        llm = LLM(str(folder), dtype="float32", enforce_eager=eager, max_model_len=128)
        assert (llm.engine.runner.graphs is None) == eager
        runs[eager] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert runs[False] == runs[True]


def test_fp8_weights_use_scaled_mm() -> None:
    from loom.quant.fp8 import Fp8Linear, scaled_mm_supported

    if not scaled_mm_supported(CUDA):
        pytest.skip("no FP8 tensor cores")
    linear = torch.nn.Linear(256, 512, device=CUDA, dtype=torch.bfloat16)
    q = Fp8Linear(linear)
    assert q.use_scaled_mm
    x = torch.randn(7, 256, device=CUDA, dtype=torch.bfloat16)
    assert rel(q(x), linear(x)) < 0.06


def test_fp8_kv_cache_engine(tmp_path) -> None:
    from loom import LLM
    folder = _tiny_llama(tmp_path)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    ref = LLM(str(folder), max_model_len=128).generate([[3, 4, 5, 6]], params)
    got = LLM(str(folder), kv_cache_dtype="fp8", max_model_len=128).generate([[3, 4, 5, 6]],
                                                                             params)
    assert got[0].outputs[0].token_ids[0] == ref[0].outputs[0].token_ids[0]
