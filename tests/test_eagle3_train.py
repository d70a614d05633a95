"""EAGLE-3 through the training commands: Draft-OPD from every rollout source, `opd sft` with the draft
vocabulary taken from its data, and the spec's one-line errors. The Ray path is in tests/test_ray.py."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

from opd.cli import main
from opd.models.eagle3 import Eagle3Drafter
from opd.models.target import load_target
from opd.spec import load_spec
from tests.helpers.local_runs import assert_every_source_trains_alike
from tests.helpers.specs import validate_errors

EAGLE3 = ["models.drafter_path=", "models.drafter.kind=eagle3", "models.drafter.target_layer_ids=[1,1,2]",
          "models.drafter.draft_vocab_size=64"]


def eagle3_sets() -> list[str]:
    """The micro spec (a four-layer target) with a random EAGLE-3 drafter."""
    return list(EAGLE3)


def test_greedy_eagle3_rollouts_train_identically_from_every_source(micro_spec_file, tmp_path):
    """The rebuild holds for chains: rollouts decoded with the drafter, sampled from the target and rebuilt by the
    scorer, or read from a sample file all take the same steps, at a learning rate that changes the drafts."""
    greedy = [*eagle3_sets(), "rollout.temperature=0", "optim.lr=0.03", "steps=4",
              "models.dtype=float64"]  # the shared forward and the packed row differ in shape: float32 rounding
    assert_every_source_trains_alike(micro_spec_file, tmp_path, greedy)


def test_sft_takes_the_draft_vocabulary_from_its_data(micro_spec_file, tmp_path, capsys):
    """A fresh EAGLE-3 drafter's draft vocabulary is the SFT data's most frequent response tokens; the saved
    drafter loads back in the public format with it."""
    out = tmp_path / "eagle3"
    args = ["sft", str(micro_spec_file), "--out", str(out)]
    sets = [*eagle3_sets(), "models.drafter.draft_vocab_size=16", "sft.epochs=1", "sft.batch_size=8",
            "sft.micro_batch_size=4", "sft.response_max_new_tokens=12", "sft.anchors_per_seq=8"]
    for s in sets:
        args += ["--set", s]
    assert main(args) == 0, capsys.readouterr().err
    spec = load_spec(micro_spec_file, sets)
    rows = [json.loads(line) for line in (spec.run_dir / "sft_data.jsonl").read_text().splitlines()]
    counts = Counter(t for r in rows for t in r["response_ids"])
    target = load_target(spec.models.target_path, dtype=torch.float32, layer_ids=spec.models.layer_ids)
    drafter = Eagle3Drafter.from_pretrained(out, target)
    chosen = set(drafter.vocab_ids.tolist())
    threshold = sorted(counts.values(), reverse=True)[15]
    assert {t for t, c in counts.items() if c > threshold} <= chosen and len(chosen) == 16


@pytest.mark.parametrize(("sets", "message"), [
    (["models.drafter.kind=eagle3", "models.drafter.num_layers=2"], "drafter.num_layers: 2 on an eagle3 drafter"),
    (["models.drafter.kind=eagle3", "models.drafter.mask_token_id=3"], "drafter.mask_token_id: unknown key (an option of kind dflash;"),
    (["models.drafter.kind=eagle3", "models.drafter.tree_topk=4"], "drafter.tree_topk: 4 is a draft tree"),
    (["models.drafter.draft_vocab_size=10"], "drafter.draft_vocab_size: unknown key (an option of kind eagle3;"),
    (["models.drafter.kind=eagle3", "models.drafter.target_layer_ids=[1,2]"], "(expected 3 ids"),
    (["models.drafter.kind=eagle3", "models.drafter.target_layer_ids=[1,2,9]"], "layer 9 is outside the target"),
    (["models.drafter.kind=eagle3", "models.drafter_path=", "models.drafter.target_layer_ids=[1,1,2]",
      "replay.teacher_topk=8"], "replay.teacher_topk: 8 with an eagle3 drafter"),
    (["models.drafter.kind=eagle3", "models.drafter.target_layer_ids=[1,1,2]"], "drafter.kind: eagle3 but"),
])
def test_eagle3_spec_errors_are_one_line(micro_spec_file, capsys, sets, message):
    assert message in validate_errors(micro_spec_file, sets, capsys)


def test_a_draft_vocabulary_larger_than_the_target_is_one_error(micro_spec_file, capsys):
    args = ["train", str(micro_spec_file)]
    for s in [*eagle3_sets(), "models.drafter.draft_vocab_size=5000"]:
        args += ["--set", s]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "draft_vocab_size: 5000 is larger than the target's vocabulary" in err and "Traceback" not in err
