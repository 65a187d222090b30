"""Thinking blocks apart from the answer (loom.tools.reasoning): whole replies, and every
prefix of them as streaming sees them (each part only grows, and the last split is the whole
reply's)."""

from __future__ import annotations

import pytest

from loom.tools.reasoning import ReasoningParser, opens_thinking, parser_enabled

CASES = [  # (prompt opened the block, reply, reasoning, content)
    (False, "<think>\nLet me add.\n</think>\n\nThe sum is 4.", "\nLet me add.\n", "The sum is 4."),
    (False, "The sum is 4.", "", "The sum is 4."),
    (False, "  <think>a < b</think>yes", "a < b", "yes"),
    (False, "<think>cut short while thin", "cut short while thin", ""),
    (False, "<thinking>not a tag</thinking>", "", "<thinking>not a tag</thinking>"),
    (False, "<", "", "<"),
    (True, "Count: 1, 2.\n</think>\n\nTwo.", "Count: 1, 2.\n", "Two."),
    (True, "all thinking </thi", "all thinking </thi", ""),
    (True, "</think>Answer at once", "", "Answer at once"),
]


@pytest.mark.parametrize(("started", "text", "reasoning", "content"), CASES)
def test_whole_reply_and_every_prefix(started, text, reasoning, content) -> None:
    parser = ReasoningParser(started)
    whole = parser.split(text, final=True)
    assert (whole.reasoning, whole.content) == (reasoning, content)
    seen = ("", "")
    for end in range(len(text) + 1):
        part = parser.split(text[:end], final=False)
        assert part.reasoning.startswith(seen[0]) and part.content.startswith(seen[1]), end
        seen = (part.reasoning, part.content)
    assert reasoning.startswith(seen[0]) and content.startswith(seen[1])


def test_prompts_that_open_a_block_and_templates_that_know_one() -> None:
    assert opens_thinking("<|im_start|>assistant\n<think>\n")  # R1 / Qwen3-Thinking
    assert not opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # no thinking
    assert not opens_thinking("<|im_start|>assistant\n")
    qwen3 = "{% if enable_thinking is false %}<think>\n\n</think>{% endif %}"
    assert parser_enabled("auto", qwen3) and not parser_enabled("auto", "{{ messages }}")
    assert not parser_enabled("none", qwen3) and parser_enabled("deepseek_r1", None)


def test_server_context_reads_the_prompts_thinking_state() -> None:
    """A prompt that ends inside <think> starts the reply as reasoning, and a constraint
    (structured output, forced tool calls) holds after the block ("open"); with no block the
    reply may open one first ("optional"); past a closed block (thinking turned off) the
    constraint holds from the first token."""
    from loom.entrypoints.openai.serving_common import ServerContext
    from loom.loader.resolve import resolve_model
    from loom.tokenizer.tokenizer import Tokenizer

    tok = Tokenizer.from_source(resolve_model(None))
    ctx = ServerContext(engine=None, tokenizer=tok, model_name="m", max_model_len=64,
                        reasoning_parser="deepseek_r1")
    opened = tok.encode("<|im_start|>assistant\n<think>\n", add_special_tokens=False)
    closed = tok.encode("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    states = [ctx.reasoning(None, ids) for ids in (opened, tok.encode("assistant\n"), closed)]
    assert [(r.started, r.constraint_mode) for r in states] == [
        (True, "open"), (False, "optional"), (False, None)]
    assert ServerContext(engine=None, tokenizer=tok, model_name="m", max_model_len=64,
                         reasoning_parser="auto").reasoning("{{ x }}", opened) is None
