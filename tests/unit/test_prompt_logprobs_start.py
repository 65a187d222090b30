"""`SamplingParams.prompt_logprobs_start`: a prompt-logprob request may take prefix-cache hits,
but never past the position whose logits give the first logprob it asks for."""

from __future__ import annotations

import pytest

from loom.core.kv_cache_manager import KVCacheManager
from loom.request import Request
from loom.sampling_params import SamplingParams, SamplingParamsError

BS = 4


def admit(kv: KVCacheManager, req: Request) -> int:
    blocks, num_hit = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - num_hit, blocks, num_hit) is not None
    req.num_computed_tokens = req.num_tokens
    return num_hit


@pytest.mark.parametrize(("start", "hit"), [(0, 0), (1, 0), (4, 0), (5, 4), (9, 8), (13, 12),
                                            (100, 16)])
def test_hits_stop_before_the_first_position_asked_for(start: int, hit: int) -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BS, enable_caching=True, max_model_len=64)
    admit(kv, Request("a", list(range(17)), SamplingParams(), block_size=BS))
    params = SamplingParams(prompt_logprobs=0, prompt_logprobs_start=start)
    assert admit(kv, Request("b", list(range(17)), params, block_size=BS)) == hit


def test_start_is_validated() -> None:
    with pytest.raises(SamplingParamsError, match="prompt_logprobs_start"):
        SamplingParams(prompt_logprobs=0, prompt_logprobs_start=-1)
