"""A tiny model's forward with every attention layer on the Triton kernels (in Triton's
interpreter on the CPU) gives the logits of the torch reference backend: a prompt in two
chunks, then batched decodes, with the cache written by the Triton K/V copy."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are imported

import pytest  # noqa: E402
import torch  # noqa: E402

from loom.attention.backends import triton_attn  # noqa: E402
from loom.loader.model_loader import load_model  # noqa: E402
from loom.loader.resolve import resolve_model  # noqa: E402
from tests.paged_batch import PagedBatch, rel_err  # noqa: E402
from tests.tiny_models import make_tiny_model  # noqa: E402

pytestmark = pytest.mark.skipif(not triton_attn.available(), reason="triton is not installed")


def run(folder, triton: bool, dtype: str) -> list[torch.Tensor]:
    loaded = load_model(resolve_model(str(folder)), dtype, "cpu", quantization="none")
    batch = PagedBatch(loaded, num_blocks=16)
    for attn in loaded.model.attention_layers():
        attn.use_triton = triton
        attn.use_kernel = False  # the torch reference otherwise (not the C kernel)
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randint(0, 256, (n,), generator=g).tolist() for n in (21, 9))
    steps = [{"a": a[:13], "b": b}, {"a": a[13:], "b": [5]}, {"a": [7], "b": [9]}]
    return [torch.cat([o.float() for o in batch.step(w).values()]) for w in steps]


def test_tiny_model_logits_match_reference(tmp_path) -> None:
    """Gemma 2: a window of 8 on every other layer, soft-capped scores, GQA, bf16."""
    folder = make_tiny_model("gemma2", tmp_path / "gemma2")
    for got, want in zip(run(folder, True, "bfloat16"), run(folder, False, "bfloat16")):
        assert rel_err(got, want) < 3e-2
