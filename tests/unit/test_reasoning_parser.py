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
