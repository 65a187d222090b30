"""The grammar engine behind structured output: llguidance (chosen by measurement; see
docs/structured_output.md). Everything llguidance-specific lives in this file.

A `CompiledGrammar` is built once per distinct constraint and cached; each request gets its own
`GrammarMatcher` (a cheap copy of the compiled one) that follows the request's tokens.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import torch

from loom.structured.schema import no_additional_properties

if TYPE_CHECKING:
    from loom.structured.params import StructuredOutputsParams
    from loom.tokenizer.tokenizer import Tokenizer


class GrammarError(ValueError):
    """The schema, regex or grammar is invalid or unsupported; the message says where."""


class GrammarMatcher:
    """The grammar state of one request: which tokens may come next, and the tokens so far."""

    __slots__ = ("_m",)

    def __init__(self, matcher) -> None:  # noqa: ANN001 - llguidance.LLMatcher
        self._m = matcher

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed-token bits into `bitmask[row]` ([rows, ceil(vocab/32)] int32, CPU)."""
        self._m.unsafe_compute_mask_ptr(bitmask[row].data_ptr(), bitmask.size(1) * 4)

    def accept_token(self, token_id: int) -> bool:
        """Advance by one sampled token; False if the grammar does not allow it."""
        return self._m.consume_token(token_id)

    def num_valid(self, token_ids: list[int]) -> int:
        """How many of `token_ids`, in order from the current state, the grammar allows (the
        state does not move)."""
        return self._m.validate_tokens(token_ids)

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens."""
        if num_tokens and not self._m.rollback(num_tokens):
            raise RuntimeError(f"the grammar could not roll back {num_tokens} tokens: "
                               f"{self.error}")

    def is_terminated(self) -> bool:
        """The output is complete: the grammar allows nothing more (except end of sequence)."""
        return self._m.is_stopped()

    def is_accepting(self) -> bool:
        return self._m.is_accepting()

    @property
    def error(self) -> str | None:
        """The grammar engine's reason once it failed (its first line), else None."""
        return _first_lines(self._m.get_error(), 1) if self._m.is_error() else None


class CompiledGrammar:
    """A constraint compiled against one tokenizer; `matcher()` starts a new request on it."""

    __slots__ = ("_template",)

    def __init__(self, template) -> None:  # noqa: ANN001 - llguidance.LLMatcher
        self._template = template

    def matcher(self) -> GrammarMatcher:
        return GrammarMatcher(self._template.deep_copy())


class LLGuidanceBackend:
    """Compiles `StructuredOutputsParams` with llguidance for one tokenizer and vocabulary."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        import llguidance

        self._llg = llguidance
        backend = tokenizer.backend
        # llguidance reads the tokenizer from its JSON (the Rust `tokenizers` format).
        self.tokenizer = llguidance.LLTokenizer(
            backend.to_str(), n_vocab=vocab_size, eos_token=list(tokenizer.eos_token_ids),
        )
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(tokenizer.eos_token_ids)

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """Compile, then run the grammar a few tokens on a copy: a grammar that compiles but
        exceeds the grammar engine's limits once it runs (a lexer too complex, a parser row
        too wide) is a GrammarError here, before any request uses it."""
        grammar = self._grammar_text(params)
        matcher = self._llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"invalid {params.kind}: {_first_lines(matcher.get_error())}")
        self._probe(matcher, params.kind)
        return CompiledGrammar(matcher)

    def _probe(self, template, kind: str) -> None:  # noqa: ANN001 - llguidance.LLMatcher
        """Compute the first mask on `template` itself (every request's copy then starts with
        it cached) and follow one allowed token per step on a copy for `_PROBE_STEPS` steps."""
        bitmask = torch.zeros((1, (self.vocab_size + 31) // 32), dtype=torch.int32)
        matcher = GrammarMatcher(template)
        for step in range(_PROBE_STEPS + 1):
            matcher.fill_bitmask(bitmask, 0)
            if matcher.error is not None:
                raise GrammarError(f"the {kind} exceeds a limit of the grammar engine: "
                                   f"{matcher.error}")
            allowed = _allowed_tokens(bitmask[0], self.vocab_size, self.eos_token_ids)
            if step == _PROBE_STEPS or not allowed or matcher.is_terminated():
                return
            if step == 0:  # the template itself stays at its start
                matcher = GrammarMatcher(template.deep_copy())
            if not matcher.accept_token(allowed[-1]) or matcher.error is not None:
                raise GrammarError(f"the {kind} exceeds a limit of the grammar engine: "
                                   f"{matcher.error or 'a token was rejected'}")

    def _grammar_text(self, params: StructuredOutputsParams) -> str:
        text = self._constraint_text(params)
        return text if params.thinking is None else _after_thinking(text, params.thinking)

    def _constraint_text(self, params: StructuredOutputsParams) -> str:
        llg = self._llg.LLMatcher
        kind = params.kind
        try:
            if kind in ("json", "json_object"):
                schema = params.json if kind == "json" else {"type": "object"}
                if not params.additional_properties:
                    schema = no_additional_properties(schema)
                options = {"whitespace_flexible": params.any_whitespace}
                if not params.any_whitespace:
                    options |= {"item_separator": ", ", "key_separator": ": "}
                return llg.grammar_from_json_schema(schema, overrides=options)
            if kind == "regex":
                return llg.grammar_from_regex(params.regex)
            if kind == "choice":
                lark = "start: " + " | ".join(json.dumps(c) for c in params.choice)
                return llg.grammar_from_lark(lark)
            assert kind == "grammar"
            return self._llg.grammar_from("grammar", params.grammar)
        except (ValueError, TypeError, RecursionError) as e:
            raise GrammarError(f"invalid {kind}: {_first_lines(str(e))}") from None


# A thinking block's text: the shortest that ends in the closing tag (lazy), then a few blanks
# (bounded: a weak model would otherwise fill max_tokens with them)
_THINKING = 'think[lazy]: /(?s:.*)<\\/think>/\nblank: /[ \\t\\r\\n]{0,8}/\n'


def _after_thinking(grammar: str, mode: str) -> str:
    """A compiled constraint's grammar (llguidance's JSON) behind a `<think> ... </think>`
    block: the block's text is free, the constraint holds from the answer's first non-blank.
    "open": the reply starts inside the block; "optional": it may start with one."""
    # (llguidance gives JSON schemas and regexes as its JSON, Lark and GBNF as Lark text)
    top = json.loads(grammar) if grammar.lstrip().startswith("{") else {
        "grammars": [{"lark_grammar": grammar}]}
    answer = top["grammars"][0]
    answer["name"] = name = answer.get("name") or "answer"
    block = "think" if mode == "open" else '("<think>" think)?'
    outer = {"name": "reply", "lark_grammar": f"start: {block} blank @{name}\n{_THINKING}"}
    return json.dumps({**top, "grammars": [outer, *top["grammars"]]})


# Tokens a new grammar is run for before it is accepted (see LLGuidanceBackend._probe).
_PROBE_STEPS = 2


def _allowed_tokens(row: torch.Tensor, vocab_size: int, eos: frozenset[int]) -> list[int]:
    """The token ids one bitmask row ([words] int32) allows, eos left out, ascending."""
    bits = ((row.unsqueeze(-1) >> _SHIFTS) & 1).flatten()[:vocab_size]  # [vocab]
    return [t for t in bits.nonzero().flatten().tolist() if t not in eos]


def _first_lines(message: str, n: int = 6) -> str:
    return "\n".join(message.strip().splitlines()[:n])


def apply_token_bitmask(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
    """Set to -inf every token of `logits[rows[i]]` whose bit in `bitmask[i]` is 0; in place.

    logits: [num_rows, vocab]; bitmask: [len(rows), ceil(vocab / 32)] int32 (bit j of word w
    allows token 32 * w + j). Only the listed rows are touched, in place (no index_put copy).
    """
    if not rows:
        return
    vocab = logits.size(1)
    bits = (bitmask.unsqueeze(-1) >> _SHIFTS) & 1  # [len(rows), words, 32]
    banned = (bits == 0).flatten(1)[:, :vocab].to(logits.device)  # [len(rows), vocab]
    if len(rows) == logits.size(0) and rows == list(range(len(rows))):
        logits.masked_fill_(banned, float("-inf"))
        return
    for i, row in enumerate(rows):
        logits[row].masked_fill_(banned[i], float("-inf"))


_SHIFTS = torch.arange(32, dtype=torch.int32)  # [32]
