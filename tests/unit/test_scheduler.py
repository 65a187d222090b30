"""Scheduler with a fake runner: chunked prefill, mixed batches, caps, FCFS, preemption,
stop rules, rejection, aborts and n-way prefix sharing."""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable

import pytest

from loom.config import SchedulerConfig
from loom.core.kv_cache_manager import KVCacheManager
from loom.core.sched_output import ModelRunnerOutput, SchedulerOutput
from loom.core.scheduler import EngineCoreOutput, RequestRejectedError, Scheduler
from loom.request import FinishReason, Request, RequestStatus
from loom.sampling_params import SamplingParams

BS = 4
EOS = 2

TokenFn = Callable[[Request], int]

# Every int-sized prompt gets tokens no other prompt has, so only explicit lists share prefixes.
_fresh_tokens = itertools.count(1000)


def make_scheduler(
    num_blocks: int = 64,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 128,
    caching: bool = True,
    policy: str = "fcfs",
) -> Scheduler:
    kv = KVCacheManager(num_blocks, BS, enable_caching=caching, max_model_len=max_model_len)
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        policy=policy,
    )
    return Scheduler(config, kv, BS)


def make_request(rid: str, prompt: list[int] | int, priority: int = 0,
                 arrival_time: float | None = None, **params: object) -> Request:
    tokens = [next(_fresh_tokens) for _ in range(prompt)] if isinstance(prompt, int) else prompt
    params.setdefault("ignore_eos", True)
    params_obj = SamplingParams(**params)  # type: ignore[arg-type]
    return Request(rid, tokens, params_obj, eos_token_ids=(EOS,), arrival_time=arrival_time,
                   priority=priority)


def fake_runner_output(
    sched: Scheduler, out: SchedulerOutput, token: int | TokenFn = 7
) -> ModelRunnerOutput:
    """Sample `token` for every request whose scheduled tokens reach its end; [] for chunks."""
    req_ids, sampled = [], []
    for rid, n in out.num_scheduled_tokens.items():
        req = sched.requests[rid]
        done = req.num_computed_tokens + n == req.num_tokens
        req_ids.append(rid)
        sampled.append([token(req) if callable(token) else token] if done else [])
    return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)


def step(
    sched: Scheduler, token: int | TokenFn = 7
) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
    out = sched.schedule()
    outputs = sched.update_from_output(out, fake_runner_output(sched, out, token))
    sched.kv_cache_manager.check_integrity()
    return out, outputs


def run_to_completion(sched: Scheduler, max_steps: int = 1000) -> dict[str, EngineCoreOutput]:
    finals: dict[str, EngineCoreOutput] = {}
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            break
        _, outputs = step(sched)
        finals.update({o.req_id: o for o in outputs if o.finished})
    assert not sched.has_unfinished_requests()
    return finals


def assert_drained(sched: Scheduler) -> None:
    kv = sched.kv_cache_manager
    kv.check_integrity()
    assert kv.req_to_blocks == {}
    assert all(b.ref_cnt == 0 for b in kv.block_pool.blocks)
    assert kv.num_free_blocks == kv.num_usable_blocks


# ---- the token-budget rule -----------------------------------------------------------------


def test_chunked_prefill_under_small_budget() -> None:
    sched = make_scheduler(max_num_batched_tokens=8)
    req = make_request("a", 20, max_tokens=2)
    sched.add_request(req)

    out, outputs = step(sched)
    assert out.num_scheduled_tokens == {"a": 8} and out.total_num_scheduled_tokens == 8
    [new] = out.scheduled_new_reqs
    assert (new.req_id, new.block_ids, new.num_computed_tokens) == ("a", [1, 2], 0)
    assert new.token_ids == req.prompt_token_ids and new.num_prompt_tokens == 20
    assert outputs == [] and req.num_computed_tokens == 8

    out, outputs = step(sched)
    assert out.num_scheduled_tokens == {"a": 8} and out.scheduled_new_reqs == []
    assert out.scheduled_cached_reqs.req_ids == ["a"]
    assert out.scheduled_cached_reqs.new_block_ids == [[3, 4]]
    assert out.scheduled_cached_reqs.num_computed_tokens == [8]
    assert outputs == []

    out, outputs = step(sched)
    assert out.num_scheduled_tokens == {"a": 4}
    assert out.scheduled_cached_reqs.new_block_ids == [[5]]
    assert [(o.req_id, o.new_token_ids, o.finish_reason) for o in outputs] == [("a", [7], None)]
    assert req.num_computed_tokens == 20 and req.output_token_ids == [7]

    out, outputs = step(sched)  # decode: 1 token, block 6 for position 20
    assert out.num_scheduled_tokens == {"a": 1}
    assert out.scheduled_cached_reqs.new_block_ids == [[6]]
    assert outputs[0].finish_reason == FinishReason.LENGTH
    assert_drained(sched)
    assert sched.schedule().finished_req_ids == {"a"}


def test_mixed_prefill_and_decode_in_one_step() -> None:
    sched = make_scheduler()
    sched.add_request(make_request("a", 4, max_tokens=5))
    step(sched)
    sched.add_request(make_request("b", 10, max_tokens=5))
    out, outputs = step(sched)
    assert out.num_scheduled_tokens == {"a": 1, "b": 10}
    assert out.total_num_scheduled_tokens == 11
    assert out.scheduled_cached_reqs.req_ids == ["a"]
    assert out.scheduled_cached_reqs.new_block_ids == [[2]]  # position 4 starts a's 2nd block
    assert [n.req_id for n in out.scheduled_new_reqs] == ["b"]
    assert out.scheduled_new_reqs[0].block_ids == [3, 4, 5]
    assert {o.req_id for o in outputs} == {"a", "b"}


def test_budget_split_between_decode_and_prefill_chunk() -> None:
    sched = make_scheduler(max_num_batched_tokens=6)
    sched.add_request(make_request("a", 4, max_tokens=5))
    step(sched)
    sched.add_request(make_request("b", 10, max_tokens=5))
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"a": 1, "b": 5}


def test_max_num_seqs_caps_running_requests() -> None:
    sched = make_scheduler(max_num_seqs=2)
    for i, max_tokens in enumerate([1, 3, 3]):
        sched.add_request(make_request(f"r{i}", 4, max_tokens=max_tokens))
    out, outputs = step(sched)
    assert list(out.num_scheduled_tokens) == ["r0", "r1"]
    assert (sched.num_running, sched.num_waiting) == (1, 1)  # r0 finished at once
    assert [o.req_id for o in outputs if o.finished] == ["r0"]
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"r1": 1, "r2": 4}
    assert sched.num_running == 2
    run_to_completion(sched)
    assert_drained(sched)


def test_waiting_queue_is_fcfs_without_skipping() -> None:
    sched = make_scheduler(num_blocks=7)  # 6 usable blocks
    sched.add_request(make_request("a", 12, max_tokens=8))
    step(sched)  # a holds 3 blocks
    sched.add_request(make_request("b", 16, max_tokens=4))  # needs 4 blocks: does not fit now
    sched.add_request(make_request("c", 4, max_tokens=4))  # would fit, must not overtake b
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"a": 1}
    assert [r.request_id for r in sched.waiting] == ["b", "c"]
    finals = run_to_completion(sched)
    assert set(finals) == {"a", "b", "c"}
    assert_drained(sched)


# ---- preemption ----------------------------------------------------------------------------


def test_preempts_newest_and_recomputes_it_later() -> None:
    sched = make_scheduler(num_blocks=5)  # 4 usable blocks
    a = make_request("a", 4, max_tokens=8)
    b = make_request("b", 4, max_tokens=8)
    sched.add_request(a)
    sched.add_request(b)
    out, _ = step(sched)
    assert [(n.req_id, n.block_ids) for n in out.scheduled_new_reqs] == [("a", [1]), ("b", [2])]
    out, _ = step(sched)
    assert out.scheduled_cached_reqs.new_block_ids == [[3], [4]]
    for _ in range(3):
        step(sched)
    # Both at 8 computed tokens + 1 pending: a needs a 3rd block and none is free.
    assert (a.num_computed_tokens, b.num_computed_tokens, b.num_output_tokens) == (8, 8, 5)

    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"a": 1}
    assert out.scheduled_cached_reqs.new_block_ids == [[4]]  # b's freed tail block, evicted
    assert out.finished_req_ids == out.preempted_req_ids == {"b"}
    assert b.status == RequestStatus.PREEMPTED
    assert (b.num_computed_tokens, b.num_preemptions, sched.num_preemptions_total) == (0, 1, 1)
    assert list(sched.waiting) == [b] and sched.running == [a]
    assert sched.kv_cache_manager.get_block_ids("b") == []
    b_outputs = list(b.output_token_ids)

    finals: dict[str, EngineCoreOutput] = {}
    resumed = None
    while sched.has_unfinished_requests():
        out, outputs = step(sched)
        finals.update({o.req_id: o for o in outputs if o.finished})
        for new in out.scheduled_new_reqs:
            resumed = new
    assert resumed is not None and resumed.req_id == "b"
    assert resumed.token_ids == b.prompt_token_ids + b_outputs  # prompt + outputs so far
    # b's first block survived in the prefix cache: only the 2nd block is recomputed.
    assert resumed.num_computed_tokens == 4
    assert finals["a"].finish_reason == finals["b"].finish_reason == FinishReason.LENGTH
    assert len(a.output_token_ids) == len(b.output_token_ids) == 8
    assert_drained(sched)


def _newest_preempted(sched: Scheduler) -> tuple[Request, Request]:
    """Requests a and b in a 4-block cache: b, the newest, needs a third block at its first
    decode and preempts itself there (the step after its prompt's)."""
    a = make_request("a", 6, max_tokens=3)  # 2 blocks with room for position 6
    b = make_request("b", 8, max_tokens=2)  # 2 full blocks: position 8 needs a 3rd
    sched.add_request(a)
    sched.add_request(b)
    step(sched)
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"a": 1}
    assert out.finished_req_ids == out.preempted_req_ids == {"b"}
    assert b.status == RequestStatus.PREEMPTED and sched.running == [a]
    return a, b


def test_request_aborted_while_preempted_reaches_the_runner() -> None:
    """A preempted request aborted before it resumes is named in finished_req_ids (and not
    as preempted) so the runner forgets the generator it kept for the resumption."""
    sched = make_scheduler(num_blocks=5)  # 4 usable blocks
    _newest_preempted(sched)
    sched.finish_requests("b", RequestStatus.FINISHED_ABORTED)
    out, _ = step(sched)
    assert "b" in out.finished_req_ids and not out.preempted_req_ids
    run_to_completion(sched)
    assert_drained(sched)


def test_request_preempts_itself_when_it_is_the_newest() -> None:
    sched = make_scheduler(num_blocks=5)  # 4 usable blocks
    a, b = _newest_preempted(sched)
    finals = run_to_completion(sched)
    assert set(finals) == {"a", "b"}
    assert b.output_token_ids == [7, 7] and len(a.output_token_ids) == 3
    assert_drained(sched)


def test_random_workload_finishes_with_clean_cache() -> None:
    rng = random.Random(0)
    sched = make_scheduler(num_blocks=24, max_num_seqs=6, max_num_batched_tokens=20)
    kv = sched.kv_cache_manager
    shared = [rng.randrange(100, 200) for _ in range(12)]
    reqs: dict[str, tuple[Request, int]] = {}
    for i in range(30):
        own = [rng.randrange(100, 200) for _ in range(rng.randrange(1, 20))]
        prompt = (shared if i % 2 else []) + own
        max_tokens = rng.randrange(1, 30)
        req = make_request(f"r{i}", prompt, max_tokens=max_tokens)
        reqs[req.request_id] = (req, max_tokens)
        sched.add_request(req)
    finals: dict[str, EngineCoreOutput] = {}
    for _ in range(2000):
        if not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        assert out.total_num_scheduled_tokens <= 20
        assert len(out.num_scheduled_tokens) <= 6
        for rid, n in out.num_scheduled_tokens.items():
            req = sched.requests[rid]
            # Blocks cover every token computed after this step, and never beyond the request.
            assert len(kv.get_block_ids(rid)) * BS >= req.num_computed_tokens + n
            assert req.num_computed_tokens + n <= req.num_tokens
        outputs = sched.update_from_output(out, fake_runner_output(sched, out))
        kv.check_integrity()
        finals.update({o.req_id: o for o in outputs if o.finished})
    assert set(finals) == set(reqs)
    assert all(o.finish_reason == FinishReason.LENGTH for o in finals.values())
    assert all(len(req.output_token_ids) == max_tokens for req, max_tokens in reqs.values())
    assert sched.num_preemptions_total > 0
    assert sum(req.num_preemptions for req, _ in reqs.values()) == sched.num_preemptions_total
    assert sched.prefix_cache_stats.hits > 0
    assert_drained(sched)


# ---- the priority policy -------------------------------------------------------------------


def test_priority_policy_admits_by_priority_then_arrival() -> None:
    sched = make_scheduler(max_num_seqs=2, policy="priority")
    for i, (rank, arrival) in enumerate([(5, 0.0), (1, 1.0), (5, 2.0), (0, 3.0), (1, 0.5)]):
        sched.add_request(make_request(f"r{i}", 4, priority=rank, arrival_time=arrival,
                                       max_tokens=2))
    assert [r.request_id for r in sched.waiting] == ["r3", "r4", "r1", "r0", "r2"]
    admitted = []
    while sched.has_unfinished_requests():
        out, _ = step(sched)
        admitted += [n.req_id for n in out.scheduled_new_reqs]
    assert admitted == ["r3", "r4", "r1", "r0", "r2"]
    assert sched.num_preemptions_total == 0
    assert_drained(sched)


def test_priority_policy_preempts_lowest_priority_for_blocks() -> None:
    """Running requests that run out of blocks preempt the lowest-ranked one (not the newest),
    which waits in its place behind better-ranked waiting ones."""
    sched = make_scheduler(num_blocks=5, policy="priority")  # 4 usable blocks
    low = make_request("low", 4, priority=3, arrival_time=0.0, max_tokens=8)
    high = make_request("high", 4, priority=1, arrival_time=1.0, max_tokens=8)
    sched.add_request(low)
    sched.add_request(high)
    for _ in range(5):
        step(sched)
    assert [r.request_id for r in sched.running] == ["high", "low"]
    out, _ = step(sched)  # both need a third block: the newer one, high, must not be the victim
    assert out.preempted_req_ids == {"low"} and out.num_scheduled_tokens == {"high": 1}
    finals = run_to_completion(sched)
    assert len(low.output_token_ids) == len(high.output_token_ids) == 8
    assert set(finals) == {"low", "high"}
    assert_drained(sched)


@pytest.mark.parametrize("limit", ["seqs", "blocks"])
def test_priority_policy_preempts_running_for_a_better_waiting_request(limit: str) -> None:
    """A waiting request that outranks running ones and cannot be admitted (max_num_seqs, or
    too few free blocks) preempts the lowest-ranked running request, and is admitted in the
    same step; equal ranks never preempt each other."""
    if limit == "seqs":
        sched = make_scheduler(max_num_seqs=2, policy="priority")
        prompt, max_tokens = 4, 6
    else:  # 4 usable blocks: a and b's 5-token prompts take two each, room for 3 more tokens
        sched = make_scheduler(num_blocks=5, policy="priority")
        prompt, max_tokens = 5, 3
    a = make_request("a", prompt, priority=2, max_tokens=max_tokens)
    b = make_request("b", prompt, priority=4, max_tokens=max_tokens)
    sched.add_request(a)
    sched.add_request(b)
    step(sched)
    sched.add_request(make_request("same", 8, priority=4, max_tokens=2))
    out, _ = step(sched)
    assert not out.preempted_req_ids and out.num_scheduled_tokens == {"a": 1, "b": 1}
    sched.add_request(make_request("urgent", 8, priority=0, max_tokens=2))
    out, _ = step(sched)
    assert out.preempted_req_ids == {"b"}
    assert [n.req_id for n in out.scheduled_new_reqs] == ["urgent"]
    assert sched.running[0].request_id == "urgent" and b not in sched.running
    assert [r.request_id for r in sched.waiting] == ["b", "same"]  # b arrived first
    run_to_completion(sched)
    assert [len(r.output_token_ids) for r in (a, b)] == [max_tokens] * 2
    assert_drained(sched)


def test_fcfs_policy_keeps_arrival_order_whatever_the_priority() -> None:
    sched = make_scheduler(max_num_seqs=1)
    for i, rank in enumerate([3, 0]):  # the engine refuses ranks under fcfs; the queue ignores them
        sched.add_request(make_request(f"r{i}", 4, priority=rank, max_tokens=1))
    out, _ = step(sched)
    assert list(out.num_scheduled_tokens) == ["r0"]


def test_scheduler_config_rejects_an_unknown_policy() -> None:
    from loom.config import ConfigError

    with pytest.raises(ConfigError, match="scheduling policy"):
        SchedulerConfig(policy="lifo")


# ---- stop rules ----------------------------------------------------------------------------


def tokens_from(seq: list[int]) -> TokenFn:
    return lambda req: seq[req.num_output_tokens]


def run_single(req: Request, seq: list[int], max_model_len: int = 128) -> EngineCoreOutput:
    sched = make_scheduler(max_model_len=max_model_len)
    sched.add_request(req)
    final = None
    for _ in range(100):
        _, outputs = step(sched, tokens_from(seq))
        if outputs and outputs[-1].finished:
            final = outputs[-1]
            break
    assert final is not None
    assert_drained(sched)
    return final


def test_eos_stops() -> None:
    req = make_request("a", 4, max_tokens=10, ignore_eos=False)
    final = run_single(req, [5, 6, EOS, 8])
    assert (final.finish_reason, final.stop_reason) == (FinishReason.STOP, None)
    assert req.output_token_ids == [5, 6, EOS] and req.status == RequestStatus.FINISHED_STOPPED


def test_ignore_eos_runs_to_max_tokens() -> None:
    req = make_request("a", 4, max_tokens=4, ignore_eos=True)
    final = run_single(req, [EOS] * 4)
    assert final.finish_reason == FinishReason.LENGTH and req.output_token_ids == [EOS] * 4


def test_min_tokens_delays_eos_and_stop_tokens() -> None:
    req = make_request("a", 4, max_tokens=10, ignore_eos=False, min_tokens=3, stop_token_ids=[9])
    final = run_single(req, [EOS, 9, 5, EOS])
    assert final.finish_reason == FinishReason.STOP
    assert req.output_token_ids == [EOS, 9, 5, EOS]


def test_stop_token_ids_set_stop_reason_before_eos() -> None:
    req = make_request("a", 4, max_tokens=10, ignore_eos=False, stop_token_ids=[EOS, 9])
    final = run_single(req, [5, EOS])
    assert (final.finish_reason, final.stop_reason) == (FinishReason.STOP, EOS)
    assert req.stop_reason == EOS


def test_stop_beats_length_on_the_last_allowed_token() -> None:
    req = make_request("a", 4, max_tokens=2, stop_token_ids=[9])
    final = run_single(req, [5, 9])
    assert (final.finish_reason, final.stop_reason) == (FinishReason.STOP, 9)


def test_max_tokens_caps_length() -> None:
    req = make_request("a", 4, max_tokens=3)
    final = run_single(req, [5, 6, 7, 8])
    assert final.finish_reason == FinishReason.LENGTH and len(req.output_token_ids) == 3


def test_max_model_len_caps_length_when_max_tokens_is_none() -> None:
    req = make_request("a", 10, max_tokens=None)
    final = run_single(req, [5] * 20, max_model_len=16)
    assert req.max_tokens == 6
    assert final.finish_reason == FinishReason.LENGTH
    assert req.num_tokens == 16 and len(req.output_token_ids) == 6


# ---- admission -----------------------------------------------------------------------------


def test_rejects_requests_that_can_never_fit() -> None:
    sched = make_scheduler(num_blocks=5, max_model_len=32)  # 4 usable blocks = 16 tokens
    too_long = r"max_tokens \(10\) = 35 exceeds max_model_len \(32\)"
    with pytest.raises(RequestRejectedError, match=too_long):
        sched.add_request(make_request("a", 25, max_tokens=10))
    too_big = "need 5 KV blocks of 4 tokens but the cache has only 4"
    with pytest.raises(RequestRejectedError, match=too_big):
        sched.add_request(make_request("b", 10, max_tokens=7))
    with pytest.raises(RequestRejectedError, match="no room for output"):
        sched.add_request(make_request("c", 16, max_tokens=None))
    with pytest.raises(RequestRejectedError, match="empty"):
        sched.add_request(make_request("d", [], max_tokens=1))
    assert isinstance(RequestRejectedError("x", "y"), ValueError)
    assert not sched.has_unfinished_requests()

    ok = make_request("e", 10, max_tokens=6)
    sched.add_request(ok)  # 16 tokens exactly fill the cache
    open_ended = make_request("f", 10, max_tokens=None)
    sched.add_request(open_ended)
    assert open_ended.max_tokens == 6  # capped by the cache (16 tokens), not max_model_len
    with pytest.raises(ValueError, match="already"):
        sched.add_request(make_request("e", 4))
    finals = run_to_completion(sched)
    assert len(ok.output_token_ids) == 6 and len(open_ended.output_token_ids) == 6
    assert set(finals) == {"e", "f"}
    assert_drained(sched)


# ---- aborts --------------------------------------------------------------------------------


def test_finish_requests_aborts_running_and_waiting() -> None:
    sched = make_scheduler(max_num_seqs=1)
    running = make_request("run", 9, max_tokens=5)
    waiting = make_request("wait", 4, max_tokens=5)
    sched.add_request(running)
    sched.add_request(waiting)
    step(sched)
    assert sched.kv_cache_manager.get_block_ids("run") == [1, 2, 3]
    free_before = sched.kv_cache_manager.num_free_blocks
    sched.finish_requests(["run", "wait", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert sched.kv_cache_manager.num_free_blocks == free_before + 3
    assert running.get_finished_reason() == FinishReason.ABORT
    assert waiting.status == RequestStatus.FINISHED_ABORTED
    assert (sched.num_running, sched.num_waiting, sched.get_num_unfinished_requests()) == (0, 0, 0)
    out = sched.schedule()
    assert out.finished_req_ids == {"run"}  # "wait" never reached the runner
    assert out.is_empty
    assert_drained(sched)
    with pytest.raises(ValueError, match="finished status"):
        sched.finish_requests("run", RequestStatus.RUNNING)


def test_abort_between_schedule_and_update_is_ignored() -> None:
    sched = make_scheduler()
    req = make_request("a", 4, max_tokens=5)
    sched.add_request(req)
    out = sched.schedule()
    runner_output = fake_runner_output(sched, out)
    sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert sched.update_from_output(out, runner_output) == []
    assert req.output_token_ids == []
    assert_drained(sched)


def test_stop_string_finish_reports_stop() -> None:
    sched = make_scheduler()
    req = make_request("a", 4, max_tokens=5)
    sched.add_request(req)
    step(sched)
    req.stop_reason = "###"
    sched.finish_requests("a", RequestStatus.FINISHED_STOPPED)
    assert req.get_finished_reason() == FinishReason.STOP
    assert_drained(sched)


# ---- n-way fan-out -------------------------------------------------------------------------


def test_fan_out_of_one_prompt_shares_prompt_blocks() -> None:
    sched = make_scheduler()
    prompt = list(range(100, 118))  # 18 tokens: 4 full blocks + 2 tokens
    reqs = [make_request(f"n{i}", prompt, max_tokens=3, seed=i) for i in range(4)]
    for req in reqs:
        sched.add_request(req)
    out, outputs = step(sched)
    kv = sched.kv_cache_manager
    one_request_blocks = len(kv.get_block_ids("n0"))
    assert kv.get_block_ids("n0") == [1, 2, 3, 4, 5]
    assert [kv.get_block_ids(f"n{i}") for i in (1, 2, 3)] == [
        [1, 2, 3, 4, 6], [1, 2, 3, 4, 7], [1, 2, 3, 4, 8],
    ]
    used = kv.num_usable_blocks - kv.num_free_blocks
    assert used == 8 < 4 * one_request_blocks
    assert [kv.block_pool.blocks[i].ref_cnt for i in range(1, 9)] == [4, 4, 4, 4, 1, 1, 1, 1]
    assert out.num_scheduled_tokens == {"n0": 18, "n1": 2, "n2": 2, "n3": 2}
    assert [n.num_computed_tokens for n in out.scheduled_new_reqs] == [0, 16, 16, 16]
    assert [r.num_cached_tokens for r in reqs] == [0, 16, 16, 16]
    assert [o.num_cached_tokens for o in outputs] == [0, 16, 16, 16]
    assert sched.prefix_cache_stats.hits == 48
    run_to_completion(sched)
    assert_drained(sched)


def _lookahead_output(sched: Scheduler, out: SchedulerOutput, tokens: list[int]
                      ) -> ModelRunnerOutput:
    """A runner of a lookahead step: every request samples 1 + lookahead tokens."""
    rids = list(out.num_scheduled_tokens)
    return ModelRunnerOutput(req_ids=rids, sampled_token_ids=[
        tokens[: 1 + out.lookahead] for _ in rids])


def test_lookahead_only_for_greedy_decode_steps_with_room() -> None:
    """num_scheduler_steps: a step where every running request decodes greedily (argmax only)
    and nobody waits gets decode_steps - 1 more steps, capped by max_tokens and max_model_len,
    their KV slots allocated and handed to the runner; a step with a prompt, a waiting
    request, logprobs or too few free blocks gets none; the computed tokens follow."""
    sched = make_scheduler(max_model_len=40)
    sched.decode_steps = 4
    a = make_request("a", 6, temperature=0.0, max_tokens=8)
    sched.add_request(a)
    out, _ = step(sched)
    assert out.lookahead == 0  # the prompt's step
    out = sched.schedule()
    assert out.lookahead == 3 and out.scheduled_cached_reqs.new_block_ids == [[next(
        iter(sched.kv_cache_manager.get_block_ids("a")[-1:]))]]  # slots up to position 9
    sched.update_from_output(out, _lookahead_output(sched, out, [5, 6, 7, 8]))
    sched.kv_cache_manager.check_integrity()
    assert a.num_output_tokens == 5 and a.num_computed_tokens == a.num_tokens - 1 == 10
    out = sched.schedule()
    assert out.lookahead == 2  # 5 of 8 out: 1 + 2 more
    sched.update_from_output(out, _lookahead_output(sched, out, [5, 6, 7, 8]))
    assert a.num_output_tokens == 8 and a.is_finished()  # max_tokens exactly
    out = sched.schedule()
    assert out.lookahead == 0 and out.is_empty
    # a request that asks for logprobs, or one waiting, keeps every step to one token
    b = make_request("b", 6, temperature=0.0, max_tokens=20, logprobs=0)
    sched.add_request(b)
    sched.update_from_output(out, fake_runner_output(sched, out))
    while b.num_computed_tokens < b.num_prompt_tokens:
        out, _ = step(sched)
    out, _ = step(sched)
    assert out.lookahead == 0
    sched.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)
    c = make_request("c", 6, temperature=0.0, max_tokens=20)
    sched.add_request(c)
    step(sched)  # its prompt
    sched.add_request(make_request("w", 6, temperature=0.0, max_tokens=20))
    sched.max_num_seqs = 1  # w waits
    out, _ = step(sched)
    assert out.lookahead == 0
    # too few free blocks: no lookahead, and nothing leaked
    small = make_scheduler(num_blocks=7, max_model_len=40)
    small.decode_steps = 8
    for rid, n, most in (("d", 11, 3), ("e", 7, 8)):
        small.add_request(make_request(rid, n, temperature=0.0, max_tokens=most))
    step(small)
    kv = small.kv_cache_manager
    held = {rid: len(kv.get_block_ids(rid)) for rid in "de"}
    assert held == {"d": 3, "e": 2} and kv.block_pool.get_num_free_blocks() == 1
    out = small.schedule()
    assert out.lookahead == 0  # d's one more token takes the free block, e's then finds none
    assert {rid: len(kv.get_block_ids(rid)) for rid in "de"} == held
    small.update_from_output(out, fake_runner_output(small, out))
    kv.check_integrity()


def test_lookahead_stop_token_mid_step_finishes() -> None:
    """An EOS among a lookahead step's tokens ends the request there (what follows dropped)."""
    sched = make_scheduler()
    sched.decode_steps = 4
    r = make_request("r", 6, temperature=0.0, max_tokens=30, ignore_eos=False)
    sched.add_request(r)
    step(sched)
    out = sched.schedule()
    assert out.lookahead == 3
    (o,) = sched.update_from_output(out, _lookahead_output(sched, out, [5, EOS, 8, 9]))
    assert o.finished and o.new_token_ids == [5, EOS] and r.output_token_ids == [7, 5, EOS]
    assert_drained(sched)


def test_lookahead_within_the_time_bound() -> None:
    """By default (ahead_budget_s set) steps ahead only fit the bound by the measured time of a
    decode step (per forward, smoothed): none before one was timed, 3 at 5 ms a step with 40
    ms, 1 at 15 ms, none at 30 ms; steps with a prompt are not timed."""
    sched = make_scheduler(max_model_len=200)
    sched.decode_steps, sched.ahead_budget_s = 4, 0.04
    sched.add_request(make_request("a", 6, temperature=0.0, max_tokens=150))
    out, _ = step(sched)
    sched.observe_step(out, 1.0)  # the prompt's step: not timed
    assert sched.decode_step_s is None
    lookaheads = []
    for seconds in (0.005, None, *[0.015] * 12, *[0.03] * 12):
        out = sched.schedule()
        lookaheads.append(out.lookahead)
        sched.update_from_output(out, _lookahead_output(sched, out, [5, 6, 7, 8]))
        if seconds is not None:
            sched.observe_step(out, seconds * (1 + out.lookahead))
    assert lookaheads[:3] == [0, 3, 3]  # untimed; 5 ms; 5 ms still (no step timed between)
    assert lookaheads[14] == 1 and lookaheads[-1] == 0
    assert sched.decode_step_s == pytest.approx(0.03, rel=0.25)
