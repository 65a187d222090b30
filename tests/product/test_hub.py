"""Models by name: the registry and file choice (fast), and `loom pull | list | show | rm`,
then `loom serve NAME`, against a local server in the Hub's URL layout (HF_ENDPOINT)."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from loom.hub.files import RepoFilesError, gguf_tag, model_files, pick_gguf
from loom.hub.pull import file_digest
from loom.hub.registry import ModelNameError, parse_name
from loom.loader.resolve import ModelNotFoundError, default_gguf_path, resolve_model
from tests.product.hub_server import FakeHub, RepoFile
from tests.server.utils import ENGINE_ARGS, ROOT, ServerProcess

REPO = "loom-test/SmolLM2-135M-Instruct-GGUF"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
OTHER = "SmolLM2-135M-Instruct.Q4_K_M.gguf"
BAD_REPO = "loom-test/corrupt-GGUF"
STALL_REPO = "loom-test/stalled-GGUF"
STALL_AT = 45_000_000  # bytes the first transfer gets before the server hangs


@pytest.mark.parametrize("name, repo, quant", [
    ("smollm2", None, None),
    ("qwen3", "Qwen/Qwen3-0.6B-GGUF", "Q8_0"),
    ("qwen3:0.6b", "Qwen/Qwen3-0.6B-GGUF", "Q8_0"),
    ("qwen3:0.6b-q4_0", "Qwen/Qwen3-0.6B-GGUF", "Q4_0"),
    ("gemma3:270m", "ggml-org/gemma-3-270m-it-GGUF", "Q8_0"),
    ("smollm2:Q4_1", "bartowski/SmolLM2-135M-Instruct-GGUF", "Q4_1"),
    ("org/repo", "org/repo", None),
    ("org/repo:q4_k_m", "org/repo", "Q4_K_M"),
])
def test_names_parse(name: str, repo: str | None, quant: str | None) -> None:
    ref = parse_name(name)
    assert (ref.repo_id, ref.quant) == (repo, quant)


@pytest.mark.parametrize("name", ["nosuchmodel", "org/repo:latest", "a/b/c", "qwen3:banana"])
def test_bad_names_are_clear_errors(name: str) -> None:
    with pytest.raises(ModelNameError, match="model name|unknown model"):
        parse_name(name)


def test_files_picked_by_tag() -> None:
    files = ["README.md", "m-Q8_0.gguf", "m-Q4_K_M.gguf", "m-Q4_K.gguf", "mmproj-m-F16.gguf",
             "m.F16.gguf"]
    assert [gguf_tag(f) for f in files[1:]] == ["Q8_0", "Q4_K_M", "Q4_K", "F16", "F16"]
    assert pick_gguf(files, "Q4_K", "r") == "m-Q4_K.gguf"  # not Q4_K_M
    assert pick_gguf(files, None, "r") == "m-Q8_0.gguf"  # the preferred tag present
    with pytest.raises(RepoFilesError, match="no GGUF tagged Q5_1; its tags: F16, Q4_K, Q4_K_M"):
        pick_gguf(files, "Q5_1", "r")
    with pytest.raises(RepoFilesError, match="split"):
        pick_gguf(["m-Q8_0-00001-of-00002.gguf", "m-Q8_0-00002-of-00002.gguf"], "Q8_0", "r")
    hf = ["config.json", "model.safetensors", "tokenizer.json", "pytorch_model.bin", "x/y.json"]
    assert model_files(hf, None, "r") == ("hf", ["config.json", "model.safetensors",
                                                 "tokenizer.json"])
    with pytest.raises(RepoFilesError, match="neither GGUF"):
        model_files(["README.md"], None, "r")


def test_checksums_of_both_kinds(tmp_path: Path) -> None:
    f = tmp_path / "x"
    f.write_bytes(b"hello\n")
    sha256 = hashlib.sha256(b"hello\n").hexdigest()
    assert file_digest(f, sha256) == ("sha256", sha256)
    # git's blob id of "hello\n", as `git hash-object` prints it
    git = "ce013625030ba8dba906f756967f9e9ca394464a"
    assert file_digest(f, git) == ("git-sha1", git)
    assert file_digest(f, "not-a-hash") is None


def test_unpulled_name_says_pull(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ModelNotFoundError, match="loom pull qwen3:0.6b"):
        resolve_model("qwen3:0.6b")


# ---- against the Hub-layout server -----------------------------------------------------------


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[FakeHub, dict[str, str]]]:
    tmp = tmp_path_factory.mktemp("hub")
    (tmp / "README.md").write_text("# SmolLM2 135M Instruct, Q4_1\n")
    (tmp / "other.gguf").write_bytes(b"GGUF" + bytes(4096))
    fake = FakeHub(
        {REPO: {"README.md": RepoFile(tmp / "README.md", lfs=False),
                GGUF: RepoFile(default_gguf_path(), lfs=True),
                OTHER: RepoFile(tmp / "other.gguf", lfs=True)},
         BAD_REPO: {"model.Q8_0.gguf": RepoFile(tmp / "other.gguf", lfs=True)},
         STALL_REPO: {"model.Q4_1.gguf": RepoFile(default_gguf_path(), lfs=True)}},
        cut_once={f"{REPO}/{GGUF}"}, corrupt={f"{BAD_REPO}/model.Q8_0.gguf"},
        stall_once={f"{STALL_REPO}/model.Q4_1.gguf": STALL_AT})
    url = fake.start()
    env = {**os.environ, "HF_ENDPOINT": url, "HF_HOME": str(tmp / "hf"), "HF_HUB_OFFLINE": "0",
           "HF_HUB_DISABLE_TELEMETRY": "1"}
    yield fake, env
    fake.stop()


def loom(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "loom.entrypoints.cli", *args], env=env,
                          cwd=ROOT, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_pull_shows_progress_and_resumes(hub) -> None:
    fake, env = hub
    r = loom(env, "pull", f"{REPO}:Q4_1")
    assert r.returncode == 0, r.stderr
    assert GGUF in r.stderr and "100%" in r.stderr  # the progress bar reached the end
    assert "resume" in r.stderr  # the broken transfer was resumed...
    size = default_gguf_path().stat().st_size
    first, second = fake.gets(GGUF)
    assert first is None and second is not None
    start = int(second.removeprefix("bytes=").rstrip("-"))
    assert 0 < start < size  # ...from where it stopped, with a Range request
    assert fake.gets(OTHER) == []  # the other tag was not downloaded
    cached = next(Path(env["HF_HOME"]).glob(f"hub/models--*/snapshots/*/{GGUF}"))
    sha256 = RepoFile(default_gguf_path(), True).sha256
    assert file_digest(cached.resolve(), sha256) == ("sha256", sha256)
    again = loom(env, "pull", "--quiet", f"{REPO}:Q4_1")  # cached: no second download
    assert again.returncode == 0 and len(fake.gets(GGUF)) == 2


@pytest.mark.slow
def test_a_killed_pull_resumes(hub) -> None:
    """Ctrl-C in the middle of a file; the next pull asks only for the rest."""
    fake, env = hub
    # the server stalls the first GET until released: huggingface_hub's own read timeout (10 s)
    # would otherwise end the stall itself on a slow machine, resume, and finish before Ctrl-C
    env = {**env, "HF_HUB_DOWNLOAD_TIMEOUT": "600", "PYTHONFAULTHANDLER": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "loom.entrypoints.cli", "pull",
                             f"{STALL_REPO}:Q4_1"], env=env, cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            # a suite started in the background (`make test &`) runs with SIGINT
                            # ignored, which a child inherits: Python then never raises
                            # KeyboardInterrupt and Ctrl-C is lost; a terminal's pull has it
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    blobs = Path(env["HF_HOME"]) / "hub" / "models--loom-test--stalled-GGUF" / "blobs"
    deadline = time.monotonic() + 120
    while not any(p.stat().st_size > 0 for p in blobs.glob("*.incomplete")):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGABRT)  # PYTHONFAULTHANDLER: every thread's stack
        raise AssertionError(proc.communicate()[1]) from None
    fake.release.set()
    assert proc.returncode == 1 and "again resumes where it stopped" in err, err
    part = next(blobs.glob("*.incomplete"))
    kept = part.stat().st_size
    assert 0 < kept < default_gguf_path().stat().st_size
    r = loom(env, "pull", f"{STALL_REPO}:Q4_1")
    assert r.returncode == 0, r.stderr
    assert f"resuming model.Q4_1.gguf at {kept / 1e6:.1f} MB" in r.stderr
    gets = fake.gets("model.Q4_1.gguf")
    assert gets[0] is None and gets[-1] == f"bytes={kept}-"  # only the rest, the 2nd time
    assert not part.exists()
    blob = next(blobs.iterdir())
    assert file_digest(blob, blob.name) == ("sha256", blob.name)  # whole and intact


@pytest.mark.slow
def test_checksum_failure_is_reported_and_nothing_kept(hub) -> None:
    fake, env = hub
    r = loom(env, "pull", f"{BAD_REPO}:Q8_0")
    assert r.returncode == 1
    assert "checksum mismatch for model.Q8_0.gguf: sha256" in r.stderr
    assert BAD_REPO not in loom(env, "list").stdout
    assert not list(Path(env["HF_HOME"]).glob("hub/models--loom-test--corrupt-GGUF/blobs/*"))
    missing = loom(env, "pull", "loom-test/no-such-repo")
    assert missing.returncode == 1 and "not a model repo" in missing.stderr


@pytest.mark.slow
def test_serve_by_name_offline(hub) -> None:
    _, env = hub
    name = f"{REPO}:Q4_1"
    assert loom(env, "pull", "-q", name).returncode == 0
    server = ServerProcess([name, *ENGINE_ARGS], env={"HF_HOME": env["HF_HOME"],
                                                      "HF_ENDPOINT": "http://127.0.0.1:9"})
    server.start()  # HF_HUB_OFFLINE=1 there, and the endpoint unreachable
    try:
        assert httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"] == name
        r = httpx.post(f"{server.url}/v1/completions", timeout=120, json={
            "model": name, "prompt": "The capital of France is", "max_tokens": 4,
            "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    finally:
        server.stop()


@pytest.mark.slow
def test_list_show_rm_agree(hub) -> None:
    _, env = hub
    name = f"{REPO}:Q4_1"
    assert loom(env, "pull", "-q", name).returncode == 0
    listed = loom(env, "list").stdout
    assert name in listed and "smollm2" in listed
    shown = loom(env, "show", name)
    assert shown.returncode == 0 and "LlamaForCausalLM" in shown.stdout
    assert "Q4_1" in shown.stdout and "chat template   yes" in shown.stdout
    assert "134.5 M" in shown.stdout  # SmolLM2-135M's parameters, counted from its tensors
    rm = loom(env, "rm", name)
    assert rm.returncode == 0 and f"deleted {name}" in rm.stdout
    assert name not in loom(env, "list").stdout
    assert not (Path(env["HF_HOME"]) / "hub" / "models--loom-test--SmolLM2-135M-Instruct-GGUF"
                ).exists()
    gone = loom(env, "show", name)
    assert gone.returncode == 1 and f"loom pull {name}" in gone.stderr
    again = loom(env, "rm", name, "smollm2")  # gone already; the packaged model stays
    assert again.returncode == 1 and again.stderr.count("error:") == 2, again.stderr
