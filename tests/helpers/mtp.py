"""Tiny targets that carry an MTP head in their own checkpoint, as the public ones do: a random HF causal LM of a
target family (transformers' own config and model classes), saved, and a random head of the target's layer kind
written in the family's layout into a second shard named by the weight index (`mtp.*` for Qwen3.5,
`model.layers.{N}.*` with `enorm`, `hnorm`, `eh_proj` and `shared_head` for DeepSeek-V3 and GLM-4.5), its MoE
experts one tensor per expert as the target's own shards (and public checkpoints) store them, or fused."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import yaml
from safetensors.torch import load_file, save_file
from transformers import (
    AutoTokenizer,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    Glm4MoeConfig,
    Glm4MoeForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from opd.formats.experts import split_experts
from opd.formats.mtp import MTPConfig, MTPSpec, to_layout
from opd.model_dir import WEIGHTS_FILE, WEIGHTS_INDEX
from opd.models.mtp import MTPDrafter, json_config
from opd.models.registry import family
from opd.models.target import Target, load_target
from tests.helpers.target_families import family_model

HIDDEN, LAYERS = 32, 3
OWN_LAYOUT = {"qwen2": "mimo"}  # a target whose model_type names no layout: the one its checkpoint is written in
SHARD, HEAD_SHARD = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
_MOE = dict(vocab_size=8, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, moe_intermediate_size=HIDDEN // 2,
            num_hidden_layers=LAYERS, num_attention_heads=4, n_routed_experts=4, num_experts_per_tok=2,
            n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=1, max_position_embeddings=512,
            tie_word_embeddings=False, attn_implementation="sdpa", experts_implementation="eager",
            num_nextn_predict_layers=1)


def tiny_model(name: str, seed: int = 0, vocab_size: int = 8):
    """A random float64 causal LM of target family `name`: qwen3, qwen3_5 (tests/helpers/target_families.py),
    deepseek_v3 (latent attention, MoE past layer 0), glm4_moe (GQA, MoE past layer 0) or qwen2 (MiMo's stand-in,
    its head in MiMo's `model.mtp_layers.0.*` layout)."""
    moe = _MOE | {"vocab_size": vocab_size}
    builders = {
        "deepseek_v3": lambda: DeepseekV3ForCausalLM(DeepseekV3Config(
            **moe, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
            qk_nope_head_dim=8, v_head_dim=8)),
        "glm4_moe": lambda: Glm4MoeForCausalLM(Glm4MoeConfig(**moe, num_key_value_heads=2, head_dim=8)),
        # MiMo's stand-in: MiMo is a Qwen2 model (transformers has no MiMo class) whose head is a Qwen2 layer
        "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(
            vocab_size=vocab_size, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False,
            attn_implementation="sdpa")),
    }
    if name not in builders:
        return family_model(name, vocab_size=vocab_size, seed=seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return builders[name]().to(torch.float64)


def load(directory: Path) -> Target:
    """The target as the project loads it (transformers drops the MTP tensors), reading its last hidden state."""
    num_layers = json.loads((directory / "config.json").read_text())["num_hidden_layers"]
    return load_target(str(directory), dtype=torch.float64, attn_implementation="sdpa", layer_ids=[num_layers - 1])


def target_dir(name: str, directory: Path, *, head: bool = True, seed: int = 0, per_expert: bool = True,
               vocab_size: int = 8) -> Path:
    """A target directory of family `name`; with `head`, a random MTP head of its layer kind in its family's
    layout, in a second shard the weight index names (the first holds the rest, as public checkpoints split), its
    experts one tensor per expert (`per_expert`) or in transformers' fused tensors."""
    model = tiny_model(name, seed, vocab_size)
    model.save_pretrained(directory)
    if not head:
        return directory
    (directory / WEIGHTS_FILE).rename(directory / SHARD)
    tensors = load_file(directory / SHARD)
    target = Target(model, [model.config.num_hidden_layers - 1])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 1)
        drafter = family("mtp").initial(MTPSpec(from_target=False), target, None)
        if name in OWN_LAYOUT:
            drafter = MTPDrafter(MTPConfig(drafter.block_size, OWN_LAYOUT[name], json_config(model.config)),
                                 model.get_input_embeddings(), model.lm_head, drafter._shared[2])
    sharpen(drafter)
    head_tensors = to_layout(drafter.state_dict(), drafter.form, model.config.num_hidden_layers)
    if per_expert:
        head_tensors = split_experts(head_tensors)
    prefix = drafter.form.prefix_for(model.config.num_hidden_layers)
    copies = {"embed_tokens.weight": "model.embed_tokens.weight", "shared_head.head.weight": "lm_head.weight"}
    head_tensors |= {prefix + name: tensors[copies[name]] for name in drafter.form.shared}
    save_file({n: t.contiguous() for n, t in head_tensors.items()}, directory / HEAD_SHARD)
    weight_map = {n: SHARD for n in tensors} | {n: HEAD_SHARD for n in head_tensors}
    (directory / WEIGHTS_INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return directory


def sharpen(drafter) -> None:
    """Scale the head's input projection up, so a random head's drafts are decided by its inputs (some get
    accepted on a random target) rather than by the bias of its norms."""
    with torch.no_grad():
        drafter.fc.weight.mul_(4.0)


def spec_file(name: str, kind: str, micro_assets, micro_spec_file, tmp_path: Path) -> Path:
    """The micro spec on a target of family `name` sized to the micro tokenizer (its MTP head in its checkpoint),
    with a drafter of `kind` (mtp: that head, the warm start)."""
    tokenizer = AutoTokenizer.from_pretrained(micro_assets["target"])
    directory = target_dir(name, tmp_path / name, vocab_size=len(tokenizer))
    tokenizer.save_pretrained(directory)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(config | {"eos_token_id": tokenizer.eos_token_id}))
    spec = yaml.safe_load(micro_spec_file.read_text())
    spec["models"] = {"target_path": str(directory), "dtype": "float32", "drafter": {"kind": kind, "block_size": 4}}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path
