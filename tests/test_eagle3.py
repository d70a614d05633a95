"""What only the EAGLE-3 drafter does: the target states it fuses, drafts and logits on its draft vocabulary, the
loss and SFT over that vocabulary, and its own head trained beside the shared embedding. What every family keeps
(lossless decoding, replay, the rebuild, checkpoints, a learner step) is tests/test_family_contract.py's.

Micro models in float64 (no argmax ties), as tests/test_decoding.py.
"""

from __future__ import annotations

import pytest
import torch

from opd.decoding.sampling import Sampling
from opd.decoding.speculative import SpeculativeDecoder
from opd.distill.losses import sft_loss
from opd.distill.replay import score, student_hidden
from opd.tiny.micro import micro_eagle3, micro_target
from tests.helpers.decoding import EOS
from tests.helpers.eagle3 import trained_like

PROMPTS = [[1, 2, 3], [4, 5], [1, 1, 1, 1, 2], [3], [2, 2], [0, 1, 2, 3, 4, 5], [5, 4], [1]]


@pytest.fixture(scope="module")
def target():
    # Six layers: EAGLE-3 fuses the states entering layers 2, 3, 4 (this project's ids 1, 2, 3).
    return micro_target(seed=0, vocab_size=8, num_layers=6, layer_ids=[1, 2, 3])


def test_captured_features_are_the_states_entering_the_engines_layers(target):
    """fc reads the residual stream entering layers 2, L//2 and L-3 (vLLM's and SGLang's default) = HF
    hidden_states[2], [3], [4] for a six-layer target."""
    ids = torch.tensor([PROMPTS[5]])
    hf = target.model(ids, output_hidden_states=True).hidden_states
    _, features = target.hidden_states(ids)
    drafter = micro_eagle3(target)
    assert drafter.config.aux_layer_ids == [2, 3, 4] == [2, 6 // 2, 6 - 2]
    assert torch.equal(features, torch.cat([hf[i] for i in drafter.config.aux_layer_ids], dim=-1))


def test_draft_logits_live_on_the_draft_vocabulary(target):
    drafter = trained_like(target, draft_vocab_size=5)
    cache = drafter.new_cache(1)
    ids = torch.tensor([[1, 2, 3]])
    _, features = target.hidden_states(ids)
    drafter.extend_cache(cache, features, torch.arange(3)[None], torch.ones(1, 3, dtype=torch.bool),
                         torch.tensor([[2, 3, 4]]))
    drafts, logits = drafter.draft(cache, torch.tensor([4]), torch.tensor([3]))
    outside = ~drafter.t2d
    assert torch.isinf(logits[..., outside]).all() and torch.isfinite(logits[..., drafter.t2d]).all()
    assert drafter.t2d[drafts].all()


def test_sft_soft_targets_live_on_the_draft_vocabulary(target):
    """EAGLE-3's SFT loss is the soft cross-entropy to the target's distribution renormalised over the draft
    vocabulary: zero gradient exactly when the drafter already matches it."""
    drafter = micro_eagle3(target, draft_vocab_size=5)
    teacher = torch.randn(3, 2, target.hidden_size, dtype=torch.float64)
    matched = torch.log_softmax(drafter.teacher_head(teacher), -1)
    from torch import nn
    identity = nn.Linear(5, 5, bias=False).to(torch.float64)
    identity.weight.data = torch.eye(5, dtype=torch.float64)
    student = matched.clone().requires_grad_(True)
    loss = sft_loss(student, torch.zeros(3, 2, dtype=torch.long), gamma=4.48, head=identity, teacher=teacher,
                    teacher_head=drafter.teacher_head)
    loss.backward()
    assert student.grad.abs().max() < 1e-12  # the minimum of CE(p, q) over q is q = p
    full = torch.softmax(target.lm_head(teacher), -1)[..., drafter.vocab_ids]
    assert torch.allclose(matched.exp(), full / full.sum(-1, keepdim=True))


def test_out_of_vocabulary_slots_are_not_trained(target):
    drafter = micro_eagle3(target, draft_vocab_size=4)
    teacher = torch.randn(50, 3, target.hidden_size, dtype=torch.float64)
    keep = drafter.trainable_slots(teacher)
    argmax = target.lm_head(teacher).argmax(-1)
    assert torch.equal(keep, drafter.t2d[argmax]) and 0 < int(keep.sum()) < keep.numel()


def test_the_own_head_is_trained_the_embedding_is_not(target):
    """The chunked loss takes the gradient of the drafter's own head (EAGLE-3) as well as of its hidden rows."""
    drafter = trained_like(target)
    records = SpeculativeDecoder(target, drafter, eos_id=EOS).generate(PROMPTS, Sampling(), max_new_tokens=16)
    batch = score(target, records, block_size=4, mode="draft_opd")
    from opd.distill.losses import acceptance_aware_loss
    from opd.spec import LossSpec
    hidden = student_hidden(drafter, batch)
    terms = acceptance_aware_loss(hidden, batch.teacher, batch.accepted, LossSpec(), batch.position_mask,
                                  head=drafter.student_head, teacher_head=drafter.teacher_head, chunk_size=7)
    terms.loss.backward()
    grads = {name: p.grad for name, p in drafter.named_parameters()}
    assert all(g is not None and g.abs().sum() > 0 for g in grads.values()), [n for n, g in grads.items() if g is None]
    assert target.embed_tokens.weight.grad is None
    # the same loss with the head's logits formed at once, autograd end to end
    drafter.zero_grad()
    whole = acceptance_aware_loss(drafter.logits(student_hidden(drafter, batch)), torch.log_softmax(drafter.teacher_head(batch.teacher), -1),
                                  batch.accepted, LossSpec(), batch.position_mask)
    whole.loss.backward()
    assert torch.allclose(drafter.lm_head.weight.grad, grads["lm_head.weight"], atol=1e-12)
