"""The acceptance objectives (opd/distill/acceptance_loss.py) against written-out references in fp64.

- p̃ is the target processed exactly as verification processes it, and q is what the serving decoder samples from
  (DFlash's processed logits; DFlash 2's selector given the draft sampled before);
- each objective's value and gradient equal a slot-by-slot loop over decoded, replayed blocks;
- with the score-function term, the expected gradient over every sampled prefix (enumerated) is the gradient of
  the expected objective; without it, it is not (the test has the power to see the missing term);
- micro-batch and chunk splits do not change the step's loss.
"""

from __future__ import annotations

import itertools
import math
from types import SimpleNamespace

import pytest
import torch

from opd.decoding.sampling import Sampling, target_probs
from opd.decoding.speculative import SpeculativeDecoder
from opd.decoding.verify import sample_chained_draft, sample_draft
from opd.distill.acceptance_loss import acceptance_objective, block_slots, realized_q, served_acceptance
from opd.distill.losses import StepNorm, acceptance_aware_loss, processed_logprobs, slot_weights
from opd.distill.replay import score, student_hidden
from opd.models.dflash2 import CandidateSelector, DFlash2Drafter
from opd.models.protocol import chains
from opd.spec import LossSpec
from opd.tiny.micro import micro_drafter, micro_target
from tests.helpers.dflash2 import dflash2_drafter

EOS, MASK = 6, 7
PROMPTS = [[1, 2, 3], [4, 5], [1, 1, 1, 1, 2], [3], [2, 2], [0, 1, 2, 3, 4, 5]]
SERVING = Sampling(0.5, top_k=3, top_p=0.9, sample_drafts=True)
OBJECTIVES = ["neg_log_alpha", "one_minus_alpha", "lk", "expected_length"]


@pytest.fixture(scope="module")
def target():
    return micro_target(seed=0, vocab_size=8, layer_ids=[0, 2, 3])


@pytest.fixture(scope="module", params=["dflash", "dflash2"])
def drafter(target, request):
    if request.param == "dflash":
        return micro_drafter(target, seed=1, block_size=4, mask_token_id=MASK)
    return dflash2_drafter(target, codebook_scale=10.0)


@pytest.fixture(scope="module")
def replayed(target, drafter):
    """Blocks decoded with drafts sampled from q at the serving setting, replayed as the learner sees them."""
    records = SpeculativeDecoder(target, drafter, eos_id=EOS).generate(PROMPTS, SERVING, max_new_tokens=14, seed=5)
    return score(target, records, block_size=drafter.block_size)


@pytest.mark.parametrize("sampling", [Sampling(1.0), Sampling(0.6, top_k=3), Sampling(0.7, top_p=0.8),
                                      Sampling(0.6, top_k=5, top_p=0.9), Sampling(0.0)])
def test_processed_logprobs_are_the_verifiers_distribution(sampling):
    logits = torch.randn(4, 3, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    got = processed_logprobs(logits, sampling).exp()
    expected = (torch.nn.functional.one_hot(logits.argmax(-1), 8).double() if sampling.greedy
                else target_probs(logits, sampling).double())
    assert got.dtype == torch.float64 and torch.allclose(got, expected, atol=1e-6)


@torch.no_grad()
def test_realized_q_is_what_the_decoder_samples_from(target, drafter):
    """DFlash: the drafter's logits processed like the target's (`sample_draft`); DFlash 2: the selector's softmax
    over its candidates given the draft sampled before (`sample_chained_draft`), whatever path was sampled."""
    ids = torch.tensor([[b % 6, (b * 5) % 6, (b * 3 + 1) % 6, b % 5] for b in range(16)])
    cache = drafter.new_cache(16)
    drafter.extend_cache(cache, target(ids).features[:, :3], torch.arange(3).expand(16, -1),
                         torch.ones(16, 3, dtype=torch.bool))
    anchors, positions = ids[:, -1], torch.full((16,), 3)
    hidden, logits = drafter.drafted_slots(cache, anchors, positions)
    if not chains(drafter):
        drafts, decoded = sample_draft(logits, SERVING, seed=3)
        decoded_probs, decoded_ids = decoded, None
    else:
        drafts, decoded = sample_chained_draft(drafter, cache, anchors, positions, SERVING, seed=3)
        decoded_probs, decoded_ids = decoded.probs, decoded.ids
    q = realized_q(drafter, hidden, logits, torch.cat([anchors[:, None], drafts[:, :-1]], 1), SERVING)
    assert torch.allclose(q.probs.float(), decoded_probs.float(), atol=1e-6)
    assert (q.ids is None) == (decoded_ids is None) and (q.ids is None or torch.equal(q.ids, decoded_ids))


def test_alpha_is_one_minus_total_variation():
    g = torch.Generator().manual_seed(1)
    p_log = torch.log_softmax(torch.randn(5, 8, generator=g, dtype=torch.float64), -1)
    q = torch.softmax(torch.randn(5, 8, generator=g, dtype=torch.float64), -1)
    got = served_acceptance(p_log, SimpleNamespace(probs=q, ids=None))
    assert torch.allclose(got, 1 - 0.5 * (p_log.exp() - q).abs().sum(-1))
    ids = torch.stack([torch.randperm(8, generator=g)[:3] for _ in range(5)])
    sparse = torch.softmax(torch.randn(5, 3, generator=g, dtype=torch.float64), -1)
    dense = torch.zeros(5, 8, dtype=torch.float64).scatter(-1, ids, sparse)
    assert torch.allclose(served_acceptance(p_log, SimpleNamespace(probs=sparse, ids=ids)),
                          served_acceptance(p_log, SimpleNamespace(probs=dense, ids=None)))


def _written_out(drafter, hidden, teacher, predecessors, accepted, mask, cfg: LossSpec, norm: StepNorm,
                 teacher_processing: Sampling) -> torch.Tensor:
    """The step's objective slot by slot: q, p̃ and α written out per slot with Python loops over tokens."""
    k1 = hidden.shape[1]
    coef = torch.zeros(hidden.shape[:2], dtype=torch.float64)
    if cfg.objective == "expected_length":
        coef[mask] = 1.0 / (k1 * norm.num_blocks)
    else:
        w = slot_weights(accepted, mask, cfg, norm)
        coef.view(-1)[w.rows] = w.coef
    total = torch.zeros((), dtype=torch.float64)
    for n in range(hidden.shape[0]):
        survival = torch.ones((), dtype=torch.float64)
        for k in range(k1):
            logits = drafter.student_head(hidden[n, k])
            p = processed_logprobs(drafter.teacher_head(teacher[n, k]), teacher_processing).exp()
            q = _slot_q(drafter, hidden[n, k], logits, int(predecessors[n, k]))
            alpha = sum(torch.minimum(p[v], q[v]) for v in q)
            if cfg.objective == "expected_length":
                survival = survival * (alpha if mask[n, k] else 1.0)
                f = 1 - survival
            elif cfg.objective == "neg_log_alpha":
                f = -torch.log(alpha.clamp_min(1e-30))  # a slot whose q misses p̃: no gradient
            elif cfg.objective == "one_minus_alpha":
                f = 1 - alpha
            else:
                r = torch.log_softmax(logits / SERVING.temperature, -1)
                kl = sum(p[v] * (torch.log(p[v]) - r[v]) for v in range(len(p)) if p[v] > 0)
                lam = math.exp(-cfg.lk_eta * float(alpha.detach()))
                f = lam * kl + (1 - lam) * (1 - alpha)
            total = total + coef[n, k] * f
    return total


def _slot_q(drafter, hidden, logits, predecessor: int) -> dict[int, torch.Tensor]:
    """q at one slot as {token: probability}: the processed logits, or the selector written out over its candidates."""
    if not chains(drafter):
        x = logits / SERVING.temperature
        kth = sorted(x.tolist(), reverse=True)[SERVING.top_k - 1]
        keep = [v for v in range(len(x)) if x[v] >= kth]
        probs = torch.softmax(torch.stack([x[v] for v in keep]), 0)
        order = sorted(range(len(keep)), key=lambda i: -float(probs[i].detach()))
        mass, kept = 0.0, []
        for i in order:
            if mass >= SERVING.top_p:
                break
            kept.append(i)
            mass += float(probs[i].detach())
        norm = sum(probs[i] for i in kept)
        return {keep[i]: probs[i] / norm for i in kept}
    s = drafter.selector
    candidates = logits.topk(s.top_k).indices.tolist()
    gate = s.hidden_projection.weight @ hidden
    scores = torch.stack([logits[c] + (s.predecessor_codebook[predecessor] * gate * s.successor_codebook[c]).sum()
                          for c in candidates])
    return dict(zip(candidates, torch.softmax(scores / SERVING.temperature, 0)))


@pytest.mark.parametrize("objective", OBJECTIVES)
@pytest.mark.parametrize("served", [True, False])
def test_objective_and_gradient_equal_the_slot_by_slot_reference(target, drafter, replayed, objective, served):
    """Value and gradient (w.r.t. the drafter's hidden states and its selector) of the chunked objective equal the
    written-out loop, with the predecessors the rollout sampled; with a served teacher p̃ is the serving
    setting's, else the target at T=0.3 (replay.teacher_temperature)."""
    cfg = LossSpec(objective=objective, lambda_rej=0.5)
    teacher = Sampling.of(SERVING) if served else Sampling(0.3)
    batch = replayed
    norm = StepNorm.of([(batch.accepted, batch.position_mask)], cfg)
    predecessors = batch.block_ids[batch.block_valid]
    hidden = student_hidden(drafter, batch).detach().requires_grad_(True)
    params = list(drafter.selector.parameters()) if chains(drafter) else []
    drafter.zero_grad(set_to_none=True)
    slots = block_slots(predecessors, batch.accepted, batch.position_mask, cfg, norm)
    terms = acceptance_objective(drafter, hidden, batch.teacher, slots, cfg, serving=SERVING,
                                 teacher_processing=teacher, chunk_size=5)
    got = torch.autograd.grad(terms.loss, [hidden, *params])
    ref_hidden = hidden.detach().clone().requires_grad_(True)
    expected = _written_out(drafter, ref_hidden, batch.teacher, predecessors, batch.accepted, batch.position_mask,
                            cfg, norm, teacher)
    want = torch.autograd.grad(expected, [ref_hidden, *params])
    assert len(batch.accepted) > 8 and float(expected.detach()) > 0
    assert float(terms.loss.detach()) == pytest.approx(float(expected.detach()), rel=1e-9)
    assert float(terms.acc + terms.rej) == pytest.approx(float(expected.detach()), rel=1e-9)
    for g, w in zip(got, want):
        assert torch.allclose(g, w, rtol=1e-8, atol=1e-12)
    # Against the unprocessed teacher a random micro drafter's q exceeds p̃ wherever it has mass, where α has no
    # gradient (only its KL does); against the served p̃ every objective has one.
    assert all(w.abs().sum() > 0 for w in want) or (not served and objective != "lk")


@pytest.mark.parametrize("objective", ["one_minus_alpha", "expected_length"])
def test_micro_batches_and_chunks_sum_to_the_step(target, drafter, replayed, objective):
    cfg = LossSpec(objective=objective)
    batch = replayed
    norm = StepNorm.of([(batch.accepted, batch.position_mask)], cfg)
    hidden = student_hidden(drafter, batch).detach()
    predecessors = batch.block_ids[batch.block_valid]

    def part(rows: slice, chunk: int | None) -> float:
        slots = block_slots(predecessors[rows], batch.accepted[rows], batch.position_mask[rows], cfg, norm)
        return float(acceptance_objective(drafter, hidden[rows], batch.teacher[rows], slots, cfg, serving=SERVING,
                                          teacher_processing=Sampling(1.0), chunk_size=chunk).loss.detach())

    whole, cut = part(slice(None), None), len(hidden) // 2
    assert part(slice(None), 3) == pytest.approx(whole, rel=1e-12)
    assert part(slice(0, cut), 6) + part(slice(cut, None), None) == pytest.approx(whole, rel=1e-12)


# ----------------------------------------------------------------------------------- the sampled prefix's gradient


class _Chain:
    """A drafter-like object small enough to enumerate every sampled prefix: V tokens, K-1 slots, a selector
    whose q at a slot depends on the draft before it, and a teacher whose view of slot k depends on the drafts
    before k (a table of final-norm states per prefix)."""

    chains_q = True  # its selector chains the slots, as DFlash 2's does
    draft_law = DFlash2Drafter.draft_law  # and its q is DFlash 2's law over that selector

    @property
    def candidate_selector(self) -> CandidateSelector:
        return self.selector

    def __init__(self, vocab: int = 4, slots: int = 3, hidden: int = 6, top_k: int = 3, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        config = SimpleNamespace(vocab_size=vocab, selector_rank=3, selector_top_k=top_k, hidden_size=hidden)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.selector = CandidateSelector(config).double()
        with torch.no_grad():
            self.selector.predecessor_codebook.mul_(40)
            self.selector.successor_codebook.mul_(40)
        self.student_head = torch.nn.Linear(hidden, vocab, bias=False).double()
        self.teacher_head = torch.nn.Linear(hidden, vocab, bias=False).double()
        self.student_head.weight.requires_grad_(False)
        self.teacher_head.weight.requires_grad_(False)
        self.hidden = torch.randn(slots, hidden, generator=g, dtype=torch.float64, requires_grad=True)
        self.views = {prefix: torch.randn(hidden, generator=g, dtype=torch.float64) * 2
                      for k in range(slots) for prefix in itertools.product(range(vocab), repeat=k)}
        self.vocab, self.slots, self.anchor = vocab, slots, 1

    def teacher(self, path: tuple[int, ...]) -> torch.Tensor:
        return torch.stack([self.views[path[:k]] for k in range(self.slots)])[None]

    def q_of_path(self, path: tuple[int, ...]) -> torch.Tensor:
        """q(d_0 ... d_{K-2}), differentiable: the probability of sampling the prefix every slot's term reads."""
        predecessors = torch.tensor([[self.anchor, *path[: self.slots - 1]]])
        logits = self.student_head(self.hidden)[None]
        q = realized_q(self, self.hidden[None], logits, predecessors, SERVING)
        drafted = slice(0, self.slots - 1)
        mass = (q.probs[:, drafted] * (q.ids[:, drafted] == torch.tensor([list(path)])[..., None])).sum(-1)
        return mass[0].prod()


@pytest.mark.parametrize("objective", ["expected_length", "one_minus_alpha", "neg_log_alpha"])
def test_the_score_term_makes_the_gradient_that_of_the_expected_objective(objective):
    """E_{d~q}[∇ loss(d)] over every sampled prefix d equals ∇ E_{d~q}[loss(d)] with the score-function term, and
    differs from it without (pathwise only), when both q and the teacher depend on the prefix."""
    chain = _Chain()
    cfg = {g: LossSpec(objective=objective, prefix_gradient=g) for g in ("pathwise", "score")}
    accepted, mask = torch.tensor([1]), torch.ones(1, chain.slots, dtype=torch.bool)
    norm = StepNorm.of([(accepted, mask)], cfg["score"])
    paths = list(itertools.product(range(chain.vocab), repeat=chain.slots - 1))
    params = [chain.hidden, *chain.selector.parameters()]
    exact = torch.zeros((), dtype=torch.float64)
    estimates = {g: [torch.zeros_like(p) for p in params] for g in cfg}
    for path in paths:
        weight = chain.q_of_path(path)
        probability = float(weight.detach())  # the number; `weight` keeps its graph for the exact objective
        if probability == 0:  # a path q never samples adds nothing
            continue
        predecessors = torch.tensor([[chain.anchor, *path]])
        for g, c in cfg.items():
            slots = block_slots(predecessors, accepted, mask, c, norm)
            loss = acceptance_objective(chain, chain.hidden[None], chain.teacher(path), slots, c, serving=SERVING,
                                        teacher_processing=Sampling.of(SERVING)).loss
            grads = torch.autograd.grad(loss, params, allow_unused=True, retain_graph=True)
            for acc, grad in zip(estimates[g], grads):
                acc += probability * (0 if grad is None else grad)
            if g == "pathwise":  # E[loss] differentiated by autograd through q(d) and the loss's own gradient
                exact = exact + weight * loss
    truth = torch.autograd.grad(exact, params)
    flat = {g: torch.cat([e.flatten() for e in estimates[g]]) for g in cfg}
    truth = torch.cat([t.flatten() for t in truth])
    assert torch.allclose(flat["score"], truth, rtol=1e-9, atol=1e-12)
    assert (flat["pathwise"] - truth).abs().max() > 1e-3 * truth.abs().max()


def test_a_stale_draft_outside_the_candidates_adds_no_score_term(target):
    """A prefix drafted by older weights may hold a token that is not among today's candidates (q = 0): its score
    term is left out rather than making the loss's gradient infinite."""
    chain = _Chain(top_k=2)
    logits = chain.student_head(chain.hidden)
    outside = next(v for v in range(chain.vocab) if v not in logits[0].topk(2).indices.tolist())
    cfg = LossSpec(objective="expected_length", prefix_gradient="score")
    accepted, mask = torch.tensor([0]), torch.ones(1, chain.slots, dtype=torch.bool)
    slots = block_slots(torch.tensor([[chain.anchor, outside, 0]]), accepted, mask, cfg,
                        StepNorm.of([(accepted, mask)], cfg))
    loss = acceptance_objective(chain, chain.hidden[None], chain.teacher((outside, 0)), slots, cfg, serving=SERVING,
                                teacher_processing=Sampling(1.0)).loss
    grads = torch.autograd.grad(loss, [chain.hidden, *chain.selector.parameters()])
    assert all(torch.isfinite(g).all() for g in grads) and math.isfinite(float(loss.detach()))


def test_the_served_teacher_enters_the_papers_kl():
    """Point-mass drafts keep the paper's objectives; `replay.teacher: served` makes their teacher p̃, the target
    processed as the server verifies (here top-k 3, so the forward KL is over p̃'s three tokens)."""
    g = torch.Generator().manual_seed(2)
    head = torch.nn.Linear(5, 8, bias=False).double().requires_grad_(False)
    student, teacher = torch.randn(4, 3, 5, generator=g, dtype=torch.float64), torch.randn(4, 3, 5, generator=g,
                                                                                          dtype=torch.float64)
    cfg, served = LossSpec(kl_mode="all_forward"), Sampling(0.6, top_k=3)
    accepted = torch.tensor([0, 1, 3, 2])
    got = acceptance_aware_loss(student, teacher, accepted, cfg, head=head, teacher_processing=served).loss
    w = slot_weights(accepted, torch.ones(4, 3, dtype=torch.bool), cfg, StepNorm.of([(accepted, torch.ones(4, 3))],
                                                                                      cfg))
    expected = 0.0
    for row, c in zip(w.rows.tolist(), w.coef.tolist()):
        p = processed_logprobs(head(teacher.flatten(0, 1)[row]), served).exp()
        q = torch.log_softmax(head(student.flatten(0, 1)[row]), -1)
        assert int((p > 0).sum()) == 3
        expected += c * float(sum(p[v] * (torch.log(p[v]) - q[v]) for v in range(8) if p[v] > 0))
    assert float(got.detach()) == pytest.approx(expected, rel=1e-10)
