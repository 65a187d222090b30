"""Speculative decoding parts without a model: the n-gram proposer, the rejection sampler on a
synthetic target distribution, the adaptive draft length and the KV rollback."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from loom.config import ConfigError
from loom.core.kv_cache_manager import KVCacheManager
from loom.core.sched_output import CachedRequestData, SchedulerOutput
import numpy as np

from loom.core.spec_decode import (
    START_MATCH, SpecDecoder, SpeculativeConfig, ngram_match, ngram_propose, prediction_match,
)
from loom.engine.args import EngineArgs
from loom.engine.spec import spec_decoder
from loom.kernels.dispatch import KernelChoice
from loom.request import Request
from loom.sample.rejection import rejection_sample, verify_greedy
from loom.sampling_params import SamplingParams


def test_ngram_finds_the_latest_longest_match() -> None:
    tokens = [1, 2, 3, 9, 1, 2, 3, 4, 5, 6, 7, 1, 2, 3]
    assert ngram_propose(tokens, 3, 1, 3) == [4, 5, 6]  # [1 2 3] last seen before 4 5 6
    assert ngram_propose(tokens, 10, 1, 3) == [4, 5, 6, 7, 1, 2, 3]  # up to the end
    assert ngram_propose([5, 6, 7, 8], 2, 1, 3) == []  # 8 never seen before
    assert ngram_propose([5, 6, 5], 2, 1, 3) == [6, 5]
    assert ngram_propose([5, 6, 5], 2, 2, 3) == []  # shorter than prompt_lookup_min matches
    # the match length counts every token agreeing backwards, past prompt_lookup_max
    assert ngram_match(tokens, 1, 2) == (7, 3)  # [2 3] looked up, [1 2 3] agree
    assert ngram_match(list(range(9)) + [7, 3, 4, 5], 1, 3) == (6, 3)
    assert ngram_match([8] + list(range(9)) + [8] + list(range(5)), 1, 3) == (6, 6)
    assert ngram_match([5, 6, 7, 8], 1, 3) == (-1, 0)


def test_greedy_verification_keeps_the_target_tokens() -> None:
    assert verify_greedy([4, 5, 9, 1], [4, 5, 6]) == [4, 5, 9]
    assert verify_greedy([4, 5, 6, 1], [4, 5, 6]) == [4, 5, 6, 1]
    assert verify_greedy([7, 5, 6, 1], [4, 5, 6]) == [7]


def test_rejection_sampler_preserves_the_target_distribution() -> None:
    """First emitted token ~ p0 and, after an accepted first draft, the second ~ p1: total
    variation distance to the target <= 0.035 over 8,000 draws with a fixed seed (its
    expected value here is ~0.013; accepting every draft would give ~0.6)."""
    gen = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.1, 0.3, 0.2, 0.4, 0.0], [0.5, 0.0, 0.25, 0.05, 0.2],
                      [0.2, 0.2, 0.2, 0.2, 0.2]])
    draft = [3, 0]
    n = 8_000
    first, second = torch.zeros(5), torch.zeros(5)
    for _ in range(n):
        out = rejection_sample(p, draft, generator=gen)
        first[out[0]] += 1
        if out[0] == draft[0]:
            second[out[1]] += 1
    assert 0.5 * (first / n - p[0]).abs().sum() <= 0.035
    assert 0.5 * (second / second.sum() - p[1]).abs().sum() <= 0.035
    assert first[4] == 0 and second[1] == 0  # zero-probability tokens never come out


def test_rejection_sampler_with_a_draft_distribution() -> None:
    gen = torch.Generator().manual_seed(1)
    p = torch.tensor([[0.6, 0.3, 0.1], [1 / 3, 1 / 3, 1 / 3]])
    q = torch.tensor([[0.1, 0.1, 0.8]])
    n, counts = 6_000, torch.zeros(3)
    for _ in range(n):
        d = int(torch.multinomial(q[0], 1, generator=gen))
        counts[rejection_sample(p, [d], q=q, generator=gen)[0]] += 1
    assert 0.5 * (counts / n - p[0]).abs().sum() <= 0.035


def _request(tokens: list[int], max_tokens: int = 50, request_id: str = "r") -> Request:
    r = Request(request_id, tokens, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    r.max_tokens = max_tokens
    return r


def _drafts(spec: SpecDecoder, reqs: list[Request], accept: bool) -> list[int]:
    """One step: each request's draft length; then all accepted (or none)."""
    spec.prepare(reqs)
    drafts = [spec.propose(r, len(reqs), 100) for r in reqs]
    for r, d in zip(reqs, drafts):
        if d:
            spec.on_verified(r.request_id, len(d), len(d) if accept else 0)
    return [len(d) for d in drafts]


LONG = list(range(1, 40)) + list(range(1, 20))  # its last 19 tokens occurred before
SHORT = list(range(1, 40)) + [30, 1, 2, 3, 4]  # its last 4


def test_adaptive_draft_length_follows_the_match() -> None:
    """A draft is as long as its tokens' chances pay for (row_cost's prior 0.3): k where the
    last 19 tokens occurred before, 3 after a match of 4 (then more as such drafts are kept);
    a request whose drafts are rejected drafts less, then pauses 1, 2, 4 ... steps with a probe
    after each pause. Fixed length without `adaptive`."""
    config = SpeculativeConfig(num_speculative_tokens=7, prompt_lookup_max=3)
    assert _drafts(SpecDecoder(config, max_model_len=200), [_request(LONG, 90)], True) == [7]
    spec = SpecDecoder(config, max_model_len=200)
    req = _request(SHORT, 90)
    assert [_drafts(spec, [req], True)[0] for _ in range(6)] == [3, 4, 5, 6, 7, 7]
    assert spec.propose(req, 1, 100) == [5, 6, 7, 8, 9, 10, 11]  # the draft itself
    spec = SpecDecoder(config, max_model_len=200)
    req = _request(LONG, 90)
    assert [_drafts(spec, [req], False)[0] for _ in range(16)] == [
        7, 4, 3, 2, 0, 0, 2, 0, 0, 0, 1, 0, 0, 0, 0, 0]
    assert spec.propose(req, 9, 100) == []  # more running than disable_by_batch_size (8)
    assert spec.propose(req, 1, 0) == []  # no budget left
    fixed = SpecDecoder(SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=2,
                                          adaptive=False), max_model_len=100)
    assert [_drafts(fixed, [_request(SHORT, 90)], False)[0] for _ in range(4)] == [4, 4, 4, 4]
    short = _request(SHORT, max_tokens=3)
    short.append_output_token_ids(5)  # one of 3 out: at most 1 draft + 1 sampled
    assert ngram_propose(short.all_token_ids, 4, 1, 2) == [6, 7, 8, 9]
    assert SpecDecoder(config, max_model_len=100).propose(short, 1, 100) == [6]


def test_adaptive_draft_length_shares_the_step() -> None:
    """Batch-aware: the more requests decode in a step, the surer a draft token must be to be
    worth its row (a match of 4: 3 tokens alone, 1 each among four); the requests planned
    first in a step leave the later ones fewer rows; past disable_by_batch_size none drafts."""
    config = SpeculativeConfig(num_speculative_tokens=7, prompt_lookup_max=3)
    reqs = [_request(SHORT, 90, f"r{i}") for i in range(9)]
    assert _drafts(SpecDecoder(config, max_model_len=200), reqs[:1], True) == [3]
    assert _drafts(SpecDecoder(config, max_model_len=200), reqs[:3], True) == [2, 1, 1]
    assert _drafts(SpecDecoder(config, max_model_len=200), reqs[:4], True) == [1, 1, 1, 1]
    assert _drafts(SpecDecoder(config, max_model_len=200), reqs, True) == [0] * 9
    with pytest.raises(ConfigError, match="row_cost"):
        SpeculativeConfig(row_cost=1.5)
    with pytest.raises(ConfigError, match="adaptive"):  # JSON "false" is not false
        SpeculativeConfig.parse({"method": "ngram", "adaptive": "false"})
    with pytest.raises(ConfigError, match="row_cost"):  # it would be ignored
        SpeculativeConfig.parse({"method": "ngram", "adaptive": False, "row_cost": 0.1})


def _decode_step(rows: int) -> SchedulerOutput:
    """A step in which one request decoded its last token and rows - 1 draft tokens."""
    return SchedulerOutput([], CachedRequestData(["r"], [[]], [0]), {"r": rows}, rows, set(),
                           scheduled_spec_decode_tokens={"r": [0] * (rows - 1)} if rows > 1
                           else {})


def test_adaptive_draft_length_from_measured_step_times() -> None:
    """Without row_cost the engine's measured step times set a row's cost: where 8 rows take
    about as long as 1, a match of 4 drafts k; where each row costs a one-row step, none. A
    seeded sampled request, and a config with row_cost, keep the prior's lengths; steps with a
    prompt are not counted."""
    config = SpeculativeConfig(num_speculative_tokens=7, prompt_lookup_max=3)

    def measured(seconds_per_rows) -> SpecDecoder:
        spec = SpecDecoder(config, max_model_len=200)
        for _ in range(3):
            for rows in (1, 8):
                spec.observe_step(_decode_step(rows), seconds_per_rows(rows))
        return spec

    flat = measured(lambda rows: 0.010 + 0.0005 * rows)
    assert _drafts(flat, [_request(SHORT, 90)], True) == [7]
    seeded = Request("s", SHORT, SamplingParams(temperature=0.8, seed=3, max_tokens=90))
    seeded.max_tokens = 90
    assert _drafts(measured(lambda rows: 0.010 + 0.0005 * rows), [seeded], True) == [3]
    steep = measured(lambda rows: 0.010 * rows)
    assert _drafts(steep, [_request(SHORT, 90)], True) == [0]
    pinned = SpecDecoder(SpeculativeConfig(num_speculative_tokens=7, prompt_lookup_max=3,
                                           row_cost=0.3), max_model_len=200)
    for _ in range(3):
        pinned.observe_step(_decode_step(8), 0.010)
        pinned.observe_step(_decode_step(1), 0.010)
    assert _drafts(pinned, [_request(SHORT, 90)], True) == [3]
    prompt = SpecDecoder(config, max_model_len=200)
    for _ in range(3):
        for rows in (1, 8):  # a prompt chunk of `rows` tokens: not a decode step
            so = _decode_step(rows)
            so.scheduled_spec_decode_tokens = {}
            prompt.observe_step(so, 0.010)
    assert _drafts(prompt, [_request(SHORT, 90)], True) == [3]


def test_seeded_sampled_draft_lengths_do_not_depend_on_step_times() -> None:
    """A seeded sampled request drafts the same lengths (so its random draws are the same)
    whatever the measured step times: its pauses too (a verified draft resets the back-off by
    the prior costs, not the measured ones)."""
    config = SpeculativeConfig(num_speculative_tokens=7, prompt_lookup_max=3)
    accepted = [1, 1, 0, 0, 1, 1, 0, 1] + [0] * 12 + [1, 0, 0, 1, 0, 0, 1, 1, 0, 0, 0, 0, 1, 0, 1]

    def lengths(spec: SpecDecoder) -> list[int]:
        req = Request("s", LONG, SamplingParams(temperature=0.8, seed=3, max_tokens=90))
        req.max_tokens = 90
        out = []
        for a in accepted:
            spec.prepare([req])
            draft = spec.propose(req, 1, 100)
            if draft:
                spec.on_verified("s", len(draft), min(a, len(draft)))
            out.append(len(draft))
        return out

    flat = SpecDecoder(config, max_model_len=200)
    for _ in range(3):
        for rows in (1, 8):  # a second row nearly free: a greedy request would never pause
            flat.observe_step(_decode_step(rows), 0.010 + 0.0005 * rows)
    prior = lengths(SpecDecoder(config, max_model_len=200))
    assert 0 in prior[8:] and lengths(flat) == prior


def test_trim_returns_the_rejected_tokens_blocks() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_caching=True, max_model_len=64)
    req = _request(list(range(6)))
    assert kv.allocate_slots(req, 6 + 5) is not None  # prompt + 5 draft tokens: 3 blocks
    free = kv.num_free_blocks
    kv.trim(req, 7)  # one draft accepted: 7 tokens computed, 2 blocks
    assert len(kv.get_block_ids("r")) == 2 and kv.num_free_blocks == free + 1
    kv.check_integrity()
    kv.free(req)
    kv.check_integrity()


def test_config_parse() -> None:
    c = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 5}')
    assert c is not None and c.num_speculative_tokens == 5 and c.prompt_lookup_max == 4
    assert SpeculativeConfig.parse(None) is None
    with pytest.raises(Exception, match="prompt_lookup_min"):
        SpeculativeConfig.parse({"method": "ngram", "prompt_lookup_min": 5,
                                 "prompt_lookup_max": 2})


def test_long_drafts_warn_where_the_kernels_change_past_8_rows(caplog) -> None:
    """A verify step of more than 8 rows on kernels whose bits change past 8 rows (the default
    int8 ones: VNNI up to 8, bf16 past) warns that greedy output may differ and names the
    limit; k = 7, batch-invariant kernels and no CPU kernels do not."""
    varying = KernelChoice("bf16", "bf16", "vnni", "int8", False)
    fixed = KernelChoice("bf16", "fp32", "fp32", "int8", True)

    def warned(k: int, kernels: KernelChoice | None) -> bool:
        caplog.clear()
        config = json.dumps({"method": "ngram", "num_speculative_tokens": k})
        with caplog.at_level(logging.WARNING, logger="loom.engine.spec"):
            got = spec_decoder(EngineArgs(speculative_config=config), 256, None, 16,
                               torch.device("cpu"), kernels)
        assert got is not None and got.config.num_speculative_tokens == k
        return "num_speculative_tokens <= 7" in caplog.text

    assert warned(8, varying) and warned(12, varying)
    assert not warned(7, varying) and not warned(12, fixed) and not warned(12, None)


def test_prediction_match_follows_the_output() -> None:
    """Where the output goes on in a prediction: its start before any output; after the
    longest suffix n-gram of the output found in it, the occurrence nearest after where the
    last draft led; nowhere when the n-gram is absent or ends the prediction."""
    pred = np.array([5, 6, 7, 8, 9, 5, 6, 7, 1, 2], dtype=np.int64)
    assert prediction_match(pred, [], 0) == (0, START_MATCH)
    assert prediction_match(pred[:0], [], 0) == (-1, 0)
    assert prediction_match(pred, [5, 6], 2) == (2, START_MATCH)  # the prediction's start
    # [6, 7] occurs twice: the one at or after the expected place, else the last before it
    assert prediction_match(pred, [4, 6, 7], 3) == (3, 2)
    assert prediction_match(pred, [4, 6, 7], 4) == (8, 2)
    assert prediction_match(pred, [4, 6, 7], 9) == (8, 2)
    # the longer n-gram wins over the expected place: [8, 9, 5, 6, 7] leads to 1
    assert prediction_match(pred, [8, 9, 5, 6, 7], 3) == (8, 5)
    assert prediction_match(pred, [3, 4], 0) == (-1, 0)
    assert prediction_match(pred, [1, 2], 0) == (-1, 0)  # nothing follows it


def _prediction_request(tokens: list[int], prediction: list[int], request_id: str = "p"
                        ) -> Request:
    r = _request(tokens, 90, request_id)
    r.prediction = np.asarray(prediction, dtype=np.int64)
    return r


def test_prediction_drafts_without_a_speculative_config() -> None:
    """The engine's decoder without --speculative-config drafts for requests with a prediction
    alone: from the prediction's start, on along it as tokens are accepted, and again from where
    the output meets it after a change; never for other requests, nor for pooling ones."""
    spec = SpecDecoder(SpeculativeConfig(num_speculative_tokens=7), 200, predictions_only=True)
    assert not spec.reported
    plain = _request(LONG, 90, "plain")  # its lookup would find a draft with a config
    pred = list(range(100, 130))
    req = _prediction_request([1, 2, 3], pred)
    spec.prepare([plain, req])
    assert spec.propose(plain, 2, 100) == []
    first = spec.propose(req, 2, 100)
    assert first and first == pred[: len(first)]
    spec.on_verified("p", len(first), len(first))
    assert spec.reported
    req.append_output_token_ids(pred[: len(first) + 1])  # all kept, then the sampled one
    spec.prepare([req])
    assert spec.propose(req, 1, 100) == pred[len(first) + 1: len(first) + 8]
    # the reply changes a token, then goes on as the prediction after it
    req.append_output_token_ids([7, pred[len(first) + 2]])
    spec.prepare([req])
    assert spec.propose(req, 1, 100) == []  # a match of one token: not worth a row
    req.append_output_token_ids(pred[len(first) + 3])
    spec.prepare([req])
    assert spec.propose(req, 1, 100)[:1] == [pred[len(first) + 4]]
    pooled = Request("e", [1, 2], SamplingParams(max_tokens=1, pooling="last"))
    pooled.prediction = req.prediction
    spec.prepare([pooled])
    assert spec.propose(pooled, 1, 100) == []
    spec.drop("p")
    assert not spec._expect and not spec._adaptive


def test_prediction_tokens_from_the_engine_args() -> None:
    """Without a config the decoder serves predictions alone, up to 7 drafts (a verify step
    within the one-row kernels' 8 rows) or 16 where the kernels keep their bits past 8; with
    one, predictions draft the more of that and its k; none with tensor parallelism."""
    varying = KernelChoice("bf16", "bf16", "vnni", "int8", False)
    fixed = KernelChoice("bf16", "fp32", "fp32", "int8", True)
    cpu = torch.device("cpu")
    alone = spec_decoder(EngineArgs(), 256, None, 16, cpu, varying)
    assert alone is not None and alone.predictions_only and alone.prediction_tokens == 7
    assert spec_decoder(EngineArgs(), 256, None, 16, cpu, fixed).prediction_tokens == 16
    config = json.dumps({"method": "ngram", "num_speculative_tokens": 3})
    both = spec_decoder(EngineArgs(speculative_config=config), 256, None, 16, cpu, varying)
    assert not both.predictions_only and both.prediction_tokens == 7
    assert spec_decoder(EngineArgs(tensor_parallel_size=2), 256, None, 16, cpu, varying) is None
