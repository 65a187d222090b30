"""offload.py: small request work (a body, a prompt's text) runs on the event loop, large work on
a worker thread; results and errors are the same either way."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

from loom.entrypoints.openai import body
from loom.entrypoints.openai.body import parse_body
from loom.entrypoints.openai.errors import APIError
from loom.entrypoints.openai.offload import INLINE_BODY_BYTES, run_sized
from loom.entrypoints.openai.protocol import CompletionRequest


def _ran_on_loop(size: int, limit: int) -> bool:
    async def main() -> tuple[int, int]:
        return threading.get_ident(), await run_sized(size, limit, threading.get_ident)
    loop_thread, ran_on = asyncio.run(main())
    return ran_on == loop_thread


def test_small_work_runs_on_the_loop_and_large_on_a_thread() -> None:
    assert _ran_on_loop(10, 10)
    assert not _ran_on_loop(11, 10)


@pytest.mark.parametrize("size", [0, 100])
def test_errors_propagate_both_ways(size: int) -> None:
    def fail(x: int) -> None:
        raise ValueError(f"bad {x}")
    with pytest.raises(ValueError, match="bad 7"):
        asyncio.run(run_sized(size, 50, fail, 7))


class _Body:
    """What parse_body reads of a starlette Request."""

    def __init__(self, raw: bytes) -> None:
        self.raw = raw

    async def body(self) -> bytes:
        return self.raw


@pytest.mark.parametrize(("prompt_chars", "on_loop"), [(800, True), (INLINE_BODY_BYTES, False)])
def test_parse_body_thread_by_size(monkeypatch, prompt_chars: int, on_loop: bool) -> None:
    """A benchmark-sized body parses on the loop; one past INLINE_BODY_BYTES on a thread, and
    both validate the same (a bad field is the same 400)."""
    seen: list[int] = []
    parse = body.parse_json_body

    def spy(raw: bytes, model):  # noqa: ANN001, ANN202 - the real parser, its thread noted
        seen.append(threading.get_ident())
        return parse(raw, model)

    monkeypatch.setattr(body, "parse_json_body", spy)
    prompt = "x" * prompt_chars

    async def main() -> int:
        req = await parse_body(_Body(json.dumps({"prompt": prompt}).encode()), CompletionRequest)
        assert req.prompt == prompt
        with pytest.raises(APIError) as e:
            await parse_body(_Body(json.dumps({"prompt": prompt, "n": "x"}).encode()),
                             CompletionRequest)
        assert e.value.status == 400 and e.value.param == "n"
        return threading.get_ident()

    loop_thread = asyncio.run(main())
    assert len(seen) == 2
    assert all((t == loop_thread) == on_loop for t in seen)
