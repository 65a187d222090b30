"""Chat roles as text: where a role's message begins and ends, read off the model's template.

A program's state is text, so `user("hi")` must become the exact characters the chat template
would write for that message. Rather than a hand-written table per model (SGLang's approach),
the template itself is rendered twice: once with the conversation so far, once with a new
message whose content is a sentinel. The difference, split at the sentinel, is the role's
begin and end. This covers templates that add a default system prompt before the first
message (SmolLM2's) or wrap the first message specially, as long as rendering one more message
only appends text (every common template does; otherwise LangError says so).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from loom.lang.errors import LangError

if TYPE_CHECKING:
    from loom.tokenizer.tokenizer import Tokenizer

_SENTINEL = "\u2063LOOMLANGCONTENT\u2063"  # invisible separator: no template trims or edits it
ROLES = ("system", "user", "assistant")

Render = Callable[[list[dict[str, Any]], bool], str]


class ChatTemplate:
    """Begin/end strings of chat roles, derived by rendering the model's Jinja template."""

    def __init__(self, render: Render) -> None:
        self._render = render

    @classmethod
    def from_tokenizer(cls, tokenizer: Tokenizer) -> ChatTemplate | None:
        """The template of a Loom `Tokenizer` (the engine's, or one loaded for a server); None
        when the model has none."""
        if not tokenizer.chat_template:
            return None

        def render(messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
            return tokenizer.apply_chat_template(messages, add_generation_prompt)

        return cls(render)

    @classmethod
    def from_jinja(cls, template: str, **special_tokens: str) -> ChatTemplate:
        """A Jinja chat template as HF tokenizers store it; `special_tokens` (bos_token=...,
        eos_token=...) are the variables it may read."""
        from transformers.utils.chat_template_utils import render_jinja_template

        def render(messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
            rendered, _ = render_jinja_template(
                conversations=[messages], chat_template=template,
                add_generation_prompt=add_generation_prompt, **special_tokens,
            )
            return rendered[0]

        return cls(render)

    def role_span(self, messages: list[dict[str, Any]], role: str) -> tuple[str, str]:
        """(begin, end): the text the template writes around the content of a `role` message
        that follows `messages` (earlier messages of this program, contents as written)."""
        if role not in ROLES:
            raise LangError(f"unknown chat role {role!r}; expected one of {ROLES}")
        try:
            before = self._render(messages, False) if messages else ""
            full = self._render([*messages, {"role": role, "content": _SENTINEL}], False)
        except Exception as e:  # jinja's raise_exception: e.g. a template without system role
            raise LangError(f"the chat template cannot render a {role} message here: {e}") from e
        if not full.startswith(before):
            raise LangError("the chat template rewrites earlier messages when one is added; "
                            "roles cannot be rendered incrementally with it")
        begin, sep, end = full[len(before):].partition(_SENTINEL)
        if not sep:
            raise LangError(f"the chat template drops the content of a {role} message")
        return begin, end
