"""The offline API: `LLM(model).generate(prompts, SamplingParams(...))` and `LLM.chat(...)`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from loom.engine.args import EngineArgs
from loom.engine.beam_search import BeamSearchOutput, BeamSearchParams, beam_search
from loom.engine.llm_engine import LLMEngine
from loom.engine.outputs import RequestOutput
from loom.sampling_params import SamplingParams
from loom.tokenizer.tokenizer import template_kwargs
from loom.tools.chat import prepare_conversation
from loom.tools.parsers import parser_for_template

# vLLM's forms too: {"prompt": text} (TextPrompt) and {"prompt_token_ids": ids} (TokensPrompt).
Prompt = str | list[int] | dict[str, Any]
Conversation = list[dict[str, Any]]


class LLM:
    """Runs many prompts through one engine with continuous batching; results in input order."""

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        self.engine = LLMEngine(EngineArgs(model=model, **kwargs))
        self._counter = 0

    def get_tokenizer(self):  # noqa: ANN201 - loom.tokenizer.Tokenizer
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Prompts are strings, token-id lists or vLLM's prompt dicts; one SamplingParams for all
        or one per prompt. `priority`: one per prompt, with `scheduling_policy="priority"`
        (lower runs first)."""
        prompts = _prompt_list(prompts)
        params = sampling_params if sampling_params is not None else SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling params")
        priority = [0] * len(prompts) if priority is None else list(priority)
        if len(priority) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(priority)} priorities")
        ids = []
        try:
            for prompt, p, rank in zip(prompts, params, priority):
                request_id = f"llm-{self._counter}"
                self._counter += 1
                self.engine.add_request(request_id, prompt, p, priority=rank)
                ids.append(request_id)
        except Exception:
            self.engine.abort_request(ids)
            while self.engine.has_unfinished_requests():
                self.engine.step()
            raise
        return self._run(ids, use_tqdm)

    def beam_search(self, prompts: Sequence[Prompt], params: BeamSearchParams
                    ) -> list[BeamSearchOutput]:
        """Beam search per prompt (loom.engine.beam_search: transformers' semantics)."""
        return beam_search(self, _prompt_list(prompts), params)

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """One conversation (a list of messages) or a list of conversations.

        `continue_final_message`: the last message is left open and the model continues it (an
        assistant prefill; needs add_generation_prompt=False). `chat_template_kwargs`: further
        variables of the template (e.g. Qwen3's `enable_thinking`).

        `tools` (OpenAI function definitions) reach the model as the server passes them: through
        the template when it knows tools, else as a Hermes-style system prompt. Messages may hold
        assistant `tool_calls` and `role: "tool"` results. Parse replies with
        `loom.tools.parsers.parser_for_template(llm.engine.tokenizer.chat_template)` (where its
        `MARKERS` are special tokens, as Mistral's, decode with skip_special_tokens=False).
        """
        options = template_kwargs(add_generation_prompt, continue_final_message,
                                  chat_template_kwargs)
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.engine.tokenizer
        template = chat_template or tok.chat_template
        parser = parser_for_template(template)
        prompts = []
        for c in conversations:  # type: ignore[union-attr]
            conv, template_tools = prepare_conversation(list(c), tools, template, parser)
            prompts.append(tok.encode_chat(conv, chat_template=chat_template, tools=template_tools,
                                           **options))
        return self.generate(prompts, sampling_params, use_tqdm)

    def embed(
        self, prompts: Prompt | Sequence[Prompt], pooling: str | None = None,
        use_tqdm: bool = True, truncate_prompt_tokens: int | None = None,
    ) -> list[RequestOutput]:
        """Embeddings of prompts (strings or token-id lists), each in its output's `.embedding`:
        the final hidden states pooled as the model's config says (`pooling` overrides: "last"
        token or "mean"), L2-normalised; scheduled and batched like generation.
        `truncate_prompt_tokens`: embed each prompt's last N tokens (-1: all that fit)."""
        mode = pooling or self.engine.model_config.pooling
        params = SamplingParams(max_tokens=1, temperature=0.0, pooling=mode,
                                truncate_prompt_tokens=truncate_prompt_tokens)
        outputs = self.generate(prompts, params, use_tqdm)
        for out in outputs:
            if out.embedding is None:
                raise RuntimeError(f"request {out.request_id} gave no embedding: {out.error}")
        return outputs

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="generating", unit="req", disable=not use_tqdm or len(ids) < 2)
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    results[out.request_id] = out
                    bar.update(1)
        bar.close()
        return [results[i] for i in ids]


def _prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[str | list[int]]:
    """One prompt or a sequence of them as a list of strings and token-id lists; a dict prompt
    with keys Loom does not take (multi_modal_data, ...) is refused by name."""
    if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
        prompts = [prompts]  # type: ignore[list-item]
    out = []
    for p in prompts:  # type: ignore[union-attr]
        if isinstance(p, dict):
            unknown = sorted(set(p) - {"prompt", "prompt_token_ids"})
            if unknown:
                raise ValueError(f"prompt keys not supported: {unknown}")
            if "prompt_token_ids" in p:
                p = p["prompt_token_ids"]
            elif "prompt" in p:
                p = p["prompt"]
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        out.append(p)
    return out
