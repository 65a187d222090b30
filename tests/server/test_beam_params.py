"""use_beam_search's parameters on /v1/completions (serving_beam.beam_params), without a
server: the beam width comes from beam_width, else best_of, else n; a width below 1, given
by any of them, is a 400 (never replaced by the next one)."""

from __future__ import annotations

import pytest

from loom.entrypoints.openai.errors import APIError
from loom.entrypoints.openai.protocol import CompletionRequest
from loom.entrypoints.openai.serving_beam import beam_params


def _params(**extra: object):
    return beam_params(CompletionRequest.model_validate(
        {"prompt": "hi", "use_beam_search": True, "max_tokens": 4, **extra}))


@pytest.mark.parametrize(("extra", "width", "n"), [
    ({}, 1, 1), ({"n": 2}, 2, 2), ({"best_of": 3}, 3, 1), ({"beam_width": 4, "best_of": 3}, 4, 1),
    ({"beam_width": 3, "n": 2}, 3, 2),
])
def test_the_width_and_the_beams_returned(extra, width: int, n: int) -> None:
    params, returned = _params(**extra)
    assert (params.beam_width, returned) == (width, n)


@pytest.mark.parametrize("extra", [
    {"beam_width": 0}, {"beam_width": 0, "n": 2}, {"best_of": 0}, {"beam_width": -1}, {"n": 0},
])
def test_a_width_below_one_is_400(extra) -> None:
    with pytest.raises(APIError) as e:
        _params(**extra)
    assert (e.value.status, e.value.param) == (400, "beam_width"), e.value.message


def test_a_width_past_what_a_step_scores_says_so() -> None:
    """Each step scores the top 2 x beam_width tokens of a beam as logprobs (at most
    MAX_LOGPROBS): a wider search is refused naming beam_width and its bound, not logprobs."""
    from loom.engine.beam_search import BeamSearch
    from loom.sampling_params import MAX_LOGPROBS

    params, _ = _params(beam_width=MAX_LOGPROBS // 2 + 1)
    with pytest.raises(ValueError, match=f"beam_width must be at most {MAX_LOGPROBS // 2} "):
        BeamSearch([[1, 2]], params, eos_token_ids=[0])
    assert BeamSearch([[1, 2]], _params(beam_width=MAX_LOGPROBS // 2)[0], [0]).keep == MAX_LOGPROBS
