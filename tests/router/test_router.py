"""`loom router` over real `loom serve` replicas (tiny random Llama, SmolLM2's tokenizer):
prefix-cache affinity beats round robin on shared system prompts, a replica killed mid-run
loses no request that had not started streaming, and the router's own errors are OpenAI's."""

from __future__ import annotations

import concurrent.futures as cf
import signal
from collections.abc import Iterator

import anthropic
import httpx
import openai
from openai import OpenAI
import pytest

from tests.router.utils import (
    RouterProcess, free_port, hit_counts, replica, run_workload, tiny_chat_model, wait_for,
)
from tests.server.utils import ServerProcess

pytestmark = pytest.mark.slow

_started: list[ServerProcess] = []


def _start(proc: ServerProcess) -> ServerProcess:
    _started.append(proc)
    return proc.start()


@pytest.fixture(scope="module", autouse=True)
def _stop_all() -> Iterator[None]:
    yield
    for p in _started:
        p.kill()


@pytest.fixture(scope="module")
def replicas() -> list[ServerProcess]:
    model = tiny_chat_model()
    procs = [replica(model) for _ in range(2)]
    with cf.ThreadPoolExecutor(2) as pool:  # the two start-ups overlap
        return list(pool.map(_start, procs))


def _router(backends: list[str], *args: str, wait_healthy: bool = True) -> RouterProcess:
    r = RouterProcess(backends, *args)
    _started.append(r)
    return r.start(wait_healthy)


def _metric(proc: ServerProcess, name: str) -> float:
    return sum(v for k, v in proc.metrics().items() if k == name)


def test_cache_aware_routing_beats_round_robin_on_shared_system_prompts(replicas) -> None:
    urls = [r.url for r in replicas]
    rates = {}
    for seed, policy in enumerate(["round_robin", "cache_aware"]):
        router = _router(urls, "--policy", policy)
        client = router.client()
        model = client.models.list().data[0].id
        before = hit_counts(replicas)
        # distinct words per policy: no prompt of one run is cached for the other
        run_workload(client, model, _chats(seed), turns=3, seed=seed)
        after = hit_counts(replicas)
        rates[policy] = (after[0] - before[0]) / (after[1] - before[1])
        served = [_metric(r, "loom:generation_tokens_total") for r in replicas]
        assert all(s > 0 for s in served), f"{policy} left a replica idle: {served}"
        router.stop()
    print("prefix-cache hit rates:", rates)
    assert rates["cache_aware"] > rates["round_robin"] + 0.1, rates


def _chats(seed: int) -> list[list[dict]]:
    from tests.router.utils import conversations

    return conversations(seed, num_systems=3, convs_per_system=2)


def test_a_replica_killed_mid_run_loses_no_request_that_had_not_streamed(replicas) -> None:
    victim = _start(replica(tiny_chat_model()))
    router = _router([replicas[0].url, victim.url], "--policy", "round_robin")
    client = router.client()
    model = client.models.list().data[0].id

    def complete(i: int) -> str:
        r = client.completions.create(model=model, prompt=f"Request {i}: tell me a story",
                                      max_tokens=400, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 400
        return r.choices[0].text

    with cf.ThreadPoolExecutor(10) as pool:
        futures = [pool.submit(complete, i) for i in range(6)]
        # kill it while it runs requests (not streamed: the router has sent nothing yet)
        wait_for(lambda: _metric(victim, "loom:num_requests_running") > 0, 60, "victim busy")
        victim.signal(signal.SIGKILL)
        victim.wait(30)
        # streams sent now may still be routed to the dead replica: retried before any byte
        streams = [pool.submit(_stream, client, model, i) for i in range(4)]
        texts = [f.result() for f in futures]
        stream_texts = [f.result() for f in streams]
    assert len(texts) == 6 and all(texts) and all(stream_texts)
    m = router.metrics()
    assert m["loom_router:retries_total"] >= 1
    assert m.get("loom_router:stream_failures_total", 0) == 0
    health = httpx.get(f"{router.url}/health").json()
    assert health["healthy_backends"] == 1 and health["backends"] == 2


def _stream(client: openai.OpenAI, model: str, i: int) -> str:
    chunks = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": f"stream {i}"}], max_tokens=16,
        temperature=0, stream=True, extra_body={"ignore_eos": True})
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_router_errors_are_openai_errors(replicas) -> None:
    router = _router([replicas[0].url])
    for body, param in [(b"{not json", None), (b"[1, 2]", None), (b'{"model": "m"}', "messages"),
                        (b'{"model": "m", "messages": []}', "messages")]:
        r = httpx.post(f"{router.url}/v1/chat/completions", content=body,
                       headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["param"] == param
    r = httpx.get(f"{router.url}/v1/nope")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    # a replica's own validation error comes back as it was sent
    client = router.client()
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=client.models.list().data[0].id, prompt="hi",
                                  max_tokens=-1)
    assert e.value.status_code == 400

    nobody = _router([f"http://127.0.0.1:{free_port()}"], wait_healthy=False)
    assert httpx.get(f"{nobody.url}/health").status_code == 503
    with pytest.raises(openai.APIStatusError) as e:
        nobody.client().chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert e.value.status_code == 503
    assert e.value.body["code"] == "no_healthy_backend"
    assert "none of 1 replicas passes its health checks" in e.value.body["message"]
    assert _metric(nobody, "loom_router:requests_total") == 1


def test_responses_continue_on_the_replica_that_stored_them(replicas) -> None:
    """/v1/responses through the router: each continuation (previous_response_id, streamed or
    not), GET and DELETE reaches the replica whose store holds the response, whichever the
    policy would pick; an id it never routed is a 404."""
    router = _router([r.url for r in replicas], "--policy", "round_robin")
    client = router.client()
    model = client.models.list().data[0].id
    previous = None
    for turn in range(6):  # round robin alternates replicas: each turn has to follow the id
        kwargs = dict(model=model, input=f"Turn {turn}", max_output_tokens=4, temperature=0,
                      previous_response_id=previous)
        if turn % 2:
            events = list(client.responses.create(stream=True, **kwargs))
            response = events[-1].response
        else:
            response = client.responses.create(**kwargs)
        assert response.status in ("completed", "incomplete")
        previous = response.id
    assert client.responses.retrieve(previous).id == previous
    client.responses.delete(previous)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(previous)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=model, input="hi", previous_response_id="resp-0")
    claude = anthropic.Anthropic(base_url=router.url, api_key="unused", max_retries=0)
    ask = [{"role": "user", "content": "Hi"}]
    assert claude.messages.create(model=model, max_tokens=4, messages=ask).usage.output_tokens
    assert claude.messages.count_tokens(model=model, messages=ask).input_tokens > 0


def test_serve_data_parallel_starts_replicas_behind_the_router() -> None:
    from prometheus_client.parser import text_string_to_metric_families

    server = _start(replica(tiny_chat_model(), "--data-parallel-size", "2"))
    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=300, max_retries=0)
    model = client.models.list().data[0].id
    msgs = [{"role": "user", "content": "Hello there"}]
    whole = client.chat.completions.create(model=model, messages=msgs, max_tokens=8,
                                           temperature=0)
    streamed = _stream_text(client, model, msgs)
    assert whole.choices[0].message.content == streamed and whole.usage.completion_tokens > 0
    text = httpx.get(f"{server.url}/metrics").text
    healthy = {s.labels["backend"]: s.value for f in text_string_to_metric_families(text)
               for s in f.samples if s.name == "loom_router:backend_healthy"}
    assert len(healthy) == 2 and all(v == 1 for v in healthy.values())
    server.signal(signal.SIGTERM)
    assert server.wait(60) == 0
    for url in healthy:  # the replicas stopped with it
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"{url}/health", timeout=2)


def _stream_text(client: OpenAI, model: str, msgs: list[dict]) -> str:
    chunks = client.chat.completions.create(model=model, messages=msgs, max_tokens=8,
                                            temperature=0, stream=True)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
