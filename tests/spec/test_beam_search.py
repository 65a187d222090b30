"""LLM.beam_search equals transformers' generate(num_beams=..., do_sample=False) on the packaged
SmolLM2 in fp32 (quantization="none"): the returned sequences in order, for several length
penalties and early-stopping modes, with beams that end on eos and ones that run to max_tokens."""

from __future__ import annotations

import pytest
import torch

from loom.engine.beam_search import BeamSearchParams
from tests.engine_fixtures import make_llm  # noqa: F401

pytestmark = pytest.mark.slow

CHAT = "<|im_start|>user\nReply with one word: yes or no?<|im_end|>\n<|im_start|>assistant\n"
PROMPTS = [CHAT, "The capital of France is", "def fibonacci(n):"]


def _hf(model, ids: list[int], p: BeamSearchParams, eos: tuple[int, ...]):
    out = model.generate(
        torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        num_beams=p.beam_width, num_return_sequences=p.beam_width, do_sample=False,
        max_new_tokens=p.max_tokens, length_penalty=p.length_penalty,
        early_stopping=p.early_stopping, eos_token_id=list(eos), pad_token_id=eos[0],
        output_scores=True, return_dict_in_generate=True)
    seqs = []
    for row in out.sequences.tolist():
        gen = row[len(ids):]
        ends = [i for i, t in enumerate(gen) if t in eos]
        seqs.append(gen[: ends[0] + 1] if ends else gen)  # the padding after eos dropped
    return seqs, out.sequences_scores.tolist()


@pytest.mark.parametrize("width,max_tokens,lp,early,prompts", [
    (3, 12, 1.0, False, PROMPTS), (4, 8, 0.5, True, [CHAT]), (2, 10, 2.0, "never", [CHAT]),
])
def test_beam_search_equals_transformers(make_llm, smollm2_transformers, width, max_tokens, lp,
                                         early, prompts):
    llm = make_llm(None, quantization="none")
    params = BeamSearchParams(beam_width=width, max_tokens=max_tokens, length_penalty=lp,
                              early_stopping=early)
    eos = tuple(llm.engine.eos_token_ids)
    outs = llm.beam_search(prompts, params)
    llm.engine.check_integrity()
    saw_eos = False
    for prompt, out in zip(prompts, outs):
        ids = llm.get_tokenizer().encode(prompt)
        assert out.prompt_token_ids == ids
        ref, ref_scores = _hf(smollm2_transformers, ids, params, eos)
        assert [s.token_ids for s in out.sequences] == ref, prompt
        assert [s.score for s in out.sequences] == pytest.approx(ref_scores, abs=1e-3)
        saw_eos |= any(s.finish_reason == "stop" for s in out.sequences)
    if lp <= 1.0:  # (2.0 favours long beams)
        assert saw_eos  # some of the chat prompt's beams end on <|im_end|>
