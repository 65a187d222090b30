"""Weight-only INT8 against the unquantized fp32 reference on the real SmolLM2 weights."""

from __future__ import annotations

import pytest
import torch

from loom.config import ConfigError
from loom.loader.model_loader import load_model
from loom.loader.resolve import resolve_model
from loom.quant.int8 import Int8Linear
from loom.tokenizer.tokenizer import Tokenizer
from tests.paged_batch import PagedBatch, rel_err

TEXTS = [
    "The capital of France is Paris, and the capital of Germany is Berlin. Both cities are",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n",
    "Water boils at 100 degrees Celsius at sea level, but at higher altitudes it boils at",
]


def test_int8_linear_matches_float_linear() -> None:
    lin = torch.nn.Linear(64, 32, bias=True)
    q = Int8Linear(lin)
    x = torch.randn(5, 64)
    assert q.weight_int8.dtype == torch.int8 and q.weight_int8.shape == (32, 64)
    assert rel_err(q(x), lin(x)) < 0.03


def test_int8_smollm2_agrees_with_reference() -> None:
    source = resolve_model(None)
    tok = Tokenizer.from_source(source)
    prompts = {str(i): tok.encode(t) for i, t in enumerate(TEXTS)}
    ref = PagedBatch(load_model(source, "float32")).step(prompts)
    quant = load_model(source, "float32", quantization="int8")
    assert sum(isinstance(m, Int8Linear) for m in quant.model.modules()) == 30 * 4
    got = PagedBatch(quant).step(prompts)
    agree = sum(int((ref[k].argmax(-1) == got[k].argmax(-1)).sum()) for k in prompts)
    total = sum(len(p) for p in prompts.values())
    assert agree / total >= 0.97  # measured 0.989 (90 of 91 positions)
    assert max(rel_err(got[k], ref[k]) for k in prompts) < 0.1


def test_unknown_quantization_is_rejected() -> None:
    with pytest.raises(ConfigError, match="unsupported quantization 'fp4'"):
        load_model(resolve_model(None), quantization="fp4")
