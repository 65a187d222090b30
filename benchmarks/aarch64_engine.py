"""Loom end to end on AArch64 without an ARM machine: the engine (torch, the C kernels, the
one-call decoder stack, the sampler) under qemu-user, greedy tokens and logprobs against the
float32 reference on this machine. benchmarks/aarch64_engine.sh sets up an arm64 Python and
runs it; this file is both sides:

    python aarch64_engine.py generate MODEL '{"cpu_kernels": "neon"}' > out.json   # either side
    python aarch64_engine.py compare REF.json OUT.json ...

`generate` prints, per prompt, the 16 greedy token ids, each position's top-1 (id, logprob),
the text, and which kernels ran and whether the C stack ran the steps."""

from __future__ import annotations

import json
import sys

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ",
           "Once upon a time, in a small village,", "List three colors: red,"]


def generate(model: str, kwargs: dict) -> dict:
    from loom import LLM
    from loom.kernels import kernel_choice
    from loom.models import q8_decoder
    from loom.sampling_params import SamplingParams

    steps = []
    forward = q8_decoder.Q8Decoder.forward

    def counted(self, *a, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
        steps.append(1)
        return forward(self, *a, **k)

    q8_decoder.Q8Decoder.forward = counted
    llm = LLM(model, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=1)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return {"kernels": str(kernel_choice()), "stack_steps": len(steps),
            "outputs": [[o.outputs[0].token_ids,
                         [[q.token_ids[0], q.logprobs[0]] for q in o.outputs[0].logprobs],
                         o.outputs[0].text] for o in outs]}


def compare(ref_path: str, paths: list[str]) -> bool:
    ref = json.load(open(ref_path))["outputs"]
    ok = True
    for path in paths:
        got = json.load(open(path))
        same = sum(a[0] == b[0] for a, b in zip(got["outputs"], ref))
        gaps = [abs(x[1] - y[1]) for a, b in zip(got["outputs"], ref)
                for x, y in zip(a[1], b[1]) if x[0] == y[0]]
        print(f"{path}: {got['kernels']}; C stack steps {got['stack_steps']}; {same}/{len(ref)} "
              f"prompts' greedy tokens equal to the reference; top-1 logprob max |diff| "
              f"{max(gaps):.4f} over {len(gaps)} positions")
        for a, b in zip(got["outputs"], ref):
            if a[0] != b[0]:
                print(f"  {a[2]!r}\n  reference {b[2]!r}")
        ok &= same == len(ref)
    return ok


if __name__ == "__main__":
    if sys.argv[1] == "generate":
        print(json.dumps(generate(sys.argv[2], json.loads(sys.argv[3] if len(sys.argv) > 3
                                                          else "{}"))))
    else:
        sys.exit(0 if compare(sys.argv[2], sys.argv[3:]) else 1)
