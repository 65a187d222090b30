"""Loom: an LLM inference and serving engine."""

from __future__ import annotations

from typing import TYPE_CHECKING

from loom.threads import default_openmp_env

default_openmp_env()  # the CLI's short OpenMP spin, where torch is not loaded yet (loom.threads)

from loom.sampling_params import SamplingParams  # noqa: E402

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]

if TYPE_CHECKING:
    from loom.engine.llm import LLM


def __getattr__(name: str):  # noqa: ANN202 - lazy import keeps `import loom` light
    if name == "LLM":
        from loom.engine.llm import LLM

        return LLM
    raise AttributeError(name)
