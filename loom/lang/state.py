"""A program's state: its text, chat messages and variables, changed by `s += expr`.

`s += expr` returns at once; the expression runs on the state's own worker thread, in order.
So `for f in s.fork(8): f += gen(...)` starts eight generations together, and the engine
batches them and shares their prefix. Reading (`s["name"]`, `s.text()`, `s.fork()`) waits
for what was added before it. The first failure stops the state; reads raise it.

Threads: the program's thread adds; one worker (started when work arrives, gone when none is
left) executes. `_lock` guards the queue, the text, the variables and the streamed pieces.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from loom.lang.errors import LangError
from loom.lang.ir import Gen, Role, Select

if TYPE_CHECKING:
    from loom.lang.backend import Backend

@dataclass
class VarMeta:
    """What is known about one variable besides its text."""

    kind: Literal["gen", "select"]
    text: str
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int | None = None  # prompt tokens served by the prefix cache (if known)
    finish_reason: str | None = None
    logprobs: list[float] = field(default_factory=list)  # gen: each generated token's
    # select: every choice, its summed logprob and its tokens' logprobs; exact=False when the
    # backend could not score (a fallback; logprobs are then None)
    choices: list[str] = field(default_factory=list)
    choice_logprobs: list[float | None] = field(default_factory=list)
    choice_token_logprobs: list[list[float]] = field(default_factory=list)
    exact: bool = True


class ProgramState:
    """The `s` of a program. Build one with `Program.run`; add to it with `+=`."""

    def __init__(self, backend: Backend, default_gen: dict[str, Any] | None = None,
                 text: str = "", messages: list[dict[str, str]] | None = None,
                 stream: bool = False) -> None:
        self.backend = backend
        self._default_gen = dict(default_gen or {})
        self._text = text
        self._messages = list(messages or [])
        self._vars: dict[str, str] = {}
        self._meta: dict[str, VarMeta] = {}
        self._lock = threading.Condition()
        self._ops: deque[Callable[[], None]] = deque()
        self._working = False
        self._error: BaseException | None = None
        # streamed (variable, text) pieces, kept so that every text_iter sees all of them
        self._events: list[tuple[str | None, str]] | None = [] if stream else None
        self._ended = False

    # ---- adding (the program's thread) ----------------------------------------------------

    def __iadd__(self, expr: Any) -> ProgramState:
        _check(expr)
        self._submit(lambda: self._exec(expr))
        return self

    def _submit(self, op: Callable[[], None]) -> None:
        with self._lock:
            self._ops.append(op)
            if not self._working:
                self._working = True
                threading.Thread(target=self._work, name="loom-lang-state", daemon=True).start()

    def _work(self) -> None:
        while True:
            with self._lock:
                if not self._ops:
                    self._working = False
                    self._lock.notify_all()
                    return
                op = self._ops.popleft()
                failed = self._error is not None
            if failed:
                continue
            try:
                op()
            except BaseException as e:  # noqa: BLE001 - kept and raised to the reader
                self._fail(e)

    def _fail(self, error: BaseException) -> None:
        """Keep the first failure; every later read raises it."""
        with self._lock:
            self._error = self._error or error

    def sync(self) -> ProgramState:
        """Wait until everything added so far has run; raise the first failure."""
        with self._lock:
            while self._working:
                self._lock.wait()
            if self._error is not None:
                raise self._error
        return self

    # ---- reading --------------------------------------------------------------------------

    def __getitem__(self, name: str) -> str:
        self.sync()
        if name not in self._vars:
            raise KeyError(f"no variable {name!r}; have {sorted(self._vars)}")
        return self._vars[name]

    def __contains__(self, name: str) -> bool:
        return name in self.sync()._vars

    def text(self) -> str:
        """The whole text so far (prompt, chat markup and generations)."""
        return self.sync()._text

    def messages(self) -> list[dict[str, str]]:
        """The chat messages so far (role and content, as the template saw them)."""
        return [dict(m) for m in self.sync()._messages]

    def variables(self) -> dict[str, str]:
        return dict(self.sync()._vars)

    def meta(self, name: str) -> VarMeta:
        """Token counts, finish reason and logprobs of variable `name`."""
        self.sync()
        if name not in self._meta:
            raise KeyError(f"no variable {name!r}; have {sorted(self._meta)}")
        return self._meta[name]

    def text_iter(self, var: str | None = None) -> Iterator[str]:
        """The program's text as it is written (a state run with stream=True): every piece of
        text, or with `var` only the generated text of that variable."""
        if self._events is None:
            raise LangError("this state does not stream; run the program with stream=True")
        i = 0
        while True:
            with self._lock:
                while i >= len(self._events) and not self._ended:
                    self._lock.wait()
                if i >= len(self._events):
                    break
                name, delta = self._events[i]
                i += 1
            if var is None or name == var:
                yield delta
        self.sync()

    def _emit(self, var: str | None, text: str) -> None:
        if self._events is not None and text:
            with self._lock:
                self._events.append((var, text))
                self._lock.notify_all()

    def _end_stream(self) -> None:
        with self._lock:
            self._ended = True
            self._lock.notify_all()

    # ---- forks ----------------------------------------------------------------------------

    def fork(self, n: int) -> ForkGroup:
        """`n` copies of this state that continue independently (and run together)."""
        if not isinstance(n, int) or n < 1:
            raise LangError(f"fork needs a positive number of branches, got {n!r}")
        self.sync()
        forks = [ProgramState(self.backend, self._default_gen, self._text, self._messages)
                 for _ in range(n)]
        return ForkGroup(self, forks, len(self._text))

    # ---- executing (the worker thread) ----------------------------------------------------

    def _append(self, text: str, var: str | None = None, emit: bool = True) -> None:
        with self._lock:
            self._text += text
        if emit:
            self._emit(var, text)

    def _exec(self, expr: Any) -> None:
        if isinstance(expr, str):
            self._append(expr)
        elif isinstance(expr, (list, tuple)):
            for part in expr:
                self._exec(part)
        elif isinstance(expr, Gen):
            self._gen(expr)
        elif isinstance(expr, Select):
            self._select(expr)
        elif isinstance(expr, Role):
            self._role(expr)
        else:
            raise LangError(f"cannot add {type(expr).__name__} to a program state")

    def _set(self, name: str | None, meta: VarMeta) -> None:
        if name is not None:
            with self._lock:
                self._vars[name] = meta.text
                self._meta[name] = meta

    def _gen(self, expr: Gen) -> None:
        spec = expr.spec(self._default_gen)
        streamed: list[str] = []

        def on_delta(delta: str) -> None:
            streamed.append(delta)
            self._emit(expr.name, delta)

        result = self.backend.generate(self._text, spec, on_delta)
        sent = "".join(streamed)
        rest = result.text[len(sent):] if result.text.startswith(sent) else result.text
        self._append(result.text, emit=False)
        self._emit(expr.name, rest)
        self._set(expr.name, VarMeta(
            "gen", result.text, result.prompt_tokens, result.completion_tokens,
            result.cached_tokens, result.finish_reason, result.logprobs))

    def _select(self, expr: Select) -> None:
        scores = self.backend.score_choices(self._text, expr.choices)
        choice = expr.choices[scores.best(expr.method)]
        self._append(choice, var=expr.name)
        self._set(expr.name, VarMeta(
            "select", choice, choices=list(expr.choices), choice_logprobs=scores.logprobs,
            choice_token_logprobs=scores.token_logprobs, exact=scores.exact))

    def _role(self, expr: Role) -> None:
        template = self.backend.chat_template
        if template is None:
            raise LangError("the backend has no chat template; give one to the backend "
                            "(OpenAIBackend(chat_template=... or tokenizer=...))")
        begin, end = template.role_span(self._messages, expr.role)
        self._append(begin)
        start = len(self._text)
        self._exec(expr.parts)
        content = self._text[start:]
        self._append(end)
        with self._lock:
            self._messages.append({"role": expr.role, "content": content})


class ForkGroup:
    """The branches of one `fork`: index or iterate them; `join()` waits for all."""

    def __init__(self, parent: ProgramState, forks: list[ProgramState], fork_at: int) -> None:
        self.parent = parent
        self.forks = forks
        self._fork_at = fork_at

    def __len__(self) -> int:
        return len(self.forks)

    def __getitem__(self, i: int) -> ProgramState:
        return self.forks[i]

    def __iter__(self) -> Iterator[ProgramState]:
        return iter(self.forks)

    def join(self, mode: Literal["wait", "concat"] = "wait") -> list[ProgramState]:
        """Wait for every branch. mode="concat" also appends each branch's new text (in branch
        order) to the parent, at this point of the parent's program."""
        if mode not in ("wait", "concat"):
            raise LangError(f"join mode must be 'wait' or 'concat', got {mode!r}")
        if mode == "wait":
            for f in self.forks:
                f.sync()
            return self.forks

        def concat() -> None:
            self.parent._exec("".join(f.text()[self._fork_at:] for f in self.forks))

        self.parent._submit(concat)
        return self.forks


def _check(expr: Any) -> None:
    """Reject what cannot be added where the program adds it, not later on the worker."""
    if isinstance(expr, (list, tuple)):
        for part in expr:
            _check(part)
    elif isinstance(expr, Role):
        _check(expr.parts)
    elif not isinstance(expr, (str, Gen, Select)):
        raise LangError(f"cannot add {type(expr).__name__} to a program state; add text, gen, "
                        "select or a chat role")
