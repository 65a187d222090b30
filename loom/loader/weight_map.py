"""Copy checkpoint tensors into model parameters, packing q/k/v and gate/up shards."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn


class WeightLoadError(ValueError):
    """Checkpoint tensors do not match the model: names the missing, unexpected or misshapen ones."""


def _shard_slice(param_name: str, shard: int, model: nn.Module) -> slice:
    """Row range of shard `shard` inside a packed parameter (qkv_proj or gate_up_proj)."""
    config = model.config  # type: ignore[attr-defined]
    if "qkv_proj" in param_name:
        q = config.num_attention_heads * config.head_dim
        kv = config.num_key_value_heads * config.head_dim
        starts, sizes = [0, q, q + kv], [q, kv, kv]
    else:
        i = config.intermediate_size
        starts, sizes = [0, i], [i, i]
    return slice(starts[shard], starts[shard] + sizes[shard])


def load_packed_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    packed_modules: dict[str, tuple[str, int]],
    skip: set[str] = frozenset(),  # type: ignore[assignment]
) -> None:
    params = dict(model.named_parameters())
    # Each parameter must be covered exactly: count loaded rows per parameter.
    loaded_rows: dict[str, int] = {name: 0 for name in params}
    unexpected: list[str] = []
    for name, tensor in weights:
        if name in skip or name.endswith("rotary_emb.inv_freq"):
            continue
        target, rows = name, None
        for frag, (packed, shard) in packed_modules.items():
            if f".{frag}." in name:
                target = name.replace(f".{frag}.", f".{packed}.")
                rows = _shard_slice(target, shard, model)
                break
        param = params.get(target)
        if param is None:
            unexpected.append(name)
            continue
        dest = param.data if rows is None else param.data[rows]
        if dest.shape != tensor.shape:
            raise WeightLoadError(
                f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}"
            )
        dest.copy_(tensor)
        loaded_rows[target] += dest.shape[0] if dest.dim() else 1
    if unexpected:
        raise WeightLoadError(f"unexpected tensors in checkpoint: {sorted(unexpected)[:20]}")
    missing = [n for n, p in params.items() if loaded_rows[n] != (p.shape[0] if p.dim() else 1)]
    if missing:
        raise WeightLoadError(f"checkpoint is missing tensors for parameters: {missing[:20]}")
