"""Copy checkpoint tensors into model parameters, packing q/k/v and gate/up shards."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from loom.quant.int8 import Q8Groups


class WeightLoadError(ValueError):
    """Checkpoint tensors do not match the model: names the missing, unexpected or misshapen ones."""


def select_rows(w: torch.Tensor | Q8Groups, index: torch.Tensor | slice
                ) -> torch.Tensor | Q8Groups:
    """Rows `index` of a checkpoint tensor: a float one, or quantized blocks (int8 groups,
    K-quant blocks: their map_rows)."""
    return w.map_rows(lambda a: a[index]) if hasattr(w, "map_rows") else w[index]


def _shard_slice(param_name: str, shard: int, model: nn.Module, rows: int) -> slice:
    """Row range of shard `shard` inside a packed parameter of `rows` rows (qkv_proj, or
    gate_up_proj: two halves, whatever its MLP's width: an expert's, a shared expert's; or
    the sizes the model's `shard_sizes(param_name)` gives, where it gives some)."""
    config = model.config  # type: ignore[attr-defined]
    sizes = model.shard_sizes(param_name) if hasattr(model, "shard_sizes") else None
    if sizes is not None:  # a model's own packing (a hybrid's linear-attention input)
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
    elif "qkv_proj" in param_name:
        q = config.num_attention_heads * config.head_dim
        kv = config.num_key_value_heads * config.head_dim
        starts, sizes = [0, q, q + kv], [q, kv, kv]
    else:
        i = rows // 2
        starts, sizes = [0, i], [i, i]
    return slice(starts[shard], starts[shard] + sizes[shard])


def load_packed_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor | Q8Groups]],
    packed_modules: dict[str, tuple[str, int]],
    skip: set[str] = frozenset(),  # type: ignore[assignment]
) -> None:
    """Copy each checkpoint tensor into its parameter (rows of a packed one). A module with
    `load_rows` (int8 layers built empty) takes its `.weight` itself, float or already grouped;
    grouped weights meant for a float parameter are dequantized."""
    params = dict(model.named_parameters())
    rows_of = {name: p.shape[0] if p.dim() else 1 for name, p in params.items()}
    takers: dict[str, nn.Module] = {}
    for name, m in model.named_modules():
        # A tied output projection shares its embedding's tensors: the embedding takes them.
        if hasattr(m, "load_rows") and all(t.weight_int8 is not m.weight_int8
                                           for t in takers.values()):
            takers[f"{name}.weight"] = m
    rows_of.update({name: m.weight_int8.shape[0] for name, m in takers.items()})
    # Each parameter must be covered exactly: count loaded rows per parameter.
    loaded_rows: dict[str, int] = {name: 0 for name in rows_of}
    unexpected: list[str] = []
    for name, tensor in weights:
        if name in skip or name.endswith("rotary_emb.inv_freq"):
            continue
        target, rows = name, None
        for frag, (packed, shard) in packed_modules.items():
            if f".{frag}." in name:
                target = name.replace(f".{frag}.", f".{packed}.")
                rows = _shard_slice(target, shard, model, rows_of.get(target, 0))
                break
        if target in takers:
            try:
                loaded_rows[target] += takers[target].load_rows(rows, tensor)
            except ValueError as e:
                raise WeightLoadError(f"tensor {name!r}: {e}") from None
            continue
        param = params.get(target)
        if param is None:
            unexpected.append(name)
            continue
        if isinstance(tensor, Q8Groups):
            tensor = tensor.dequantize()
        dest = param.data if rows is None else param.data[rows]
        if dest.shape != tensor.shape:
            raise WeightLoadError(
                f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}"
            )
        dest.copy_(tensor)
        loaded_rows[target] += dest.shape[0] if dest.dim() else 1
    if unexpected:
        raise WeightLoadError(f"unexpected tensors in checkpoint: {sorted(unexpected)[:20]}")
    missing = [n for n, r in rows_of.items() if loaded_rows[n] != r]
    if missing:
        raise WeightLoadError(f"checkpoint is missing tensors for parameters: {missing[:20]}")
