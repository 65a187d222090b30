"""`loom chat [MODEL]`: talk to a model in the terminal.

Answers stream as they come; the conversation is kept (and with it the engine's prefix cache:
each turn re-sends the whole conversation, whose earlier blocks are cached); each answer ends
with its tokens, speed and time to first token. Ctrl-C stops an answer and keeps you in the chat;
Ctrl-D or /bye leaves. A line `\"\"\"` starts and ends a multi-line message. `--url` talks to a
running server instead of loading the model here.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from loom.engine.arg_utils import HelpFormatter, add_dataclass_args, flags_set, from_namespace
from loom.engine.args import EngineArgs

HELP = """commands:
  /set KEY VALUE   sampling: temperature, top_p, top_k, min_p, max_tokens, seed,
                   repetition_penalty, presence_penalty, frequency_penalty (/set alone: show)
  /system TEXT     set the system prompt (/system alone: show it; /system - : remove it)
  /clear           forget the conversation
  /save FILE       save the conversation and settings as JSON; /load FILE reads one back
  /bye             leave (or Ctrl-D); Ctrl-C stops an answer
  \"\"\"              on a line of its own: start or end a multi-line message"""
SETTINGS = {"temperature": float, "top_p": float, "top_k": int, "min_p": float,
            "max_tokens": int, "seed": int, "repetition_penalty": float,
            "presence_penalty": float, "frequency_penalty": float}


ENGINE_DEFAULTS = {"max_num_seqs": 1}  # one conversation: a KV cache for one sequence


def register(sub: Any) -> argparse.ArgumentParser:
    """Register `loom chat` on the `loom` subcommand parser."""
    p = sub.add_parser("chat", help="chat with a model in the terminal (streamed)",
                       formatter_class=HelpFormatter, description=__doc__)
    add_dataclass_args(p, EngineArgs, positional=("model",), skip=("served_model_name",))
    p.set_defaults(**ENGINE_DEFAULTS)
    g = p.add_argument_group("chat")
    g.add_argument("--url", default=None,
                   help="chat with a running server (e.g. http://127.0.0.1:8000) instead of "
                        "loading the model here; MODEL then picks among its models")
    g.add_argument("--api-key", default=None, help="with --url: the server's API key")
    g.add_argument("--system", default=None, help="system prompt")
    g.add_argument("--temperature", type=float, default=0.7)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--max-tokens", type=int, default=1024, help="longest answer in tokens")
    g.add_argument("--verbose", "-v", action="store_true", help="keep the engine's log lines")
    p.set_defaults(func=cmd_chat)
    return p


@dataclass
class Conversation:
    system: str | None = None
    messages: list[dict[str, str]] = field(default_factory=list)
    settings: dict[str, Any] = field(default_factory=dict)

    def request(self) -> list[dict[str, str]]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + self.messages

    def save(self, path: Path) -> None:
        path.write_text(json.dumps({"system": self.system, "settings": self.settings,
                                    "messages": self.messages}, indent=2, ensure_ascii=False))

    def load(self, path: Path) -> None:
        data = json.loads(path.read_text())
        messages = data.get("messages")
        if not isinstance(messages, list) or not all(
                isinstance(m, dict) and isinstance(m.get("content"), str)
                and m.get("role") in ("user", "assistant") for m in messages):
            raise ValueError(f"{path}: `messages` must be a list of user/assistant messages")
        self.messages = [{"role": m["role"], "content": m["content"]} for m in messages]
        self.system = data.get("system") or None
        self.settings.update({k: v for k, v in (data.get("settings") or {}).items()
                              if k in SETTINGS})


class _StopFlag:
    """While an answer streams, Ctrl-C sets a flag instead of raising: the answer stops at the
    next step, the engine stays consistent."""

    def __init__(self) -> None:
        self.hit = False

    def __enter__(self) -> _StopFlag:
        self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum: int, frame: object) -> None:
        self.hit = True

    def __exit__(self, *exc: object) -> None:
        signal.signal(signal.SIGINT, self._previous)


class ChatREPL:
    def __init__(self, backend: Any, conversation: Conversation, out: TextIO = sys.stdout):
        self.backend = backend
        self.conv = conversation
        self.out = out
        self.dim = ("\x1b[2m", "\x1b[0m") if out.isatty() else ("", "")

    def say(self, text: str) -> None:
        self.out.write(text + "\n")
        self.out.flush()

    def read_message(self) -> str | None:
        """One message (None at end of input); `\"\"\"` lines bracket a multi-line one."""
        line = input(">>> ")
        if not line.startswith('"""'):
            return line
        first = line.rstrip()[3:]
        if first.endswith('"""'):  # opened and closed on one line
            return first[:-3]
        lines = [first] if first else []
        while True:
            more = input("... ")
            if more.rstrip().endswith('"""'):
                lines.append(more.rstrip()[:-3])
                return "\n".join(x for x in lines if x or len(lines) > 1).strip("\n")
            lines.append(more)

    def run(self) -> None:
        self.say(f"Loom chat with {self.backend.model}. /help for commands, Ctrl-D or /bye "
                 "to leave.")
        while True:
            try:
                text = self.read_message()
            except EOFError:
                self.say("")
                return
            except KeyboardInterrupt:
                self.say("\n(Ctrl-D or /bye to leave)")
                continue
            if text is None or not text.strip():
                continue
            if text.startswith("/"):
                if self.command(text.strip()) == "bye":
                    return
                continue
            self.answer(text)

    def answer(self, text: str) -> None:
        from loom.entrypoints.chat_backends import BackendError

        self.conv.messages.append({"role": "user", "content": text})
        pieces: list[str] = []
        with _StopFlag() as flag:
            try:
                for piece in self.backend.stream(self.conv.request(), self.conv.settings,
                                                 lambda: flag.hit):
                    pieces.append(piece)
                    self.out.write(piece)
                    self.out.flush()
            except BackendError as e:
                self.conv.messages.pop()
                self.say(f"error: {e}")
                return
        stats = self.backend.stats
        if flag.hit:
            stats.finish_reason = "abort"
        self.conv.messages.append({"role": "assistant", "content": "".join(pieces)})
        self.say(f"\n{self.dim[0]}[{stats.line()}]{self.dim[1]}")

    def command(self, line: str) -> str | None:
        name, _, arg = line.partition(" ")
        arg = arg.strip()
        if name in ("/bye", "/exit", "/quit"):
            return "bye"
        if name in ("/help", "/?"):
            self.say(HELP)
        elif name == "/clear":
            self.conv.messages.clear()
            self.say("conversation cleared")
        elif name == "/system":
            if arg:
                self.conv.system = None if arg == "-" else arg
                self.say("system prompt removed" if arg == "-" else "system prompt set")
            else:
                self.say(self.conv.system or "(no system prompt)")
        elif name == "/set":
            self._set(arg)
        elif name in ("/save", "/load") and arg:
            self._file(name, Path(arg).expanduser())
        else:
            self.say(f"unknown command {line!r}; /help lists them")
        return None

    def _set(self, arg: str) -> None:
        from loom.sampling_params import SamplingParams, SamplingParamsError

        key, _, value = arg.partition(" ")
        if not key:
            self.say(", ".join(f"{k} = {v}" for k, v in self.conv.settings.items()))
            return
        if key not in SETTINGS or not value.strip():
            self.say(f"usage: /set KEY VALUE, KEY one of {', '.join(SETTINGS)}")
            return
        try:
            new = {**self.conv.settings, key: SETTINGS[key](value.strip())}
            SamplingParams(**new)
        except (ValueError, SamplingParamsError) as e:
            self.say(f"error: {key}: {e}")
            return
        self.conv.settings = new
        self.say(f"{key} = {new[key]}")

    def _file(self, name: str, path: Path) -> None:
        try:
            if name == "/save":
                self.conv.save(path)
                self.say(f"saved {len(self.conv.messages)} messages to {path}")
            else:
                self.conv.load(path)
                self.say(f"loaded {len(self.conv.messages)} messages from {path}")
        except (OSError, ValueError) as e:
            self.say(f"error: {e}")


def cmd_chat(ns: argparse.Namespace) -> None:
    from loom.entrypoints.chat_backends import BackendError, LocalBackend, RemoteBackend

    try:
        import readline  # noqa: F401 - line editing and history for input()
    except ImportError:
        pass
    settings = {"temperature": ns.temperature, "top_p": ns.top_p, "max_tokens": ns.max_tokens}
    if ns.url:
        # The server runs its own engine: an engine flag here would be silently ignored.
        ignored = flags_set(EngineArgs, ns, skip=("model",), defaults=ENGINE_DEFAULTS)
        if ignored:
            raise SystemExit(f"error: {', '.join(ignored)} configure a local engine; with --url "
                             "the server's own settings apply")
        try:
            backend: Any = RemoteBackend(ns.url, ns.api_key, ns.model)
        except BackendError as e:
            raise SystemExit(f"error: {e}") from None
    else:
        backend = LocalBackend(_local_engine(ns, logging.INFO if ns.verbose else logging.WARNING))
    ChatREPL(backend, Conversation(ns.system, [], settings)).run()


def _local_engine(ns: argparse.Namespace, level: int):  # noqa: ANN202 - LLMEngine
    from loom.config import ConfigError
    from loom.engine.llm_engine import LLMEngine
    from loom.loader.resolve import ModelNotFoundError

    logging.getLogger().setLevel(level)
    try:
        return LLMEngine(from_namespace(EngineArgs, ns))
    except (ConfigError, ModelNotFoundError, OSError) as e:
        raise SystemExit(f"error: {e}") from None
