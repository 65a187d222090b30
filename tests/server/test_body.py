"""Request bodies parsed and validated as the server does (body.parse_json_body), no server:
a prompt-like field is validated as the one form its first item names, so a long list of token
ids with one bad item costs one error naming that item."""

from __future__ import annotations

import json

import pytest

from loom.entrypoints.openai.body import parse_json_body
from loom.entrypoints.openai.errors import APIError
from loom.entrypoints.openai.protocol import CompletionRequest
from loom.entrypoints.openai.serving_embedding import EmbeddingRequest

MODELS = [(CompletionRequest, "prompt"), (EmbeddingRequest, "input")]


@pytest.mark.parametrize(("model", "field"), MODELS)
@pytest.mark.parametrize(("value", "where"), [
    ([1, 2, "x"], "[2]"),  # token ids: the bad item, not "should be a valid string"
    (["a", 3], "[1]"),
    ([[1], [2, "x"]], "[1][1]"),
    ([1] * 100_000 + [None], "[100000]"),
])
def test_the_first_bad_item_is_named(model, field: str, value, where: str) -> None:
    with pytest.raises(APIError) as e:
        parse_json_body(json.dumps({field: value}).encode(), model)
    assert e.value.status == 400
    assert e.value.param == f"{field}{where}", e.value.message


@pytest.mark.parametrize(("model", "field"), MODELS)
@pytest.mark.parametrize("value", ["hi", ["a", "b"], [1, 2], [[1], [2, 3]]])
def test_every_form_is_accepted(model, field: str, value) -> None:
    assert getattr(parse_json_body(json.dumps({field: value}).encode(), model), field) == value
