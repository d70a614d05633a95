"""The micro assets re-made with vLLM-friendly heads (4 x 64), bf16, as a spec: what the `gpu` tests serve."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from opd.models.dflash import DFlashConfig, DFlashDrafter
from opd.tiny.micro import micro_target

LAYERS = [1, 2]  # the target layers the drafter reads

@pytest.fixture
def vllm_spec_file(micro_assets, tmp_path) -> Path:
    """The micro assets re-made with vLLM-friendly heads (4 x 64), bf16, as a spec."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(micro_assets["target"])
    target = micro_target(vocab_size=len(tokenizer), hidden_size=256, num_kv_heads=2, dtype=torch.float32,
                          layer_ids=LAYERS)
    target.model.config.eos_token_id = tokenizer.eos_token_id
    target.model.save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    config = DFlashConfig.for_target(target.config, num_layers=1, block_size=4, mask_token_id=tokenizer.mask_token_id,
                                     target_layer_ids=LAYERS)
    DFlashDrafter(config, target.embed_tokens, target.lm_head).save_pretrained(tmp_path / "drafter")
    spec = {"name": "vllm", "steps": 1, "engine": "local",
            "models": {"target_path": str(tmp_path / "target"), "drafter_path": str(tmp_path / "drafter"),
                       "dtype": "bfloat16", "drafter": {"num_layers": 1, "block_size": 4, "target_layer_ids": LAYERS}},
            "data": {"train_prompts": micro_assets["train"], "eval_prompts": micro_assets["train"],
                     "max_prompt_tokens": 200},
            "rollout": {"batch_size": 2, "temperature": 0.0}, "optim": {"batch_size": 4},
            "sft": {"response_max_new_tokens": 16},
            "tracking": {"run_dir": str(tmp_path / "runs" / "{name}")},
            "eval": {"num_prompts": 16, "max_new_tokens": 32, "sampling": [{"name": "greedy", "temperature": 0.0}]}}
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))
    return tmp_path / "spec.yaml"
