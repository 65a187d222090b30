"""The chat page and the dashboard of `loom serve`, in a real headless Chromium.

One server and one browser for the module. Screenshots go to the test's tmp folder, and to
docs/ (web_chat.png, dashboard.png) when LOOM_SCREENSHOTS=docs.
"""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from tests.product.browser import start_chromium
from tests.server.utils import ENGINE_ARGS, ROOT, ServerProcess

pytestmark = pytest.mark.slow
WAIT_S = 120


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    srv = ServerProcess([*ENGINE_ARGS, "--max-num-seqs", "8",
                         "--reasoning-parser", "deepseek_r1"]).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def browser():  # noqa: ANN201
    driver = start_chromium()
    yield driver
    driver.quit()


def _wait(driver, condition, timeout: float = WAIT_S, message: str = ""):  # noqa: ANN001, ANN202
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout, poll_frequency=0.05).until(condition, message)


def _by_id(driver, element_id: str):  # noqa: ANN001, ANN202
    from selenium.webdriver.common.by import By

    return driver.find_element(By.ID, element_id)


def _assistant(driver) -> list:  # noqa: ANN001
    from selenium.webdriver.common.by import By

    return driver.find_elements(By.CSS_SELECTOR, ".msg.assistant")


def _set(driver, element_id: str, value: str) -> None:  # noqa: ANN001
    field = _by_id(driver, element_id)
    field.clear()
    field.send_keys(value)


def _screenshot(driver, tmp_path: Path, name: str) -> Path:  # noqa: ANN001
    path = tmp_path / name
    driver.save_screenshot(str(path))
    assert path.stat().st_size > 10_000  # a rendered page, not a blank one
    if os.environ.get("LOOM_SCREENSHOTS") == "docs":
        shutil.copy(path, ROOT / "docs" / name)
    return path


def _send(driver, text: str) -> None:  # noqa: ANN001
    _set(driver, "prompt", text)
    _by_id(driver, "send").click()


def test_chat_streams_stops_and_keeps_the_conversation(browser, server, tmp_path) -> None:
    d = browser
    d.get(f"{server.url}/")
    d.execute_script("localStorage.clear()")
    d.refresh()
    _wait(d, lambda d: _by_id(d, "model-label").text == "smollm2", message="model not listed")
    _by_id(d, "settings-toggle").click()
    _set(d, "temperature", "0")
    _set(d, "max-tokens", "48")

    # 1. The answer streams: text shows while the message is still marked streaming.
    _send(d, "Write a Python function that adds two numbers, in a code block.")
    _wait(d, lambda d: (len(_assistant(d)) == 1 and "streaming" in _assistant(d)[0].get_attribute(
        "class") and _assistant(d)[0].find_element("css selector", ".body").text.strip() != ""),
        message="no streamed text seen while the answer was streaming")
    _wait(d, lambda d: "tokens" in _assistant(d)[0].find_element("css selector", ".msg-stats").text)
    first = _assistant(d)[0]
    stats = first.find_element("css selector", ".msg-stats").text
    assert "48 tokens" in stats or "finish: stop" in stats, stats
    assert "tok/s" in stats and "TTFT" in stats, stats
    first_text = first.find_element("css selector", ".body").text
    assert first_text.strip()
    _screenshot(d, tmp_path, "web_chat.png")

    # 2. A second, long answer, stopped mid-way: it keeps what came, the engine drops it.
    _set(d, "max-tokens", "900")
    _send(d, "Now tell me a very long story about a lighthouse keeper.")
    _wait(d, lambda d: len(_assistant(d)) == 2 and len(
        _assistant(d)[1].find_element("css selector", ".body").text) > 20)
    _by_id(d, "stop").click()
    _wait(d, lambda d: "stopped" in _assistant(d)[1].find_element("css selector",
                                                                   ".msg-stats").text)
    assert _by_id(d, "send").is_displayed() and not _by_id(d, "stop").is_displayed()
    partial = _assistant(d)[1].find_element("css selector", ".body").text
    assert partial
    server.wait_idle()  # the abort reached the engine: nothing runs, the KV cache is free
    generated = server.metrics()["loom:generation_tokens_total"]
    assert generated < 48 + 900, generated

    # 3. After a reload the conversation is still there, with both turns.
    d.refresh()
    _wait(d, lambda d: len(_assistant(d)) == 2)
    items = d.find_elements("css selector", "#conversations li")
    assert len(items) == 1 and "Write a Python function" in items[0].text
    users = [e.text for e in d.find_elements("css selector", ".msg.user")]
    assert users == ["Write a Python function that adds two numbers, in a code block.",
                     "Now tell me a very long story about a lighthouse keeper."]
    assert _assistant(d)[0].find_element("css selector", ".body").text == first_text
    assert _assistant(d)[1].find_element("css selector", ".body").text == partial
    assert "stopped" in _assistant(d)[1].find_element("css selector", ".msg-stats").text


def test_thinking_shows_in_a_block_above_the_answer(browser, server) -> None:
    """A reply that opens with a thinking block (made so by a regex the test adds to the page's
    request body, applied to the thinking too: enable_in_reasoning): the page shows its
    reasoning_content in a "Thinking" block, escaped, and the answer below it; the thinking is
    not sent back as part of the conversation."""
    d = browser
    d.get(f"{server.url}/")
    d.execute_script("localStorage.clear()")
    d.refresh()
    _wait(d, lambda d: _by_id(d, "model-label").text == "smollm2", message="model not listed")
    d.execute_script(
        "const plain = requestBody; window.bodies = [];"
        "requestBody = (c) => { const b = { ...plain(c), temperature: 0, max_tokens: 48,"
        "  structured_outputs: { regex: arguments[0], enable_in_reasoning: true } };"
        "  window.bodies.push(b); return b; };",
        "<think>[a-z <]{8,24}</think>\n[A-Z][a-z ]{3,20}\\.")
    _send(d, "Is the sky blue?")
    _wait(d, lambda d: len(_assistant(d)) == 1 and "tokens" in _assistant(d)[0].find_element(
        "css selector", ".msg-stats").text, message="no finished answer")
    body = _assistant(d)[0].find_element("css selector", ".body")
    thinking = body.find_elements("css selector", "details.thinking")
    assert len(thinking) == 1 and thinking[0].text.startswith("Thinking")
    assert d.execute_script("return arguments[0].querySelector('div').textContent",
                            thinking[0]).strip()
    assert not body.find_elements("css selector", "details.thinking script, details.thinking b")
    answer = d.execute_script("return [...arguments[0].childNodes].filter(n => n.tagName !== "
                              "'DETAILS').map(n => n.textContent).join('')", body)
    assert answer.strip()[0].isupper() and answer.strip().endswith(".") and "think" not in answer
    _send(d, "And the grass?")
    _wait(d, lambda d: d.execute_script("return window.bodies.length") == 2)
    sent = d.execute_script("return window.bodies[1].messages")
    assert all("think" not in (m.get("content") or "") for m in sent), sent


def test_terminal_chat_shows_split_thinking_as_the_model_wrote_it(server) -> None:
    """`loom chat --url` against a server that splits thinking off: the streamed answer is the
    model's own text again, thinking block and all."""
    from loom.entrypoints.chat_backends import RemoteBackend

    settings = {"temperature": 0, "max_tokens": 48, "structured_outputs": {
        "regex": "<think>[a-z ]{8,24}</think>\n\n[A-Z][a-z ]{3,20}\\.",
        "enable_in_reasoning": True}}  # (a grammar that writes the thinking too)
    text = "".join(RemoteBackend(server.url).stream(
        [{"role": "user", "content": "Is the sky blue?"}], settings, lambda: False))
    thought, _, answer = text.partition("</think>\n\n")
    assert thought.startswith("<think>") and len(thought) > len("<think>") + 7
    assert answer and answer[0].isupper() and answer.endswith("."), text


def test_markdown_is_escaped(browser, server) -> None:
    d = browser
    d.get(f"{server.url}/")
    html = d.execute_script("return LoomMarkdown.render(arguments[0])",
                            "<script>alert(1)</script> <img src=x onerror=alert(2)> **bold** "
                            "[a](javascript:alert(3)) [b](https://example.com)\n```py\n"
                            "x = '<b>'  # c\n```")
    assert "<script" not in html and "<img" not in html
    assert "&lt;script&gt;" in html and "&lt;img" in html
    assert 'href="javascript:' not in html and 'href="https://example.com"' in html
    assert "<strong>bold</strong>" in html
    assert '<span class="tok-string">&#39;&lt;b&gt;&#39;</span>' in html
    assert '<span class="tok-comment"># c</span>' in html
    # the page forbids inline scripts and other origins even if something slipped through
    csp = httpx.get(f"{server.url}/").headers["content-security-policy"]
    assert "script-src 'self'" in csp and "default-src 'self'" in csp


def test_model_picker_when_several_models_are_served(browser, server) -> None:
    """Loom serves one model; a server listing two (a stand-in /v1/models answer in the page)
    gets a picker, and requests name the model picked."""
    from selenium.webdriver.support.ui import Select

    d = browser
    d.get(f"{server.url}/")
    _wait(d, lambda d: _by_id(d, "model-label").text == "smollm2")
    assert not _by_id(d, "model-picker").is_displayed()
    d.execute_async_script("""
        const done = arguments[arguments.length - 1], real = window.fetch;
        window.fetch = (url, opts) => url === "/v1/models"
            ? Promise.resolve(new Response(JSON.stringify({data: [{id: "smollm2"}, {id: "b"}]})))
            : real(url, opts);
        loadModels().then(done);""")
    picker = Select(_by_id(d, "model-picker"))
    assert [o.text for o in picker.options] == ["smollm2", "b"]
    assert _by_id(d, "model-picker").is_displayed() and _by_id(d, "model-label").text == ""
    picker.select_by_visible_text("b")
    assert d.execute_script("return requestBody({messages: []}).model") == "b"


def test_dashboard_shows_a_running_request(browser, server, tmp_path) -> None:
    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)
    stream = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Count from 1 to 1000."}],
        max_tokens=900, temperature=0, stream=True, extra_body={"ignore_eos": True})
    request_id: list[str] = []
    started = threading.Event()
    stop = threading.Event()

    def consume() -> None:
        for chunk in stream:
            request_id.append(chunk.id)
            started.set()
            if stop.is_set():
                break
        stream.close()

    reader = threading.Thread(target=consume, daemon=True)
    reader.start()
    try:
        assert started.wait(WAIT_S)
        d = browser
        d.get(f"{server.url}/dashboard")
        _wait(d, lambda d: _by_id(d, "running").text == "1" and any(
            row.find_element("css selector", ".state").text == "running"
            and row.find_element("css selector", ".id").text == request_id[0]
            for row in d.find_elements("css selector", "#requests tbody tr")),
            message="the streaming request never showed as running")
        assert _by_id(d, "feed-status").text == "live"
        _wait(d, lambda d: _by_id(d, "tps").text not in ("-", "0.0"))
        _screenshot(d, tmp_path, "dashboard.png")
    finally:
        stop.set()
        reader.join(WAIT_S)
    server.wait_idle()
    feed = httpx.get(f"{server.url}/dashboard/feed").json()
    assert feed["requests"] == [] and feed["now"]["running"] == 0
    assert feed["now"]["generation_tokens_total"] > 0


def test_pages_are_open_and_the_api_is_not() -> None:
    """The pages and the feed are outside the API-key check; the API is not."""
    from loom.entrypoints.openai import web
    from loom.entrypoints.openai.api_server import OPEN_PATHS

    assert {"/", "/dashboard", "/dashboard/feed", "/static/chat.js"} <= web.OPEN_PATHS
    assert web.OPEN_PATHS <= OPEN_PATHS
    assert not {"/v1/chat/completions", "/v1/models"} & OPEN_PATHS


def test_chat_in_a_terminal_against_the_server(server) -> None:
    """`loom chat --url`: the same session against this module's server."""
    from tests.product.chat_driver import drive, spawn_chat

    first, second = drive(spawn_chat(["--url", server.url]))
    assert "TTFT" in first and "tok/s" in second
    server.wait_idle()  # the answer stopped with Ctrl-C was aborted on the server too


def test_startup_says_what_it_serves(server) -> None:
    """One line: the model and its weights' format, the kernels and why, the KV cache in
    tokens, the address."""
    feed = httpx.get(f"{server.url}/dashboard/feed").json()["kv_cache"]
    tokens = (feed["num_blocks"] - 1) * feed["block_size"]
    log = server.log_path.read_text(errors="replace")
    line = next(x for x in log.splitlines() if "Loom serves " in x)
    assert f"Loom serves smollm2 at {server.url} " in line
    assert ("SmolLM2-135M-Instruct.Q4_1.gguf (LlamaForCausalLM, GGUF Q4_1 weights kept as int8 "
            "groups of 32 (exact)") in line
    assert "| kernels: " in line and f"| KV cache: {tokens} tokens (" in line
