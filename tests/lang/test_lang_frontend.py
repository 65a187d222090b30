"""loom.lang's frontend without a model: expressions, chat-role rendering, state threading,
forks, joins, streaming and errors, over a small scripted backend (the model tests are in
test_lang_engine.py and test_lang_server.py)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from loom.lang import (
    Backend, ChatTemplate, ChoiceScores, GenResult, GenSpec, LangError, assistant, function, gen,
    select, system, user,
)
from loom.lang.backend import scored_span

CHATML = ("{% for m in messages %}{% if loop.first and m['role'] != 'system' %}"
          "<|im_start|>system\nDefault<|im_end|>\n{% endif %}"
          "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


class ScriptBackend(Backend):
    """Answers `gen` with "<N>" (N = the prompt's length), streamed a character at a time, and
    scores a choice by minus its length; records every prompt. Blocks generations until
    `release` is set, so a test can see that forks are in flight together."""

    def __init__(self) -> None:
        self.chat_template = ChatTemplate.from_jinja(CHATML)
        self.prompts: list[str] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.release = threading.Event()
        self.release.set()
        self._lock = threading.Lock()

    def generate(self, prompt: str, spec: GenSpec, on_delta=None) -> GenResult:
        with self._lock:
            self.prompts.append(prompt)
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        assert self.release.wait(10)
        text = f"<{len(prompt)}>"
        for ch in text:
            if on_delta is not None:
                on_delta(ch)
        with self._lock:
            self.in_flight -= 1
        return GenResult(text, "stop", len(prompt), len(text), [-0.5] * len(text))

    def score_choices(self, prompt: str, choices: Sequence[str]) -> ChoiceScores:
        return ChoiceScores.from_token_logprobs(choices, [[-1.0] * len(c) for c in choices])


def test_scored_span_starts_where_all_tokenizations_agree():
    assert scored_span([1, 2, 3], [[1, 2, 3, 4], [1, 2, 3, 5, 6]]) == 3
    # a choice merged with the prefix's last token: every choice is scored from there
    assert scored_span([1, 2, 3], [[1, 2, 9], [1, 2, 3, 5]]) == 2
    with pytest.raises(LangError, match="text before"):
        scored_span([1], [[2, 3]])


def test_role_spans_come_from_the_template():
    t = ChatTemplate.from_jinja(CHATML)
    # first message not a system one: the template's default system prompt comes with it
    assert t.role_span([], "user") == (
        "<|im_start|>system\nDefault<|im_end|>\n<|im_start|>user\n", "<|im_end|>\n")
    assert t.role_span([{"role": "system", "content": "S"}], "user") == (
        "<|im_start|>user\n", "<|im_end|>\n")
    with pytest.raises(LangError, match="unknown chat role"):
        t.role_span([], "tool")


def test_a_tokenizer_gives_its_template_or_none():
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers.models import WordLevel

    from loom.tokenizer.tokenizer import Tokenizer

    raw = RawTokenizer(WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    assert ChatTemplate.from_tokenizer(Tokenizer(backend=raw)) is None
    t = ChatTemplate.from_tokenizer(Tokenizer(backend=raw, chat_template=CHATML))
    assert t is not None and t.role_span([{"role": "system", "content": "S"}], "user") == (
        "<|im_start|>user\n", "<|im_end|>\n")


def test_roles_render_like_the_template_and_record_messages():
    @function
    def chat(s):
        s += system("Be brief.")
        s += user("Hi")
        s += assistant(gen("a"))

    state = chat.run(backend=ScriptBackend())
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    prompt = ChatTemplate.from_jinja(CHATML)._render(messages, True)
    assert state["a"] == f"<{len(prompt)}>"
    assert state.messages() == [*messages, {"role": "assistant", "content": state["a"]}]
    assert state.text() == prompt + state["a"] + "<|im_end|>\n"


def test_gen_metadata_and_concatenation():
    @function
    def prog(s, topic):
        s += "Topic: " + topic + "\n" + gen("x", max_tokens=3) + "!"

    state = prog.run("cats", backend=ScriptBackend())
    assert state.text() == "Topic: cats\n<12>!"
    meta = state.meta("x")
    assert (meta.kind, meta.prompt_tokens, meta.completion_tokens, meta.finish_reason) == (
        "gen", 12, 4, "stop")
    assert meta.logprobs == [-0.5] * 4


def test_select_picks_the_best_scored_choice_with_scores():
    @function
    def prog(s):
        s += "Pick: " + select("c", choices=["long one", "ab", "abc"])

    state = prog.run(backend=ScriptBackend())
    assert state["c"] == "ab"
    assert state.meta("c").choice_logprobs == [-8.0, -2.0, -3.0]
    assert state.text() == "Pick: ab"


def test_forks_run_together_and_join_concatenates_in_order():
    backend = ScriptBackend()
    backend.release.clear()

    @function
    def prog(s):
        s += "ctx "
        forks = s.fork(3)
        for i, f in enumerate(forks):
            f += f"b{i}:" + gen("x")
        forks.join("concat")
        s += " end"

    state = prog.run(backend=backend, stream=True)
    deadline = threading.Event()
    for _ in range(100):  # all three generations are in flight before any is released
        if backend.in_flight == 3:
            break
        deadline.wait(0.05)
    assert backend.in_flight == 3
    backend.release.set()
    assert state.text() == "ctx b0:<7>b1:<7>b2:<7> end"
    assert sorted(backend.prompts) == ["ctx b0:", "ctx b1:", "ctx b2:"]


def test_streaming_yields_the_text_as_written():
    @function
    def prog(s):
        s += "Q:" + gen("a") + " R:" + gen("b")

    state = prog.run(backend=ScriptBackend(), stream=True)
    assert "".join(state.text_iter()) == state.text() == "Q:<2> R:<8>"
    assert list(state.text_iter("b")) == ["<", "8", ">"]


def test_errors_surface_where_the_program_reads():
    with pytest.raises(LangError, match="at most one of"):
        gen("x", regex="a+", choices=["a"])
    with pytest.raises(LangError, match="non-empty"):
        select("x", choices=[])

    @function
    def bad(s):
        s += 3

    with pytest.raises(LangError, match="cannot add int"):
        bad.run(backend=ScriptBackend())

    class NoTemplate(ScriptBackend):
        def __init__(self) -> None:
            super().__init__()
            self.chat_template = None

    @function
    def chat(s):
        s += user("hi")
        s += "after"

    with pytest.raises(LangError, match="no chat template"):
        chat.run(backend=NoTemplate())
    with pytest.raises(LangError, match="does not stream"):
        next(chat.run(backend=ScriptBackend()).text_iter())
    with pytest.raises(LangError, match="no backend"):
        chat.run()


def test_run_batch_keeps_input_order():
    @function
    def prog(s, word):
        s += word + gen("x")

    states = prog.run_batch([{"word": w} for w in ["a", "bb", "ccc", "dddd"]],
                            backend=ScriptBackend(), num_threads=2)
    assert [st["x"] for st in states] == ["<1>", "<2>", "<3>", "<4>"]


class _FailingStream(BaseHTTPRequestHandler):
    """An OpenAI-compatible server whose completion stream breaks off with an in-band error
    event, as Loom's server sends one when the engine fails after the headers went out."""

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        self.rfile.read(int(self.headers["content-length"]))
        body = (b'data: {"choices": [{"index": 0, "text": "Hel", "finish_reason": null}]}\n\n'
                b'data: {"error": {"message": "the engine failed", "type": "internal_error", '
                b'"param": null, "code": 500}}\n\ndata: [DONE]\n\n')
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_an_error_event_mid_stream_fails_the_gen():
    from loom.lang import OpenAIBackend

    server = ThreadingHTTPServer(("127.0.0.1", 0), _FailingStream)
    threading.Thread(target=server.serve_forever, daemon=True).start()

    @function
    def prog(s):
        s += "Say hello:" + gen("x", max_tokens=4)

    try:
        with OpenAIBackend(f"http://127.0.0.1:{server.server_port}/v1", model="m") as backend, \
                pytest.raises(LangError, match="the engine failed"):
            prog.run(backend=backend)
    finally:
        server.shutdown()
        server.server_close()
