"""`@function` programs and how they run: `run`, `run_batch`, streaming."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from loom.lang.errors import LangError
from loom.lang.state import ProgramState

if TYPE_CHECKING:
    from loom.lang.backend import Backend

_default_backend: Backend | None = None


def set_default_backend(backend: Backend | None) -> None:
    """The backend programs run on when neither `run` nor `@function` names one."""
    global _default_backend
    _default_backend = backend


class Program:
    """A prompt program: a Python function whose first argument is the state `s`."""

    def __init__(self, fn: Callable[..., Any], backend: Backend | None = None) -> None:
        self.fn = fn
        self.backend = backend
        functools.update_wrapper(self, fn)

    def __call__(self, s: ProgramState, *args: Any, **kwargs: Any) -> Any:
        """Call as a sub-program on another program's state."""
        return self.fn(s, *args, **kwargs)

    def _backend(self, backend: Backend | None) -> Backend:
        chosen = backend or self.backend or _default_backend
        if chosen is None:
            raise LangError("no backend: pass backend=, or call loom.lang.set_default_backend()")
        return chosen

    def run(self, *args: Any, backend: Backend | None = None, stream: bool = False,
            default_gen: dict[str, Any] | None = None, **kwargs: Any) -> ProgramState:
        """Run the program; returns its finished state. With stream=True it returns at once
        and `state.text_iter()` yields the text as it is written. `default_gen` sets gen's
        defaults for this run (e.g. {"max_tokens": 64, "temperature": 0.7})."""
        state = ProgramState(self._backend(backend), default_gen, stream=stream)
        if not stream:
            self.fn(state, *args, **kwargs)
            return state.sync()

        def body() -> None:
            try:
                self.fn(state, *args, **kwargs)
                state.sync()
            except BaseException as e:  # noqa: BLE001 - surfaced by text_iter / sync
                state._fail(e)
            finally:
                state._end_stream()

        threading.Thread(target=body, name="loom-lang-program", daemon=True).start()
        return state

    def run_batch(self, batch: Sequence[dict[str, Any]], backend: Backend | None = None,
                  num_threads: int | None = None,
                  default_gen: dict[str, Any] | None = None) -> list[ProgramState]:
        """Run the program once per dict of keyword arguments, `num_threads` at a time
        (default: all of them, up to 64), so their requests reach the engine together.
        Returns the states in input order; the first failure is raised."""
        if num_threads is None:
            num_threads = min(64, max(1, len(batch)))
        if num_threads < 1:
            raise LangError(f"num_threads must be positive, got {num_threads}")
        chosen = self._backend(backend)
        with ThreadPoolExecutor(num_threads, thread_name_prefix="loom-lang-batch") as pool:
            futures = [pool.submit(self.run, backend=chosen, default_gen=default_gen, **kwargs)
                       for kwargs in batch]
            return [f.result() for f in futures]


def function(fn: Callable[..., Any] | None = None, *,
             backend: Backend | None = None) -> Any:
    """Decorator: `@function` or `@function(backend=...)` turns `def prog(s, ...)` into a
    Program with `.run(...)` and `.run_batch([...])`."""
    if fn is None:
        return lambda f: Program(f, backend)
    return Program(fn, backend)
