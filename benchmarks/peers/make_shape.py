"""Write a random-weight model in a real model's shape, for benchmarks at a real size (issue 32).

Two shapes (`--shape`): SmolLM2-1.7B's (the default, below) and Llama-3-8B's body
(`llama3-8b`: hidden 4096, 32 layers, 32 query heads and 8 KV heads of 128, MLP 14336, RoPE base
500000, an untied output head; the files go to $LOOM_PEERS/llama3-8b-shape), which keeps the
packaged SmolLM2 vocabulary (49152 tokens, not Llama 3's 128256: every engine must tokenize
alike, and the tokenizer comes from the packaged GGUF), so its embedding and head are 0.4x the
real model's and the whole ~7.4 B weights.

SmolLM2-1.7B-Instruct's configuration (Llama: hidden 2048, 24 layers, 32 heads and 32 KV heads of
64, MLP 8192, vocabulary 49152, RoPE base 130000, RMSNorm eps 1e-5, tied embeddings, 8192-token
context) with random weights, and the tokenizer and chat template of the packaged SmolLM2-135M
GGUF (the same vocabulary), so every engine tokenizes alike. Weights are normal with the scales
of a trained model's initialisation (std 0.02; the projections into the residual stream,
attention output and MLP down, 0.02 / sqrt(2 x layers)), norms 1: activations stay finite and
the next-token distribution is not degenerate. Outputs are meaningless text; speed is what counts.

Writes, under OUT (default $LOOM_PEERS/smollm2-1.7b-shape; sizes the 1.7B's, the 8B's ~4.3x):
  <name>-F16.gguf      the weights as llama.cpp's converter would write them (3.4 GB; with
                       --drop-f16 removed once the quantized files are written)
  <name>-Q4_K_M.gguf   quantized by llama.cpp's own `llama-quantize` (~1.0 GB)
  <name>-Q4_0.gguf     likewise (~1.0 GB)
  hf/                              the Q4_K_M file's weights dequantized, as a Hugging Face Llama
                                   folder (bf16 safetensors by default), for vLLM: the same
                                   effective weights the GGUF engines run

    .venv/bin/python benchmarks/peers/make_shape.py [--out DIR] [--quantize BIN] \\
        [--hf-dtype bfloat16|float32] [--types Q4_K_M,Q4_0] [--layers 24]
    .venv/bin/python benchmarks/peers/make_shape.py --shape llama3-8b --types Q4_K_M \\
        --hf-from '' --drop-f16      # the 8B body: ~15 GB of F16 on the way, 4.6 GB kept

`--quantize` defaults to the llama-quantize of benchmarks/peers/install_llama_cpp.sh, else of
install_ik_llama_cpp.sh. Steps whose output exists are skipped (--force redoes them). Peak memory
stays near 1 GB (tensors are generated, written and converted one at a time). `--layers 2`
makes a small file of the same width for smoke tests.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

PEERS = Path(os.environ.get("LOOM_PEERS", Path.home() / ".cache" / "loom-peers"))

# SmolLM2-1.7B-Instruct's config.json, the fields that make its shape.
CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
    "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 24,
    "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 64,
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 130000.0,
    "rope_scaling": None, "tie_word_embeddings": True, "vocab_size": 49152,
    "attention_bias": False, "mlp_bias": False, "initializer_range": 0.02,
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2,
}

# Llama-3-8B's config.json where it differs, with the packaged vocabulary (above).
SHAPES = {
    "smollm2-1.7b": ("smollm2-1.7b-shape", "SmolLM2-1.7B", CONFIG),
    "llama3-8b": ("llama3-8b-shape", "Llama-3-8B body", {
        **CONFIG, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "rope_theta": 500000.0, "tie_word_embeddings": False}),
}

# GGUF tensor name -> Hugging Face name ({i}: the layer)
HF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def tensor_plan(cfg: dict) -> list[tuple[str, tuple[int, ...], float | None]]:
    """(GGUF name, numpy shape (rows, cols), std; None: a norm, all ones) in file order."""
    h, f, n = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    hd = cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    std, out_std = cfg["initializer_range"], cfg["initializer_range"] / np.sqrt(2 * n)
    plan: list[tuple[str, tuple[int, ...], float | None]] = [
        ("token_embd.weight", (cfg["vocab_size"], h), std)]
    for i in range(n):
        plan += [(f"blk.{i}.attn_norm.weight", (h,), None),
                 (f"blk.{i}.attn_q.weight", (q, h), std),
                 (f"blk.{i}.attn_k.weight", (kv, h), std),
                 (f"blk.{i}.attn_v.weight", (kv, h), std),
                 (f"blk.{i}.attn_output.weight", (h, q), out_std),
                 (f"blk.{i}.ffn_norm.weight", (h,), None),
                 (f"blk.{i}.ffn_gate.weight", (f, h), std),
                 (f"blk.{i}.ffn_up.weight", (f, h), std),
                 (f"blk.{i}.ffn_down.weight", (h, f), out_std)]
    plan.append(("output_norm.weight", (h,), None))
    if not cfg["tie_word_embeddings"]:
        plan.append(("output.weight", (cfg["vocab_size"], h), std))
    return plan


def _values(name: str, shape: tuple[int, ...], std: float | None, seed: int) -> np.ndarray:
    if std is None:
        return np.ones(shape, np.float32)
    # one generator per tensor: the weights do not depend on the order they are made in
    rng = np.random.default_rng([seed, *name.encode()])
    return (rng.standard_normal(shape, dtype=np.float32) * np.float32(std)).astype(np.float16)


def _copy_tokenizer(writer, source: Path) -> None:  # noqa: ANN001
    """Every tokenizer.* key of the source GGUF (vocabulary, merges, special ids, template)."""
    from gguf import GGUFReader, GGUFValueType

    reader = GGUFReader(str(source))
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub_type=sub)


def write_f16(out: Path, cfg: dict, tokenizer_gguf: Path, seed: int, title: str) -> Path:
    from gguf import GGUFWriter, LlamaFileType

    w = GGUFWriter(str(out), "llama")
    w.add_name(f"{title} shape, random weights (seed {seed})")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_dimension_count(cfg["head_dim"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_file_type(LlamaFileType.MOSTLY_F16)
    _copy_tokenizer(w, tokenizer_gguf)
    plan = tensor_plan(cfg)
    for name, shape, std in plan:
        dtype = np.float32 if std is None else np.float16
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        w.add_tensor_info(name, shape, np.dtype(dtype), nbytes)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, shape, std in plan:  # generated and written one at a time
        w.write_tensor_data(_values(name, shape, std, seed))
    w.close()
    return out


def default_quantize() -> Path | None:
    for build in ("llama-cpp", "ik-llama-cpp"):
        found = PEERS / build / "bin" / "llama-quantize"
        if found.is_file():
            return found
    return None


def quantize(binary: Path, src: Path, dst: Path, qtype: str, threads: int) -> None:
    tmp = dst.with_suffix(".partial")
    cmd = [str(binary), str(src), str(tmp), qtype, str(threads)]
    print("$", " ".join(cmd), flush=True)
    r = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if r.returncode != 0:
        sys.exit(f"make_shape: llama-quantize failed ({r.returncode}):\n{r.stderr[-3000:]}")
    tmp.rename(dst)


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """The inverse of llama.cpp's converter's q/k row permutation (GGUF -> Hugging Face)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


def hf_name(gguf_name: str) -> str:
    if gguf_name in HF_NAMES:
        return HF_NAMES[gguf_name]
    _, layer, kind, _ = gguf_name.split(".")
    return f"model.layers.{layer}.{HF_NAMES[kind]}.weight"


def write_hf(gguf_path: Path, out: Path, cfg: dict, tokenizer_gguf: Path, dtype: str,
             shard_bytes: int = 2 << 30) -> Path:
    """The GGUF's weights dequantized (the `gguf` package's own dequantizers) into a Hugging
    Face folder, in shards written one at a time."""
    import torch
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    tdtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
    size = 2 if tdtype == torch.bfloat16 else 4
    reader = GGUFReader(str(gguf_path))
    tensors = [t for t in reader.tensors  # tied: the embeddings
               if t.name != "output.weight" or not cfg["tie_word_embeddings"]]
    shards, cur, cur_bytes = [], [], 0
    for t in tensors:
        nb = int(t.n_elements) * size
        if cur and cur_bytes + nb > shard_bytes:
            shards.append(cur)
            cur, cur_bytes = [], 0
        cur.append(t)
        cur_bytes += nb
    shards.append(cur)
    out.mkdir(parents=True, exist_ok=True)
    weight_map, total = {}, 0
    for k, shard in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        state = {}
        for t in shard:
            a = dequantize(t.data, t.tensor_type).reshape([int(d) for d in reversed(t.shape)])
            if ".attn_q." in t.name:
                a = _unpermute(a, cfg["num_attention_heads"])
            elif ".attn_k." in t.name:
                a = _unpermute(a, cfg["num_key_value_heads"])
            name = hf_name(t.name)
            state[name] = torch.from_numpy(np.ascontiguousarray(a, np.float32)).to(tdtype)
            weight_map[name] = fname
            total += state[name].numel() * size
        save_file(state, str(out / fname), metadata={"format": "pt"})
        del state
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1) + "\n")
    (out / "config.json").write_text(json.dumps({**cfg, "torch_dtype": dtype}, indent=1) + "\n")
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"]}) + "\n")
    tok = AutoTokenizer.from_pretrained(str(tokenizer_gguf.parent), gguf_file=tokenizer_gguf.name)
    tok.save_pretrained(str(out))
    (out / "loom_source.json").write_text(json.dumps({"gguf": str(gguf_path)}) + "\n")
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shape", default="smollm2-1.7b", choices=sorted(SHAPES),
                   help="the real model whose shape the weights take")
    p.add_argument("--out", default=None, help="output folder (default $LOOM_PEERS/<name>)")
    p.add_argument("--quantize", default=None, help="the llama-quantize binary")
    p.add_argument("--types", default="Q4_K_M,Q4_0", help="llama-quantize types to make")
    p.add_argument("--hf-from", default="Q4_K_M",
                   help="the file whose weights the HF folder holds ('' for none)")
    p.add_argument("--hf-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--layers", type=int, default=None,
                   help="decoder layers (default the shape's; fewer for a smoke test)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="llama-quantize's")
    p.add_argument("--tokenizer-gguf", default=None,
                   help="GGUF to copy the tokenizer from (default: the packaged SmolLM2)")
    p.add_argument("--force", action="store_true", help="redo steps whose output exists")
    p.add_argument("--drop-f16", action="store_true",
                   help="remove the F16 file once the quantized files and HF folder exist")
    ns = p.parse_args(argv)
    name, title, shape_cfg = SHAPES[ns.shape]
    out = Path(ns.out or PEERS / name).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    cfg = {**shape_cfg, "num_hidden_layers": ns.layers or shape_cfg["num_hidden_layers"]}
    if ns.tokenizer_gguf:
        tok_gguf = Path(ns.tokenizer_gguf)
    else:
        from loom.loader.resolve import default_gguf_path

        tok_gguf = default_gguf_path()
    f16 = out / f"{name}-F16.gguf"
    if ns.force or not f16.is_file():
        t0 = time.perf_counter()
        tmp = write_f16(out / f"{name}-F16.partial", cfg, tok_gguf, ns.seed, title)
        tmp.rename(f16)
        print(f"wrote {f16} ({f16.stat().st_size / 2**30:.2f} GiB) in "
              f"{time.perf_counter() - t0:.0f} s", flush=True)
    qtypes = [q for q in ns.types.split(",") if q]
    binary = Path(ns.quantize) if ns.quantize else default_quantize()
    for q in qtypes:
        dst = out / f"{name}-{q}.gguf"
        if dst.is_file() and not ns.force:
            continue
        if binary is None or not binary.is_file():
            sys.exit("make_shape: no llama-quantize (run benchmarks/peers/install_llama_cpp.sh, "
                     "or give --quantize BIN)")
        t0 = time.perf_counter()
        quantize(binary, f16, dst, q, ns.threads)
        print(f"wrote {dst} ({dst.stat().st_size / 2**30:.2f} GiB) in "
              f"{time.perf_counter() - t0:.0f} s", flush=True)
    if ns.hf_from:
        src = f16 if ns.hf_from == "F16" else out / f"{name}-{ns.hf_from}.gguf"
        hf = out / "hf"
        if ns.force or not (hf / "config.json").is_file():
            t0 = time.perf_counter()
            write_hf(src, hf, cfg, tok_gguf, ns.hf_dtype)
            print(f"wrote {hf} ({ns.hf_dtype}, the weights of {src.name}) in "
                  f"{time.perf_counter() - t0:.0f} s", flush=True)
    if ns.drop_f16 and f16.is_file():
        f16.unlink()
        print(f"removed {f16}", flush=True)


if __name__ == "__main__":
    main()
