"""`loom chat`: its commands (fast, no model), and a real session in a pseudo-terminal."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from loom.entrypoints.chat import ChatREPL, Conversation
from loom.entrypoints.chat_backends import AnswerStats
from tests.product.chat_driver import drive, spawn_chat


def _repl() -> tuple[ChatREPL, io.StringIO]:
    out = io.StringIO()
    return ChatREPL(None, Conversation(None, [], {"temperature": 0.7}), out), out


def test_commands_set_system_clear_save_load(tmp_path: Path) -> None:
    repl, out = _repl()
    repl.command("/set temperature 0")
    repl.command("/set max_tokens 12")
    repl.command("/set max_tokens -3")
    repl.command("/set colour blue")
    assert repl.conv.settings == {"temperature": 0.0, "max_tokens": 12}
    assert "error: max_tokens" in out.getvalue() and "usage: /set KEY VALUE" in out.getvalue()
    repl.command("/system You are terse.")
    repl.conv.messages += [{"role": "user", "content": "hi"},
                           {"role": "assistant", "content": "hello"}]
    assert repl.conv.request()[0] == {"role": "system", "content": "You are terse."}
    path = tmp_path / "chat.json"
    repl.command(f"/save {path}")
    saved = json.loads(path.read_text())
    assert saved["messages"][1]["content"] == "hello" and saved["system"] == "You are terse."
    repl.command("/clear")
    repl.command("/system -")
    assert repl.conv.messages == [] and repl.conv.request() == []
    repl.command(f"/load {path}")
    assert len(repl.conv.messages) == 2 and repl.conv.system == "You are terse."
    assert repl.conv.settings["max_tokens"] == 12
    path.write_text(json.dumps({"messages": [{"role": "robot", "content": 1}]}))
    repl.command(f"/load {path}")
    assert "error:" in out.getvalue().splitlines()[-1] and len(repl.conv.messages) == 2
    assert repl.command("/bye") == "bye" and repl.command("/nope") is None


def test_stats_line() -> None:
    s = AnswerStats(prompt_tokens=37, completion_tokens=11, cached_tokens=32, ttft_s=0.25,
                    decode_s=2.0, finish_reason="abort")
    assert s.line() == ("11 tokens · 5.0 tok/s · TTFT 250 ms · prompt 37 · prefix cache 32 · "
                        "stopped")


@pytest.mark.slow
def test_chat_in_a_terminal_local_engine() -> None:
    child = spawn_chat(["--max-model-len", "1024", "--kv-cache-memory", str(64 * 2**20)])
    first, second = drive(child)
    assert "TTFT" in first and "tok/s" in first
    # the second turn re-sends the first: its blocks come from the prefix cache
    assert "prefix cache" in second, second


def test_multi_line_messages(monkeypatch: pytest.MonkeyPatch) -> None:
    repl, _ = _repl()
    lines = iter(['"""', "first line", "", 'last line"""', '"""one line"""', "plain"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    assert repl.read_message() == "first line\n\nlast line"
    assert repl.read_message() == "one line"
    assert repl.read_message() == "plain"
