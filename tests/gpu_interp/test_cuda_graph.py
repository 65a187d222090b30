"""The CUDA-graph decode path's CPU-checkable parts (loom/worker/cuda_graph.py): bucket choice,
and a decode step padded into the persistent buffers (what a replay computes) giving the
unpadded step's logits while the padding rows write nothing to the KV cache. The model runs its
attention on the Triton kernels in Triton's interpreter, as a graph would on CUDA."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are imported

import pytest  # noqa: E402
import torch  # noqa: E402

from loom.attention.backends import triton_attn  # noqa: E402
from loom.attention.forward_context import set_forward_context  # noqa: E402
from loom.worker.cuda_graph import DecodeGraphs, bucket_for, capture_sizes  # noqa: E402


def test_buckets() -> None:
    assert capture_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    assert capture_sizes(1) == [1]
    assert capture_sizes(8) == [1, 2, 4, 8]
    sizes = capture_sizes(256)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 256 and len(sizes) == 20
    assert [bucket_for(n, sizes) for n in (1, 3, 9, 17, 256, 257)] == [1, 4, 16, 32, 256, None]


@pytest.mark.skipif(not triton_attn.available(), reason="triton is not installed")
def test_padded_decode_matches_eager_and_writes_no_padding(tmp_path) -> None:
    from loom.loader.model_loader import load_model
    from loom.loader.resolve import resolve_model
    from tests.paged_batch import PagedBatch, rel_err
    from tests.tiny_models import make_tiny_model

    loaded = load_model(resolve_model(str(make_tiny_model("qwen3", tmp_path / "m"))),
                        "bfloat16", "cpu", quantization="none")
    model = loaded.model
    for attn in model.attention_layers():
        attn.use_triton = True
    batch = PagedBatch(loaded, num_blocks=16)
    batch.step({"a": list(range(5, 22)), "b": list(range(40, 49)), "c": [7, 8, 9]})
    rids, md, positions, ids, _ = batch._inputs({"a": [3], "b": [4], "c": [5]})
    caches = [a.kv_cache for a in model.attention_layers()]
    before = [c.clone() for c in caches]

    graphs = DecodeGraphs(model, max_num_seqs=8, max_model_len=64, block_size=16,
                          num_kv_heads=loaded.config.num_key_value_heads,
                          device=torch.device("cpu"))
    assert graphs.can_run(3, md)
    # stale rows from an earlier, larger step must not leak into this one
    graphs.block_tables.fill_(5)
    graphs.seq_lens.fill_(40)
    hidden, logits = graphs.run(ids, positions, md)  # bucket 4: one padding row
    assert hidden.shape[0] == 3 and logits.shape == (3, loaded.config.vocab_size)
    assert torch.equal(graphs.slot_mapping[3:4], torch.tensor([-1]))
    padded_caches = [c.clone() for c in caches]

    for c, b in zip(caches, before):
        c.copy_(b)
    with set_forward_context(md):
        _, want = model.forward_logits(ids, positions, torch.arange(3).numpy(), only_rows=True)
    assert rel_err(logits.float(), want.float()) < 2e-2
    for got, ref, old in zip(padded_caches, caches, before):
        assert torch.equal(got, ref)  # the same three slots written, nothing else
        assert not torch.equal(got, old)


def test_kv_budget_and_dummy_step(tmp_path) -> None:
    """The memory rule's arithmetic, and the profiled step on a tiny model: logits for every
    request, over a throwaway cache, the layers' own caches put back untouched."""
    from loom.loader.model_loader import load_model
    from loom.loader.resolve import resolve_model
    from loom.worker.gpu_memory import dummy_step, kv_budget
    from tests.tiny_models import make_tiny_model

    assert kv_budget(100_000, 0.9, 30_000, 5_000) == 55_000
    loaded = load_model(resolve_model(str(make_tiny_model("llama", tmp_path / "m"))),
                        "bfloat16", "cpu", quantization="none")
    layers = loaded.model.attention_layers()
    own = [torch.zeros(1) for _ in layers]
    for attn, cache in zip(layers, own):
        attn.kv_cache = cache
    probs = dummy_step(loaded.model, loaded.config, 37, 4, 16, torch.bfloat16,
                       torch.device("cpu"))
    assert probs.shape == (4, loaded.config.vocab_size)
    assert torch.allclose(probs.sum(-1), torch.ones(4))
    assert all(attn.kv_cache is cache for attn, cache in zip(layers, own))
