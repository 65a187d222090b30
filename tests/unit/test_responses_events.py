"""The Responses API's stream from chat chunks (serving_responses._Events): a thinking model's
reasoning, its answer and its calls become one output item each, in order, every item opened,
grown and closed with OpenAI's events; the non-streamed output holds the same items."""

from __future__ import annotations

import json

from loom.entrypoints.openai.serving_responses import _as_message, _Events, _outputs


def _kinds(events: list[str]) -> list[str]:
    return [json.loads(e.split("data: ", 1)[1])["type"] for e in events]


def test_reasoning_then_text_then_calls() -> None:
    deltas = [{"reasoning_content": "Think"}, {"reasoning_content": "ing."},
              {"content": "Let me "}, {"content": "check."},
              {"tool_calls": [{"index": 0, "id": "call_a", "type": "function",
                               "function": {"name": "f", "arguments": '{"x": '}}]},
              {"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]},
              {"tool_calls": [{"index": 1, "id": "call_b", "type": "function",
                               "function": {"name": "g", "arguments": "{}"}}]}]
    ev = _Events()
    events = [e for d in deltas for e in ev.delta(d)] + ev.close()
    assert _kinds(events) == [
        "response.output_item.added", "response.reasoning_text.delta",
        "response.reasoning_text.delta", "response.reasoning_text.done",
        "response.output_item.done",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done"]
    seqs = [json.loads(e.split("data: ", 1)[1])["sequence_number"] for e in events]
    assert seqs == list(range(len(events)))
    streamed = [{k: v for k, v in item.items() if k != "id"} for item in ev.items]
    whole = _outputs({"reasoning_content": "Thinking.", "content": "Let me check.",
                      "tool_calls": [
                          {"id": "call_a", "function": {"name": "f", "arguments": '{"x": 1}'}},
                          {"id": "call_b", "function": {"name": "g", "arguments": "{}"}}]})
    assert streamed == [{k: v for k, v in item.items() if k != "id"} for item in whole]
    assert [i["type"] for i in whole] == ["reasoning", "message", "function_call",
                                          "function_call"]
    # the next turn's messages: the reasoning left out, the text and calls kept
    message = _as_message(whole)
    assert message["content"] == "Let me check."
    assert [c["id"] for c in message["tool_calls"]] == ["call_a", "call_b"]


def test_the_response_store_is_bounded_in_number_and_text() -> None:
    import pytest

    from loom.entrypoints.openai.errors import APIError
    from loom.entrypoints.openai.serving_common import ResponseStore

    store = ResponseStore(size=3, max_chars=100)
    for i in range(5):
        store.put({"id": f"r{i}"}, [{"role": "user", "content": str(i)}], 10)
    with pytest.raises(APIError) as e:  # the oldest past the count
        store.get("r1", "previous_response_id")
    assert e.value.status == 404 and e.value.param == "previous_response_id"
    assert store.get("r4")[1] == [{"role": "user", "content": "4"}]
    store.put({"id": "big"}, [], 95)  # past the text bound: all the older ones go
    for old in ("r2", "r3", "r4"):
        with pytest.raises(APIError):
            store.get(old)
    store.put({"id": "huge"}, [], 500)  # alone past the bound: kept (the newest always is)
    assert store.get("huge")[0] == {"id": "huge"}
    store.delete("huge")
    with pytest.raises(APIError):
        store.delete("huge")
