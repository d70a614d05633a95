"""The SFT stage: its loss learns, and `opd sft` writes a drafter that loads back."""

from __future__ import annotations

import torch

from opd.cli import main
from opd.models.build import build_models
from opd.spec import load_spec
from opd.train.sft import SftExample, sft_step_loss


def test_sft_loss_falls_on_a_fixed_batch(micro_spec_file):
    models = build_models(load_spec(micro_spec_file))
    examples = [SftExample([1, 2, 3], [5, 6, 7, 8, 9, 10, 11, 12]), SftExample([4, 4], [9, 8, 7, 6, 5, 4])]
    opt = torch.optim.AdamW(models.drafter.parameters(), lr=1e-2)
    losses = []
    for _ in range(30):
        loss, slots = sft_step_loss(models.target, models.drafter, examples, anchors_per_seq=4, gamma=4.0,
                                    max_length=64, generator=torch.Generator().manual_seed(0))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert slots > 0 and losses[-1] < losses[0] - 0.5  # the frozen random micro LM head makes it slow


def test_opd_sft_writes_a_loadable_drafter(micro_spec_file, tmp_path):
    out = tmp_path / "warm"
    assert main(["sft", str(micro_spec_file), "--out", str(out), "--set", "sft.epochs=1", "--set", "sft.batch_size=8",
                 "--set", "sft.response_max_new_tokens=8", "--set", "sft.anchors_per_seq=4"]) == 0
    spec = load_spec(micro_spec_file)
    assert (spec.run_dir / "sft_data.jsonl").read_text().count("\n") == 40  # one response per train prompt
    before = build_models(spec).drafter.state_dict()
    after = build_models(spec, str(out)).drafter.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_opd_sft_logs_an_mlflow_run(micro_spec_file, tmp_path):
    import mlflow

    sets = ["sft.epochs=1", "sft.batch_size=20", "sft.response_max_new_tokens=4", "sft.anchors_per_seq=2"]
    assert main(["sft", str(micro_spec_file), "--out", str(tmp_path / "d"), *[a for s in sets for a in ("--set", s)]]) == 0
    spec = load_spec(micro_spec_file, sets)
    mlflow.set_tracking_uri(spec.tracking_uri)
    run = mlflow.search_runs(experiment_names=[spec.tracking.experiment]).iloc[0]
    assert run["params.sft.epochs"] == "1" and run["metrics.sft_loss"] > 0
