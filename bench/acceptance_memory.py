"""Peak memory of one loss chunk at Qwen3 shapes: the paper's KL loss against the acceptance objectives.

The acceptance objectives (opd/distill/acceptance_loss.py) form, per chunk of blocks, the student's logits (with
their graph), p̃ and q over the vocabulary, so their transient memory is set by `optim.loss_chunk_size` as the KL
loss's is; this measures by how much more. Forward and backward of one chunk of `--blocks` blocks of K-1 slots,
bf16 hidden states and a bf16 shared LM head (vocabulary 151,936), on the CPU (torch's profiler counts the bytes).

    python bench/acceptance_memory.py [--hidden 2560] [--blocks 26] [--json bench/results/acceptance_memory.json]
"""

from __future__ import annotations

import argparse
import json
import time
from types import SimpleNamespace

import torch
from rich.console import Console
from rich.table import Table

from opd.decoding.sampling import Sampling
from opd.distill.acceptance_loss import acceptance_objective, block_slots
from opd.distill.losses import StepNorm, acceptance_aware_loss
from opd.memory import peak_cpu_bytes
from opd.models.dflash2 import CandidateSelector
from opd.spec import LossSpec

VOCAB, K = 151_936, 16
SERVING = Sampling(0.6, top_k=20, top_p=0.95, sample_drafts=True)


def _drafter(hidden: int, selector: bool) -> SimpleNamespace:
    head = torch.nn.Linear(hidden, VOCAB, bias=False).bfloat16().requires_grad_(False)
    chosen = None
    if selector:
        config = SimpleNamespace(vocab_size=VOCAB, selector_rank=256, selector_top_k=16, hidden_size=hidden)
        chosen = CandidateSelector(config).bfloat16()
    return SimpleNamespace(student_head=head, teacher_head=head, selector=chosen)


def measure(name: str, hidden: int, blocks: int, objective: str, selector: bool, gradient: str = "pathwise") -> dict:
    g = torch.Generator().manual_seed(0)
    drafter = _drafter(hidden, selector)
    student = torch.randn(blocks, K - 1, hidden, generator=g).bfloat16().requires_grad_(True)
    teacher = torch.randn(blocks, K - 1, hidden, generator=g).bfloat16()
    accepted = torch.randint(0, K, (blocks,), generator=g)
    predecessors = torch.randint(0, VOCAB, (blocks, K - 1), generator=g)
    mask = torch.ones(blocks, K - 1, dtype=torch.bool)
    cfg = LossSpec(objective=objective, prefix_gradient=gradient)
    norm = StepNorm.of([(accepted, mask)], cfg)
    chunk = blocks * (K - 1)

    def step() -> None:
        if objective == "kl":
            loss = acceptance_aware_loss(student, teacher, accepted, cfg, mask, head=drafter.student_head,
                                         norm=norm, chunk_size=chunk).loss
        else:
            slots = block_slots(predecessors, accepted, mask, cfg, norm)
            loss = acceptance_objective(drafter, student, teacher, slots, cfg, serving=SERVING,
                                        teacher_processing=Sampling.of(SERVING), chunk_size=chunk).loss
        loss.backward()

    started = time.perf_counter()
    peak = peak_cpu_bytes(step)
    return {"arm": name, "hidden": hidden, "slots": chunk, "peak_gb": peak / 1e9,
            "seconds": time.perf_counter() - started}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=2560)
    parser.add_argument("--blocks", type=int, default=26)  # 26 x 15 = 390 slots: optim.loss_chunk_size 400
    parser.add_argument("--json", default="bench/results/acceptance_memory.json")
    args = parser.parse_args()
    torch.set_num_threads(2)
    arms = [("paper KL (DFlash)", "kl", False, "pathwise"), ("1 - α (DFlash)", "one_minus_alpha", False, "pathwise"),
            ("1 - α (DFlash 2)", "one_minus_alpha", True, "pathwise"),
            ("expected length + score (DFlash 2)", "expected_length", True, "score")]
    rows = [measure(name, args.hidden, args.blocks, objective, selector, gradient)
            for name, objective, selector, gradient in arms]
    table = Table(title=f"one loss chunk, forward + backward, hidden {args.hidden}, vocabulary {VOCAB:,}, "
                        f"{args.blocks} blocks x {K - 1} slots")
    for column in ("objective", "peak GB", "x paper KL", "seconds"):
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(r["arm"], f"{r['peak_gb']:.2f}", f"{r['peak_gb'] / rows[0]['peak_gb']:.2f}x",
                      f"{r['seconds']:.1f}")
    Console().print(table)
    with open(args.json, "w") as f:
        json.dump(rows, f, indent=2)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
