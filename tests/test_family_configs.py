"""What the target families need of a drafter's config and of the teacher (issue 42, Build 4), and the shipped
configs for public pairs (Build 7).

RoPE other than the default is read through transformers' own initialisation, flat or per layer type; a random
drafter built for a target carries the target's RoPE, its embedding scale and its final-logit softcapping, as the
public drafters for those families do; and a teacher formed from final-norm hidden states is soft-capped as the
target's own forward caps its logits. Targets come from transformers' config classes (tests/test_target_families.py).
"""

from __future__ import annotations

import math
import re
import shutil
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

from opd.cli import main
from opd.commands.preflight import check_layer_kinds_of
from opd.errors import OpdError
from opd.formats.dflash import FULL, SLIDING, DFlashConfig
from opd.model_dir import ModelDir
from opd.models.dflash import DFlashDrafter
from opd.models.lm_head import teacher_head
from opd.models.shared_head import embedding_scale, load_shared_head
from opd.tiny.micro import micro_drafter, micro_target
from tests.helpers.drafter_variants import with_change
from tests.helpers.target_families import family_model

CAP = 5.0


def gemma(cap: float | None = CAP, dtype: torch.dtype = torch.float64):
    """A tiny Gemma 4 text model (sliding and global layers, per-layer-type RoPE, a scaled embedding)."""
    model = family_model("gemma4", vocab_size=64, dtype=dtype)
    model.config.final_logit_softcapping = cap
    return model


def shape_of(model) -> SimpleNamespace:
    """What `teacher_head` and a drafter read of a target: its config, embedding and LM head."""
    return SimpleNamespace(config=model.config, lm_head=model.get_output_embeddings(),
                           embed_tokens=model.get_input_embeddings())


# ----------------------------------------------------------------------------------------------------- RoPE


def rope_drafter(rope_parameters: dict, layer_types: list[str] | None = None) -> DFlashDrafter:
    target = micro_target(num_layers=4, layer_ids=[1, 3], dtype=torch.float32)
    base = micro_drafter(target, num_layers=2, block_size=4)
    change = {"rope_parameters": rope_parameters}
    if layer_types:
        change |= {"layer_types": layer_types, "use_sliding_window": True, "sliding_window": 8}
    config = DFlashConfig.from_hf_dict(with_change(base.config.to_hf_dict(), change))
    return DFlashDrafter(config, target.embed_tokens, target.lm_head)


def transformers_tables(drafter: DFlashDrafter, rope: dict, positions: torch.Tensor):
    """cos/sin as z-lab's drafter forms them: transformers' Qwen3 rotary embedding over a flat RoPE."""
    hf = Qwen3Config(**{**drafter.config.to_hf_dict(), "rope_parameters": dict(rope), "rope_scaling": None})
    return Qwen3RotaryEmbedding(hf)(torch.zeros(1, dtype=torch.float32), positions)


YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16}
LINEAR = {"rope_type": "linear", "rope_theta": 1e6, "factor": 2.0}


@pytest.mark.parametrize("rope", [YARN, LINEAR, {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0,
                                                 "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                 "original_max_position_embeddings": 16}])
def test_a_scaled_rope_rotates_as_transformers_rotary_embedding(rope):
    drafter = rope_drafter(rope)
    positions = torch.arange(40)[None]
    for cos, sin in drafter._rope(positions):
        want_cos, want_sin = transformers_tables(drafter, rope, positions)
        assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)


def test_rope_per_layer_type_gives_each_layer_its_types_tables_and_round_trips():
    rope = {SLIDING: {"rope_type": "default", "rope_theta": 10000.0}, FULL: LINEAR}
    drafter = rope_drafter(rope, [SLIDING, FULL])
    positions = torch.arange(30)[None]
    tables = drafter._rope(positions)
    want_full = transformers_tables(drafter, LINEAR, positions)
    assert torch.equal(tables[1][0], want_full[0]) and torch.equal(tables[1][1], want_full[1])
    want_sliding = transformers_tables(drafter, rope[SLIDING], positions)
    assert torch.allclose(tables[0][0], want_sliding[0], atol=1e-6)
    assert not torch.allclose(tables[0][0], tables[1][0])
    assert DFlashConfig.from_hf_dict(drafter.config.to_hf_dict()) == drafter.config


@pytest.mark.parametrize(("rope", "message"), [
    ({"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}, "rope_parameters.rope_type' is 'dynamic'"),
    ({"rope_type": "yarn", "factor": 2.0}, "'rope_theta' is missing"),
    (YARN | {"partial_rotary_factor": 0.5}, "rotates 4 of 8 head dims"),
    ({SLIDING: YARN}, "gives RoPE per layer type but not for 'full_attention'"),
])
def test_rope_a_drafter_cannot_reproduce_is_refused_in_one_line(rope, message):
    hf = micro_drafter(micro_target(num_layers=4, layer_ids=[1, 3])).config.to_hf_dict()
    hf.pop("rope_theta")
    with pytest.raises(OpdError, match=message) as err:
        rope_drafter(rope) if "partial" in str(rope) else DFlashConfig.from_hf_dict(hf | {"rope_parameters": rope})
    assert "\n" not in str(err.value)


# ------------------------------------------------------------------------------- random drafters per family


def test_a_random_drafter_for_gemma_carries_its_rope_embedding_scale_and_softcap():
    model = gemma()
    config = DFlashConfig.for_target(model.config, num_layers=2, block_size=4, mask_token_id=3,
                                     target_layer_ids=[1, 3],
                                     input_embedding_scale=embedding_scale(model.get_input_embeddings()))
    assert config.rope_parameters == {k: v for k, v in model.config.rope_parameters[FULL].items()}
    assert config.input_embedding_scale == pytest.approx(math.sqrt(model.config.hidden_size))
    assert config.final_logit_softcapping == CAP
    assert DFlashConfig.from_hf_dict(config.to_hf_dict()) == config


def test_a_target_giving_rope_per_layer_type_without_a_full_attention_entry_is_refused_in_one_line():
    config = gemma().config
    config.rope_parameters = {SLIDING: config.rope_parameters[SLIDING]}
    with pytest.raises(OpdError, match=f"RoPE per layer type \\({SLIDING}\\) but none for '{FULL}'") as err:
        DFlashConfig.for_target(config, num_layers=1, block_size=4, mask_token_id=3, target_layer_ids=[1, 3])
    assert "\n" not in str(err.value)


def test_a_random_drafter_for_gpt_oss_carries_yarn():
    model = family_model("gpt_oss", vocab_size=64)
    config = DFlashConfig.for_target(model.config, num_layers=1, block_size=4, mask_token_id=3)
    assert config.rope_parameters["rope_type"] == "yarn"
    assert config.rope_parameters["factor"] == model.config.rope_parameters["factor"]
    drafter = DFlashDrafter(config, model.get_input_embeddings(), model.get_output_embeddings())
    assert drafter._rope_frequencies[0][1] > 1.0  # YaRN's attention scaling is in force


def test_block_embeddings_are_the_raw_rows_times_the_drafters_scale_whatever_the_targets_module():
    """z-lab embeds a block from the embedding's stored rows times `input_embedding_scale`; Gemma's own embedding
    module scales its rows itself, and the learner's copy of it is a plain `nn.Embedding`: both must draft alike."""
    model = gemma(dtype=torch.float32)
    scaled = model.get_input_embeddings()
    plain = nn.Embedding.from_pretrained(scaled.weight.detach().clone())
    config = DFlashConfig.for_target(model.config, num_layers=1, block_size=4, mask_token_id=3,
                                     target_layer_ids=[1, 3], input_embedding_scale=embedding_scale(scaled))
    drafters = []
    for embed in (scaled, plain):
        torch.manual_seed(0)
        drafters.append(DFlashDrafter(config, embed, model.get_output_embeddings()))
    features = torch.randn(1, 6, 2 * model.config.hidden_size)
    drafts = []
    for drafter in drafters:
        cache = drafter.new_cache(1)
        drafter.extend_cache(cache, features, torch.arange(6)[None], torch.ones(1, 6, dtype=torch.bool))
        drafts.append(drafter.draft(cache, torch.tensor([5]), torch.tensor([6]))[1])
    assert torch.equal(drafts[0], drafts[1])


# ------------------------------------------------------------------------------------------------ teacher


def test_the_teacher_head_is_soft_capped_as_the_targets_forward_and_argmax_is_kept():
    model = gemma()
    ids = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(0))
    hidden = model.model(ids).last_hidden_state
    want = model(ids).logits
    assert torch.allclose(teacher_head(shape_of(model))(hidden), want, atol=1e-12)
    assert want.abs().max() < CAP
    assert not torch.allclose(shape_of(model).lm_head(hidden), want)  # the cap matters on these logits
    uncapped = gemma(cap=None)
    assert teacher_head(shape_of(uncapped)) is uncapped.get_output_embeddings()


def test_the_learners_shared_head_keeps_the_scale_and_cap_and_builds_the_same_drafter(tmp_path):
    model = gemma(dtype=torch.float32)
    model.save_pretrained(tmp_path)
    shared = load_shared_head(str(tmp_path), dtype=torch.float32, layer_ids=[1, 3])
    assert embedding_scale(shared.embed_tokens) == embedding_scale(model.get_input_embeddings()) > 1
    hidden = torch.randn(5, model.config.hidden_size)
    assert torch.equal(teacher_head(shared)(hidden), teacher_head(shape_of(model))(hidden))
    drafter = micro_drafter(shared, num_layers=1)
    assert drafter.teacher_head(hidden).abs().max() < CAP
    assert drafter.config.input_embedding_scale == embedding_scale(model.get_input_embeddings())


# ------------------------------------------------------------------------------------------------ preflight


def config_only_target(family_name: str, micro_assets, tmp_path):
    """A target directory holding the family's config.json and the micro tokenizer, and no weights."""
    target = tmp_path / family_name
    shutil.copytree(micro_assets["target"], target, ignore=shutil.ignore_patterns("*.safetensors", "config.json"))
    family_model(family_name, vocab_size=128, dtype=torch.float32).config.save_pretrained(target)
    return target


def test_validate_and_train_refuse_a_targets_layer_kinds_from_its_config_json_alone(micro_assets, micro_spec_file,
                                                                                     tmp_path, capsys):
    """No weights to load: the refusal of GLM 5's indexed-attention layers (DeepSeek sparse attention, a layer type
    no kind is registered for) comes from the config, by `Target`'s rule, before anything would load."""
    from transformers import GlmMoeDsaConfig

    target = tmp_path / "glm5"
    shutil.copytree(micro_assets["target"], target, ignore=shutil.ignore_patterns("*.safetensors", "config.json"))
    GlmMoeDsaConfig(num_hidden_layers=4, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                    num_attention_heads=4, num_key_value_heads=2, vocab_size=512, n_routed_experts=4,
                    num_experts_per_tok=2, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                    v_head_dim=8).save_pretrained(target)
    for command in ("validate", "train"):
        assert main([command, str(micro_spec_file), "--set", f"models.target_path={target}"]) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err and len(err.splitlines()) == 1, err
        assert re.search(r"layers \[0, 1, 2, 3\] are 'indexed_attention'", err), err


@pytest.mark.parametrize("family_name", ["gpt_oss", "gemma4", "llama4"])
def test_the_preflight_passes_the_layer_kinds_that_run_exactly(family_name, micro_assets, tmp_path):
    check_layer_kinds_of(ModelDir.read(config_only_target(family_name, micro_assets, tmp_path)))


# ---------------------------------------------------------------------------------------------- shipped configs


SHIPPED = {  # config: (target, drafter, target layers, layer ids, mask token, the thinking switch)
    "llama3.1-8b": ("Llama-3.1-8B-Instruct", "LLaMA3.1-8B-Instruct-DFlash-UltraChat", 32, None, None, None),
    "gpt-oss-20b": ("gpt-oss-20b", "gpt-oss-20b-DFlash", 24, None, None, None),
    "qwen3.5-9b": ("Qwen3.5-9B", "Qwen3.5-9B-DFlash", 32, [1, 8, 15, 22, 29], 248070, True),
    "gemma4-31b": ("gemma-4-31B-it", "gemma-4-31B-it-DFlash", 60, [1, 12, 23, 35, 46, 57], 4, None),
    "gpt-oss-120b": ("gpt-oss-120b", "gpt-oss-120b-DFlash", 36, None, None, None),
    "qwen3.5-122b-a10b": ("Qwen3.5-122B-A10B", "Qwen3.5-122B-A10B-DFlash", 48, None, None, True),
    "qwen3.5-397b-a17b": ("Qwen3.5-397B-A17B", "Qwen3.5-397B-A17B-DFlash", 60, None, None, True),
}


@pytest.mark.parametrize("name", SHIPPED)
def test_a_shipped_public_pair_validates_without_its_paths(name, capsys):
    from opd.spec import load_spec

    path = f"configs/{name}.yaml"
    assert main(["validate", path, "--no-path-check"]) == 0, capsys.readouterr().err
    target, drafter, depth, layer_ids, mask, thinking = SHIPPED[name]
    spec = load_spec(path, [], check_paths=False)
    m = spec.models
    assert (m.target_path.rsplit("/", 1)[1], m.drafter_path.rsplit("/", 1)[1]) == (target, drafter)
    assert m.target_num_layers == depth and m.drafter.mask_token_id == mask
    assert layer_ids is None or m.layer_ids == layer_ids
    assert (spec.data.render, spec.data.enable_thinking) == ("chat", thinking)


def test_the_shipped_hybrid_config_trains_the_papers_recipe(micro_assets, tmp_path):
    """configs/qwen3.5-9b.yaml replays drafted blocks (layout draft_opd) with the expected-acceptance diagnostic,
    as the Qwen3 configs do, and a Qwen3.5 config passes the layer-kind preflight."""
    from opd.distill.replay import replay_mode
    from opd.spec import load_spec

    spec = load_spec("configs/qwen3.5-9b.yaml", [], check_paths=False)
    assert (replay_mode(spec), spec.eval.diagnostic) == ("draft_opd", True)
    check_layer_kinds_of(ModelDir.read(config_only_target("qwen3_5", micro_assets, tmp_path)))
