"""`loom serve` on the real Gemma 3 270M Q4_K_M GGUF (PyPI parts): completions give
transformers' greedy text, chat renders Gemma's turn format and stops at <end_of_turn>."""

from __future__ import annotations

import httpx
import pytest
from openai import OpenAI

from tests.gguf_files import gemma3_gguf_path
from tests.server.conftest import start_server
from tests.server.utils import ENGINE_ARGS, ServerProcess

pytestmark = pytest.mark.slow

# transformers' Gemma3ForCausalLM, greedy, fp32, on the same file (20 tokens)
FRANCE = (" the capital of the country of France. It is the largest city in France and the "
          "second largest city")


@pytest.fixture(scope="module")
def gemma_server() -> ServerProcess:
    return start_server([str(gemma3_gguf_path()), *ENGINE_ARGS])


@pytest.fixture(scope="module")
def gemma_client(gemma_server: ServerProcess) -> OpenAI:
    return OpenAI(base_url=f"{gemma_server.url}/v1", api_key="unused", timeout=300, max_retries=0)


def test_gemma_completion_is_transformers_greedy(gemma_client: OpenAI) -> None:
    model = gemma_client.models.list().data[0].id
    out = gemma_client.completions.create(model=model, prompt="The capital of France is",
                                          max_tokens=20, temperature=0)
    assert out.choices[0].text == FRANCE
    assert out.choices[0].finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (6, 20)  # <bos> + 5


def test_gemma_add_special_tokens(gemma_client: OpenAI) -> None:
    """vLLM's add_special_tokens: completions add Gemma's <bos> unless told not to (the same
    text then follows the prompt without it); chat adds another on top of the template's only
    when asked."""
    model = gemma_client.models.list().data[0].id
    kw = dict(model=model, prompt="The capital of France is", max_tokens=4, temperature=0)
    without = gemma_client.completions.create(**kw, extra_body={"add_special_tokens": False})
    assert without.usage.prompt_tokens == 5
    chat = dict(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=1)
    assert gemma_client.chat.completions.create(**chat).usage.prompt_tokens == 10
    doubled = gemma_client.chat.completions.create(**chat,
                                                   extra_body={"add_special_tokens": True})
    assert doubled.usage.prompt_tokens == 11


def test_gemma_chat_uses_the_turn_template(gemma_client: OpenAI,
                                            gemma_server: ServerProcess) -> None:
    model = gemma_client.models.list().data[0].id
    out = gemma_client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=64, temperature=0)
    # <bos> <start_of_turn> user \n Hi <end_of_turn> \n <start_of_turn> model \n
    assert out.usage.prompt_tokens == 10
    choice = out.choices[0]
    assert choice.message.content and "<end_of_turn>" not in choice.message.content
    assert choice.finish_reason in ("stop", "length")
    # This small model talks past 64 tokens above; pushed to end its turn, it stops there.
    end_of_turn = httpx.post(f"{gemma_server.url}/tokenize", json={
        "prompt": "<end_of_turn>", "add_special_tokens": False}).json()["tokens"]
    assert len(end_of_turn) == 1
    out = gemma_client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=64, temperature=0,
        logit_bias={str(end_of_turn[0]): 100})
    assert (out.choices[0].finish_reason, out.choices[0].message.content) == ("stop", "")
    assert out.usage.completion_tokens == 1
