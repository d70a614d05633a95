"""The MTP family on targets that carry their own head (tests/helpers/mtp.py): the warm start read from the target's
checkpoint, the one-line refusal where there is none, lossless decoding (greedy equals autoregressive; chi-square)
and exact replay and rebuild on two target families, a written-out reference of vLLM's nextn forward for the
DeepSeek-V3 and GLM-4.5 layouts, and the export into the target's own layout, linked, loading back.

What the contract (tests/test_family_contract.py) checks on the micro target holds here on hybrid (Qwen3.5: the
head's layer is its full-attention layer) and latent-attention MoE (DeepSeek-V3) targets. Float64 throughout.
"""

from __future__ import annotations

import json
import shlex

import pytest
import torch
from safetensors.torch import load_file

from opd.decoding.autoregressive import generate_autoregressive
from opd.decoding.sampling import Sampling
from opd.decoding.speculative import SpeculativeDecoder
from opd.distill.replay import score, student_hidden
from opd.errors import OpdError
from opd.formats.experts import fuse_experts, split_experts
from opd.formats.mtp import HEAD_SHARD, LAYOUTS, MTPSpec, to_layout, write_speculators
from opd.model_dir import WEIGHTS_INDEX, ModelDir
from opd.models.mtp import MTPDrafter
from opd.models.registry import family
from tests.helpers import mtp as helper
from tests.helpers.decoding import EOS, MIXED_PROMPTS, assert_rebuild_recovers, drafted_alone
from tests.helpers.lossless import assert_lossless

LAYOUT_OF = {"qwen3_5": "qwen3_next", "deepseek_v3": "nextn", "glm4_moe": "nextn", "qwen2": "mimo"}
# These families' RMSNorms normalise in float32 whatever their input (x.float()), as vLLM's do, so two float64 paths
# whose attention sums in another order (a cache against a full causal pass) can round apart there: agreement is to
# float32's rounding inside a norm, not float64's.
TOLERANCE = {"qwen3_5": 1e-6, "deepseek_v3": 1e-6, "glm4_moe": 1e-6, "qwen2": 1e-6}
K = 4


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    """name -> (directory, the loaded target), built on first use."""
    built: dict[str, tuple] = {}

    def of(name: str):
        if name not in built:
            directory = helper.target_dir(name, tmp_path_factory.mktemp(name))
            built[name] = (directory, helper.load(directory))
        return built[name]

    return of


def own_head(target) -> MTPDrafter:
    return family("mtp").initial(MTPSpec(block_size=K), target, None)


@pytest.mark.parametrize("name", list(LAYOUT_OF))
def test_the_warm_start_is_the_targets_own_head(name, targets):
    """With no drafter path, the head is read from the target's own shards (which transformers dropped), in the
    target family's layout, every tensor as written."""
    directory, target = targets(name)
    drafter = own_head(target)
    assert drafter.form.name == LAYOUT_OF[name]
    written = load_file(directory / helper.HEAD_SHARD)
    ours = split_experts(to_layout(drafter.state_dict(), drafter.form, target.num_layers))
    assert ours.keys() <= written.keys() and all(torch.equal(t, written[n]) for n, t in ours.items())
    assert not any(n.startswith(drafter.form.prefix_for(target.num_layers)) for n in target.model.state_dict())


def test_a_target_without_mtp_layers_is_refused_in_one_line(tmp_path):
    target = helper.load(helper.target_dir("qwen3", tmp_path, head=False))
    with pytest.raises(OpdError, match="holds no MTP layers") as info:
        own_head(target)
    assert "\n" not in str(info.value) and "from_target: false" in str(info.value)
    fresh = family("mtp").initial(MTPSpec(from_target=False), target, None)
    assert fresh.form.name == "speculators" and fresh.block_size == 4


@pytest.mark.parametrize("name", ["qwen3_5", "deepseek_v3"])
def test_greedy_decoding_is_the_targets_argmax(name, targets):
    _, target = targets(name)
    drafter = own_head(target)
    records = SpeculativeDecoder(target, drafter, eos_id=EOS).generate(MIXED_PROMPTS, Sampling(), max_new_tokens=20)
    reference = generate_autoregressive(target, MIXED_PROMPTS, Sampling(), max_new_tokens=20, eos_id=EOS, seed=0,
                                        keys=list(range(len(MIXED_PROMPTS))))
    assert [r.response_ids for r in records] == reference
    assert sum(sum(r.accepted) for r in records) > 0


# Qwen3.5's chi-square takes the hybrid target's slower decode: slow, since DeepSeek-V3's runs the same MTP code
@pytest.mark.parametrize("name", [pytest.param("qwen3_5", marks=pytest.mark.slow), "deepseek_v3"])
def test_decoding_at_t1_is_lossless(name, targets):
    """The joint law of the first three tokens equals the target's (chi-square, 4k sequences)."""
    _, target = targets(name)
    assert_lossless(target, own_head(target), Sampling(temperature=1.0), 4000)


@pytest.mark.parametrize("name", ["qwen3_5", "deepseek_v3"])
def test_replay_and_the_rebuild_give_decodings_blocks(name, targets):
    """Replay (every block of a sequence in one forward, fed its recorded drafts) gives each block the logits its
    draft gave it alone, and the rebuild recovers every block from the committed text alone."""
    _, target = targets(name)
    drafter = own_head(target)
    decoded = SpeculativeDecoder(target, drafter, eos_id=EOS).generate(MIXED_PROMPTS, Sampling(temperature=1.0),
                                                                       max_new_tokens=20, seed=3)
    batch = score(target, decoded, block_size=K, mode="draft_opd")
    with torch.no_grad():
        logits = drafter.student_head(student_hidden(drafter, batch))
        row = 0
        for record in decoded:
            ids = torch.tensor([record.prompt_ids + record.response_ids])
            features = target(ids).features
            for anchor, recorded in zip(record.anchors, record.drafts):
                drafts, alone = drafted_alone(drafter, features, ids, len(record.prompt_ids) + anchor)
                assert drafts.tolist() == recorded
                torch.testing.assert_close(logits[row], alone, rtol=TOLERANCE[name], atol=TOLERANCE[name])
                row += 1
    assert_rebuild_recovers(target, drafter, decoded, batch_size=4)


# -- vLLM's nextn forward, written out -----------------------------------------------------------------------------


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """vLLM's RMSNorm (`forward_native`): normalised in float32, cast back, then scaled."""
    wide = x.float()
    return weight * (wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def nextn_chain(directory, target, ids: torch.Tensor, anchor: int, steps: int) -> torch.Tensor:
    """Logits [steps, V] of vLLM's `DeepSeekMultiTokenPredictorLayer` chained from `anchor`, with no cache: the
    tensors read by their nextn names; column p = eh_proj(cat(enorm(embed(x_{p+1}) zeroed at position 0),
    hnorm(h_p))), h the target's last hidden state after its final norm; `mtp_block` is the target's decoder layer
    class (vLLM's DeepseekV2DecoderLayer), run causally over the whole sequence; its output (residual added, not
    normed) is fed to the next step, at the next position; logits = shared_head.head(shared_head.norm(output))."""
    config, n = target.config, target.num_layers
    prefix = f"model.layers.{n}."
    weights = fuse_experts(load_file(directory / helper.HEAD_SHARD), "head shard")  # transformers' layer's names
    own = {name[len(prefix):]: t for name, t in weights.items() if name.startswith(prefix)}
    block = type(target.model.model.layers[-1])(config, n).to(torch.float64)
    block.load_state_dict({k: v for k, v in own.items()
                           if not k.startswith(("enorm", "hnorm", "eh_proj", "shared_head", "embed_tokens"))})
    eps, embed = config.rms_norm_eps, own["embed_tokens.weight"]
    hidden = target(ids[:, :anchor]).features[0, :, -config.hidden_size:]  # h_0 .. h_{a-1}
    tokens = ids[0, 1:anchor + 1].tolist()  # x_1 .. x_a
    out = []
    for _ in range(steps):
        positions = torch.arange(len(tokens))[None]
        e = embed[torch.tensor(tokens)].clone()
        e[positions[0] == 0] = 0
        x = torch.cat([rms(e, own["enorm.weight"], eps), rms(hidden, own["hnorm.weight"], eps)], -1)
        x = (x @ own["eh_proj.weight"].T)[None]
        causal = torch.full((len(tokens), len(tokens)), torch.finfo(torch.float64).min, dtype=torch.float64).triu(1)
        h = block(x, attention_mask=causal[None, None], position_ids=positions,
                  position_embeddings=target.model.model.rotary_emb(x, positions))
        h = (h[0] if isinstance(h, tuple) else h)[0, -1]
        logits = rms(h, own["shared_head.norm.weight"], eps) @ own["shared_head.head.weight"].T
        out.append(logits)
        hidden = torch.cat([hidden, h[None]])
        tokens.append(int(logits.argmax()))
    return torch.stack(out)


@pytest.mark.parametrize("name", ["deepseek_v3", "glm4_moe"])
def test_the_nextn_head_gives_vllms_nextn_forward(name, targets):
    directory, target = targets(name)
    drafter = own_head(target)
    for anchor, logits in chains_from_anchors(drafter, target):
        torch.testing.assert_close(logits, nextn_chain(directory, target, CHAIN_IDS, anchor, K - 1),
                                   rtol=TOLERANCE[name], atol=TOLERANCE[name])


CHAIN_IDS = torch.tensor([[1, 2, 3, 4, 5, 6, 2, 3, 4]])


def chains_from_anchors(drafter, target, anchors=(1, 4, 8)):
    """(anchor, the drafter's chain logits [K-1, V]) after each anchor of CHAIN_IDS, its context cached."""
    features = target(CHAIN_IDS).features
    for anchor in anchors:
        yield anchor, drafted_alone(drafter, features, CHAIN_IDS, anchor)[1]


def mimo_chain(directory, target, ids: torch.Tensor, anchor: int, steps: int) -> torch.Tensor:
    """Logits [steps, V] of vLLM's `MiMoMultiTokenPredictorLayer` chained from `anchor`, with no cache: the tensors
    read by their names under `model.mtp_layers.0.`; column p = input_proj(cat(hidden_layernorm(h_p),
    token_layernorm(embed(x_{p+1}) zeroed at position 0))), hidden first; the target's decoder layer class (vLLM's
    Qwen2DecoderLayer, its checkpoint tensors directly under the prefix) run causally; its output (residual added)
    through final_layernorm is returned, fed to the next step at the next position, and read by the target's LM
    head."""
    config, prefix = target.config, "model.mtp_layers.0."
    own = {n[len(prefix):]: t for n, t in load_file(directory / helper.HEAD_SHARD).items() if n.startswith(prefix)}
    parts = ("token_layernorm", "hidden_layernorm", "input_proj", "final_layernorm")
    block = type(target.model.model.layers[-1])(config, target.num_layers - 1).to(torch.float64)  # full attention
    block.load_state_dict({k: v for k, v in own.items() if not k.startswith(parts)})
    eps = config.rms_norm_eps
    embed, head = target.model.model.embed_tokens.weight, target.model.lm_head.weight
    hidden = target(ids[:, :anchor]).features[0, :, -config.hidden_size:]
    tokens = ids[0, 1:anchor + 1].tolist()
    out = []
    for _ in range(steps):
        positions = torch.arange(len(tokens))[None]
        e = embed[torch.tensor(tokens)].clone()
        e[positions[0] == 0] = 0
        x = torch.cat([rms(hidden, own["hidden_layernorm.weight"], eps), rms(e, own["token_layernorm.weight"], eps)],
                      -1)
        x = (x @ own["input_proj.weight"].T)[None]
        causal = torch.full((len(tokens), len(tokens)), torch.finfo(torch.float64).min, dtype=torch.float64).triu(1)
        h = block(x, attention_mask=causal[None, None], position_ids=positions,
                  position_embeddings=target.model.model.rotary_emb(x, positions))
        h = rms((h[0] if isinstance(h, tuple) else h)[0, -1], own["final_layernorm.weight"], eps)
        logits = h @ head.T
        out.append(logits)
        hidden = torch.cat([hidden, h[None]])
        tokens.append(int(logits.argmax()))
    return torch.stack(out)


def test_a_mimo_head_gives_vllms_mimo_mtp_forward(targets):
    """MiMo's layout (`model.mtp_layers.0.*`) on its stand-in, a Qwen2 target (MiMo is Qwen2's architecture; there is
    no MiMo class in transformers): the warm head read from the checkpoint drafts what vLLM's forward computes."""
    directory, target = targets("qwen2")
    drafter = own_head(target)
    assert drafter.form.name == "mimo" and type(drafter.layer).__name__ == "Qwen2DecoderLayer"
    for anchor, logits in chains_from_anchors(drafter, target):
        torch.testing.assert_close(logits, mimo_chain(directory, target, CHAIN_IDS, anchor, K - 1),
                                   rtol=TOLERANCE["qwen2"], atol=TOLERANCE["qwen2"])


# -- the export into the target's own layout ---------------------------------------------------------------------


@pytest.mark.parametrize("name", ["qwen3_5", "deepseek_v3", "qwen2"])
def test_the_export_into_the_targets_layout_links_its_shards_and_loads_back(name, targets, tmp_path):
    """A trained head goes into a new directory: the target's shards linked, the head in a new shard, the index
    naming it; the target loaded from there is the same target, and its own head is the trained one."""
    directory, target = targets(name)
    drafter = own_head(target)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(0.01 * torch.randn_like(p))
    out = family("mtp").save_into_target(drafter, directory, tmp_path / "served")
    assert (out / helper.SHARD).is_symlink() and not (out / HEAD_SHARD).is_symlink()
    index = json.loads((out / WEIGHTS_INDEX).read_text())["weight_map"]
    ours = split_experts(to_layout(drafter.state_dict(), drafter.form, target.num_layers))
    assert {index[n] for n in ours} == {HEAD_SHARD} and index["lm_head.weight"] == helper.SHARD
    copies = {drafter.form.prefix_for(target.num_layers) + n for n in drafter.form.shared}  # left in their shard
    assert set(load_file(out / HEAD_SHARD)) == set(load_file(directory / helper.HEAD_SHARD)) - copies
    assert {index[n] for n in copies} <= {helper.HEAD_SHARD}  # the target's own naming, experts one tensor each
    # vLLM reads every tensor of every shard the index names: the old head's shard is rewritten, not linked
    served = [(n, file) for file in set(index.values()) for n in load_file(out / file)]
    assert sorted(n for n, _ in served) == sorted(index) and all(index[n] == file for n, file in served)
    assert (out / helper.HEAD_SHARD).exists() == bool(copies) and not (out / helper.HEAD_SHARD).is_symlink()
    assert set(load_file(directory / helper.HEAD_SHARD)) >= set(ours)  # the target's own file is untouched
    (out / helper.HEAD_SHARD).unlink(missing_ok=True)  # a link an earlier export left, exported over again:
    (out / helper.HEAD_SHARD).symlink_to(directory / helper.HEAD_SHARD)
    family("mtp").save_into_target(drafter, directory, out)
    assert set(load_file(directory / helper.HEAD_SHARD)) >= set(ours)  # nothing written through it
    assert not (out / helper.HEAD_SHARD).is_symlink()
    assert ModelDir.read(out).kind.layout == "target"
    reloaded = helper.load(out)
    assert all(torch.equal(a, b) for a, b in zip(reloaded.state_dict().values(), target.state_dict().values()))
    warm = own_head(reloaded)
    assert all(torch.equal(warm.state_dict()[n], t) for n, t in drafter.state_dict().items())


@pytest.mark.parametrize("name", ["deepseek_v3", "glm4_moe"])
def test_a_head_stored_one_tensor_per_expert_is_the_fused_one(name, targets, tmp_path):
    """The MoE head as public checkpoints store it (`experts.{N}.gate_proj.weight` ...) and as transformers' layer
    holds it (`experts.gate_up_proj`, `experts.down_proj`) loads to the same head: the same drafts and logits."""
    directory, target = targets(name)
    assert any(".experts.0.gate_proj.weight" in n for n in load_file(directory / helper.HEAD_SHARD))
    fused_dir = helper.target_dir(name, tmp_path / "fused", per_expert=False)
    assert any(n.endswith(".experts.gate_up_proj") for n in load_file(fused_dir / helper.HEAD_SHARD))
    ids = torch.tensor([[1, 2, 3, 4, 5, 6, 2, 3, 4]])
    features = target(ids).features
    drafts = []
    for drafter in (own_head(target), own_head(helper.load(fused_dir))):
        drafts.append(drafted_alone(drafter, features, ids, 6))
    assert torch.equal(drafts[0][0], drafts[1][0]) and torch.equal(drafts[0][1], drafts[1][1])


def test_an_expert_missing_from_the_head_is_refused_in_one_line(targets, tmp_path):
    directory, _ = targets("deepseek_v3")
    broken = {n: t for n, t in load_file(directory / helper.HEAD_SHARD).items() if ".experts.2.up_proj." not in n}
    with pytest.raises(OpdError, match=r"missing .*experts\.2\.up_proj\.weight") as info:
        fuse_experts(broken, "head")
    assert "\n" not in str(info.value)


def test_splitting_experts_inverts_fusing():
    state = {"l.mlp.experts.gate_up_proj": torch.randn(3, 8, 5), "l.mlp.experts.down_proj": torch.randn(3, 5, 4),
             "l.mlp.shared_experts.gate_proj.weight": torch.randn(4, 5)}
    split = split_experts(state)
    assert len(split) == 10 and split["l.mlp.experts.1.up_proj.weight"].shape == (4, 5)
    assert torch.equal(split["l.mlp.experts.1.gate_proj.weight"], state["l.mlp.experts.gate_up_proj"][1, :4])
    again = fuse_experts(split, "state")
    assert again.keys() == state.keys() and all(torch.equal(again[n], t) for n, t in state.items())


def test_a_target_family_vllm_serves_no_head_for_is_refused_in_one_line(tmp_path):
    directory = helper.target_dir("qwen3", tmp_path / "t", head=False)
    drafter = family("mtp").initial(MTPSpec(from_target=False), helper.load(directory), None)
    with pytest.raises(OpdError, match="vLLM serves no MTP head of model_type 'qwen3'") as info:
        family("mtp").save_into_target(drafter, directory, tmp_path / "out")
    assert "\n" not in str(info.value)


def test_every_layout_names_each_part_once():
    for layout in LAYOUTS.values():
        assert len(set(layout.parts.values())) == 4 and set(layout.parts) == {"fc", "token_norm", "hidden_norm",
                                                                              "final_norm"}


# -- `opd export --to target` and `opd serve-bench` on what it writes ---------------------------------------------


def test_opd_export_to_target_writes_the_directory_vllm_serves_and_serve_bench_takes_it(targets, tmp_path, capsys):
    """`opd export CKPT --to target --target T --out DIR`, as a user types it: DIR links T's shards, holds the trained
    head in T's own naming, and prints the vLLM line that serves DIR itself with `method: mtp`; `opd serve-bench
    --draft DIR` with `kind: mtp` serves DIR as the model, and refuses it for another kind or without a head."""
    from types import SimpleNamespace

    from opd.cli import main
    from opd.commands.serve_bench import served_config
    from opd.formats.dflash import DFlashSpec

    directory, target = targets("deepseek_v3")
    drafter = own_head(target)
    with torch.no_grad():
        drafter.fc.weight.add_(0.01)
    # in float32, which `opd export` then loads in: transformers' grouped-mm experts take no float64
    write_speculators(tmp_path / "ckpt", drafter.config, drafter.state_dict(), torch.float32, str(directory), [])
    out = tmp_path / "served"
    assert main(["export", str(tmp_path / "ckpt"), "--to", "target", "--target", str(directory), "--out",
                 str(out)]) == 0
    printed = capsys.readouterr().out.strip().splitlines()
    assert printed[0].endswith(f"to {out} (the target's files linked)")
    vllm, serve, model, flag, config = shlex.split(printed[2])
    assert (vllm, serve, model, flag) == ("vllm", "serve", str(out), "--speculative-config")
    assert json.loads(config) == {"method": "mtp", "num_speculative_tokens": K - 1}
    assert (out / helper.SHARD).is_symlink() and any(".experts.0.up_proj." in n for n in load_file(out / HEAD_SHARD))
    warm = own_head(helper.load(out))
    assert all(torch.equal(warm.state_dict()[n], t.float().double()) for n, t in drafter.state_dict().items())

    spec = SimpleNamespace(models=SimpleNamespace(target_path=str(directory), drafter=MTPSpec(block_size=5)))
    assert served_config(str(out), spec) == {"method": "mtp", "num_speculative_tokens": 4}
    plain = helper.target_dir("deepseek_v3", tmp_path / "plain", head=False)
    refusals = ((plain, MTPSpec(), "plain: a target model holding no MTP layers"),
                (out, DFlashSpec(), r"served is a target model \(DeepseekV3ForCausalLM\), not a drafter"))
    for path, drafter_spec, message in refusals:
        spec.models.drafter = drafter_spec
        with pytest.raises(OpdError, match=message) as info:
            served_config(str(path), spec)
        assert "\n" not in str(info.value)


def test_a_deepseek_head_is_never_written_where_speculators_cannot_load_it(targets, tmp_path, capsys):
    """speculators' MTPDraftModel builds no DeepSeek-V3 layer ("Unsupported MTP model type"): `--to speculators` is
    refused in one line naming `--to target`, and the line a run ends with suggests `--to target`; a Qwen3.5 head
    keeps speculators' layout first."""
    from opd.cli import main
    from opd.commands.export import export_command

    directory, target = targets("deepseek_v3")
    write_speculators(tmp_path / "ckpt", own_head(target).config, own_head(target).state_dict(), torch.float32,
                      str(directory), [])
    out = tmp_path / "refused"
    assert main(["export", str(tmp_path / "ckpt"), "--to", "speculators", "--target", str(directory), "--out",
                 str(out)]) == 2
    error = capsys.readouterr().err.strip()
    assert "\n" not in error and "'deepseek_v3'" in error and error.endswith(
        "(expected --to target, which writes this drafter as it is)")
    assert not out.exists()
    assert " --to target " in export_command(tmp_path / "ckpt", "mtp", tmp_path / "o", str(directory))
    qwen, _ = targets("qwen3_5")
    assert " --to speculators " in export_command(tmp_path / "ckpt", "mtp", tmp_path / "o", str(qwen))


# -- the preflight's shape check -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["qwen3_5", "deepseek_v3", "glm4_moe"])
def test_the_shapes_a_head_must_have_are_the_built_heads(name, targets):
    from opd.models.mtp import head_shapes

    _, target = targets(name)
    drafter = own_head(target)
    assert head_shapes(drafter._shared[2]) == {n: tuple(t.shape) for n, t in drafter.state_dict().items()}


@pytest.mark.parametrize("per_expert", [False, True])
def test_the_preflight_checks_a_heads_tensors_against_the_target(per_expert, targets, tmp_path):
    """`opd run`'s preflight reads only the header: an export (experts fused, or one tensor per expert) passes; a
    tensor of another shape, a missing one, or a head for another vocabulary is refused in one line before any
    weights load."""
    from safetensors.torch import save_file

    from opd.commands.preflight import check_drafter, check_target

    directory, target = targets("deepseek_v3")
    drafter = own_head(target)
    family("mtp").save_speculators(drafter, tmp_path / "ok", str(directory))
    weights = tmp_path / "ok" / "model.safetensors"
    if per_expert:
        save_file(split_experts(load_file(weights)), weights)
    shape = check_target(ModelDir.read(directory), [target.num_layers - 1])
    check_drafter(str(tmp_path / "ok"), shape, MTPSpec())
    tensors = load_file(weights)
    expert = "mtp_layers.0.mlp.experts.1.down_proj.weight" if per_expert else "mtp_layers.0.mlp.experts.down_proj"
    bad = {"shape": tensors | {expert: tensors[expert][..., :-1]},
           "missing": {n: t for n, t in tensors.items() if n != expert}}
    for what, state in bad.items():
        (tmp_path / what).mkdir()
        (tmp_path / what / "config.json").write_text((tmp_path / "ok" / "config.json").read_text())
        save_file({n: t.contiguous() for n, t in state.items()}, tmp_path / what / "model.safetensors")
        with pytest.raises(OpdError, match=f"has shape|missing tensor\\(s\\) {expert}") as info:
            check_drafter(str(tmp_path / what), shape, MTPSpec())
        assert "\n" not in str(info.value) and expert in str(info.value)
    shape.vocab_size += 1
    with pytest.raises(OpdError, match="a vocabulary of 8 but the target's is 9"):
        check_drafter(str(tmp_path / "ok"), shape, MTPSpec())
