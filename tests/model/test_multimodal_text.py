"""Multimodal checkpoints run as their text model (images are not read): a tiny random
Gemma3ForConditionalGeneration, Mistral3ForConditionalGeneration and
Qwen3_5ForConditionalGeneration, saved by transformers,
give transformers' own logits and greedy tokens on text (fp32, Loom's default CPU path); the
vision tower's and projector's weights are left unread."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from loom.loader.hf import iter_safetensors
from loom.loader.model_loader import load_model
from loom.loader.resolve import resolve_model
from tests.cpu_kernels import require_cpu_kernels
from tests.model.test_arch_stack import _mixed_batch, match_transformers

pytestmark = pytest.mark.slow

TEXT = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            max_position_embeddings=256)


def _wrapped(name: str, folder: Path) -> Path:
    from transformers import (
        Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig, Mistral3Config,
        Mistral3ForConditionalGeneration, MistralConfig, PixtralVisionConfig, SiglipVisionConfig,
    )

    torch.manual_seed(0)
    if name == "gemma3":
        text = Gemma3TextConfig(**TEXT, sliding_window=8,
                                layer_types=["sliding_attention", "full_attention"])
        vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                    num_attention_heads=2, image_size=28, patch_size=14)
        config = Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(),
                              mm_tokens_per_image=4)
        model = Gemma3ForConditionalGeneration(config)
    elif name.startswith("qwen3_5"):  # linear-attention and gated-attention layers
        from transformers.models import qwen3_5, qwen3_5_moe

        moe = name == "qwen3_5-moe"
        mod, prefix = (qwen3_5_moe, "Qwen3_5Moe") if moe else (qwen3_5, "Qwen3_5")
        shape = dict(TEXT, layer_types=["linear_attention", "full_attention"],
                     linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                     linear_value_head_dim=8, tie_word_embeddings=False)
        if moe:  # every MLP 4 experts, 2 a token, and a shared one
            del shape["intermediate_size"]
            shape.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                         shared_expert_intermediate_size=48)
        text = getattr(mod, f"{prefix}TextConfig")(**shape)
        vision = getattr(mod, f"{prefix}VisionConfig")(
            depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
            patch_size=14)
        config = getattr(mod, f"{prefix}Config")(text_config=text.to_dict(),
                                                 vision_config=vision.to_dict())
        model = getattr(mod, f"{prefix}ForConditionalGeneration")(config)
    else:
        text = MistralConfig(**TEXT, tie_word_embeddings=False)
        vision = PixtralVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=2, image_size=28, patch_size=14,
                                     head_dim=16)
        config = Mistral3Config(text_config=text.to_dict(), vision_config=vision.to_dict(),
                                vision_feature_layer=-1)
        model = Mistral3ForConditionalGeneration(config)
    with torch.no_grad():  # widen the random init so logits are not all near zero
        for pname, p in model.named_parameters():
            p.normal_(0.0, 0.08 if p.dim() > 1 else 0.1)
    model.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("name, arch", [("gemma3", "Gemma3ForCausalLM"),
                                        ("mistral3", "MistralForCausalLM"),
                                        ("qwen3_5", "Qwen3_5ForCausalLM"),
                                        ("qwen3_5-moe", "Qwen3_5MoeForCausalLM")])
def test_the_text_model_of_a_multimodal_checkpoint(tmp_path, name, arch) -> None:
    from transformers import AutoModelForImageTextToText

    require_cpu_kernels()
    folder = _wrapped(name, tmp_path / name)
    names = [n for n, _ in iter_safetensors(folder)]
    assert names and all(n.startswith(("model.", "lm_head.")) for n in names)
    assert not any("vision" in n or "projector" in n for n in names)
    ref = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32,
                                                      attn_implementation="eager").eval()
    ref.generation_config.eos_token_id = None
    loaded = load_model(resolve_model(str(folder)), "float32", batch_invariant=True)
    assert loaded.config.architecture == arch
    prompts, logits, seqs = _mixed_batch(loaded, loaded.config.vocab_size)
    match_transformers(ref, prompts, logits, seqs, 1e-4)
