"""The replay data path per sequence at Qwen3's real vocabulary and hidden sizes, on a CPU: the replaced path beside
the new one. bench/scale.py runs it; the random-weight target and records here are the ones its other
measurements use too.

Random-weight Qwen3 targets with the real vocabulary (151,936) and hidden size (2560 = 4B, 4096 = 8B), one
decoder layer (MLP width = hidden, so a CPU can run it) whose output is read five times as the drafter's
features (n = 5, as the shipped drafters), and a one-layer DFlash drafter. Synthetic rollout records with a
`--prompt`-token prompt, τ ≈ 6, block 16. Measured, per response length:

- bytes the scorer ships per sequence: the new `ScoredBatch` pickled (protocol 5: in-band + out-of-band
  buffers), and the replaced path's tensors from the same packed forward (fp32 [N, 15, V] log-probs and the
  packed row's whole feature storage, which a view pickled);
- scorer and learner peak memory per micro-batch (one sequence; `opd.memory.peak_cpu_bytes`); the scorer also
  with the expected-acceptance diagnostic it computes for the default eval settings (greedy and T=0.6 / top-p
  0.95 / top-k 20: the LM head over the drafted slots, `opd/train/scorer.py`), whose [N, K-1] results it also
  ships (counted in the bytes). The replaced learner is the unchunked loss on [N, 15, V] logits; the new one the
  chunked loss from hidden states. The bench uses `--chunk` 128 slots so that every length spans several chunks.

The CPU runs fp32 (its bf16 matmuls are 8x slower); shipped float tensors are cast to bf16 before they are
measured, as on the GPU.
"""

from __future__ import annotations

import argparse
import gc
import pickle

import torch
from projection import VOCAB, fit  # bench/projection.py, beside this script
from replay import synthetic_record  # bench/replay.py, beside this script
from rich.console import Console
from rich.table import Table

from opd.decoding.record import SequenceRecord
from opd.distill.losses import acceptance_aware_loss, teacher_distribution
from opd.distill.replay import pack, packed_inputs, score, student_hidden
from opd.distill.scored_batch import ScoredBatch
from opd.eval.expected import point_mass_settings, record_drafts, teacher_acceptance
from opd.memory import peak_cpu_bytes
from opd.models.dflash import DFlashConfig, DFlashDrafter
from opd.models.target import Target
from opd.spec import EvalSpec, LossSpec

K, N_FEATURES = 16, 5  # the shipped drafters' block size and feature count


def build(hidden: int, seed: int = 0) -> tuple[Target, DFlashDrafter]:
    """A one-layer random Qwen3 target at the real vocabulary and `hidden`, and a one-layer DFlash drafter on it."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=hidden, num_hidden_layers=1,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                         max_position_embeddings=8192, tie_word_embeddings=False, attn_implementation="sdpa")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        target = Target(Qwen3ForCausalLM(config).float(), [0] * N_FEATURES)
        drafter_config = DFlashConfig.for_target(target.config, num_layers=1, block_size=K,
                                                 mask_token_id=VOCAB - 1, target_layer_ids=[0] * N_FEATURES)
        drafter = DFlashDrafter(drafter_config, target.embed_tokens, target.lm_head)
    return target, drafter


def records(length: int, prompt: int, tau: float, count: int = 1) -> list[SequenceRecord]:
    """`count` synthetic rollout records of `length` response tokens, seeded by the length."""
    g = torch.Generator().manual_seed(length)
    accept = 1 - 1 / tau  # geometric acceptance: mean accepted + 1 ≈ τ
    return [synthetic_record(i, length, prompt, VOCAB - 1, K, accept, g) for i in range(count)]


def as_bf16(batch: ScoredBatch) -> ScoredBatch:
    """What the GPU path ships: float tensors in the target's bf16."""
    batch.features, batch.teacher = batch.features.bfloat16(), batch.teacher.bfloat16()
    return batch


def pickled_bytes(obj: object) -> int:
    """Bytes of a protocol-5 pickle, in-band and out-of-band buffers together: what the object store moves."""
    buffers = []
    inband = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    return len(inband) + sum(memoryview(b).nbytes for b in buffers)


def old_scorer(target: Target, recs: list) -> tuple[torch.Tensor, torch.Tensor]:
    """The replaced scorer: packed forward *with* the LM head, fp32 log-probs at every slot, features as a view."""
    packed, ids, positions, layout = packed_inputs(recs, K, "draft_opd")
    with torch.no_grad():
        out = target(ids, attention_mask=layout, position_ids=positions)
        rows = torch.stack([out.logits[b, torch.tensor(s)] for b, p in enumerate(packed) for s in p.slot_index])
        return teacher_distribution(rows), out.features


def measure_new(target: Target, drafter: DFlashDrafter, recs: list[SequenceRecord],
                args: argparse.Namespace) -> tuple[dict, ScoredBatch]:
    """The new path's scorer peak (with and without the diagnostic), shipped bytes and chunked learner peak, and
    the scored batch the replaced learner is measured on."""
    row: dict = {}
    scored = {}
    row["scorer_peak_new"] = peak_cpu_bytes(lambda: scored.setdefault("b", score(target, recs, block_size=K)))
    batch = scored["b"]
    drafts, _ = record_drafts(recs)
    settings = point_mass_settings(EvalSpec().sampling)

    def scorer_with_diagnostic() -> None:
        replayed = score(target, recs, block_size=K)
        scored["a"] = teacher_acceptance(drafts, replayed.teacher, target.lm_head, settings)

    row["scorer_peak_diagnostic"] = peak_cpu_bytes(scorer_with_diagnostic)
    row["packed_tokens"] = len(pack(recs[0], K, "draft_opd").ids)
    row["shipped_new"] = pickled_bytes(as_bf16(score(target, recs, block_size=K))) + pickled_bytes(scored["a"])
    cfg = LossSpec()

    def new_learner() -> None:
        hidden = student_hidden(drafter, batch)
        acceptance_aware_loss(hidden, batch.teacher, batch.accepted, cfg, batch.position_mask, head=drafter.lm_head,
                              chunk_size=args.chunk).loss.backward()

    row["learner_peak_new"] = peak_cpu_bytes(new_learner)
    drafter.zero_grad(set_to_none=True)
    return row, batch


def measure_old(target: Target, drafter: DFlashDrafter, recs: list[SequenceRecord], batch: ScoredBatch) -> dict:
    """The replaced path's scorer peak, shipped bytes and unchunked learner peak on the same sequence."""
    old = {}
    row = {"scorer_peak_old": peak_cpu_bytes(lambda: old.setdefault("t", old_scorer(target, recs)))}
    teacher, features = old["t"]
    row["shipped_old"] = teacher.nbytes + features.numel() * 2  # the view pickled the whole bf16 storage
    cfg = LossSpec()

    def old_learner() -> None:
        logits = drafter.logits(student_hidden(drafter, batch))
        acceptance_aware_loss(logits, teacher, batch.accepted, cfg, batch.position_mask).loss.backward()

    row["learner_peak_old"] = peak_cpu_bytes(old_learner)
    drafter.zero_grad(set_to_none=True)
    return row


def measure_length(target: Target, drafter: DFlashDrafter, length: int, args: argparse.Namespace) -> dict:
    """One sequence of `length` response tokens: the new path, and the replaced one up to --old-max-length."""
    recs = records(length, args.prompt, args.tau)
    row: dict = {"length": length, "blocks": recs[0].num_steps}
    new, batch = measure_new(target, drafter, recs, args)
    row |= new
    if length <= args.old_max_length:
        row |= measure_old(target, drafter, recs, batch)
    gc.collect()
    return row


def chunk_bytes_per_slot(rows: list[dict], chunk: int) -> float:
    """The loss's transient per chunk slot: the new learner's flat part (its intercept in blocks), per slot of the
    measured chunk. The projection scales the shipped loss chunk by it."""
    base, _ = fit(rows, "learner_peak_new", "blocks")
    return base / chunk


def print_data_path(measured: dict) -> None:
    """The per-sequence table, in MB, one row per hidden size and response length."""
    t = Table(title="measured on this CPU, one sequence per micro-batch (MB)")
    for c in ("hidden", "response", "blocks", "shipped old", "shipped new", "scorer peak old", "scorer peak new",
              "+ diagnostic", "learner peak old", "learner peak new"):
        t.add_column(c, justify="right")
    mb = 1e6
    for h, rows in measured.items():
        for r in rows:
            def cell(key: str) -> str:
                return f"{r[key] / mb:,.0f}" if key in r else "—"
            t.add_row(str(h), str(r["length"]), str(r["blocks"]), cell("shipped_old"), cell("shipped_new"),
                      cell("scorer_peak_old"), cell("scorer_peak_new"), cell("scorer_peak_diagnostic"),
                      cell("learner_peak_old"),
                      cell("learner_peak_new"))
    Console().print(t)
