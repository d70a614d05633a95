"""The MTP path sized for real targets: Qwen3.5-122B-A10B (bf16) and DeepSeek-V3 (FP8), their own MTP head trained
by Draft-OPD and the target frozen, laid out on 8×H200 nodes as bench/sharded_layout.py lays out the targets.

    python bench/mtp_scale.py [--block-size 4] [--tau 3.0] [--json bench/results/mtp_scale.json]

The head is one decoder layer of the target's own kind (a full-attention layer over the target's MoE: Qwen3.5's
gated attention with 256 experts of 1024; DeepSeek-V3's latent attention with 256 experts of 2048), its input
projection (2H x H) and norms, on the target's frozen embedding and LM head; its parameter counts come from
sharded_layout's per-family counts for a one-layer config. Every expert trains (the router picks different ones per
token), so the learner holds the head whole: 20 bytes a parameter at the step (fp32 masters and AdamW moments,
bf16 weights and gradients), split over ZeRO-2 ranks where one H200 cannot hold it; FLOPs count the active share.

What changes against sharded_layout's DFlash rows, role by role (the target's roles are the same frozen target):
- rollout and evaluator ranks hold the head's bf16 copy instead of a DFlash drafter's (`drafter_params` here);
- drafting: every committed token runs through the head's layer once (its column), each block K-2 chain steps and
  K-1 rows of the target's LM head;
- the scorer ships the target's last hidden state only (one feature layer, not five);
- the learner: 6x the head's active parameters per column and chain step, 4x the frozen LM head per slot (input
  gradients only), over the update's 210 sequences.

Block size K and τ are assumptions (`--block-size`, `--tau`: vLLM serves MTP heads with 1-3 speculative tokens;
DeepSeek reports 85-90% acceptance of its one MTP token). A projection, not a measurement; no assertions.
"""

from __future__ import annotations

import argparse
import json
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import sharded_layout as layout

RESULTS = Path(__file__).resolve().parent / "results"
TARGETS = [("qwen3.5-122b-a10b", "bf16"), ("deepseek-v3", "fp8")]
ZERO_RANKS = (1, 2, 3, 5, 6, 7, 10, 14, 15)  # learner ranks that divide the update's 210 sequences


def head_counts(s: layout.Shape) -> tuple[float, float]:
    """(total, active) parameters of the target's MTP head: one layer of its full-attention kind over its MLP, the
    input projection and three norms (the embedding and LM head are the target's)."""
    one_layer = {"qwen3_5_moe": {"num_hidden_layers": 1, "full_attention_interval": 1},
                 "deepseek_v3": {"num_hidden_layers": 1, "first_k_dense_replace": 0}}[s.family]
    b = layout.FAMILIES[s.family](s.config | one_layer)
    own = 2 * s.hidden * s.hidden + 3 * s.hidden
    mixers = b.attention + b.attention_whole + b.linear
    return mixers + b.mlp_split + b.router + own, mixers + b.mlp_active + b.router + own


@contextmanager
def drafter(params: float):
    """sharded_layout's roles holding this drafter (its bf16 copy on rollout ranks, its state on the learner)."""
    before = layout.drafter_params
    layout.drafter_params = lambda s: params
    try:
        yield
    finally:
        layout.drafter_params = before


def project(name: str, precision: str, args: argparse.Namespace) -> dict[str, Any]:
    s = layout.shape(name, json.loads((layout.FIXTURES / f"{name}.json").read_text()), precision)
    total, active = head_counts(s)
    p, r, k, tau = args.prompt, args.response, args.block_size, args.tau
    blocks = r / tau
    with drafter(total):
        roles = {role: layout.degree_for(s, role, p + r) for role in layout.KNOBS}
        learners = next((n for n in ZERO_RANKS if layout.learner_bytes(s, n) <= layout.LIMIT), None)
        learner_gb = None if learners is None else layout.learner_bytes(s, learners) / layout.GB
    head = s.vocab * s.hidden
    per_sequence = {"draft": 2 * active * (p + r + blocks * (k - 2)) + 2 * head * blocks * (k - 1),
                    "target_verify": 2 * s.active * (p + blocks * k),
                    "scorer": 2 * s.active * (p + r + blocks * (k - 1)),
                    "learner": 6 * active * (p + r + blocks * (k - 2)) + 4 * head * blocks * (k - 1)}
    seconds = {role: layout.SEQUENCES * flops / (layout.PEAK_FLOPS * args.mfu) for role, flops in per_sequence.items()}
    placed = {role: (v.degree, v.knob, v.bytes / layout.GB) if isinstance(v, layout.Placed) else v
              for role, v in roles.items()}
    return {"target": name, "precision": precision, "head_params_b": total / 1e9, "head_active_b": active / 1e9,
            "head_bf16_gb": 2 * total / layout.GB, "roles": placed, "learner_ranks": learners,
            "learner_gb_per_rank": learner_gb, "flops_per_sequence": per_sequence,
            "gpu_seconds_per_update_at_mfu": seconds,
            "draft_share_of_rollout_flops": per_sequence["draft"] / (per_sequence["draft"]
                                                                      + per_sequence["target_verify"]),
            "scored_gb_per_update": layout.SEQUENCES * (blocks * (k - 1) + p + r) * s.hidden * 2 / layout.GB}


def placed_cell(placed: Any) -> str:
    """A role's (ranks, knob, GB) as the table shows it, or "refused"."""
    return f"{placed[0]}, {placed[2]:.0f}" if isinstance(placed, tuple) else "refused"


def dflash_row(name: str, precision: str) -> dict[str, Any] | None:
    """sharded_layout's row for the same target with a 5-layer DFlash drafter, where it has one."""
    rows = json.loads((RESULTS / "sharded_layout.json").read_text())["rows"]
    return next((row for row in rows if row["target"] == name and row["precision"] == precision), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--response", type=int, default=2048)
    parser.add_argument("--block-size", type=int, default=4)
    parser.add_argument("--tau", type=float, default=3.0)
    parser.add_argument("--mfu", type=float, default=0.4)
    parser.add_argument("--json", default=str(RESULTS / "mtp_scale.json"))
    args = parser.parse_args()
    rows = [project(name, precision, args) | {"dflash_layout": dflash_row(name, precision)}
            for name, precision in TARGETS]
    print(f"MTP head trained by Draft-OPD, target frozen: K={args.block_size}, τ {args.tau}, prompt {args.prompt}, "
          f"response {args.response}, {layout.SEQUENCES} sequences an update, MFU {args.mfu} of the H200's bf16 peak")
    print(f"{'target':<20}{'head B (active)':>17}{'bf16 GB':>9}{'rollout ranks, GB':>19}{'scorer ranks, GB':>18}"
          f"{'learner ranks, GB':>19}{'learner s':>11}{'draft share':>13}")
    for row in rows:
        rollout, scorer = row["roles"]["rollout"], row["roles"]["scorer"]
        learner = (f"{row['learner_ranks']}, {row['learner_gb_per_rank']:.0f}" if row["learner_ranks"]
                   else "over 15 ranks")
        print(f"{row['target'] + ' ' + row['precision']:<20}{row['head_params_b']:>9.2f} ({row['head_active_b']:.2f})"
              f"{row['head_bf16_gb']:>9.1f}{placed_cell(rollout):>19}{placed_cell(scorer):>18}{learner:>19}"
              f"{row['gpu_seconds_per_update_at_mfu']['learner']:>11.1f}{row['draft_share_of_rollout_flops']:>13.1%}")
        for role, placed in row["roles"].items():
            if isinstance(placed, str):
                print(f"{'':<20}refused (the target's own {role} ranks, whatever the drafter): {placed}")
        if row["dflash_layout"]:
            d = row["dflash_layout"]
            print(f"{'':<20}DFlash (5 layers, sharded_layout): learner {d['learner_ranks']} rank(s), "
                  f"{d['learner_gb']:.0f} GB, {d['learner_s']:.1f} s; rollout {d['rollout']} at {d['rollout_gb']:.0f} GB")
    Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
