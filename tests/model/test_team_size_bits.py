"""The one-call C stack gives the same bits on any team size, which loom.threads.TeamSize
(the team chosen by measured step times) relies on: only speed may change with it."""

from __future__ import annotations

import torch

from loom.sampling_params import SamplingParams
from tests.engine_fixtures import make_llm  # noqa: F401 - the fixture

PROMPTS = ["Write a short story about a lighthouse keeper.", "List three fruits.",
           "Why is the sky blue? " * 12]


def test_default_kernels_give_the_same_bits_on_one_and_two_threads(make_llm) -> None:
    llm = make_llm(batch_invariant=False)  # the default model with Loom's default kernels
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=3)
    threads = torch.get_num_threads()
    got = {}
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            outs = llm.generate(PROMPTS, params, use_tqdm=False)
            got[n] = [(o.outputs[0].token_ids, [(p.token_ids, p.logprobs)
                                                 for p in o.outputs[0].logprobs]) for o in outs]
    finally:
        torch.set_num_threads(threads)
    assert llm.engine.runner.model.model.stack, "the C stack ran these steps"
    assert got[1] == got[2]
