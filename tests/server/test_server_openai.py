"""The official `openai` client against `loom serve`: completions and chat, streamed or not,
n, logprobs, echo, stop strings, seeds, usage, and the small endpoints."""

from __future__ import annotations

import httpx
import pytest
from openai import BadRequestError, OpenAI

from loom import __version__
from tests.server.utils import ServerProcess

pytestmark = pytest.mark.slow  # real `loom serve` subprocesses

PROMPT = "The capital of France is"
MESSAGES = [{"role": "system", "content": "You are a terse assistant."},
            {"role": "user", "content": "Name three colors."}]


def _tokens(server: ServerProcess, text: str) -> list[int]:
    return httpx.post(f"{server.url}/tokenize", json={"prompt": text}).json()["tokens"]


def _stream_completion(client: OpenAI, **kwargs: object) -> tuple[dict[int, str], dict, object]:
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    usage = None
    for chunk in client.completions.create(stream=True, **kwargs):  # type: ignore[call-overload]
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason is not None:
                assert c.index not in finish, "finish_reason sent twice"
                finish[c.index] = c.finish_reason
    return texts, finish, usage


def _stream_chat(client: OpenAI, **kwargs: object) -> tuple[dict[int, str], dict, object, list]:
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    usage, chunks = None, []
    stream = client.chat.completions.create(stream=True, **kwargs)  # type: ignore[call-overload]
    for chunk in stream:
        chunks.append(chunk)
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason is not None:
                finish[c.index] = c.finish_reason
    return texts, finish, usage, chunks


def test_completion_stream_equals_non_stream(client: OpenAI, model_name: str) -> None:
    args = dict(model=model_name, prompt=PROMPT, max_tokens=12, temperature=0)
    whole = client.completions.create(**args)  # type: ignore[call-overload]
    texts, finish, usage = _stream_completion(
        client, stream_options={"include_usage": True}, **args)
    assert whole.object == "text_completion" and whole.model == model_name
    assert texts == {0: whole.choices[0].text} and whole.choices[0].text
    assert finish == {0: whole.choices[0].finish_reason}
    assert usage is not None and usage.model_dump() == whole.usage.model_dump()


def test_chat_stream_equals_non_stream(client: OpenAI, model_name: str) -> None:
    args = dict(model=model_name, messages=MESSAGES, max_tokens=12, temperature=0)
    whole = client.chat.completions.create(**args)  # type: ignore[call-overload]
    texts, finish, usage, chunks = _stream_chat(
        client, stream_options={"include_usage": True}, **args)
    message = whole.choices[0].message
    assert message.role == "assistant" and message.content
    assert texts == {0: message.content}
    assert finish == {0: whole.choices[0].finish_reason}
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and usage.model_dump() == whole.usage.model_dump()
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)


@pytest.mark.parametrize(
    ("prompt", "max_tokens"),
    [("Hello", 1), ("Once upon a time", 7), ("1, 2, 3, 4,", 16)],
)
def test_usage_equals_token_counts(
    client: OpenAI, server: ServerProcess, model_name: str, prompt: str, max_tokens: int
) -> None:
    out = client.completions.create(model=model_name, prompt=prompt, max_tokens=max_tokens,
                                    temperature=0, logprobs=0, extra_body={"ignore_eos": True})
    choice = out.choices[0]
    assert choice.finish_reason == "length"
    assert out.usage.prompt_tokens == len(_tokens(server, prompt))
    assert out.usage.completion_tokens == max_tokens == len(choice.logprobs.tokens)
    assert out.usage.total_tokens == out.usage.prompt_tokens + max_tokens


def test_chat_usage_counts_the_template(client: OpenAI, server: ServerProcess,
                                        model_name: str) -> None:
    rendered = httpx.post(f"{server.url}/tokenize", json={"messages": MESSAGES}).json()
    out = client.chat.completions.create(model=model_name, messages=MESSAGES,
                                         max_completion_tokens=5, temperature=0,
                                         logprobs=True, top_logprobs=2,
                                         extra_body={"ignore_eos": True})
    assert out.usage.prompt_tokens == rendered["count"]
    assert out.usage.completion_tokens == 5 == len(out.choices[0].logprobs.content)
    assert out.choices[0].finish_reason == "length"


def test_n2_completion_and_chat(client: OpenAI, model_name: str) -> None:
    out = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=6, n=2,
                                    temperature=1.0, seed=11)
    assert sorted(c.index for c in out.choices) == [0, 1]
    assert out.choices[0].text != out.choices[1].text  # distinct samples
    texts, finish, _ = _stream_completion(client, model=model_name, prompt=PROMPT, max_tokens=6,
                                          n=2, temperature=1.0, seed=11)
    assert texts == {c.index: c.text for c in out.choices}
    assert set(finish) == {0, 1}
    chat = client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=6,
                                          n=2, temperature=1.0, seed=5)
    assert sorted(c.index for c in chat.choices) == [0, 1]
    ctexts, cfinish, _, _ = _stream_chat(client, model=model_name, messages=MESSAGES,
                                         max_tokens=6, n=2, temperature=1.0, seed=5)
    assert ctexts == {c.index: c.message.content for c in chat.choices} and set(cfinish) == {0, 1}


def test_n2_usage_sums_choices(client: OpenAI, model_name: str) -> None:
    out = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=4, n=2,
                                    temperature=1.0, seed=3, logprobs=0,
                                    extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 8
    assert all(len(c.logprobs.tokens) == 4 for c in out.choices)


def test_seed_reproducible(client: OpenAI, model_name: str) -> None:
    def sample(seed: int) -> str:
        return client.completions.create(model=model_name, prompt="My favourite animal is",
                                         max_tokens=10, temperature=1.0, seed=seed,
                                         extra_body={"ignore_eos": True}).choices[0].text

    first, again, other = sample(1234), sample(1234), sample(99)
    assert first == again
    assert first != other


def test_completion_logprobs_legacy_format(client: OpenAI, model_name: str) -> None:
    out = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=5,
                                    temperature=0, logprobs=3)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == out.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert value <= 0 and token in top and 3 <= len(top) <= 4
        assert value == pytest.approx(max(top.values()))  # greedy picks the top token


@pytest.mark.parametrize("echo", [False, True])
def test_streamed_completion_logprobs_match_the_whole(client: OpenAI, model_name: str,
                                                      echo: bool) -> None:
    """Streamed legacy logprobs add up to the whole response's, text_offset too where a stop
    string holds text back (the fuzzing found a stream's offsets lagging by the held-back
    characters: [0, 0, 0, 2, ...] against [0, 2, 4, 6, ...])."""
    whole = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=12,
                                      temperature=0, logprobs=1, echo=echo).choices[0]
    stop = whole.text[len(whole.text) * 3 // 4:][:3]  # a late stop: earlier text waits for it
    kwargs = dict(model=model_name, prompt=PROMPT, max_tokens=12, temperature=0, logprobs=1,
                  echo=echo, stop=[stop])
    want = client.completions.create(**kwargs).choices[0].logprobs
    got = {"tokens": [], "token_logprobs": [], "text_offset": []}
    for chunk in client.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            if c.logprobs is not None:
                for key in got:
                    got[key] += getattr(c.logprobs, key)
    assert got["tokens"] == want.tokens and got["text_offset"] == want.text_offset
    assert got["token_logprobs"] == pytest.approx(want.token_logprobs, abs=1e-6)
    assert want.text_offset == [sum(len(t) for t in want.tokens[:i])
                                for i in range(len(want.tokens))]


def test_completion_echo_with_logprobs(client: OpenAI, server: ServerProcess,
                                       model_name: str) -> None:
    out = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=3,
                                    temperature=0, echo=True, logprobs=1)
    choice = out.choices[0]
    n_prompt = len(_tokens(server, PROMPT))
    assert choice.text.startswith(PROMPT) and len(choice.text) > len(PROMPT)
    assert len(choice.logprobs.tokens) == n_prompt + 3
    assert choice.logprobs.token_logprobs[0] is None
    assert all(v is not None for v in choice.logprobs.token_logprobs[1:])
    texts, _, _ = _stream_completion(client, model=model_name, prompt=PROMPT, max_tokens=3,
                                     temperature=0, echo=True)
    assert texts == {0: choice.text}


def test_chat_logprobs_format(client: OpenAI, model_name: str) -> None:
    out = client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=4,
                                         temperature=0, logprobs=True, top_logprobs=3)
    content = out.choices[0].logprobs.content
    assert "".join(t.token for t in content) == out.choices[0].message.content
    for t in content:
        assert t.bytes == list(t.token.encode()) and len(t.top_logprobs) == 3
        assert t.logprob == pytest.approx(t.top_logprobs[0].logprob)
    _, _, _, chunks = _stream_chat(client, model=model_name, messages=MESSAGES, max_tokens=4,
                                   temperature=0, logprobs=True, top_logprobs=3)
    streamed = [t.token for c in chunks for ch in c.choices if ch.logprobs
                for t in ch.logprobs.content]
    assert streamed == [t.token for t in content]


def test_stop_string_never_leaks(client: OpenAI, model_name: str) -> None:
    args = dict(model=model_name, prompt="1, 2, 3, 4, 5,", max_tokens=20, temperature=0)
    free = client.completions.create(**args).choices[0].text  # type: ignore[call-overload]
    assert " 7," in free, free
    stop = " 7,"
    out = client.completions.create(stop=[stop, "nowhere"], **args)  # type: ignore[call-overload]
    choice = out.choices[0]
    assert choice.finish_reason == "stop" and choice.text == free[: free.index(stop)]
    texts, finish, _ = _stream_completion(client, stop=stop, **args)
    assert texts == {0: choice.text} and finish == {0: "stop"}
    kept = client.completions.create(stop=stop, extra_body={"include_stop_str_in_output": True},
                                     **args)  # type: ignore[call-overload]
    assert kept.choices[0].text == choice.text + stop


def test_chat_multi_turn_and_text_parts(client: OpenAI, model_name: str) -> None:
    messages = [
        {"role": "system", "content": [{"type": "text", "text": "Answer briefly."}]},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello. How can I help?"},
        {"role": "user", "content": [{"type": "text", "text": "What is "},
                                     {"type": "text", "text": "2+2?"}]},
    ]
    out = client.chat.completions.create(model=model_name, messages=messages, max_tokens=8,
                                         temperature=0, presence_penalty=0.5,
                                         frequency_penalty=0.5, logit_bias={"28": -5},
                                         extra_body={"top_k": 5, "min_p": 0.01,
                                                     "repetition_penalty": 1.1})
    assert out.choices[0].message.content and out.usage.prompt_tokens > 20


def test_completion_prompt_forms(client: OpenAI, server: ServerProcess, model_name: str) -> None:
    ids = _tokens(server, PROMPT)
    by_text = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=5,
                                        temperature=0)
    by_ids = client.completions.create(model=model_name, prompt=ids, max_tokens=5, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    many = client.completions.create(model=model_name, prompt=[PROMPT, "Water is"], max_tokens=5,
                                     temperature=0, n=2)
    assert [c.index for c in sorted(many.choices, key=lambda c: c.index)] == [0, 1, 2, 3]
    assert {c.text for c in many.choices if c.index < 2} == {by_text.choices[0].text}
    many_ids = client.completions.create(model=model_name, prompt=[ids, ids], max_tokens=5,
                                         temperature=0)
    assert [c.text for c in many_ids.choices] == [by_text.choices[0].text] * 2
    assert many_ids.usage.prompt_tokens == 2 * len(ids)


def test_stop_token_ids_and_min_tokens(client: OpenAI, server: ServerProcess,
                                       model_name: str) -> None:
    free = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=8,
                                     temperature=0, logprobs=0)
    second = _tokens(server, free.choices[0].logprobs.tokens[1])
    out = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=8,
                                    temperature=0, extra_body={"stop_token_ids": second})
    assert out.choices[0].finish_reason == "stop" and out.usage.completion_tokens == 2
    forced = client.completions.create(model=model_name, prompt="Hi", max_tokens=6,
                                       temperature=0, extra_body={"min_tokens": 6})
    assert forced.usage.completion_tokens == 6


def test_allowed_tokens_bad_words_and_truncation(client: OpenAI, server: ServerProcess,
                                                 model_name: str) -> None:
    """vLLM's allowed_token_ids, bad_words and truncate_prompt_tokens on completions, chat and
    embeddings; bad values are 400s naming the field."""
    free = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=8,
                                     temperature=0)
    assert "Paris" in free.choices[0].text
    out = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=8,
                                    temperature=0, extra_body={"bad_words": ["Paris"]})
    assert "Paris" not in out.choices[0].text
    allowed = _tokens(server, " the") + _tokens(server, ".")
    only = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=6, logprobs=0,
                                     temperature=1.0, seed=1,
                                     extra_body={"allowed_token_ids": allowed})
    assert set(only.choices[0].logprobs.tokens) <= {" the", "."}
    long = "word " * 20000 + PROMPT  # past max_model_len: refused unless truncated
    with pytest.raises(BadRequestError, match="max_model_len"):
        client.completions.create(model=model_name, prompt=long, max_tokens=4)
    cut = client.completions.create(model=model_name, prompt=long, max_tokens=4, echo=True,
                                    temperature=0, extra_body={"truncate_prompt_tokens": 8})
    tail = _tokens(server, "word " * 20 + PROMPT)[-8:]  # (/tokenize refuses `long` too)
    alone = client.completions.create(model=model_name, prompt=tail, max_tokens=4, echo=True,
                                      temperature=0)
    assert cut.usage.prompt_tokens == 8 and cut.choices[0].text == alone.choices[0].text
    chat = client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": long}], max_tokens=2,
        extra_body={"truncate_prompt_tokens": 30})
    assert chat.usage.prompt_tokens == 30
    emb = client.embeddings.create(model=model_name, input=long,
                                   extra_body={"truncate_prompt_tokens": 10})
    assert emb.usage.prompt_tokens == 10
    for bad, param in (({"allowed_token_ids": [10**7]}, "allowed_token_ids"),
                       ({"bad_words": [""]}, "bad_words"),
                       ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens")):
        with pytest.raises(BadRequestError) as e:
            client.completions.create(model=model_name, prompt=PROMPT, max_tokens=2,
                                      extra_body=bad)
        assert e.value.body["param"] == param


def test_vllm_prompt_logprobs(client: OpenAI, server: ServerProcess, model_name: str) -> None:
    """vLLM's prompt_logprobs: per prompt token None (the first) or {id: {logprob, rank,
    decoded_token}} for it and the top N; the same values as echo's legacy logprobs; on chat
    at the top level; a 400 with stream."""
    ids = _tokens(server, PROMPT)
    r = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=2, temperature=0,
                                  echo=True, logprobs=1, extra_body={"prompt_logprobs": 3})
    choice = r.model_dump()["choices"][0]
    plp, legacy = choice["prompt_logprobs"], choice["logprobs"]
    assert len(plp) == len(ids) and plp[0] is None
    for i, (tid, entry) in enumerate(zip(ids[1:], plp[1:]), start=1):
        assert str(tid) in entry and 3 <= len(entry) <= 4  # the token itself and the top 3
        assert entry[str(tid)]["logprob"] == pytest.approx(legacy["token_logprobs"][i])
        assert {1, 2, 3} <= {e["rank"] for e in entry.values()}
        assert len(legacy["top_logprobs"][i]) <= 2  # echo's own top 1 (and the token)
    chat = client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=2,
                                          extra_body={"prompt_logprobs": 0})
    assert len(chat.model_dump()["prompt_logprobs"]) == chat.usage.prompt_tokens
    with pytest.raises(BadRequestError) as e:
        client.completions.create(model=model_name, prompt=PROMPT, max_tokens=2, stream=True,
                                  extra_body={"prompt_logprobs": 1})
    assert e.value.body["param"] == "prompt_logprobs"


def test_return_tokens_as_token_ids(client: OpenAI, model_name: str) -> None:
    """vLLM's return_tokens_as_token_ids: logprobs name tokens "token_id:N", the same tokens
    and values as by their text, on completions (streamed too) and chat."""
    kw = dict(model=model_name, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2)
    text = client.completions.create(**kw).choices[0].logprobs
    ids = client.completions.create(
        **kw, extra_body={"return_tokens_as_token_ids": True}).choices[0].logprobs
    assert all(t.startswith("token_id:") for t in ids.tokens)
    assert ids.token_logprobs == text.token_logprobs and ids.text_offset == text.text_offset
    assert all(set(top) >= {tok} for top, tok in zip(ids.top_logprobs, ids.tokens))
    streamed = [t for chunk in client.completions.create(
        **kw, stream=True, extra_body={"return_tokens_as_token_ids": True})
        for c in chunk.choices if c.logprobs for t in c.logprobs.tokens]
    assert streamed == ids.tokens
    chat = client.chat.completions.create(
        model=model_name, messages=MESSAGES, max_tokens=4, temperature=0, logprobs=True,
        top_logprobs=1, extra_body={"return_tokens_as_token_ids": True})
    content = chat.choices[0].logprobs.content
    assert content and all(e.token.startswith("token_id:") for e in content)
    assert all(e.top_logprobs[0].token.startswith("token_id:") for e in content)


def test_small_endpoints(server: ServerProcess, model_name: str) -> None:
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    assert httpx.get(f"{server.url}/version").json() == {"version": __version__}
    models = httpx.get(f"{server.url}/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == model_name
    assert models["data"][0]["max_model_len"] == 1024
    tok = httpx.post(f"{server.url}/tokenize", json={"prompt": "Hello world"}).json()
    assert tok["count"] == len(tok["tokens"]) == 2
    detok = httpx.post(f"{server.url}/detokenize", json={"tokens": tok["tokens"]}).json()
    assert detok == {"prompt": "Hello world"}


def test_echo_with_zero_max_tokens_scores_the_prompt(client: OpenAI, server: ServerProcess,
                                                     model_name: str) -> None:
    out = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=0, echo=True,
                                    logprobs=2, temperature=0)
    choice = out.choices[0]
    n_prompt = len(_tokens(server, PROMPT))
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert len(choice.logprobs.tokens) == n_prompt and out.usage.completion_tokens == 0
    texts, finish, usage = _stream_completion(client, model=model_name, prompt=PROMPT,
                                              max_tokens=0, echo=True, temperature=0,
                                              stream_options={"include_usage": True})
    assert texts == {0: PROMPT} and finish == {0: "length"} and usage.completion_tokens == 0


def test_chat_template_options(client: OpenAI, server: ServerProcess, model_name: str) -> None:
    """vLLM's chat extras: add_generation_prompt, continue_final_message (an assistant prefill
    the model continues) and chat_template_kwargs, on /v1/chat/completions and /tokenize."""
    def rendered(**options: object) -> list[int]:
        r = httpx.post(f"{server.url}/tokenize", json={"messages": messages, **options})
        assert r.status_code == 200, r.text
        return r.json()["tokens"]

    messages = [*MESSAGES, {"role": "assistant", "content": "Red, green and"}]
    opened = rendered()  # the default: a new assistant turn after the prefill's own
    closed = rendered(add_generation_prompt=False)
    prefill = rendered(add_generation_prompt=False, continue_final_message=True)
    assert opened[: len(closed)] == closed and len(opened) > len(closed)
    assert closed[: len(prefill)] == prefill and len(closed) > len(prefill)  # no end of turn
    text = httpx.post(f"{server.url}/detokenize", json={"tokens": prefill}).json()["prompt"]
    assert text.endswith("Red, green and")
    assert rendered(chat_template_kwargs={"enable_thinking": False}) == opened  # unused here

    out = client.chat.completions.create(
        model=model_name, messages=messages, max_completion_tokens=6, temperature=0,
        extra_body={"add_generation_prompt": False, "continue_final_message": True})
    same = client.completions.create(model=model_name, prompt=prefill, max_tokens=6,
                                     temperature=0)
    assert out.choices[0].message.content == same.choices[0].text  # the prefill continued
    assert out.usage.prompt_tokens == len(prefill)

    for options, param in (({"continue_final_message": True}, "continue_final_message"),
                           ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
                           ({"chat_template_kwargs": {"add_generation_prompt": False}},
                            "chat_template_kwargs")):
        r = httpx.post(f"{server.url}/v1/chat/completions",
                       json={"model": model_name, "messages": messages, **options})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_chat_prediction(client: OpenAI, server: ServerProcess, model_name: str) -> None:
    """OpenAI's predicted outputs on the default server (no --speculative-config): the reply
    is the one without a prediction, usage counts the prediction's tokens accepted and
    rejected as drafts (whole and streamed, text or text parts); a malformed one is a 400."""
    import openai

    messages = [{"role": "user", "content": "Copy this list exactly, one item per line:\n"
                 "- apples: 3 kg\n- bread: 2 loaves\n- milk: 1 litre\n- eggs: 12\n"}]
    kw = dict(model=model_name, messages=messages, max_tokens=48, temperature=0)
    base = client.chat.completions.create(**kw)
    text = base.choices[0].message.content
    assert base.usage.completion_tokens_details is None
    got = client.chat.completions.create(**kw, prediction={"type": "content", "content": text})
    assert got.choices[0].message.content == text
    details = got.usage.completion_tokens_details
    assert details.accepted_prediction_tokens > base.usage.completion_tokens // 2
    assert details.rejected_prediction_tokens >= 0
    parts = [{"type": "text", "text": text[:10]}, {"type": "text",
                                                   "text": text[10:].replace("milk", "tea")}]
    chunks = list(client.chat.completions.create(
        **kw, stream=True, stream_options={"include_usage": True},
        prediction={"type": "content", "content": parts}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    details = chunks[-1].usage.completion_tokens_details
    assert details.accepted_prediction_tokens > 0 and details.rejected_prediction_tokens > 0
    assert server.wait_idle()["loom:spec_decode_num_accepted_tokens_total"] > 0
    for bad in ({"type": "text", "content": "x"}, {"type": "content"},
                {"type": "content", "content": 5}):
        with pytest.raises(openai.BadRequestError, match="prediction"):
            client.chat.completions.create(**kw, prediction=bad)
