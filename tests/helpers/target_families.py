"""Random HF causal LMs of each target family the project runs, from transformers' own config and model classes:
6 layers, GQA, float64 by default, windows and chunks smaller than a block so they bite."""

from __future__ import annotations

import torch
from transformers import (
    Gemma4ForCausalLM,
    Gemma4TextConfig,
    GptOssConfig,
    GptOssForCausalLM,
    KimiLinearConfig,
    KimiLinearForCausalLM,
    Llama4ForCausalLM,
    Llama4TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3_5ForCausalLM,
    Qwen3_5TextConfig,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from tests.helpers.decoding import EOS

LAYER_IDS, HIDDEN, LAYERS, EXPERTS, PER_TOKEN = [1, 3], 32, 6, 4, 2
WINDOWS = {"gemma4": 3, "gpt_oss": 2}  # sliding_window, below the block size (4) and the shortest sequence (6)
CHUNK = 3  # Llama 4's attention_chunk_size, as small: blocks and sequences cross chunk boundaries
GEMMA4_LAYERS = ["sliding_attention"] * 3 + ["full_attention", "sliding_attention", "full_attention"]


def family_model(family: str, vocab_size: int = 8, dtype: torch.dtype = torch.float64, seed: int = 0):
    """A random HF causal LM of `family`, from transformers' own config and model classes."""
    common = dict(vocab_size=vocab_size, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=HIDDEN // 4, max_position_embeddings=512,
                  tie_word_embeddings=False, attn_implementation="sdpa")
    moe = dict(num_experts=EXPERTS, num_experts_per_tok=PER_TOKEN, moe_intermediate_size=HIDDEN // 2,
               experts_implementation="eager")  # transformers' grouped_mm experts take no float64
    builders = {
        "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(**common)),
        "llama": lambda: LlamaForCausalLM(LlamaConfig(**common)),
        "qwen3_moe": lambda: Qwen3MoeForCausalLM(Qwen3MoeConfig(**common, **moe)),
        "gpt_oss": lambda: GptOssForCausalLM(GptOssConfig(**common | {"attn_implementation": "eager"},  # no sdpa
                                                          num_local_experts=EXPERTS, num_experts_per_tok=PER_TOKEN,
                                                          sliding_window=WINDOWS["gpt_oss"],
                                                          experts_implementation="eager")),
        # the last two layers share the keys of the last earlier layer of their kind; per-layer input embeddings
        "gemma4": lambda: Gemma4ForCausalLM(Gemma4TextConfig(
            **common, sliding_window=WINDOWS["gemma4"], layer_types=GEMMA4_LAYERS, global_head_dim=HIDDEN // 4,
            num_kv_shared_layers=2, hidden_size_per_layer_input=8, vocab_size_per_layer_input=vocab_size)),
        # Gated DeltaNet layers 0, 1, 2, 4, 5 with small states, full attention at 3
        "qwen3_5": lambda: Qwen3_5ForCausalLM(Qwen3_5TextConfig(
            **common, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
            linear_value_head_dim=8)),
        # chunked attention at 0-2, 4, 5 and full attention without RoPE at 3; MoE at odd layers, a shared expert
        "llama4": lambda: Llama4ForCausalLM(Llama4TextConfig(
            **common, intermediate_size_mlp=2 * HIDDEN, attention_chunk_size=CHUNK, num_local_experts=EXPERTS,
            num_experts_per_tok=PER_TOKEN, interleave_moe_layer_step=2, attn_temperature_tuning=False)),
        # KDA layers 0, 1, 2, 4, 5 with 2 heads of 8, latent attention (as many key heads as query heads) at 3
        "kimi_linear": lambda: KimiLinearForCausalLM(KimiLinearConfig(
            **common | {"num_key_value_heads": 4}, pad_token_id=0, bos_token_id=1, eos_token_id=EOS,
            kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, linear_head_dim=8,
            linear_num_heads=2, num_experts=EXPERTS, num_experts_per_token=PER_TOKEN, moe_intermediate_size=HIDDEN // 2,
            experts_implementation="eager", layer_types=["linear_attention"] * 3 + ["full_attention"]
            + ["linear_attention"] * 2)),
    }
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return builders[family]().to(dtype)
