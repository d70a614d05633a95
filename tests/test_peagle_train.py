"""P-EAGLE through the training commands: `opd train` (Draft-OPD's loss, or with drafts sampled from each slot's q
the acceptance objective) and `opd sft` train its layer, head, mask_hidden and own embedding, and save speculators'
layout; a fresh drafter's SFT takes its draft vocabulary from the data; the spec's one-line errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from opd.cli import main
from opd.formats.peagle import PEagleSpec
from opd.models.peagle import PEagleDrafter
from opd.models.registry import family, load_drafter
from opd.models.target import load_target
from tests.helpers.local_runs import assert_every_source_trains_alike
from tests.helpers.specs import validate_errors

SERVED = ["--set", "serving={draft: sample, temperature: 1.0, top_p: 0.95, top_k: 40}", "--set",
          "replay.teacher=served", "--set", "loss.objective=one_minus_alpha"]
FRESH = ["models.drafter_path=", "models.drafter.kind=peagle", "models.drafter.target_layer_ids=[1,1,2]",
         "models.drafter.draft_vocab_size=16"]


@pytest.fixture
def micro_peagle(micro_assets, tmp_path) -> str:
    """A random P-EAGLE drafter on the micro target (which fuses the states entering layers 2, 2 and 3), saved."""
    target = load_target(micro_assets["target"], dtype=torch.float32, layer_ids=[1, 1, 2])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        drafter = family("peagle").initial(PEagleSpec(draft_vocab_size=64, block_size=4), target, _Tokenizer())
    drafter.save_pretrained(tmp_path / "peagle")
    return str(tmp_path / "peagle")


class _Tokenizer:
    mask_token_id = 3


@pytest.mark.parametrize("command", ["train", "train-sampled"])
def test_training_commands_train_a_peagle_drafter(micro_spec_file, micro_peagle, command, tmp_path, capsys):
    run_dir = tmp_path / "run"
    args = ["train", str(micro_spec_file), "--set", f"models.drafter_path={micro_peagle}", "--set",
            "models.drafter.target_layer_ids=[1,1,2]", "--set", f"tracking.run_dir={run_dir}", "--set", "steps=2",
            "--set", "eval.every=0", *(SERVED if command == "train-sampled" else [])]
    assert main(args) == 0, capsys.readouterr().err
    saved = sorted(p.parent for p in run_dir.rglob("config.json") if "peagle" in p.read_text())[-1]
    before = load_file(str(Path(micro_peagle) / "model.safetensors"))
    after = load_file(str(saved / "model.safetensors"))
    changed = {name for name in before if not torch.equal(before[name], after[name])}
    assert {"mask_hidden", "embed_tokens.weight", "fc.weight", "lm_head.weight"} <= changed


def test_sft_trains_a_fresh_drafter_on_a_draft_vocabulary_from_its_data(micro_spec_file, micro_assets, tmp_path,
                                                                         capsys):
    out = tmp_path / "peagle"
    args = ["sft", str(micro_spec_file), "--out", str(out)]
    for s in [*FRESH, "models.drafter.mask_token_id=3", "sft.epochs=1", "sft.batch_size=8", "sft.micro_batch_size=4",
              "sft.response_max_new_tokens=8", "sft.anchors_per_seq=4"]:
        args += ["--set", s]
    assert main(args) == 0, capsys.readouterr().err
    drafter = load_drafter(out, load_target(micro_assets["target"], dtype=torch.float32, layer_ids=[1, 1, 2]))
    assert isinstance(drafter, PEagleDrafter) and drafter.config.mask_token_id == 3
    assert not torch.equal(drafter.vocab_ids, torch.arange(16))  # fitted, not the identity a random drafter has


def test_greedy_peagle_rollouts_train_identically_from_every_source(micro_spec_file, tmp_path):
    """The rebuild holds for P-EAGLE's blocks: rollouts decoded with the drafter, sampled from the target and rebuilt
    by the scorer, or read from a sample file all take the same steps, at a learning rate that changes the drafts."""
    greedy = [*FRESH, "models.drafter.mask_token_id=3", "rollout.temperature=0", "optim.lr=0.03", "steps=4",
              "models.dtype=float64"]
    assert_every_source_trains_alike(micro_spec_file, tmp_path, greedy)


@pytest.mark.parametrize(("sets", "message"), [
    ([*FRESH, "replay.teacher_topk=8"], "replay.teacher_topk: 8 with a peagle drafter"),
    ([*FRESH, "replay.anchors=random"], "replay.anchors: random with a peagle drafter"),
    (["models.drafter.kind=peagle", "models.drafter.target_layer_ids=[1,2]"], "(expected 3 ids"),
    (["models.drafter.kind=peagle", "models.drafter.target_layer_ids=[1,1,2]"], "drafter.kind: peagle but"),
])
def test_peagle_spec_errors_are_one_line(micro_spec_file, capsys, sets, message):
    assert message in validate_errors(micro_spec_file, sets, capsys)
