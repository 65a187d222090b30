"""The engine's side of speculative decoding: building the SpecDecoder from EngineArgs, and the
output trim a multi-token step needs when a stop string ends the text mid-step."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from loom.config import ConfigError
from loom.core.spec_decode import SpecDecoder, SpeculativeConfig
from loom.quant.int8 import DECODE_ROWS

if TYPE_CHECKING:
    import torch

    from loom.config import ModelConfig
    from loom.engine.args import EngineArgs
    from loom.engine.outputs import CompletionOutput
    from loom.kernels.dispatch import KernelChoice

logger = logging.getLogger(__name__)


def spec_decoder(args: EngineArgs, max_model_len: int, target: ModelConfig, block_size: int,
                 device: torch.device, kernels: KernelChoice | None = None) -> SpecDecoder | None:
    """The scheduler's SpecDecoder for args.speculative_config; loads the draft model of method
    "draft_model". Without a config, one for requests with a prediction alone (OpenAI's
    predicted outputs); None with tensor or pipeline parallelism (a prediction then goes
    unused: it only ever changes speed). Warns where the target's CPU `kernels` make a verify
    step's bits differ from one-row steps' (docs/speculative.md, "Kernels")."""
    config = SpeculativeConfig.parse(args.speculative_config)
    parallel = args.tensor_parallel_size > 1 or args.pipeline_parallel_size > 1
    # a prediction's drafts: up to the rows whose verify step keeps one-row steps' bits
    most = DECODE_ROWS - 1 if kernels is None or not kernels.same_bits_past_8 else 2 * DECODE_ROWS
    if config is None:
        return None if parallel else SpecDecoder(
            SpeculativeConfig(num_speculative_tokens=most), max_model_len,
            predictions_only=True)
    rows = config.num_speculative_tokens + 1
    if kernels is not None and rows > DECODE_ROWS and not kernels.same_bits_past_8:
        logger.warning(
            "num_speculative_tokens %d: a verify step of %d rows runs the quantized linears' "
            "kernels for more than %d rows, whose rounding differs from a one-row step's, so "
            "greedy output can differ from decoding without speculation where two tokens "
            "nearly tie; num_speculative_tokens <= %d (or --batch-invariant) keeps it identical",
            config.num_speculative_tokens, rows, DECODE_ROWS, DECODE_ROWS - 1)
    if parallel:
        raise ConfigError("speculative decoding does not run with tensor or pipeline "
                          "parallelism yet")
    drafter = None
    if config.method == "draft_model":
        from loom.engine.draft_model import DraftModelProposer

        assert config.model is not None
        drafter = DraftModelProposer(args, config.model, target, max_model_len, block_size,
                                     device)
    return SpecDecoder(config, max_model_len, drafter,
                       prediction_tokens=max(most, config.num_speculative_tokens))


def drop_after_stop(output: CompletionOutput, num_tokens: int) -> None:
    """A stop string completed at the output's `num_tokens`-th token: tokens accepted after it
    in the same speculative step are dropped (decoding one by one would not have made them),
    with their logprobs."""
    extra = len(output.token_ids) - num_tokens
    if extra > 0:
        del output.token_ids[-extra:]
        del output.delta_token_ids[-min(extra, len(output.delta_token_ids)):]
        if output.logprobs is not None:
            del output.logprobs[-extra:]
            del output.delta_logprobs[-min(extra, len(output.delta_logprobs)):]
