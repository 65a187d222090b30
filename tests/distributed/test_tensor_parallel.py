"""--tensor-parallel-size 2 and --pipeline-parallel-size 2 over gloo (rank 0 in this process,
rank 1 a worker process or a Ray actor) on tiny random Llama, Qwen and Gemma checkpoints: greedy
tokens equal one process's, and the logprobs (log-softmax of the logits) of every prompt
position and of the top-5 at each generated one agree within fp32 tolerance; also through
`loom serve`. Quantized weights and impossible splits are refused with a clear error."""

from __future__ import annotations

import gc

import pytest
import torch

from loom import LLM, SamplingParams
from loom.config import ConfigError
from tests.tiny_models import make_tiny_chat_model

pytestmark = pytest.mark.slow

PROMPTS = [[5, 17, 99, 3, 250, 42, 8], list(range(40, 75)), [200] * 3 + [1, 2, 3, 4, 5, 6]]


def _tiny(arch: str, folder, **overrides):
    """A tiny random checkpoint with SmolLM2's tokenizer beside it (the prompts are ids)."""
    return make_tiny_chat_model(arch, folder, **overrides)


def _run(folder, tp: int, pp: int = 1, **kwargs) -> list:
    llm = LLM(str(folder), tensor_parallel_size=tp, pipeline_parallel_size=pp, dtype="float32",
              num_threads=1, kv_cache_memory=8 * 2**20, max_model_len=256, **kwargs)
    if pp > 1:  # rank 0 holds its stage's layers; the worker is up
        assert llm.engine.model_config.num_hidden_layers == 2 // pp
        assert len(llm.engine.tensor_parallel.procs) == pp - 1
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=5, prompt_logprobs=5,
                            ignore_eos=True)
    if tp > 1:  # rank 0 holds its share of the heads; the worker is up
        assert llm.engine.model_config.num_attention_heads == 4 // tp
        assert all(p.is_alive() for p in llm.engine.tensor_parallel.procs)
        assert len(llm.engine.tensor_parallel.procs) == (tp - 1 if "distributed_executor_backend"
                                                         not in kwargs else 0)
    try:
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        if pp > 1:  # three requests a step: they went through the stages as micro-batches
            assert llm.engine.runner.model.model.micro_batched_steps > 0
        return outs
    finally:
        if llm.engine.tensor_parallel is not None:
            llm.engine.tensor_parallel.close()
        del llm
        gc.collect()


def _logprob_rows(out) -> list[list[float]]:
    rows = [lp.logprobs for lp in out.prompt_logprobs if lp is not None]
    return rows + [lp.logprobs for lp in out.outputs[0].logprobs]


@pytest.mark.parametrize("arch,overrides", [
    ("llama", {}),                              # 4 heads, 2 KV heads: one KV head a rank
    ("qwen3", {}),                              # q/k norms, head_dim 32
    ("qwen2", {"num_key_value_heads": 1}),      # qkv bias, tied head, the KV head replicated
    ("gemma2", {}),                             # soft-capping, sliding window, (1+w) norms
])
def test_tp2_equals_tp1(tmp_path, arch, overrides) -> None:
    folder = _tiny(arch, tmp_path / arch, **overrides)
    ref, tp2 = _run(folder, 1), _run(folder, 2)
    for a, b in zip(ref, tp2):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for row_a, row_b in zip(_logprob_rows(a), _logprob_rows(b), strict=True):
            torch.testing.assert_close(torch.tensor(row_b), torch.tensor(row_a), atol=1e-4,
                                       rtol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_pp2_equals_pp1(tmp_path, arch) -> None:
    folder = _tiny(arch, tmp_path / arch)
    ref, pp2 = _run(folder, 1), _run(folder, 1, pp=2)
    for a, b in zip(ref, pp2):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for row_a, row_b in zip(_logprob_rows(a), _logprob_rows(b), strict=True):
            torch.testing.assert_close(torch.tensor(row_b), torch.tensor(row_a), atol=1e-5,
                                       rtol=1e-5)


def test_tp_refuses_quantized_weights(tmp_path) -> None:
    folder = _tiny("llama", tmp_path / "q")
    with pytest.raises(ConfigError, match="unquantized weights only"):
        LLM(str(folder), tensor_parallel_size=2, quantization="int8", dtype="float32")
    with pytest.raises(ConfigError, match="must divide the number of attention heads"):
        LLM(str(folder), tensor_parallel_size=3, dtype="float32")
    with pytest.raises(ConfigError, match="exceeds the number of layers"):
        LLM(str(folder), pipeline_parallel_size=3, dtype="float32")


@pytest.mark.parametrize("flag", ["--tensor-parallel-size", "--pipeline-parallel-size"])
def test_loom_serve_tp2_pp2_give_the_greedy_text_of_one_process(flag: str) -> None:
    from openai import OpenAI

    from tests.router.utils import REPLICA_ARGS, tiny_chat_model
    from tests.server.utils import ServerProcess

    folder = tiny_chat_model()
    prompt = "The quick brown fox jumps over"
    llm = LLM(folder, dtype="float32", num_threads=1, max_model_len=512,
              kv_cache_memory=16 * 2**20)
    ref = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    del llm
    server = ServerProcess([folder, *REPLICA_ARGS, flag, "2"]).start()
    try:
        client = OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        r = client.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert r.choices[0].text == ref.text and r.usage.completion_tokens == 16
        kind = "tensor" if "tensor" in flag else "pipeline"
        assert f"{kind} parallel: 2 ranks over gloo" in server.log()
    finally:
        server.stop()


def test_tp2_on_local_ray_equals_tp1(tmp_path) -> None:
    ray = pytest.importorskip("ray", reason="Ray is not installed (pip install ray)")
    folder = _tiny("llama", tmp_path / "ray")
    ray.init(num_cpus=2, include_dashboard=False)
    try:
        ref, tp2 = _run(folder, 1), _run(folder, 2, distributed_executor_backend="ray")
    finally:
        ray.shutdown()
    for a, b in zip(ref, tp2):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for row_a, row_b in zip(_logprob_rows(a), _logprob_rows(b), strict=True):
            torch.testing.assert_close(torch.tensor(row_b), torch.tensor(row_a), atol=1e-4,
                                       rtol=1e-4)
