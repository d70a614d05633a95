"""The SFT stage: its loss learns, chunked and micro-batched it equals the unchunked full-batch loss and gradient,
and `opd sft` writes a drafter that loads back."""

from __future__ import annotations

import shutil

import pytest
import torch

from opd.cli import main
from opd.distill.losses import sft_loss
from opd.models.build import build_models
from opd.spec import SftSpec, SpecError, load_spec
from opd.tiny.micro import micro_drafter, micro_target
from opd.train.sft import sft_backward, sft_batch_loss, sft_micro_batches
from tests.helpers.records import EXAMPLES


@pytest.fixture(scope="module")
def fp64_models():
    """Float64 micro models, so the chunked and micro-batched paths can be held to ~1e-12."""
    target = micro_target(seed=0, vocab_size=64, layer_ids=[0, 2])
    return target, micro_drafter(target, seed=1, num_layers=2, block_size=4)


def _grads(drafter) -> list[torch.Tensor]:
    grads = [p.grad.clone() for p in drafter.parameters()]
    drafter.zero_grad(set_to_none=True)
    return grads


def test_sft_loss_falls_on_a_fixed_batch(micro_spec_file):
    models = build_models(load_spec(micro_spec_file))
    sft = SftSpec(anchors_per_seq=4, gamma=4.0, max_length=64, batch_size=2, micro_batch_size=1)
    opt = torch.optim.AdamW(models.drafter.parameters(), lr=1e-2)
    losses = []
    for _ in range(30):
        opt.zero_grad()
        step = sft_backward(models.target, models.drafter, EXAMPLES[:2], sft, chunk_size=5,
                            generator=torch.Generator().manual_seed(0))
        opt.step()
        losses.append(step.loss)
    assert step.slots > 0 and losses[-1] < losses[0] - 0.5  # the frozen random micro LM head makes it slow


def _full_logits_loss(target, drafter, batch, gamma: float) -> torch.Tensor:
    """The SFT loss as it was computed before chunking: the target's full forward (its [B, T, V] logits made just
    to read the features) and the drafter's logits at every slot at once."""
    features = target(batch.ids, attention_mask=batch.valid.long()).features
    block_ids = torch.full((*batch.anchor_pos.shape, drafter.block_size), drafter.mask_token_id, dtype=torch.long)
    block_ids[..., 0] = batch.ids.gather(1, batch.anchor_pos)
    hidden = drafter.forward_blocks(drafter.project_context(features), batch.valid, block_ids, batch.anchor_pos)
    logits = drafter.logits(hidden[batch.block_valid][:, 1:])
    return sft_loss(logits, batch.labels[batch.block_valid], gamma=gamma, position_mask=batch.position_mask)


def test_chunked_hidden_state_loss_equals_the_full_logits_loss(fp64_models):
    target, drafter = fp64_models
    (batch,) = sft_micro_batches(EXAMPLES, anchors_per_seq=5, max_length=12, block_size=4, micro_batch_size=3,
                                 generator=torch.Generator().manual_seed(2))
    assert batch.position_mask.sum() < batch.position_mask.numel()  # blocks running past a sequence's end
    expected = _full_logits_loss(target, drafter, batch, gamma=2.0)
    expected.backward()
    expected_grads = _grads(drafter)
    loss = sft_batch_loss(target, drafter, batch, gamma=2.0, chunk_size=3)  # 3 does not divide the slots
    loss.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-14)
    for got, want in zip(_grads(drafter), expected_grads):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-13)


def test_micro_batched_gradient_equals_the_full_batch_gradient(fp64_models):
    target, drafter = fp64_models
    results = {}
    for micro in (3, 1):
        sft = SftSpec(anchors_per_seq=5, gamma=3.0, max_length=10, batch_size=3, micro_batch_size=micro)
        step = sft_backward(target, drafter, EXAMPLES, sft, chunk_size=4, generator=torch.Generator().manual_seed(5))
        results[micro] = step, _grads(drafter)
    (full, full_grads), (split, split_grads) = results[3], results[1]
    assert (split.tokens, split.blocks, split.slots) == (full.tokens, full.blocks, full.slots)
    assert full.tokens == 10 + 8 + 10 and full.blocks == 15  # max_length cuts the first and the last examples
    assert abs(split.loss - full.loss) < 1e-12
    for got, want in zip(split_grads, full_grads):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-13)


def test_a_micro_batch_size_that_does_not_divide_the_batch_is_one_line(micro_spec_file):
    with pytest.raises(SpecError) as info:
        load_spec(micro_spec_file, ["sft.batch_size=6", "sft.micro_batch_size=4"])
    assert info.value.messages == [
        "sft.micro_batch_size: 4 does not divide batch_size 6 (expected a divisor)"]


def test_opd_sft_writes_a_loadable_drafter(micro_spec_file, micro_assets, tmp_path):
    out = tmp_path / "warm"
    shutil.copytree(micro_assets["drafter"], out)  # a drafter saved before: replaced whole, atomically
    assert main(["sft", str(micro_spec_file), "--out", str(out), "--set", "sft.epochs=1", "--set", "sft.batch_size=8",
                 "--set", "sft.response_max_new_tokens=8", "--set", "sft.anchors_per_seq=4"]) == 0
    spec = load_spec(micro_spec_file)
    assert (spec.run_dir / "sft_data.jsonl").read_text().count("\n") == 40  # one response per train prompt
    before = build_models(spec).drafter.state_dict()
    after = build_models(spec, str(out)).drafter.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert not [p for p in tmp_path.iterdir() if ".tmp" in p.name]  # no temporary left beside it


def test_opd_sft_logs_an_mlflow_run(micro_spec_file, tmp_path):
    import mlflow

    sets = ["sft.epochs=1", "sft.batch_size=20", "sft.response_max_new_tokens=4", "sft.anchors_per_seq=2"]
    assert main(["sft", str(micro_spec_file), "--out", str(tmp_path / "d"), *[a for s in sets for a in ("--set", s)]]) == 0
    spec = load_spec(micro_spec_file, sets)
    mlflow.set_tracking_uri(spec.tracking_uri)
    run = mlflow.search_runs(experiment_names=[spec.tracking.experiment]).iloc[0]
    assert run["params.sft.epochs"] == "1" and run["metrics.sft_loss"] > 0
