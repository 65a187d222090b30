"""Fixtures for server tests: one shared default server per session (start-up is the slow part)
and the offline reference engine. Every server started is stopped at the end of the session."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from openai import AsyncOpenAI, OpenAI

from tests.server.utils import ENGINE_ARGS, ServerProcess

_started: list[ServerProcess] = []


def start_server(args: list[str], env: dict[str, str] | None = None) -> ServerProcess:
    server = ServerProcess(args, env)
    _started.append(server)
    return server.start()


@pytest.fixture(scope="session", autouse=True)
def _stop_all_servers() -> Iterator[None]:
    """Autouse teardown: no server outlives the session, whatever failed."""
    yield
    for server in _started:
        server.stop()


@pytest.fixture(scope="session")
def server() -> ServerProcess:
    """The default server: packaged SmolLM2, small KV cache, default flags otherwise."""
    return start_server([*ENGINE_ARGS, "--max-num-seqs", "64"])


@pytest.fixture(autouse=True)
def _server_still_alive(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test must never crash the shared server."""
    yield
    if "server" in request.fixturenames:
        srv: ServerProcess = request.getfixturevalue("server")
        assert srv.alive, f"the server died:\n{srv.log()}"


@pytest.fixture(scope="session")
def client(server: ServerProcess) -> OpenAI:
    return OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=300, max_retries=0)


@pytest.fixture
def async_client(server: ServerProcess) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=300,
                       max_retries=0)


@pytest.fixture(scope="session")
def model_name(client: OpenAI) -> str:
    return client.models.list().data[0].id
