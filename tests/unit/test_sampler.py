"""Sampler, penalties and SamplingMetadata: each parameter shapes the distribution as defined."""

from __future__ import annotations

import math

import pytest
import torch

from loom.sample.metadata import SamplingMetadata, check_token_ids_in_vocab
from loom.sample.penalties import apply_penalties
from loom.sample.sampler import Sampler, compute_prompt_logprobs
from loom.sampling_params import SamplingParams, SamplingParamsError

CPU = torch.device("cpu")
EOS = 0
sampler = Sampler()


def build(
    params: list[SamplingParams],
    vocab: int,
    prompts: list[list[int]] | None = None,
    outputs: list[list[int]] | None = None,
    generators: list[torch.Generator | None] | None = None,
) -> SamplingMetadata:
    n = len(params)
    return SamplingMetadata.build(
        params,
        prompts if prompts is not None else [[1]] * n,
        outputs if outputs is not None else [[]] * n,
        generators if generators is not None else [None] * n,
        (EOS,),
        vocab,
        CPU,
    )


def sample_many(logits_row: list[float], params: SamplingParams, draws: int = 4000) -> torch.Tensor:
    """Sample `draws` times from one distribution (one batched call); returns the token ids."""
    logits = torch.tensor([logits_row]).repeat(draws, 1)  # [draws, vocab]
    return sampler(logits, build([params] * draws, len(logits_row))).sampled_token_ids


def log_probs(probs: list[float]) -> list[float]:
    return [math.log(p) for p in probs]


PROBS = [0.5, 0.3, 0.15, 0.05]


def test_greedy_is_argmax_and_cheap() -> None:
    torch.manual_seed(0)
    logits = torch.randn(8, 100)
    md = build([SamplingParams(temperature=0.0)] * 8, 100)
    assert md.all_greedy and md.no_penalties and md.no_logit_bias
    assert md.temperature is None and md.output_token_counts is None and md.top_k is None
    assert md.max_num_logprobs is None
    before = logits.clone()
    out = sampler(logits, md)
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))
    assert out.sampled_token_ids.dtype == torch.int64
    assert out.logprobs == [None] * 8
    assert torch.equal(logits, before)  # input logits are not modified
    # ties go to the first maximal token, as argmax's do
    logits[2] = 0.0
    logits[5, 40] = logits[5, 7] = 50.0
    out = sampler(logits, md)
    assert out.sampled_token_ids[2] == 0 and out.sampled_token_ids[5] == 7
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))


def test_top_k_1_equals_greedy_in_mixed_batch() -> None:
    torch.manual_seed(1)
    for _ in range(20):
        logits = torch.randn(6, 50)
        params = [
            SamplingParams(top_k=1, temperature=1.5),
            SamplingParams(temperature=1.0),
            SamplingParams(top_k=1, top_p=0.5, temperature=0.7),
            SamplingParams(temperature=0.0),
            SamplingParams(temperature=2.0, top_k=5),
            SamplingParams(top_k=1),
        ]
        out = sampler(logits, build(params, 50)).sampled_token_ids
        argmax = logits.argmax(-1)
        for row in (0, 2, 3, 5):
            assert out[row] == argmax[row]


def test_unmodified_sampling_follows_softmax() -> None:
    ids = sample_many(log_probs(PROBS), SamplingParams(temperature=1.0), draws=20000)
    freq = torch.bincount(ids, minlength=4).float() / ids.numel()
    assert torch.allclose(freq, torch.tensor(PROBS), atol=0.02)


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_temperature_scales_logits(temperature: float) -> None:
    logits = log_probs(PROBS)
    ids = sample_many(logits, SamplingParams(temperature=temperature), draws=20000)
    freq = torch.bincount(ids, minlength=4).float() / ids.numel()
    expected = torch.softmax(torch.tensor(logits) / temperature, dim=-1)
    assert torch.allclose(freq, expected, atol=0.02)


@pytest.mark.parametrize(
    ("top_p", "kept"), [(0.4, {0}), (0.75, {0, 1}), (0.85, {0, 1, 2}), (0.99, {0, 1, 2, 3})]
)
def test_top_p_keeps_smallest_set_reaching_p(top_p: float, kept: set[int]) -> None:
    ids = sample_many(log_probs(PROBS), SamplingParams(top_p=top_p))
    assert set(ids.tolist()) == kept
    # Inside the nucleus the renormalized proportions hold.
    freq = torch.bincount(ids, minlength=4).float() / ids.numel()
    mass = sum(PROBS[i] for i in kept)
    assert abs(freq[0].item() - PROBS[0] / mass) < 0.04


@pytest.mark.parametrize(("top_k", "kept"), [(2, {0, 1}), (3, {0, 1, 2})])
def test_top_k_keeps_k_most_likely(top_k: int, kept: set[int]) -> None:
    ids = sample_many(log_probs(PROBS), SamplingParams(top_k=top_k))
    assert set(ids.tolist()) == kept


@pytest.mark.parametrize(("min_p", "kept"), [(0.2, {0, 1, 2}), (0.5, {0, 1})])
def test_min_p_drops_tokens_below_fraction_of_max(min_p: float, kept: set[int]) -> None:
    ids = sample_many(log_probs(PROBS), SamplingParams(min_p=min_p))
    assert set(ids.tolist()) == kept


def test_top_k_then_top_p_combine() -> None:
    # top_k=3 renormalizes to [0.526, 0.316, 0.158]; top_p=0.8 then keeps {0, 1}.
    ids = sample_many(log_probs(PROBS), SamplingParams(top_k=3, top_p=0.8))
    assert set(ids.tolist()) == {0, 1}


def test_logit_bias_bans_and_forces() -> None:
    logits = log_probs(PROBS)
    banned = sample_many(logits, SamplingParams(temperature=0.0, logit_bias={0: -100.0}), 10)
    assert banned.tolist() == [1] * 10
    forced = sample_many(logits, SamplingParams(logit_bias={3: 100.0}), 2000)
    assert forced.tolist() == [3] * 2000


def test_allowed_token_ids_and_bad_words() -> None:
    """vLLM's allowed_token_ids (only these may be sampled) and bad_words (a one-token word
    banned everywhere, a longer one's last token after the rest of it)."""
    logits = log_probs(PROBS)
    allowed = sample_many(logits, SamplingParams(allowed_token_ids=[1, 3]))
    assert set(allowed.tolist()) == {1, 3}
    share = (allowed == 1).float().mean().item()  # 0.3 / (0.3 + 0.05), 4000 draws
    assert abs(share - 0.3 / 0.35) < 0.03
    greedy = SamplingParams(temperature=0.0, allowed_token_ids=[2, 3])
    assert sample_many(logits, greedy, 3).tolist() == [2] * 3
    bad = SamplingParams(temperature=0.0, bad_words=["x", "y z"],
                         bad_words_token_ids=[[0], [2, 1]])
    row = torch.tensor([logits])
    for out, want in ([[3]], 1), ([[2]], 2), ([[1, 2]], 2):  # 1 banned only right after 2
        assert sampler(row, build([bad], 4, outputs=out)).sampled_token_ids.item() == want
    # the bans leave none of the allowed tokens (EOS under min_tokens): the allowed come back
    stuck = SamplingParams(allowed_token_ids=[EOS], min_tokens=3)
    assert sample_many(logits, stuck, 50).tolist() == [EOS] * 50
    with pytest.raises(SamplingParamsError, match="allowed_token_ids"):
        build([SamplingParams(allowed_token_ids=[4])], vocab=4)
    with pytest.raises(SamplingParamsError, match="bad_words_token_ids"):  # (at add_request)
        check_token_ids_in_vocab(SamplingParams(bad_words_token_ids=[[1, 4]]), 4)
    for change in ({"allowed_token_ids": []}, {"allowed_token_ids": [-1]}, {"bad_words": [" "]},
                   {"truncate_prompt_tokens": 0}, {"truncate_prompt_tokens": -2},
                   {"truncate_prompt_tokens": True}, {"bad_words_token_ids": [[]]},
                   {"bad_words_token_ids": [[1, -2]]}):
        with pytest.raises(SamplingParamsError, match=next(iter(change))):
            SamplingParams(**change)


def test_logit_bias_out_of_vocab_is_rejected() -> None:
    with pytest.raises(SamplingParamsError, match="logit_bias"):
        build([SamplingParams(logit_bias={10: 1.0})], vocab=10)


def test_penalties_hand_computed() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 1.0, 0.0, 3.0]])
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    # token 0 and 1 in the prompt only; token 2 twice and 3 once in the output; 4, 5 unseen.
    md = build([params], 6, prompts=[[0, 1, 0]], outputs=[[2, 2, 3]])
    expected = torch.tensor([[
        2.0 / 2,  # prompt only: repetition only (positive: divided)
        -1.0 * 2,  # prompt only, negative: multiplied
        0.5 / 2 - 0.5 * 2 - 0.25,  # output twice: repetition, frequency * 2, presence
        1.0 / 2 - 0.5 * 1 - 0.25,  # output once
        0.0,  # unseen: unchanged
        3.0,
    ]])
    assert torch.allclose(apply_penalties(logits.clone(), md), expected)
    out = sampler(logits, build([params.clone(logprobs=5)], 6, [[0, 1, 0]], [[2, 2, 3]]))
    lp = out.logprobs[0]
    assert lp is not None
    ref = torch.log_softmax(expected, dim=-1)[0]
    assert lp.logprobs[1:] == pytest.approx(ref.sort(descending=True).values[:5].tolist())


def test_penalties_only_touch_their_own_rows() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0]] * 2)
    params = [SamplingParams(frequency_penalty=1.0), SamplingParams()]
    md = build(params, 3, prompts=[[0], [0]], outputs=[[1, 1], [1, 1]])
    assert md.output_token_counts is not None
    assert md.output_token_counts.tolist() == [[0, 2, 0], [0, 0, 0]]
    assert md.prompt_token_mask is None  # no repetition penalty in the batch
    out = apply_penalties(logits.clone(), md)
    assert out.tolist() == [[1.0, 0.0, 3.0], [1.0, 2.0, 3.0]]


def test_min_tokens_bans_eos_and_stop_tokens() -> None:
    logits = torch.tensor([[5.0, 4.0, 3.0, 0.0]])  # EOS = 0 is the most likely
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[1])
    assert sampler(logits, build([params], 4, outputs=[[2, 2]])).sampled_token_ids.item() == 2
    # Once min_tokens outputs exist, EOS is allowed again.
    assert sampler(logits, build([params], 4, outputs=[[2, 2, 2]])).sampled_token_ids.item() == 0
    # Even a +100 bias cannot undo the ban; ignore_eos does not lift it either.
    forced = params.clone(logit_bias={0: 100.0}, ignore_eos=True, temperature=1.0)
    ids = sampler(logits.repeat(500, 1), build([forced] * 500, 4, outputs=[[2]] * 500))
    assert set(ids.sampled_token_ids.tolist()) <= {2, 3}


def _seeded_run(batch: list[SamplingParams], seeded_row: int, steps: int) -> list[int]:
    torch.manual_seed(123)  # the default generator differs between runs only via batch shape
    gens: list[torch.Generator | None] = [
        torch.Generator().manual_seed(p.seed) if p.seed is not None else None for p in batch
    ]
    tokens = []
    for step in range(steps):
        logits = torch.randn(len(batch), 64, generator=torch.Generator().manual_seed(step))
        logits[seeded_row] = torch.linspace(-1, 1, 64)  # the seeded row's logits are fixed
        out = sampler(logits, build(batch, 64, generators=gens))
        tokens.append(int(out.sampled_token_ids[seeded_row]))
    return tokens


def test_seed_reproducible_alone_or_in_batch() -> None:
    target = SamplingParams(seed=1234, top_p=0.9, temperature=0.8)
    others = [
        SamplingParams(),
        SamplingParams(seed=7, top_k=5),
        SamplingParams(temperature=0.0),
        SamplingParams(min_p=0.1, presence_penalty=1.0),
        SamplingParams(seed=99, temperature=1.5),
        SamplingParams(top_k=1),
        SamplingParams(logit_bias={3: 5.0}),
    ]
    alone = _seeded_run([target], 0, steps=20)
    batched = _seeded_run(others[:3] + [target] + others[3:], 3, steps=20)
    assert alone == batched
    other_seed = _seeded_run([target.clone(seed=4321)], 0, steps=20)
    assert other_seed != alone


def test_logprobs_are_raw_and_ranked() -> None:
    torch.manual_seed(3)
    logits = torch.randn(4, 30)
    params = [
        SamplingParams(logprobs=5, temperature=0.5, logit_bias={7: 3.0}),
        SamplingParams(logprobs=0),
        SamplingParams(),
        SamplingParams(logprobs=3, temperature=0.0),
    ]
    out = sampler(logits, build(params, 30))
    biased = logits.clone()
    biased[0, 7] += 3.0
    ref = torch.log_softmax(biased, dim=-1)  # after bias, before temperature
    assert out.logprobs[2] is None
    for row, n in ((0, 5), (1, 0), (3, 3)):
        lp = out.logprobs[row]
        assert lp is not None
        tok = int(out.sampled_token_ids[row])
        assert len(lp.token_ids) == len(lp.logprobs) == len(lp.ranks) == n + 1
        assert lp.token_ids[0] == tok
        assert lp.logprobs[0] == pytest.approx(ref[row, tok].item(), abs=1e-6)
        assert lp.ranks[0] == 1 + int((ref[row] > ref[row, tok]).sum())
        top = ref[row].topk(n)
        assert lp.token_ids[1:] == top.indices.tolist()
        assert lp.logprobs[1:] == pytest.approx(top.values.tolist(), abs=1e-6)
        assert lp.ranks[1:] == list(range(1, n + 1))
    assert out.logprobs[3] is not None and out.logprobs[3].ranks[0] == 1  # greedy: rank 1


def test_rank_counts_strictly_greater_logprobs() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0, 0.0]] * 4)
    out = compute_prompt_logprobs(logits, torch.tensor([2, 1, 3, 4]), num_top=2)
    assert [lp.ranks[0] for lp in out] == [1, 1, 3, 5]  # ties share the better rank
    lp = sampler(logits[:1], build([SamplingParams(temperature=0.0, logprobs=2)], 5)).logprobs[0]
    assert lp is not None and lp.token_ids[0] == 1 and lp.ranks[0] == 1
    assert sorted(lp.token_ids[1:]) == [1, 2]


def test_compute_prompt_logprobs() -> None:
    torch.manual_seed(4)
    logits = torch.randn(5, 40)
    next_ids = torch.tensor([3, 0, 39, 17, 3])
    out = compute_prompt_logprobs(logits, next_ids, num_top=4)
    ref = torch.log_softmax(logits, dim=-1)
    assert len(out) == 5
    for i, lp in enumerate(out):
        tok = int(next_ids[i])
        assert lp.token_ids[0] == tok
        assert lp.logprobs[0] == pytest.approx(ref[i, tok].item(), abs=1e-6)
        assert lp.ranks[0] == 1 + int((ref[i] > ref[i, tok]).sum())
        assert lp.token_ids[1:] == ref[i].topk(4).indices.tolist()
        assert lp.ranks[1:] == [1, 2, 3, 4]
    assert compute_prompt_logprobs(logits[:0], next_ids[:0], 4) == []


@pytest.mark.parametrize("change", [
    {}, {"temperature": 0.7}, {"presence_penalty": 0.5}, {"frequency_penalty": 2.0},
    {"repetition_penalty": 1.2}, {"logit_bias": {3: 5.0}}, {"min_tokens": 5}, {"logprobs": 0},
    {"allowed_token_ids": [2, 3]}, {"bad_words": ["x"], "bad_words_token_ids": [[0]]},
    {"bad_words_token_ids": [[0]]},
])
def test_argmax_only_is_the_samplers_choice(change):
    """`argmax_only` (the runner then takes the logits' argmax without the sampler) holds
    exactly when the sampler's token is the argmax of the raw logits with no logprobs: for
    each parameter that changes the choice or reports logits it is False."""
    params = SamplingParams(**{"temperature": 0.0, "max_tokens": 8, **change})
    assert params.argmax_only == (not change)
    # a row where the penalties, the bias and the min_tokens ban each move the choice
    logits = torch.tensor([[4.0, 1.0, 3.9, 3.8, 0.0]])
    out = sampler(logits, build([params], 5, prompts=[[0, 2]], outputs=[[0, 2]]))
    if params.argmax_only:
        assert out.sampled_token_ids.tolist() == [0] and out.logprobs == [None]
    elif params.greedy and "logprobs" not in change:
        assert out.sampled_token_ids.tolist() != [0]
