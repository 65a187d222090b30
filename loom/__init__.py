"""Loom: an LLM inference and serving engine. `import loom` loads no engine and sets nothing in
the process (no environment variables): `loom.LLM` loads the engine on first use."""

from __future__ import annotations

from typing import TYPE_CHECKING

from loom.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]

if TYPE_CHECKING:
    from loom.engine.llm import LLM


def __getattr__(name: str):  # noqa: ANN202 - lazy import keeps `import loom` light
    if name == "LLM":
        from loom.threads import apply_thread_defaults

        apply_thread_defaults()  # before the engine imports torch (loom.threads)
        from loom.engine.llm import LLM

        return LLM
    raise AttributeError(name)
