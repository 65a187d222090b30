"""Engine and server flags generated from their dataclasses, and defaults that depend on where
the engine runs."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from loom.engine.arg_utils import add_dataclass_args, flag_fields, flags_set, from_namespace
from loom.engine.args import SERVE_CPU_BATCHED_TOKENS, EngineArgs
from loom.entrypoints.cli import build_parser
from loom.entrypoints.openai.server_args import ServerArgs


def _parser(*classes: type) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(exit_on_error=False)
    for cls in classes:
        add_dataclass_args(p, cls, positional=("model",))
    return p


def test_cli_step_budget_is_smaller_on_the_cpu_unless_given() -> None:
    """`loom serve` leaves the step budget unset: 512 tokens on the CPU (a long prefill step
    stalls every running stream), 2048 on CUDA; the LLM class keeps 2048; a given value wins."""
    p = _parser(EngineArgs)
    args = from_namespace(EngineArgs, p.parse_args(["m"]))
    assert args.max_num_batched_tokens is None
    assert args.resolved_max_num_batched_tokens("cpu") == SERVE_CPU_BATCHED_TOKENS == 512
    assert args.resolved_max_num_batched_tokens("cuda") == 2048
    given = from_namespace(EngineArgs, p.parse_args(["m", "--max-num-batched-tokens", "96"]))
    assert given.resolved_max_num_batched_tokens("cpu") == 96
    assert EngineArgs().resolved_max_num_batched_tokens("cpu") == 2048


@pytest.mark.parametrize("cls", [EngineArgs, ServerArgs])
def test_no_flags_give_the_dataclass_defaults(cls: type) -> None:
    """Every field is a flag, and parsing nothing gives the Python defaults (the step budget,
    whose command-line default is its own, aside)."""
    assert {f.name for f in flag_fields(cls)} == {f.name for f in dataclasses.fields(cls)}
    parsed = from_namespace(cls, _parser(cls).parse_args([]))
    expected = cls()
    if cls is EngineArgs:
        expected = dataclasses.replace(expected, max_num_batched_tokens=None)
    assert parsed == expected


@pytest.mark.parametrize("argv,field,value", [
    (["--dtype", "bfloat16"], "dtype", "bfloat16"),
    (["--no-enable-prefix-caching"], "enable_prefix_caching", False),
    (["--kv-cache-dtype", "int8"], "kv_cache_dtype", "int8"),
    (["--num-threads", "3"], "num_threads", 3),
    (["--max-model-len", "512"], "max_model_len", 512),
    (["--chat-template", "{{ messages }}"], "chat_template", "{{ messages }}"),
    (["--disable-log-requests"], "disable_log_requests", True),
    (["--timeout-graceful-shutdown", "2.5"], "timeout_graceful_shutdown", 2.5),
    (["--port", "9"], "port", 9),
])
def test_a_flag_sets_its_field(argv: list[str], field: str, value: object) -> None:
    ns = _parser(EngineArgs, ServerArgs).parse_args(argv)
    built = [from_namespace(EngineArgs, ns), from_namespace(ServerArgs, ns)]
    assert [getattr(b, field) for b in built if hasattr(b, field)] == [value]


def test_chat_template_file(tmp_path) -> None:
    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    ns = _parser(EngineArgs).parse_args(["--chat-template", str(path)])
    assert from_namespace(EngineArgs, ns).chat_template == path.read_text()


@pytest.mark.parametrize("argv,message", [
    (["serve", "--num-threads", "0"], "--num-threads: must be at least 1, got 0"),
    (["serve", "--max-waiting-requests", "-1"], "must be at least 0, got -1"),
    (["serve", "--timeout-graceful-shutdown", "nan"], "must be at least 0, got nan"),
    (["serve", "--dtype", "int3"], "invalid choice: 'int3'"),
    (["generate", "--chat-template", "/nonexistent/t.jinja"], "cannot read the chat template"),
    (["generate", "--served-model-name", "x"], "unrecognized arguments"),
])
def test_bad_flags_are_usage_errors(argv: list[str], message: str, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_serve_help_is_grouped(capsys) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    out = capsys.readouterr().out
    sections = ["model:", "cache:", "scheduler:", "quantization and kernels:", "server:"]
    positions = [out.index(f"\n{s}\n") for s in sections]
    assert positions == sorted(positions)
    server = out[positions[-1]:]
    assert "--served-model-name" in server and "--port" in server and "(default: 8000)" in server


def test_flags_set_names_what_the_user_gave() -> None:
    ns = build_parser().parse_args(["serve", "--max-num-seqs", "4", "--no-enable-prefix-caching"])
    assert flags_set(EngineArgs, ns) == ["--max-num-seqs", "--enable-prefix-caching"]
    assert flags_set(EngineArgs, build_parser().parse_args(["serve"])) == []


def test_chat_with_url_refuses_engine_flags() -> None:
    """`loom chat --url` talks to a server with its own engine: an engine flag would be
    ignored, so it is an error (raised before any connection)."""
    from loom.entrypoints.cli import main

    with pytest.raises(SystemExit, match="--quantization configure a local engine"):
        main(["chat", "--url", "http://127.0.0.1:9", "--quantization", "none"])
