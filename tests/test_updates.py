"""Optimizer updates over several rollout batches: one update is one batch of all their sequences (float64); a
crash in the middle of an update restarts that update, exactly; a step is the same count in the progress bar,
the checkpoint name, MLflow and the schedule; the run length in epochs or rollout batches; the Qwen3 recipe
matches the authors' run."""

from __future__ import annotations

import pytest
import torch

from opd.commands.validate import run_length
from opd.distill.replay import score
from opd.models.build import build_models
from opd.spec import SpecError, load_spec
from opd.train import result as result_module
from opd.train.checkpoint import checkpoint_step, complete_checkpoints
from opd.train.learner import Learner
from opd.train.local import LocalTrainer

UPDATE = ["rollout.batch_size=2", "optim.batch_size=6", "optim.micro_batch_size=1", "optim.grad_clip=0",
          "models.dtype=float64"]


def test_an_update_over_three_rollout_batches_is_one_batch_of_all_their_sequences(micro_spec_file):
    spec = load_spec(micro_spec_file, UPDATE)
    assert spec.batches_per_step == 3
    trainer = LocalTrainer(spec, track=False)
    items = [trainer.scorer(trainer.rollout.run(i)) for i in range(3)]
    trainer.session.train_step(items)
    accumulated = [p.grad.clone() for p in trainer.learner.drafter.parameters()]
    models = build_models(spec)
    alone = Learner(spec, models.drafter)
    records = [r for it in items for r in it.batch.records]
    alone.train_step([score(models.target, records, block_size=spec.models.drafter.block_size)])
    for got, want in zip(accumulated, [p.grad for p in alone.drafter.parameters()]):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)


def test_a_crash_inside_an_update_restarts_that_update_exactly(micro_spec_file, tmp_path, monkeypatch):
    settings = [*UPDATE[:3], "steps=3", "tracking.checkpoint_every=1", "eval.every=0"]
    straight = LocalTrainer(load_spec(micro_spec_file, settings), track=False)
    done = straight.run()
    crashed = load_spec(micro_spec_file, [*settings, f"tracking.run_dir={tmp_path / 'crash'}"])
    trainer = LocalTrainer(crashed, track=False)
    scorer = trainer.scorer.__call__

    def dies_in_update_two(batch):
        if batch.index == 4:  # the second of update 2's batches 3, 4, 5: update 1 is checkpointed, 2 half-scored
            raise RuntimeError("killed")
        return scorer(batch)

    monkeypatch.setattr(trainer, "scorer", dies_in_update_two)
    with pytest.raises(RuntimeError, match="killed"):
        trainer.run()
    resumed = LocalTrainer(crashed, track=False)
    again = resumed.run()
    assert again.losses == done.losses[1:]  # updates 2 and 3, update 2 from its first batch
    for (name, a), b in zip(straight.learner.drafter.state_dict().items(), resumed.learner.drafter.state_dict().values()):
        assert torch.equal(a, b), name


def test_a_step_reads_the_same_in_bar_checkpoint_mlflow_and_schedule(micro_spec_file, monkeypatch):
    import mlflow

    bars = []

    class Bar:
        def __init__(self, *columns):
            self.fields = {}

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def add_task(self, label, **fields):
            self.fields = fields
            return 0

        def update(self, task, **fields):
            self.fields |= fields
            bars.append((fields["completed"], fields["batches"]))

    monkeypatch.setattr(result_module, "progress_bar", Bar)
    spec = load_spec(micro_spec_file, ["steps=2", "eval.every=0", "tracking.checkpoint_every=1"])
    trainer = LocalTrainer(spec)
    done = trainer.run()
    per = spec.batches_per_step
    assert bars == [(1, per), (2, 2 * per)]
    assert [checkpoint_step(p) for p in complete_checkpoints(spec.run_dir)] == [1, 2]
    assert trainer.learner.scheduler.last_epoch == trainer.learner.step == 2
    client = mlflow.MlflowClient(spec.tracking_uri)
    for name, values in (("loss", None), ("rollout_batches", [per, 2 * per])):
        history = client.get_metric_history(done.run_id, name)
        assert [m.step for m in history] == [1, 2]
        assert values is None or [m.value for m in history] == values


def test_run_length_in_epochs_or_rollout_batches_becomes_whole_updates(micro_spec_file):
    spec = load_spec(micro_spec_file, ["steps=null", "epochs=3"])  # 40 prompts, 4 sequences an update
    assert spec.data.train_pool_size == 40 and spec.steps == 30
    assert load_spec(micro_spec_file, ["steps=null", "rollout_batches=7"]).steps == 4  # 2 an update, rounded up
    assert load_spec(micro_spec_file, ["steps=30", "epochs=3"]).steps == 30  # a resolved spec agrees with itself
    with pytest.raises(SpecError, match="steps: the run's length is given twice and disagrees"):
        load_spec(micro_spec_file, ["steps=4", "epochs=3"])
    with pytest.raises(SpecError, match="data.train_pool_size: 16000 disagrees with the 40 prompts"):
        load_spec(micro_spec_file, ["data.train_pool_size=16000"])


def test_the_qwen3_recipes_match_the_authors_run_within_one_percent():
    """The authors' verl run: 21 prompts a rollout batch, 10 an update, 16,000 // 21 x 7 = 5,327 rollout batches
    (`global_steps`), ceil(5,327 / 10) = 533 optimizer updates, 111,867 sequences."""
    for name in ("qwen3-4b", "qwen3-8b", "qwen3-4b-thinking", "qwen3-8b-thinking"):
        spec = load_spec(f"configs/{name}.yaml", check_paths=False)
        batches = spec.steps * spec.batches_per_step
        assert (spec.rollout.batch_size, spec.batches_per_step) == (21, 10)
        assert spec.steps == pytest.approx(533, rel=0.01) and batches == pytest.approx(5327, rel=0.01)
        assert batches * spec.rollout.batch_size == pytest.approx(111_867, rel=0.01)
        assert spec.optim.lr == 3e-4 and spec.optim.schedule == "cosine" and spec.optim.warmup_ratio > 0
        assert "optimizer updates" in run_length(spec)


@pytest.mark.parametrize("resumed_at", [2, 1])
def test_the_bar_shows_the_last_trained_steps_loss_and_a_dash_before_one(micro_spec_file, monkeypatch, resumed_at):
    """A run resumed at its last step trains nothing: its bar said `loss nan τ nan`; it now shows `–` until a step
    of this invocation reports, then that step's loss and τ."""
    from io import StringIO

    from rich.console import Console
    from rich.progress import Progress

    from opd.train.messages import StepReport, TrainResult

    out = StringIO()
    monkeypatch.setattr(result_module, "progress_bar", lambda *columns: Progress(
        *columns, console=Console(file=out, width=200, force_terminal=True), auto_refresh=False))
    spec = load_spec(micro_spec_file, ["steps=2"])
    report = StepReport(step=2, metrics={"loss": 1.23456, "rollout_tau": 3.5})
    result_module.run_to(spec, TrainResult(steps=resumed_at), lambda step: [report])
    shown = out.getvalue()
    final = shown.rsplit("\x1b[2K", 1)[-1]  # the bar as it was left
    assert "nan" not in shown
    assert ("loss – τ –" if resumed_at == 2 else "loss 1.2346 τ 3.500") in final, final
