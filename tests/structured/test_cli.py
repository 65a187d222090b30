"""`loom generate` with llama.cpp-style constraint flags, end to end on the packaged model."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import jsonschema
import pytest

pytestmark = pytest.mark.slow  # `loom generate` subprocesses on the packaged SmolLM2


def _loom(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "loom.entrypoints.cli", "generate",
                           "--max-model-len", "512", *args],
                          capture_output=True, text=True, timeout=600, check=False)


def test_generate_with_constraints(tmp_path) -> None:
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]},
              "confidence": {"type": "integer", "minimum": 0, "maximum": 100}},
              "required": ["answer", "confidence"]}
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    prompts = tmp_path / "in.jsonl"
    prompts.write_text(json.dumps({"messages": [{"role": "user", "content": "Is ice cold?"}]})
                       + "\n")
    r = _loom("--input", str(prompts), "--json-schema", f"@{path}", "--max-tokens", "40")
    assert r.returncode == 0, r.stderr
    record = json.loads(r.stdout.splitlines()[0])
    jsonschema.validate(json.loads(record["outputs"][0]["text"]), schema)
    r = _loom("Pick a colour:", "--choice", "red", "--choice", "blue", "--temperature", "1",
              "--n", "3", "--max-tokens", "5")
    assert r.returncode == 0, r.stderr
    assert all(o["text"] in ("red", "blue") for o in json.loads(r.stdout)["outputs"])
    r = _loom("Year:", "--regex", "(19|20)[0-9]{2}", "--max-tokens", "8")
    assert re.fullmatch("(19|20)[0-9]{2}", json.loads(r.stdout)["outputs"][0]["text"])


def test_generate_bad_constraints_exit_with_a_message() -> None:
    r = _loom("x", "--regex", "a(b")
    assert r.returncode != 0 and "invalid regex" in r.stderr
    r = _loom("x", "--regex", "a", "--choice", "b")
    assert r.returncode != 0 and "exactly one" in r.stderr
    r = _loom("x", "--grammar", "@/nonexistent/g.lark")
    assert r.returncode != 0 and "cannot read" in r.stderr
