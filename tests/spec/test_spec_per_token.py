"""Everything a token passes through applies per accepted draft token: logprobs (from the token's
own row), penalties (counting the step's earlier accepted tokens), structured-output masks (the
grammar advanced through the draft and rolled back) and stops, with requests that speculate
batched beside ones that do not."""

from __future__ import annotations

import json
import re

import pytest

from loom import SamplingParams
from loom.structured.params import StructuredOutputsParams
from tests.engine_fixtures import make_llm, tiny_model_with_tokenizer  # noqa: F401
from tests.spec.test_spec_engine import NGRAM, _tiny_prompts


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return tiny_model_with_tokenizer(str(tmp_path_factory.mktemp("tiny")))


def _observe_steps(llm) -> list[tuple[int, int]]:
    """Per step that verified drafts: (requests with a draft, requests without one)."""
    runner = llm.engine.runner
    execute = runner.execute_model
    steps: list[tuple[int, int]] = []

    def observe(so):
        drafts = so.scheduled_spec_decode_tokens
        if drafts:
            steps.append((len(drafts), len(so.num_scheduled_tokens) - len(drafts)))
        return execute(so)

    runner.execute_model = observe
    return steps


def _penalized(n: int, max_tokens: int) -> list[SamplingParams]:
    """Greedy requests asking for top-3 logprobs; every third with repetition, frequency and
    presence penalties."""
    params = []
    for i in range(n):
        kw: dict = dict(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=3)
        if i % 3 == 1:
            kw.update(repetition_penalty=1.2, frequency_penalty=0.4, presence_penalty=0.3)
        params.append(SamplingParams(**kw))
    return params


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_tiny_greedy_logprobs_and_penalties_same(make_llm, tiny, method) -> None:
    """Tokens identical and each token's logprobs (its own, its rank, the top 3) equal within
    1e-5 with and without speculation, penalties included; drafts verified in steps beside
    prompt chunks and requests without a draft."""
    spec = dict(NGRAM) if method == "ngram" else {
        "method": "draft_model", "model": tiny, "num_speculative_tokens": 3,
        "disable_by_batch_size": None}
    prompts = _tiny_prompts(6)
    params = _penalized(len(prompts), 24)
    results = {}
    for config in (None, json.dumps(spec)):
        llm = make_llm(tiny, speculative_config=config, block_size=4, max_num_batched_tokens=48)
        steps = _observe_steps(llm)
        outs = llm.generate(prompts, params, use_tqdm=False)
        llm.engine.check_integrity()
        results[config is not None] = [o.outputs[0] for o in outs]
        if config is not None:
            assert llm.engine.scheduler.spec.stats.num_accepted_tokens > 0
            assert any(other for _, other in steps)  # beside requests without a draft
    for base, spec_out in zip(results[False], results[True]):
        assert spec_out.token_ids == base.token_ids
        assert len(spec_out.logprobs) == len(base.logprobs) == len(base.token_ids)
        for a, b in zip(base.logprobs, spec_out.logprobs):
            assert b.token_ids == a.token_ids and b.ranks == a.ranks
            assert b.logprobs == pytest.approx(a.logprobs, abs=1e-5)


@pytest.mark.slow
def test_tiny_sampled_logprobs_are_their_rows(make_llm, tiny) -> None:
    """A sampled request's logprobs with speculation are those of the tokens it emitted: each
    equals the prompt logprob of the same token when prompt + output is scored again."""
    draft = {"method": "draft_model", "model": tiny, "num_speculative_tokens": 3}
    llm = make_llm(tiny, speculative_config=json.dumps(draft))  # it drafts its own argmax
    prompt = _tiny_prompts(3)[2]
    params = [SamplingParams(temperature=0.3, max_tokens=16, ignore_eos=True, logprobs=2,
                             seed=s) for s in range(3)]
    outs = [o.outputs[0] for o in llm.generate([prompt] * 3, params, use_tqdm=False)]
    assert llm.engine.scheduler.spec.stats.num_accepted_tokens > 0
    again = llm.generate([prompt + list(o.token_ids) for o in outs],
                         SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    for o, scored in zip(outs, again):
        expected = scored.prompt_logprobs[len(prompt):]
        assert len(o.logprobs) == len(expected) == len(o.token_ids)
        for token, lp, ref in zip(o.token_ids, o.logprobs, expected):
            assert lp.token_ids[0] == ref.token_ids[0] == token
            assert lp.logprobs[0] == pytest.approx(ref.logprobs[0], abs=1e-4)


SCHEMA = {"type": "object", "properties": {"name": {"type": "string"},
                                           "age": {"type": "integer"},
                                           "city": {"type": "string"}},
          "required": ["name", "age", "city"]}
RECORD = '{"name": "Elias Marlow", "age": 54, "city": "Northcliff Harbour"}'
PHONE = r"\(\d{3}\) \d{3}-\d{4}( \(\d{3}\) \d{3}-\d{4}){1}"


@pytest.mark.slow
def test_smollm2_structured_output_same_with_speculation(make_llm) -> None:
    """JSON-schema and regex constrained requests speculate (drafts cut at the first token the
    grammar forbids, a mask per draft position) and give the same valid output as without,
    batched with a plain request asking for logprobs."""
    prompts = [f"Copy this JSON record exactly: {RECORD}\nCopy: ",
               "Phone numbers: (555) 201-3344 (555) 201-3345 (555) 201-3346. Repeat them: ",
               f"Repeat this record twice: {RECORD}"]
    params = [
        SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=(
            StructuredOutputsParams(json=SCHEMA))),
        SamplingParams(temperature=0.0, max_tokens=40, logprobs=1, structured_outputs=(
            StructuredOutputsParams(regex=PHONE))),
        SamplingParams(temperature=0.0, max_tokens=30, logprobs=1),
    ]
    results = {}
    for config in (None, json.dumps(NGRAM)):
        llm = make_llm(None, speculative_config=config)
        runner = llm.engine.runner
        execute = runner.execute_model
        constrained_drafts = []

        def observe(so, execute=execute, seen=constrained_drafts):
            rows = so.structured_rows or {}
            seen.extend(len(d) for r, d in so.scheduled_spec_decode_tokens.items() if r in rows)
            return execute(so)

        runner.execute_model = observe
        outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        llm.engine.check_integrity()
        results[config is not None] = [(o.text, o.token_ids,
                                        [lp.logprobs[0] for lp in o.logprobs or []])
                                       for o in outs]
        if config is not None:
            assert sum(constrained_drafts) >= 8  # the constrained requests speculated
            assert llm.engine.scheduler.spec.stats.num_accepted_tokens > 0
    record = json.loads(results[True][0][0])
    assert set(record) == {"name", "age", "city"} and isinstance(record["age"], int)
    assert re.fullmatch(PHONE, results[True][1][0])
    for (text, ids, lps), (text_s, ids_s, lps_s) in zip(results[False], results[True]):
        assert (text_s, ids_s) == (text, ids)
        assert lps_s == pytest.approx(lps, abs=1e-5)


@pytest.mark.slow
def test_smollm2_default_kernels_greedy_same(make_llm) -> None:
    """Loom's default kernels (not batch-invariant), one stream, adaptive drafts of up to 7
    tokens (1 to 8 rows a verify step): the decode kernel's bits for a row do not depend on the
    rows beside it, so greedy output is identical."""
    prompt = ("Quote this passage word for word: The lighthouse stood on the northern cliff "
              "for two hundred years. Its keeper, a quiet man named Elias, climbed the steps "
              "every evening to light the lamp.\nQuote: ")
    config = json.dumps({**{k: v for k, v in NGRAM.items() if k != "row_cost"},
                         "num_speculative_tokens": 7})
    params = SamplingParams(temperature=0.0, max_tokens=48, logprobs=1)
    outs = {}
    for spec in (None, config):
        llm = make_llm(None, speculative_config=spec, batch_invariant=False)
        outs[spec is not None] = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        if spec is not None:
            stats = llm.engine.scheduler.spec.stats
            assert len(stats.proposed_per_pos) == 7 and stats.accepted_per_pos[6] > 0
    assert outs[True].token_ids == outs[False].token_ids
    assert [lp.logprobs[0] for lp in outs[True].logprobs] == pytest.approx(
        [lp.logprobs[0] for lp in outs[False].logprobs], abs=1e-5)
