"""The scale-true learner path: hidden-state teacher, chunked loss, step-global normalisation, flat memory.

The reference is the path this replaced: the scorer's full-vocabulary teacher log-probs from a packed forward
*with* the LM head, and one unchunked loss over all slots. Micro models in float32 with real rollouts, so
acceptance differs between sequences and micro-batches are padded.
"""

from __future__ import annotations

import pickle

import pytest
import torch

from opd.decoding.record import SequenceRecord
from opd.decoding.sampling import Sampling
from opd.distill.anchors import redraft_at_random_anchors
from opd.distill.losses import StepNorm, acceptance_aware_loss, teacher_distribution
from opd.distill.replay import packed_inputs, score, student_hidden
from opd.memory import peak_cpu_bytes
from opd.models.build import build_models
from opd.spec import LossSpec, load_spec
from opd.tiny.micro import micro_drafter, micro_target
from opd.train.learner import Learner
from tests.helpers.loss_variants import VARIANTS
from tests.helpers.records import synthetic_record

K, EOS = 5, 3
PROMPTS = [[1, 2, 3], [4, 5], [1, 1, 1, 1, 2], [3, 0, 2, 2], [7, 8], [9, 9, 9]]


@pytest.fixture(scope="module")
def models():
    target = micro_target(seed=0, vocab_size=40, dtype=torch.float32, layer_ids=[0, 2, 3])
    return target, micro_drafter(target, seed=1, num_layers=2, block_size=K, mask_token_id=39)


@pytest.fixture(scope="module")
def records():
    """Uneven lengths and acceptance, so padding and uneven micro-batches both occur."""
    recs = [synthetic_record(i, p, 8 + 5 * i, k=K) for i, p in enumerate(PROMPTS)]
    assert len({r.tau for r in recs}) > 3
    return recs


def old_teacher(target, records, mode, temperature):
    """The replaced scorer: a packed forward with the LM head, full-vocabulary log-probs at every slot."""
    packed, ids, positions, layout = packed_inputs(records, K, mode)
    logits = target(ids, attention_mask=layout, position_ids=positions).logits
    rows = [logits[b, torch.tensor(s)] for b, p in enumerate(packed) for s in p.slot_index]
    return teacher_distribution(torch.stack(rows), temperature=temperature)


def grads(drafter) -> dict[str, torch.Tensor]:
    out = {k: p.grad.clone() for k, p in drafter.named_parameters() if p.grad is not None}
    drafter.zero_grad(set_to_none=True)
    return out


def assert_same_gradients(a: dict, b: dict, atol: float = 1e-6) -> None:
    assert a.keys() == b.keys() and a
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=atol, msg=k)


@pytest.mark.parametrize("variant", VARIANTS, ids=list(VARIANTS))
@pytest.mark.parametrize(("mode", "temperature"), [("draft_opd", 1.0), ("draft_opd", 0.7), ("naive", 1.3)])
def test_hidden_state_teacher_equals_the_full_vocabulary_path(models, records, variant, mode, temperature):
    target, drafter = models
    cfg = LossSpec(**VARIANTS[variant])
    batch = score(target, records, block_size=K, mode=mode)
    assert batch.teacher.shape == (batch.num_blocks, K - 1, target.hidden_size)
    hidden = student_hidden(drafter, batch)
    old = acceptance_aware_loss(drafter.logits(hidden), old_teacher(target, records, mode, temperature),
                                batch.accepted, cfg, batch.position_mask)
    old.loss.backward()
    old_grads = grads(drafter)
    new = acceptance_aware_loss(student_hidden(drafter, batch), batch.teacher, batch.accepted, cfg,
                                batch.position_mask, head=drafter.lm_head, teacher_processing=Sampling(temperature),
                                chunk_size=7)
    new.loss.backward()
    assert (new.num_acc, new.num_rej) == (old.num_acc, old.num_rej)
    torch.testing.assert_close(new.loss, old.loss, rtol=0, atol=1e-5)
    torch.testing.assert_close(new.acc, old.acc, rtol=0, atol=1e-5)
    assert_same_gradients(grads(drafter), old_grads)


@pytest.mark.parametrize("chunk", [1, 2, K - 2, 2 * (K - 1) + 1, 10_000])  # K-2 and 2(K-1)+1 cut blocks
def test_chunked_loss_equals_unchunked(models, records, chunk):
    target, drafter = models
    batch = score(target, records, block_size=K)
    cfg = LossSpec(gamma=0.6)

    def run(chunk_size):
        terms = acceptance_aware_loss(student_hidden(drafter, batch), batch.teacher, batch.accepted, cfg,
                                      batch.position_mask, head=drafter.lm_head, chunk_size=chunk_size)
        terms.loss.backward()
        return terms.loss.detach(), grads(drafter)

    (whole, whole_grads), (chunked, chunked_grads) = run(None), run(chunk)
    torch.testing.assert_close(chunked, whole, rtol=1e-6, atol=0)
    assert_same_gradients(chunked_grads, whole_grads)


def test_a_step_with_no_rejected_slot_is_l_acc_not_half_of_it(models, records):
    target, drafter = models
    batch = score(target, records, block_size=K, mode="naive")
    terms = acceptance_aware_loss(student_hidden(drafter, batch), batch.teacher, batch.accepted, LossSpec(),
                                  batch.position_mask, head=drafter.lm_head)
    assert terms.num_rej == 0 and terms.acc > 0
    torch.testing.assert_close(terms.loss, terms.acc.float())


def _learner_gradient(spec_file, records, micro: int, overrides=()) -> tuple[float, dict]:
    """The loss and gradient of one Learner step on `records`, scored `micro` sequences per micro-batch."""
    spec = load_spec(spec_file, [f"optim.micro_batch_size={micro}", "optim.grad_clip=0", *overrides])
    models = build_models(spec)
    torch.manual_seed(0)
    learner = Learner(spec, models.drafter)
    batches = [score(models.target, records[i : i + micro], block_size=spec.models.drafter.block_size)
               for i in range(0, len(records), micro)]
    metrics = learner.train_step(batches)
    return metrics.loss, {k: p.grad.clone() for k, p in learner.drafter.named_parameters()}


def test_a_steps_gradient_does_not_depend_on_micro_batch_or_chunk_size(micro_spec_file):
    k = 4  # the micro assets' drafter
    recs = [synthetic_record(i, [5, 6, 7 + i], 10 + 4 * i, vocab=90, k=k) for i in range(4)]
    sets = [(torch.tensor(r.accepted), torch.ones(len(r.accepted), k - 1, dtype=torch.bool)) for r in recs]
    step, alone = StepNorm.of(sets, LossSpec()), [StepNorm.of([s], LossSpec()) for s in sets]
    assert len({n.num_acc / max(1, n.num_rej) for n in alone}) > 1 and step.num_acc and step.num_rej
    loss1, g1 = _learner_gradient(micro_spec_file, recs, 1)
    for micro, extra in [(2, ()), (4, ()), (1, ["optim.loss_chunk_size=2"])]:
        loss, g = _learner_gradient(micro_spec_file, recs, micro, extra)
        assert loss == pytest.approx(loss1, rel=1e-5)
        assert_same_gradients(g, g1)


def test_records_without_blocks_train_nothing_and_crash_nothing(models, records):
    target, drafter = models
    empty = SequenceRecord(key=0, prompt_ids=[1, 2], response_ids=[EOS], finish_reason="eos")
    redrafted = redraft_at_random_anchors(target, drafter, empty, 5, torch.Generator().manual_seed(0))
    assert redrafted.anchors == []  # the random-anchor path keeps it blockless
    for mode in ("draft_opd", "naive"):
        alone = score(target, [empty], block_size=K, mode=mode)
        assert alone.num_blocks == 0 and alone.teacher.shape[0] == 0
        mixed = score(target, [empty, records[0]], block_size=K, mode=mode)
        reference = score(target, [records[0]], block_size=K, mode=mode)
        assert mixed.num_blocks == reference.num_blocks
        torch.testing.assert_close(mixed.teacher, reference.teacher)
        terms = acceptance_aware_loss(student_hidden(drafter, alone), alone.teacher, alone.accepted, LossSpec(),
                                      alone.position_mask, head=drafter.lm_head)
        terms.loss.backward()
        assert terms.loss == 0 and all(p.grad is None or not p.grad.any() for p in drafter.parameters())


def _loss_peak(blocks: int, chunk: int | None, vocab: int = 8192, hidden_size: int = 16) -> int:
    """Peak bytes of one loss forward + backward over `blocks` drafted blocks. Large vocabulary, small hidden
    size: the vocabulary-sized transients dominate, as they do at Qwen3 shapes."""
    gen = torch.Generator().manual_seed(blocks)
    head = torch.nn.Linear(hidden_size, vocab, bias=False).requires_grad_(False)
    student = torch.randn(blocks, K - 1, hidden_size, generator=gen).requires_grad_()
    teacher = torch.randn(blocks, K - 1, hidden_size, generator=gen)
    accepted = torch.randint(0, K, (blocks,), generator=gen)
    return peak_cpu_bytes(lambda: acceptance_aware_loss(student, teacher, accepted, LossSpec(), head=head,
                                                     chunk_size=chunk).loss.backward())


def test_loss_memory_is_set_by_the_chunk_not_the_response_length():
    short, long = _loss_peak(32, 64), _loss_peak(256, 64)  # 8x the drafted slots
    unchunked_short, unchunked_long = _loss_peak(32, None), _loss_peak(256, None)
    assert unchunked_long > 6 * unchunked_short  # the measure sees a loss that grows with the response
    assert long < 1.25 * short, (short, long)
    assert long < 0.2 * unchunked_long


def test_what_the_scorer_ships_is_cpu_contiguous_compact_and_pickles_out_of_band(models, records):
    target, _ = models
    batch = score(target, records[:3], block_size=K)
    tensors = {k: v for k, v in vars(batch).items()}
    for name, t in tensors.items():
        assert t.device.type == "cpu" and t.is_contiguous(), name
    prefix = max(len(r.prompt_ids) + max(r.anchors) + 1 for r in records[:3])
    assert batch.features.shape == (3, prefix, 3 * target.hidden_size)  # the prefix only, not the packed row
    assert batch.teacher.shape == (batch.num_blocks, K - 1, target.hidden_size)
    buffers = []
    inband = pickle.dumps(batch, protocol=5, buffer_callback=buffers.append)
    assert sum(memoryview(b).nbytes for b in buffers) == sum(t.nbytes for t in tensors.values())
    assert len(inband) < 4096  # only the layout travels in band; every tensor's bytes go zero-copy
    back = pickle.loads(inband, buffers=buffers)
    for name, t in tensors.items():
        assert torch.equal(getattr(back, name), t), name
