"""Beam search on the engine: `LLM.beam_search(prompts, BeamSearchParams(...))`.

Each step every live beam is one engine request of one token (prompt + the beam's tokens) that
returns its top log-probabilities; all beams of all prompts run in one batch. The prompt's KV
blocks are shared through the prefix cache: a beam recomputes only its last partial block, and
beams forked from one parent share the parent's full blocks too.

The semantics are transformers' `generate(num_beams=..., do_sample=False)` (its vectorised beam
search, transformers 5): each step the best K = max(2, 1 + number of eos ids) * beam_width
continuations of all beams by summed log-probability; those that end (an eos token, or
max_tokens reached) among the first beam_width become finished hypotheses scored
sum / generated_length ** length_penalty (eos counted), the best beam_width kept; the best
beam_width that do not end continue. With early_stopping True the search stops once beam_width
hypotheses are finished; otherwise (False) it stops when the best running beam, normalised at
its current length, cannot beat the worst finished one ("never": at max_tokens when
length_penalty > 0).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from loom.sampling_params import MAX_LOGPROBS, SamplingParams

if TYPE_CHECKING:
    from loom.engine.llm import LLM
    from loom.engine.outputs import RequestOutput

_NEG = -1.0e9  # transformers' "impossible" score


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's names (beam_width, max_tokens, ignore_eos, length_penalty) plus transformers'
    early_stopping (True, False or "never")."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0  # vLLM's field; only 0 (deterministic beam search) is supported
    length_penalty: float = 1.0
    early_stopping: bool | str = False

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.temperature != 0.0:
            raise ValueError("beam search supports temperature 0 only")
        if self.early_stopping not in (True, False, "never"):
            raise ValueError(f"early_stopping must be true, false or 'never', got "
                             f"{self.early_stopping!r}")


@dataclass
class BeamSequence:
    token_ids: list[int]  # generated tokens (an eos that ended it included)
    text: str
    cum_logprob: float
    score: float  # cum_logprob / len(token_ids) ** length_penalty
    finish_reason: str  # "stop" (eos) or "length"


@dataclass
class BeamSearchOutput:
    prompt_token_ids: list[int]
    sequences: list[BeamSequence]  # best first, beam_width of them


@dataclass
class _Search:
    prompt: list[int]
    running: list[tuple[list[int], float]]  # (tokens, summed logprob), best first
    finished: list[tuple[float, list[int], float]] = field(default_factory=list)  # (score, ..)
    improvable: bool = True
    done: bool = False


class BeamSearch:
    """The search over some prompts, driven step by step: `batch()` gives the token lists to
    score (one per live beam), `advance()` takes their one-token outputs (with `logprobs`
    = `step_params.logprobs`); `done` when every prompt's search ended."""

    def __init__(self, prompt_ids: list[list[int]], params: BeamSearchParams,
                 eos_token_ids: Sequence[int]) -> None:
        self.params = params
        self.eos = () if params.ignore_eos else tuple(eos_token_ids)
        per_beam = max(2, 1 + len(eos_token_ids))
        keep = per_beam * params.beam_width
        if keep > MAX_LOGPROBS:  # each step's candidates come as the top `keep` logprobs
            raise ValueError(f"beam_width must be at most {MAX_LOGPROBS // per_beam} for this "
                             f"model, got {params.beam_width} (a step scores the top "
                             f"{per_beam} x beam_width tokens, at most {MAX_LOGPROBS})")
        self.keep = keep
        self.step_params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=keep,
                                          ignore_eos=True)
        self.searches = [_Search(list(p), [([], 0.0)]) for p in prompt_ids]

    @property
    def done(self) -> bool:
        return all(s.done for s in self.searches)

    def batch(self) -> list[list[int]]:
        return [s.prompt + beam for s in self.searches if not s.done for beam, _ in s.running]

    def advance(self, outputs: Sequence[RequestOutput]) -> None:
        outs = iter(outputs)
        for s in [s for s in self.searches if not s.done]:
            tops = []
            for _ in s.running:
                lp = next(outs).outputs[0].logprobs[0]
                tops.append(list(zip(lp.token_ids[1:], lp.logprobs[1:])))  # the top `keep`
            _step(s, tops, self.params, self.eos, self.keep)

    def results(self, tokenizer) -> list[BeamSearchOutput]:  # noqa: ANN001
        return [_result(s, self.eos, tokenizer) for s in self.searches]


def beam_search(llm: LLM, prompts: Sequence[str | list[int]],
                params: BeamSearchParams) -> list[BeamSearchOutput]:
    """Beam search over each prompt (strings are tokenized as generate() does)."""
    tok = llm.get_tokenizer()
    ids = [list(p) if not isinstance(p, str) else tok.encode(p) for p in prompts]
    search = BeamSearch(ids, params, llm.engine.eos_token_ids)
    while not search.done:
        search.advance(llm.generate(search.batch(), search.step_params, use_tqdm=False))
    return search.results(tok)


def _step(s: _Search, tops: list[list[tuple[int, float]]], params: BeamSearchParams,
          eos: tuple[int, ...], keep: int) -> None:
    width, lp = params.beam_width, params.length_penalty
    cands = sorted(((score + logprob, b, token) for b, (_, score) in enumerate(s.running)
                    for token, logprob in tops[b]), key=lambda c: -c[0])[:keep]
    gen_len = len(s.running[0][0]) + 1
    ends = [token in eos or gen_len >= params.max_tokens for _, _, token in cands]
    # the best `width` that go on (ended ones last, as transformers' -1e9 does)
    order = sorted(range(len(cands)), key=lambda i: -(cands[i][0] + (_NEG if ends[i] else 0.0)))
    running = [(s.running[cands[i][1]][0] + [cands[i][2]],
                cands[i][0] + (_NEG if ends[i] else 0.0)) for i in order[:width]]
    full = len(s.finished) == width
    if s.improvable and not (full and params.early_stopping is True):
        for i in range(min(width, len(cands))):
            if ends[i]:
                score, b, token = cands[i]
                s.finished.append((score / gen_len ** lp, s.running[b][0] + [token], score))
        s.finished.sort(key=lambda f: -f[0])
        del s.finished[width:]
    s.running = running
    best_len = params.max_tokens if params.early_stopping == "never" and lp > 0 else gen_len
    full = len(s.finished) == width
    worst = s.finished[-1][0] if full else _NEG
    s.improvable = s.improvable and running[0][1] / best_len ** lp > worst
    s.done = not s.improvable or (full and params.early_stopping is True) or all(ends)


def _result(s: _Search, eos: tuple[int, ...], tok) -> BeamSearchOutput:  # noqa: ANN001
    sequences = [
        BeamSequence(tokens, tok.decode(tokens, skip_special_tokens=True), cum, score,
                     "stop" if tokens and tokens[-1] in eos else "length")
        for score, tokens, cum in s.finished
    ]
    return BeamSearchOutput(s.prompt, sequences)
