"""Engines for tests: loading a model once per process, however many engines a test builds."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

import loom.engine.llm_engine as llm_engine
from loom.engine.llm import LLM
from loom.kernels import select
from loom.loader.model_loader import load_model
from loom.loader.resolve import resolve_model
from loom.tokenizer.tokenizer import Tokenizer
from tests.tiny_models import make_tiny_model


@functools.lru_cache(maxsize=4)
def _load(source, dtype, device, quantization=None, cpu_kernels="auto", batch_invariant=False):
    return load_model(source, dtype, device, quantization=quantization, cpu_kernels=cpu_kernels,
                      batch_invariant=batch_invariant)


_from_source = Tokenizer.from_source


@functools.lru_cache(maxsize=4)
def _tokenizer(source, eos=()):
    return _from_source(source, eos)


@pytest.fixture
def make_llm(monkeypatch):
    """make_llm(model, **engine_kwargs) -> LLM, sharing loaded weights between engines.

    Engines bind their KV cache into the shared model when built: use one at a time. They run
    batch-invariant kernels (a request's bits the same in any batch, which the equivalence tests
    compare) unless a test passes batch_invariant=False."""
    def load(source, dtype, device, progress=False, quantization=None, cpu_kernels="auto",
             batch_invariant=False):
        if torch.device(device).type == "cpu":  # a cached model's kernels: select them again
            select(cpu_kernels, batch_invariant)
        return _load(source, dtype, device, quantization, cpu_kernels, batch_invariant)

    monkeypatch.setattr(llm_engine, "load_model", load)
    monkeypatch.setattr(llm_engine.Tokenizer, "from_source", staticmethod(_tokenizer))

    def make(model: str | None = None, **kwargs) -> LLM:
        kwargs.setdefault("dtype", "float32")
        kwargs.setdefault("batch_invariant", True)
        return LLM(model, **kwargs)

    return make


@functools.lru_cache(maxsize=1)
def tiny_model_with_tokenizer(root: str) -> str:
    """A tiny random Llama with SmolLM2's tokenizer saved beside it (ids < 256 decode fine)."""
    folder = make_tiny_model("llama", Path(root) / "tiny-llama")
    tok = Tokenizer.from_source(resolve_model(None))
    tok.hf.save_pretrained(folder)
    return str(folder)
