"""The engine's side of speculative decoding: building the SpecDecoder from EngineArgs, and the
output trim a multi-token step needs when a stop string ends the text mid-step."""

from __future__ import annotations

from typing import TYPE_CHECKING

from loom.config import ConfigError
from loom.core.spec_decode import SpecDecoder, SpeculativeConfig

if TYPE_CHECKING:
    import torch

    from loom.config import ModelConfig
    from loom.engine.args import EngineArgs
    from loom.engine.outputs import CompletionOutput


def spec_decoder(args: EngineArgs, max_model_len: int, target: ModelConfig, block_size: int,
                 device: torch.device) -> SpecDecoder | None:
    """The scheduler's SpecDecoder for args.speculative_config (None: off); loads the draft
    model of method "draft_model"."""
    config = SpeculativeConfig.parse(args.speculative_config)
    if config is None:
        return None
    if args.tensor_parallel_size > 1 or args.pipeline_parallel_size > 1:
        raise ConfigError("speculative decoding does not run with tensor or pipeline "
                          "parallelism yet")
    drafter = None
    if config.method == "draft_model":
        from loom.engine.draft_model import DraftModelProposer

        assert config.model is not None
        drafter = DraftModelProposer(args, config.model, target, max_model_len, block_size,
                                     device)
    return SpecDecoder(config, max_model_len, drafter)


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
