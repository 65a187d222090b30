"""loom.lang: prompt programs (SGLang-style) on Loom's engine or any OpenAI-compatible server.

    from loom.lang import EngineBackend, function, gen, select, user, assistant

    @function
    def qa(s, question):
        s += user(question)
        s += assistant(gen("answer", max_tokens=64))

    state = qa.run(question="What is 2 + 2?", backend=EngineBackend())
    state["answer"], state.meta("answer").completion_tokens

See docs/lang.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from loom.lang.backend import Backend, ChoiceScores, GenResult
from loom.lang.errors import LangError, LangFallbackWarning
from loom.lang.ir import GenSpec, assistant, gen, select, system, user
from loom.lang.program import Program, function, set_default_backend
from loom.lang.state import ForkGroup, ProgramState, VarMeta
from loom.lang.template import ChatTemplate

if TYPE_CHECKING:
    from loom.lang.engine_backend import EngineBackend
    from loom.lang.openai_backend import OpenAIBackend

__all__ = [
    "Backend", "ChatTemplate", "ChoiceScores", "EngineBackend", "ForkGroup", "GenResult",
    "GenSpec", "LangError", "LangFallbackWarning", "OpenAIBackend", "Program", "ProgramState",
    "VarMeta", "assistant", "function", "gen", "select", "set_default_backend", "system", "user",
]


def __getattr__(name: str):  # noqa: ANN202 - backends import torch / httpx only when used
    if name == "EngineBackend":
        from loom.lang.engine_backend import EngineBackend

        return EngineBackend
    if name == "OpenAIBackend":
        from loom.lang.openai_backend import OpenAIBackend

        return OpenAIBackend
    raise AttributeError(name)
