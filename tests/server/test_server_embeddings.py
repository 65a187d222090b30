"""POST /v1/embeddings through `loom serve` (a tiny Qwen3 with SmolLM2's tokenizer), driven by
the official client: strings, lists, token ids, float and base64 equal LLM.embed's vectors;
bad input is a 400 in OpenAI's error envelope."""

from __future__ import annotations

import numpy as np
import openai
import pytest
from openai import OpenAI

from tests.server.conftest import start_server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    from tests.tiny_models import make_tiny_chat_model

    return make_tiny_chat_model("qwen3", tmp_path_factory.mktemp("emb") / "qwen3",
                                vocab_size=49152)  # the tokenizer's


@pytest.fixture(scope="module")
def emb_client(tiny_folder) -> OpenAI:
    server = start_server([str(tiny_folder), "--max-model-len", "64", "--dtype", "float32",
                           "--served-model-name", "tiny"])
    return OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def offline(tiny_folder):
    from loom.engine.llm import LLM

    llm = LLM(str(tiny_folder), dtype="float32", max_model_len=64)
    return lambda prompts: np.array([o.embedding for o in llm.embed(prompts, use_tqdm=False)])


def test_embeddings_equal_llm_embed(emb_client: OpenAI, offline) -> None:
    texts = ["Hello there", "a longer sentence to embed, with more tokens"]
    out = emb_client.embeddings.create(model="tiny", input=texts, encoding_format="float")
    got = np.array([d.embedding for d in out.data])
    assert [d.index for d in out.data] == [0, 1]
    assert got.shape == (2, 64)
    np.testing.assert_allclose(got, offline(texts), atol=1e-5)
    assert out.usage.prompt_tokens == out.usage.total_tokens > 4
    # the official client asks for base64 by default and decodes it to the same floats
    b64 = emb_client.embeddings.create(model="tiny", input="Hello there")
    np.testing.assert_allclose(b64.data[0].embedding, got[0], atol=1e-6)
    ids = emb_client.embeddings.create(model="tiny", input=[[1, 2, 3], [4, 5]],
                                       encoding_format="float")
    np.testing.assert_allclose([d.embedding for d in ids.data], offline([[1, 2, 3], [4, 5]]),
                               atol=1e-5)
    assert ids.usage.prompt_tokens == 5


@pytest.mark.parametrize("kwargs,param", [
    (dict(input="hi", dimensions=32), "dimensions"),
    (dict(input=[]), "input"),
    (dict(input=[[]]), "input"),
    (dict(input=[10**6]), "prompt"),  # out of the vocabulary
    (dict(input="hi", encoding_format="int8"), "encoding_format"),
])
def test_bad_embedding_requests_are_400(emb_client: OpenAI, kwargs, param) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        emb_client.embeddings.create(model="tiny", **kwargs)
    assert e.value.status_code == 400
    assert param in str(e.value.body)


def test_unknown_model_is_404(emb_client: OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        emb_client.embeddings.create(model="nope", input="hi")
