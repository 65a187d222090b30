"""Drive `loom chat` in a pseudo-terminal (pexpect): /set, two turns, a multi-line message,
Ctrl-C in an answer, /bye."""

from __future__ import annotations

import os
import re
import sys

from tests.server.utils import ROOT

STATS = r"\[(\d+) tokens? · [^\]]*\]"


def spawn_chat(args: list[str], timeout: float = 300):  # noqa: ANN201 - pexpect.spawn
    pexpect = __import__("pytest").importorskip("pexpect")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TERM": "dumb"}
    return pexpect.spawn(sys.executable, ["-m", "loom.entrypoints.cli", "chat", *args], env=env,
                         cwd=str(ROOT), encoding="utf-8", timeout=timeout,
                         dimensions=(40, 200))


def drive(child) -> list[str]:  # noqa: ANN001
    """The scripted session; returns the two answers' stats lines."""
    import pexpect

    child.expect("Loom chat with ")
    child.expect_exact(">>> ")
    child.sendline("/set temperature 0")
    child.expect_exact("temperature = 0.0")
    child.sendline("/set max_tokens 24")
    child.expect_exact("max_tokens = 24")
    child.sendline("/set top_p 7")  # rejected, with the reason
    child.expect(r"error: top_p: [^\r\n]+")
    stats = []
    for question in ("What is the capital of France?", "And the capital of Italy?"):
        child.expect_exact(">>> ")
        child.sendline(question)
        child.expect_exact(question + "\r\n")  # the echo
        child.expect(STATS)
        stats.append(child.after)
        assert int(child.match.group(1)) >= 1
    child.expect_exact(">>> ")
    child.sendline('"""')  # a multi-line message
    child.expect_exact("... ")
    child.sendline("Answer in one word:")
    child.expect_exact("... ")
    child.sendline('what colour is the sky?"""')
    child.expect(STATS)
    child.expect_exact(">>> ")
    # room for the history's prompt (the three answers are capped at 24 tokens each: 173
    # tokens on a CPU whose greedy answers run to the cap) within --max-model-len 1024
    child.sendline("/set max_tokens 600")
    child.expect_exact(">>> ")
    child.sendline("Tell me a very long story about a dragon and a knight.")
    child.expect_exact("knight.\r\n")
    child.expect(r"\S+\s+\S+\s+\S+\s+\S+")  # the answer is streaming...
    child.sendintr()  # ...Ctrl-C stops it and keeps the chat going
    child.expect(STATS)
    stopped = child.after
    assert "stopped" in stopped and int(child.match.group(1)) < 600, stopped
    child.expect_exact(">>> ")
    child.sendline("/bye")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0
    return [re.sub(r"\x1b\[\d+m", "", s) for s in stats]
