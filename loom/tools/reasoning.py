"""A reasoning model's thinking apart from its answer: `<think> ... </think>` (DeepSeek-R1 and its
distills, Qwen3, SmolLM3, GLM-4.5, Phi-4-reasoning ...) -> `reasoning_content` and `content`, as
vLLM's `--reasoning-parser deepseek_r1 | qwen3` and llama.cpp's server return them.

Where the chat template opened the block itself (the prompt ends inside `<think>`, as R1's and
Qwen3-Thinking's templates do), the reply starts as reasoning; otherwise only a reply that starts
with `<think>` has any. The block ends at `</think>`: a reply cut short inside it is all
reasoning. The answer after it starts at its first non-space character.

`split(text, final)` serves both answers, as the tool parsers' views do: streaming diffs the
splits of the growing text, whose parts only ever grow (a partial tag is held back until it is
whole or cannot be one), so the streamed deltas add up to the whole answer's parts.
"""

from __future__ import annotations

from dataclasses import dataclass

START, END = "<think>", "</think>"
_WS = " \t\r\n"
MODES = ("auto", "deepseek_r1", "qwen3", "none")  # --reasoning-parser (vLLM's names)


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest proper prefix of `tag` that `text` ends with."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


@dataclass
class ReasoningSplit:
    reasoning: str
    content: str


class ReasoningParser:
    def __init__(self, started: bool = False, closed: bool = False) -> None:
        self.started = started  # the prompt left a <think> block open
        self.closed = closed  # the prompt ends past a closed block (thinking turned off)

    @property
    def constraint_mode(self) -> str | None:
        """How a constrained reply's grammar lets it think first (StructuredOutputsParams.
        thinking): inside the block the prompt opened, a block of its own, or not at all
        where the prompt closed one (Qwen3's enable_thinking=False)."""
        return "open" if self.started else None if self.closed else "optional"

    def split(self, text: str, final: bool) -> ReasoningSplit:
        body = text
        if not self.started:
            lead = len(text) - len(text.lstrip(_WS))
            rest = text[lead:]
            if rest.startswith(START):
                body = rest[len(START):]
            elif not final and START.startswith(rest):  # "" or a partial "<think"
                return ReasoningSplit("", "")
            else:
                return ReasoningSplit("", text)
        end = body.find(END)
        if end < 0:  # still thinking (or cut short while thinking)
            hold = 0 if final else _partial_suffix(body, END)
            return ReasoningSplit(body[: len(body) - hold], "")
        return ReasoningSplit(body[:end], body[end + len(END):].lstrip(_WS))


def opens_thinking(prompt_tail: str) -> bool:
    """Whether a rendered prompt ends inside a `<think>` block (the template opened it)."""
    return prompt_tail.rfind(START) > prompt_tail.rfind(END)


def closes_thinking(prompt_tail: str) -> bool:
    """Whether a rendered prompt's last thinking tag closes a block (an empty one written by
    the template, as Qwen3's with enable_thinking=False)."""
    return prompt_tail.rfind(END) > prompt_tail.rfind(START)


def parser_enabled(mode: str, template: str | None) -> bool:
    """`auto`: where the chat template knows thinking blocks; vLLM's parser names: always."""
    if mode == "none":
        return False
    if mode == "auto":
        return bool(template) and END in template
    return True
