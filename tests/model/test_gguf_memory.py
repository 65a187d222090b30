"""What a GGUF load keeps in memory (issue 32's peak-RSS goal): a K-quant token embedding stays
in the file's blocks, looked up row by row and, tied, multiplied by as the output projection;
the file's pages that converted tensors were read from go back to the system after the load."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from loom.layers.embedding import KQuantEmbedding
from loom.loader import hugepages
from loom.loader.gguf import open_gguf
from loom.loader.model_loader import load_model
from loom.loader.release import held_ranges, release_unused
from loom.loader.resolve import resolve_model
from loom.quant.kquant import KQuantLinear
from tests.cpu_kernels import require_cpu_kernels
from tests.gguf_files import write_gguf
from tests.model.test_kquant import random_blocks
from tests.paged_batch import PagedBatch
from tests.tiny_models import make_tiny_model

pytestmark = pytest.mark.slow  # loads real GGUF / tokenizer files: seconds each

Q6_K = GGMLQuantizationType.Q6_K
VOCAB, HIDDEN = 512, 256  # a K-quant row holds whole 256-wide super-blocks


@pytest.fixture(scope="module")
def tied_q6k(tmp_path_factory):
    """A tiny tied Llama whose token embedding is Q6_K blocks (as in SmolLM2-1.7B's or Llama
    3.2's Q4_K_M files), its linears Q8_0: the default load and the fp32 reference."""
    require_cpu_kernels()
    tmp = tmp_path_factory.mktemp("tied_q6k")
    folder = make_tiny_model("llama-tied", tmp / "hf", vocab_size=VOCAB, hidden_size=HIDDEN,
                             intermediate_size=512)
    blocks = random_blocks(Q6_K, VOCAB, HIDDEN, np.random.default_rng(0))
    path = write_gguf(folder, tmp / "tied-q6k.gguf", "llama", GGMLQuantizationType.Q8_0,
                      raw={"token_embd.weight": (blocks.data.numpy(), Q6_K)})
    source = resolve_model(str(path))
    return source, load_model(source, "float32"), load_model(source, "float32",
                                                             quantization="none")


def test_kquant_embedding_and_tied_head_keep_the_files_blocks(tied_q6k) -> None:
    _, loaded, ref = tied_q6k
    embed, head = loaded.model.model.embed_tokens, loaded.model.lm_head
    assert isinstance(embed, KQuantEmbedding) and isinstance(head, KQuantLinear)
    assert head.formats() == ["Q6_K"]
    (_, (_, part)), = head.parts.items()
    assert part.data.data_ptr() == embed.blocks.data.data_ptr()  # one table, not two
    # no float table of the vocabulary anywhere in the model
    assert not [n for n, t in [*loaded.model.named_parameters(), *loaded.model.named_buffers()]
                if t.numel() >= VOCAB * HIDDEN and t.is_floating_point()]
    ids = torch.tensor([[0, 5, VOCAB - 1], [17, 17, 300]])
    want = ref.model.model.embed_tokens(ids)
    assert torch.equal(embed(ids), want)  # the file's values, bit for bit
    with pytest.raises(IndexError):
        embed(torch.tensor([VOCAB]))


def test_tied_kquant_head_agrees_with_reference(tied_q6k) -> None:
    """Teacher-forced top-1 >= 99% against the fp32 reference, a token a step in groups of 6
    (decode: the kernels of up to 8 rows); the head alone past 8 rows (the batch kernel) too."""
    _, loaded, ref = tied_q6k
    rng = np.random.default_rng(1)
    prompts = {str(i): rng.integers(0, VOCAB, 24).tolist() for i in range(12)}
    agree = total = 0
    for group in (list(prompts)[:6], list(prompts)[6:]):
        runs = PagedBatch(loaded, num_blocks=48), PagedBatch(ref, num_blocks=48)
        for t in range(24):
            got, want = (b.step({k: [prompts[k][t]] for k in group}) for b in runs)
            agree += sum(int(got[k].argmax(-1) == want[k].argmax(-1)) for k in group)
            total += len(group)
    assert total == 288 and agree >= 0.99 * total, (agree, total)
    h = ref.model.model.norm(torch.randn(256, HIDDEN, generator=torch.Generator().manual_seed(2)))
    for rows in (8, 256):  # up to 8 rows: integer products; past 8, bf16 ones by default
        logits, expected = loaded.model.lm_head(h[:rows]), ref.model.lm_head(h[:rows])
        agree = int((logits.argmax(-1) == expected.argmax(-1)).sum())
        print(f"head alone, {rows} rows: top-1 {agree} / {rows}")
        assert agree >= 0.99 * rows, (agree, rows)
        assert (logits - expected).abs().max() < 1e-2 * expected.abs().max()


def test_release_keeps_what_the_model_reads(tied_q6k) -> None:
    """The pages of converted tensors (the Q8_0 linears, the norms) are released; the K-quant
    table the model reads in place is not, and the model computes the same after a release."""
    source, loaded, _ = tied_q6k
    reader = open_gguf(source.path)
    table = next(t for t in reader.tensors if t.name == "token_embd.weight")
    embed = loaded.model.model.embed_tokens
    lo, hi = table.data.ctypes.data, table.data.ctypes.data + table.data.nbytes
    # (no held range overlaps the table: the model reads another map's view of it)
    assert not any(a < hi and lo < b for a, b in held_ranges(loaded.model))
    ids = torch.arange(0, VOCAB, 7)
    before = embed(ids)
    assert release_unused(reader, loaded.model) >= table.data.nbytes - 8192  # nothing held
    # the model's own map: the table it reads is held, so none of it goes
    own = SimpleNamespace(tensors=[SimpleNamespace(data=embed.blocks.data.numpy())])
    assert release_unused(own, loaded.model) == 0
    assert torch.equal(embed(ids), before)


def test_weights_onto_huge_pages_compute_the_same(tied_q6k) -> None:
    """The idle engine's pager (loom/loader/hugepages.py) moves the file's K-quant table and
    collapses the model's own tensors: the model computes the same, bit for bit."""
    _, loaded, _ = tied_q6k
    if not hugepages.enabled():
        assert loaded.huge_pages is None
        pytest.skip("no transparent huge pages on this machine")
    embed = loaded.model.model.embed_tokens
    ids = torch.arange(0, VOCAB, 5)
    prompt = {"a": list(range(3, 40, 3)), "b": [7] * 9}
    before = embed(ids), PagedBatch(loaded, num_blocks=16).step(prompt)
    pager = loaded.huge_pages
    while pager.step():
        pass
    assert pager.moved >= embed.blocks.data.numel()  # the table the model reads in place
    after = embed(ids), PagedBatch(loaded, num_blocks=16).step(prompt)
    assert torch.equal(after[0], before[0])
    assert all(torch.equal(after[1][k], before[1][k]) for k in prompt)
