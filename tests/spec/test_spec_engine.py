"""Speculative decoding end to end: greedy output identical with and without n-gram speculation
(batched with requests that do not speculate, through preemption and prefix hits), rejected
tokens' blocks returned, and the sampled output's distribution unchanged."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from loom import SamplingParams
from loom.config import ConfigError
from loom.structured.params import StructuredOutputsParams
from tests.engine_fixtures import make_llm, tiny_model_with_tokenizer  # noqa: F401

# row_cost 0: every request drafts k tokens whenever the lookup finds them, in any batch (the
# adaptive draft length has its own tests in test_spec_unit)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1, "disable_by_batch_size": None, "row_cost": 0.0}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return tiny_model_with_tokenizer(str(tmp_path_factory.mktemp("tiny")))


def _tiny_prompts(n: int) -> list[list[int]]:
    """Prompts that repeat themselves (so lookups find drafts) and share a first block."""
    shared = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]
    return [shared + [30 + i, 31, 32, 33, 30 + i, 31, 32, 33, 30 + i, 31] * (1 + i % 3)
            for i in range(n)]


def _run(llm, prompts, params):
    outs = llm.generate(prompts, params, use_tqdm=False)
    llm.engine.check_integrity()
    assert all(o.finished for o in outs)
    return [[list(c.token_ids) for c in o.outputs] for o in outs]


def _mixed_params(n: int, max_tokens: int) -> list[SamplingParams]:
    """Greedy requests; every third asks for logprobs (so does not speculate), one has a
    repetition penalty (applied per accepted token) and one a stop token."""
    params = []
    for i in range(n):
        kw: dict = dict(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        if i % 3 == 2:
            kw["logprobs"] = 1
        if i == 1:
            kw["repetition_penalty"] = 1.3
        params.append(SamplingParams(**kw))
    return params


@pytest.mark.slow
@pytest.mark.parametrize("blocks", [None, 40])  # 40: preemptions
def test_tiny_greedy_same_with_speculation(make_llm, tiny, blocks) -> None:
    prompts = _tiny_prompts(8) + _tiny_prompts(2)  # the last two: prefix hits on whole prompts
    params = _mixed_params(len(prompts), 28)
    results = {}
    for spec in (None, json.dumps(NGRAM)):
        llm = make_llm(tiny, speculative_config=spec, num_gpu_blocks_override=blocks,
                       block_size=4, max_num_batched_tokens=64)
        results[spec is not None] = _run(llm, prompts, params)
        sched = llm.engine.scheduler
        if spec is not None:
            stats = sched.spec.stats
            assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0
            assert stats.num_accepted_tokens < stats.num_draft_tokens  # some were rolled back
            assert sched.kv_cache_manager.prefix_cache_stats.hits > 0
            assert not sched.spec._adaptive  # each request's draft state went with it
            if blocks is not None:
                assert sched.num_preemptions_total > 0
    assert results[True] == results[False]


@pytest.mark.slow
def test_smollm2_greedy_same_with_speculation(make_llm) -> None:
    """The packaged model on its default (int8, C stack) path, batch-invariant kernels; a
    stop string, a constrained request and a prefix hit among them."""
    prompts = [
        "Repeat this sentence twice: the quick brown fox jumps over the lazy dog.",
        "def add(a, b):\n    return a + b\n\nAdd a docstring to the function above:\n",
        "What is the capital of France?",
        "Repeat this sentence twice: the quick brown fox jumps over the lazy dog.",  # prefix hit
    ]
    params = _mixed_params(len(prompts), 40)
    params[3] = SamplingParams(temperature=0.0, max_tokens=40, stop=["dog"])
    # a constrained request (does not speculate) in the same batches
    params.append(SamplingParams(temperature=0.0, max_tokens=10, structured_outputs=(
        StructuredOutputsParams(choice=["Paris", "Lyon"]))))
    prompts.append(prompts[2])
    results = {}
    for spec in (None, json.dumps(NGRAM)):
        llm = make_llm(None, speculative_config=spec, num_gpu_blocks_override=24)
        results[spec is not None] = _run(llm, prompts, params)
        if spec is not None:
            assert llm.engine.scheduler.spec.stats.num_accepted_tokens > 0
    assert results[True] == results[False]


@pytest.mark.slow
def test_tiny_sampled_distribution_unchanged(make_llm, tiny) -> None:
    """Three tokens sampled (temperature 0.08) after a prompt whose lookup mostly proposes a
    draft (the last two tokens come from a verify step): their joint distribution over 600
    requests with and without speculation passes a two-sample chi-square test of homogeneity
    at significance 0.001 (outcomes seen fewer than 20 times in both runs pooled). The seeds
    are fixed, so the result is too; a sampler that accepted every draft fails it by far."""
    # Every token but 0-2 once (a lookup finds it); 200, which this model likes after 182,
    # moved there so some drafts are accepted
    prompt = [t for t in range(255, 2, -1) if t != 200]
    prompt.insert(prompt.index(182) + 1, 200)
    n = 600
    params = SamplingParams(temperature=0.08, max_tokens=3, ignore_eos=True)
    counts = {}
    for spec in (None, json.dumps(NGRAM)):
        llm = make_llm(tiny, speculative_config=spec, seed=1, max_num_seqs=64)
        outs = _run(llm, [prompt] * n, params)
        counts[spec is not None] = Counter(tuple(o[0]) for o in outs)
        if spec is not None:
            stats = llm.engine.scheduler.spec.stats
            assert stats.num_draft_tokens >= n // 2 and stats.num_accepted_tokens > 0
    stat, df = _chi_square_homogeneity(counts[False], counts[True], min_count=20)
    assert df >= 3
    assert stat <= _chi_square_critical(df, z=3.09), (stat, df, counts)  # z(0.999) = 3.09


@pytest.mark.slow
def test_tiny_sampled_draft_model(make_llm, tiny, tmp_path) -> None:
    """A sampled request's draft model samples its draft (the request's temperature), and the
    distributions it drew from go to the rejection sampling: with the target itself as the
    draft (q = p) nearly every draft token is kept (greedy drafts of sampled requests kept
    only where the target drew its argmax); another model's drafts leave the output's
    distribution as without speculation (the chi-square test above on the second token, the
    first drafted, of 600 requests at temperature 0.3; the draft: the target with its head's
    weights tripled, so its q is the target's distribution at a third of the temperature,
    sharper: drafts kept and rejected, the residual drawn); a seeded request gives the same
    tokens on two engines. (With q dropped in the verification the first part fails: 0 of
    488 kept; the rejection sampler with q has its own test in test_spec_unit.py.)"""
    import shutil
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    config = {"method": "draft_model", "model": tiny, "num_speculative_tokens": 3,
              "disable_by_batch_size": None, "row_cost": 0.0}
    llm = make_llm(tiny, speculative_config=json.dumps(config), seed=1)
    _run(llm, _tiny_prompts(8), SamplingParams(temperature=1.0, max_tokens=24,
                                               ignore_eos=True))
    stats = llm.engine.scheduler.spec.stats
    assert stats.num_draft_tokens > 100
    assert stats.num_accepted_tokens >= 0.95 * stats.num_draft_tokens, stats
    assert not llm.engine.scheduler.spec.drafter._generators  # (dropped with the requests)
    prompt = [t for t in range(255, 2, -1) if t != 200]  # as in the test above
    prompt.insert(prompt.index(182) + 1, 200)
    n = 600
    params = SamplingParams(temperature=0.3, max_tokens=3, ignore_eos=True)
    sharp = shutil.copytree(tiny, tmp_path / "sharp")
    weights = load_file(str(Path(sharp) / "model.safetensors"))
    weights["lm_head.weight"] = weights["lm_head.weight"] * 3.0
    save_file(weights, str(Path(sharp) / "model.safetensors"), metadata={"format": "pt"})
    config["model"] = str(sharp)
    counts = {}
    for spec in (None, json.dumps(config)):
        llm = make_llm(tiny, speculative_config=spec, seed=1, max_num_seqs=64)
        counts[spec is not None] = Counter(o[0][1] for o in _run(llm, [prompt] * n, params))
        if spec is not None:
            stats = llm.engine.scheduler.spec.stats
            assert stats.num_draft_tokens >= n and 0 < stats.num_accepted_tokens
            assert stats.num_accepted_tokens < stats.num_draft_tokens
    stat, df = _chi_square_homogeneity(counts[False], counts[True], min_count=20)
    assert df >= 3
    assert stat <= _chi_square_critical(df, z=3.09), (stat, df, counts)
    seeded = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, seed=5)
    runs = [_run(make_llm(tiny, speculative_config=json.dumps(config)), _tiny_prompts(3),
                 seeded) for _ in range(2)]
    assert runs[0] == runs[1]


def _chi_square_homogeneity(a: Counter, b: Counter, min_count: int) -> tuple[float, int]:
    """Two equal-sized samples: sum over outcomes of (a - b)^2 / (a + b), and its degrees of
    freedom; outcomes with fewer than `min_count` in both together pooled into one."""
    keys = set(a) | set(b)
    big = [k for k in keys if a[k] + b[k] >= min_count]
    cells = [(a[k], b[k]) for k in big]
    rest = (sum(a[k] for k in keys - set(big)), sum(b[k] for k in keys - set(big)))
    if sum(rest):
        cells.append(rest)
    return sum((x - y) ** 2 / (x + y) for x, y in cells), len(cells) - 1


def _chi_square_critical(df: int, z: float) -> float:
    """The chi-square quantile at the normal quantile z (Wilson-Hilferty)."""
    c = 2 / (9 * df)
    return df * (1 - c + z * c ** 0.5) ** 3


def test_large_batch_turns_speculation_off(make_llm, tiny) -> None:
    config = dict(NGRAM, disable_by_batch_size=2)
    llm = make_llm(tiny, speculative_config=json.dumps(config))
    _run(llm, _tiny_prompts(4), SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert llm.engine.scheduler.spec.stats.num_drafts == 0
    _run(llm, _tiny_prompts(1), SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert llm.engine.scheduler.spec.stats.num_drafts > 0


@pytest.mark.slow
def test_embedding_beside_drafts_pools_its_own_row(make_llm, tiny, monkeypatch) -> None:
    """A "last"-pooling request whose prompt ends in a step where other requests verify drafts
    (so the logits rows hold the drafts' rows too) gets the embedding it gets alone."""
    llm = make_llm(tiny, speculative_config=json.dumps(NGRAM))
    engine = llm.engine
    prompt = [5, 6, 7, 8, 9]
    alone = llm.embed([prompt], pooling="last", use_tqdm=False)[0].embedding
    drafted: set[str] = set()  # embedding requests whose prompt ran beside drafts
    execute = engine.runner.execute_model

    def observe(so):
        if so.scheduled_spec_decode_tokens:
            drafted.update(r for r in so.num_scheduled_tokens if r.startswith("e"))
        return execute(so)

    monkeypatch.setattr(engine.runner, "execute_model", observe)
    for i, tokens in enumerate(_tiny_prompts(3)):
        engine.add_request(f"g{i}", tokens,
                           SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    embeddings = {}
    step = 0
    while engine.has_unfinished_requests():
        if step < 20:
            engine.add_request(f"e{step}", prompt,
                               SamplingParams(temperature=0.0, max_tokens=1, pooling="last"))
        for out in engine.step():
            if out.finished and out.request_id.startswith("e"):
                embeddings[out.request_id] = out.embedding
        step += 1
    engine.check_integrity()
    assert drafted and len(embeddings) == min(step, 20)
    for rid in drafted:
        assert embeddings[rid] == pytest.approx(alone, abs=1e-5), rid


@pytest.mark.parametrize("bad", ['{"method": "eagle"}', '{"num_speculative_tokens": 2}',
                                 '{"method": "ngram", "num_speculative_tokens": 0}',
                                 '{"method": "ngram", "lookahead": 2}', "ngram"])
def test_bad_speculative_config_refused(make_llm, tiny, bad) -> None:
    with pytest.raises(ConfigError, match="speculative_config"):
        make_llm(tiny, speculative_config=bad)


@pytest.mark.slow
@pytest.mark.parametrize("draft", ["self", "other"])
def test_tiny_draft_model_greedy_same(make_llm, tiny, tmp_path, draft) -> None:
    """A draft model (the target itself: nearly every draft accepted; another random model:
    fewer)
    leaves greedy output unchanged, batched with requests that do not speculate and through
    preemptions."""
    from tests.tiny_models import make_tiny_model

    model = tiny if draft == "self" else str(make_tiny_model("llama", tmp_path / "d", seed=1))
    config = {"method": "draft_model", "model": model, "num_speculative_tokens": 3,
              "disable_by_batch_size": None}
    prompts = _tiny_prompts(6)
    params = _mixed_params(len(prompts), 20)
    results = {}
    for spec in (None, json.dumps(config)):
        llm = make_llm(tiny, speculative_config=spec, num_gpu_blocks_override=30, block_size=4)
        results[spec is not None] = _run(llm, prompts, params)
        if spec is not None:
            sched = llm.engine.scheduler
            stats = sched.spec.stats
            assert stats.num_draft_tokens > 0 and sched.num_preemptions_total > 0
            if draft == "self":  # (the repetition-penalised request's target disagrees)
                assert stats.num_accepted_tokens >= 0.8 * stats.num_draft_tokens
            else:
                assert stats.num_accepted_tokens < stats.num_draft_tokens
            sched.spec.drafter.kv.check_integrity()
    assert results[True] == results[False]


@pytest.mark.slow
@pytest.mark.parametrize(("blocks", "method"), [(None, None), (40, None), (None, "ngram"),
                                                (40, "draft_model")])  # 40: preemptions
def test_tiny_greedy_same_with_predictions(make_llm, tiny, tmp_path, blocks, method) -> None:
    """OpenAI's predicted outputs, without --speculative-config or beside n-gram or draft-model
    speculation: requests whose prediction is their output, their output with tokens changed,
    or unrelated tokens, batched with requests without one, give the tokens they give without
    it; the kept drafts count as accepted prediction tokens, the rolled-back ones as
    rejected."""
    from tests.tiny_models import make_tiny_model

    prompts = _tiny_prompts(6)
    plain = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)] * len(prompts)
    kw = dict(num_gpu_blocks_override=blocks, block_size=4, max_num_batched_tokens=64)
    base = _run(make_llm(tiny, **kw), prompts, plain)
    if method == "ngram":
        kw["speculative_config"] = json.dumps(NGRAM)
    elif method == "draft_model":
        kw["speculative_config"] = json.dumps({
            "method": "draft_model", "num_speculative_tokens": 3, "disable_by_batch_size": None,
            "model": str(make_tiny_model("llama", tmp_path / "d", seed=1))})
    edited = [list(o[0]) for o in base]
    for out in edited:
        out[5], out[14] = (out[5] + 1) % 256, (out[14] + 7) % 256
    predictions = [base[0][0], edited[1], list(range(40, 70)), None, base[4][0], edited[5]]
    params = [p if pred is None else p.clone(prediction=pred)
              for p, pred in zip(plain, predictions)]
    llm = make_llm(tiny, **kw)
    outs = llm.generate(prompts, params, use_tqdm=False)
    llm.engine.check_integrity()
    assert [[list(c.token_ids) for c in o.outputs] for o in outs] == base
    counts = [(o.outputs[0].accepted_prediction_tokens, o.outputs[0].rejected_prediction_tokens)
              for o in outs]
    assert counts[3] == (None, None)
    assert counts[0][0] >= 12 and counts[4][0] >= 12  # the whole output predicted
    assert counts[1][1] > 0 and counts[5][1] > 0  # the changed tokens were rejected
    spec = llm.engine.scheduler.spec
    assert spec.predictions_only == (method is None)
    if method is None:
        assert spec.stats.num_accepted_tokens == sum(a for a, _ in counts if a is not None)
    else:
        assert spec.stats.num_draft_tokens > sum(a + r for a, r in counts if a is not None)
    if method == "draft_model":
        spec.drafter.kv.check_integrity()
    if blocks is not None:
        assert llm.engine.scheduler.num_preemptions_total > 0


@pytest.mark.slow
def test_smollm2_prediction_text(make_llm) -> None:
    """The packaged model on its default path: a prediction given as text (an edit's expected
    reply) leaves greedy chat output as it is, most of it accepted as drafts."""
    llm = make_llm(None, enable_prefix_caching=False)
    messages = [{"role": "user", "content": "Copy this list exactly, one item per line:\n"
                 "- apples: 3 kg\n- bread: 2 loaves\n- milk: 1 litre\n- eggs: 12\n"}]
    params = SamplingParams(temperature=0.0, max_tokens=48)
    base = llm.chat(messages, params, use_tqdm=False)[0].outputs[0]
    edit = base.text.replace("bread", "rice")
    for pred in (base.text, edit, ""):
        out = llm.chat(messages, params.clone(prediction=pred), use_tqdm=False)[0].outputs[0]
        assert out.token_ids == base.token_ids
        if pred:
            assert out.accepted_prediction_tokens > len(base.token_ids) // 2
        else:  # an empty prediction drafts nothing
            assert out.accepted_prediction_tokens is None


def test_bad_prediction_refused(make_llm, tiny) -> None:
    from loom.engine.llm_engine import InvalidRequestError
    from loom.sampling_params import SamplingParamsError

    llm = make_llm(tiny)
    with pytest.raises(InvalidRequestError, match="prediction token ids out of range"):
        llm.engine.add_request("r", [1, 2, 3], SamplingParams(prediction=[5, 10**6]))
    with pytest.raises(SamplingParamsError, match="prediction"):
        SamplingParams(prediction=[1, -2])
    with pytest.raises(SamplingParamsError, match="prediction"):
        SamplingParams(prediction={"type": "content"})
    with pytest.raises(SamplingParamsError, match="embedding"):
        SamplingParams(max_tokens=1, pooling="last", prediction="x")
    assert not llm.engine.has_unfinished_requests()


def test_verified_blocks_reach_the_prefix_cache(make_llm, tiny) -> None:
    """A reply made of verify steps to its end (its prediction: itself): the blocks its kept
    drafts filled are offered to the prefix cache once verified, so a second turn holding the
    reply hits up to its last full block, not only the first turn's prompt's."""
    prompt = list(range(20, 41))
    params = SamplingParams(temperature=0.0, max_tokens=27, ignore_eos=True)
    llm = make_llm(tiny, block_size=4)
    reply = _run(llm, [prompt], params)[0][0]
    llm = make_llm(tiny, block_size=4)
    params.prediction = reply
    assert _run(llm, [prompt], params)[0][0] == reply
    stats = llm.engine.scheduler.kv_cache_manager.prefix_cache_stats
    hits = stats.hits
    _run(llm, [prompt + reply + [5, 6]], SamplingParams(temperature=0.0, max_tokens=2))
    assert stats.hits - hits == (len(prompt) + len(reply) - 1) // 4 * 4
