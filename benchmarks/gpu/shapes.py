"""The GPU check's model shapes and random checkpoints (benchmarks/gpu/check.py)."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

SHARD_BYTES = 4 << 30


@dataclass(frozen=True)
class SpeedSpec:
    name: str
    config: dict
    prompt: int
    output: int
    streams: tuple[int, ...]
    copy_bytes: int
    budget_s: float  # sections starting later than this are skipped (check.sh kills at 470 s)

    @classmethod
    def h200(cls) -> SpeedSpec:
        """Llama-3-8B's shape (random weights)."""
        return cls("Llama-3-8B shape, random weights", dict(
            hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
            num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
            max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5,
            tie_word_embeddings=False), 512, 128, (1, 32, 256), 4 << 30, 400.0)

    @classmethod
    def tiny(cls) -> SpeedSpec:
        return cls("tiny Llama, random weights", dict(
            hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512, max_position_embeddings=256,
            tie_word_embeddings=False), 24, 6, (1, 3, 5), 1 << 24, 600.0)


def scratch_dir(tiny: bool) -> str | None:
    """Where the random checkpoint goes: /dev/shm (RAM) when it has room, else the default."""
    shm = Path("/dev/shm")
    if not tiny and shm.is_dir() and shutil.disk_usage(shm).free > 40 << 30:
        return str(shm)
    return None


def write_tokenizer(folder: Path, vocab_size: int) -> None:
    """A word-level tokenizer of `vocab_size` tokens t0, t1, ... beside a random checkpoint:
    the engine loads one, the check sends token ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token="t1",
                            eos_token="t2").save_pretrained(folder)


def random_llama(folder: Path, spec: SpeedSpec, device: torch.device) -> Path:
    """A Llama checkpoint of spec's shape with N(0, 0.02) weights (norms 1), bf16 safetensors
    in shards, made on `device` (fast on a GPU) and written to `folder`."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**spec.config, bos_token_id=1, eos_token_id=2,
                         architectures=["LlamaForCausalLM"], dtype="bfloat16")
    folder.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(folder)
    with torch.device("meta"):
        names = {n: p.shape for n, p in LlamaForCausalLM(config).named_parameters()}
    g = torch.Generator(device=device).manual_seed(0)
    shard: dict[str, torch.Tensor] = {}
    index: dict[str, str] = {}
    files = 0

    def flush() -> None:
        nonlocal files, shard
        if shard:
            files += 1
            name = f"model-{files:05d}.safetensors"
            save_file(shard, str(folder / name), metadata={"format": "pt"})
            index.update({k: name for k in shard})
            shard = {}

    size = 0
    for name, shape in names.items():
        if name.endswith("norm.weight"):
            t = torch.ones(shape, dtype=torch.bfloat16)
        else:
            t = torch.empty(shape, dtype=torch.bfloat16, device=device).normal_(
                0.0, 0.02, generator=g).cpu()
        shard[name] = t
        size += t.numel() * 2
        if size >= SHARD_BYTES:
            flush()
            size = 0
    flush()
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": index}))
    write_tokenizer(folder, spec.config["vocab_size"])
    return folder
