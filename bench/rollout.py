"""Where a Draft-OPD step's time and FLOPs go, per rollout source, and what the paper's Qwen3-4B stage would cost.

1. Measured on this CPU with the shipped tiny models (configs/tiny-paper.yaml: batches of 8 prompts, 128 tokens), side
   by side in one process: per source, rollout samples/s, the scorer's rebuild and scoring time, one learner step,
   and the FLOPs per trained slot by role (the project's own counters, opd/models/flops.py).
2. A projection of the Qwen3-4B OPD stage per recipe (the faithful configs/qwen3-4b.yaml and its thinking variant:
   534 updates x 210 sequences, responses at their 2048 / 4096-token caps; and the 5,300 x 24 recipe they replace),
   K 16, τ 6, in H200 GPU-hours per source, from the same counters applied to Qwen3-4B's parameter counts (meta-device models:
   no weights) and a stated utilisation: decode-like work (rollout decoding, target sampling, the rebuild's
   sequential drafter steps) runs at `--decode-mfu` of the H200's dense bf16 peak, prefill-like work (the
   rebuild's target forward, teacher replay, learner) at `--prefill-mfu`. Speculative verification (K tokens per
   row per step) is likely more efficient than plain decoding, so giving both the same utilisation flatters the
   rebuilt source; the paper reports ~120 GPU-hours (8xH200, ~15 h, rollout included), far above either.

3. The rebuild's match rate in float32 (the tests prove 100% in float64): the shipped tiny target decodes the
   held-out prompts with the warm and a random drafter, greedy and at T=0.6 / top-k 20 / top-p 0.95, and every
   record is rebuilt from its text; the share of blocks identical to the decoder's.

    python bench/rollout.py                 # all three parts, ~5 min
    python bench/rollout.py --projection-only
    python bench/rollout.py --match-only
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from replay import synthetic_record  # bench/replay.py, beside this script
from rich.console import Console
from rich.table import Table

from opd.decoding.record import SequenceRecord
from opd.distill.replay import pack
from opd.models.dflash import DFlashConfig, DFlashDrafter
from opd.models.flops import DrafterParams, FlopCounter, TargetParams, decode_flops, rebuild_flops
from opd.models.target import Target
from opd.spec import load_spec
from opd.train.local import LocalTrainer

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
H200_BF16_DENSE = 989e12  # FLOP/s, dense (no sparsity)
PAPER = {"prompt": 200, "tau": 6.0, "gpu_hours": 120}
# The recipes projected: the faithful configs (sequences = updates x rollout batches an update x prompts a batch,
# responses at their cap), and the recipe they replace (5,300 updates of 24 sequences) for comparison.
RECIPES = {"qwen3-4b": ["configs/qwen3-4b.yaml"], "qwen3-4b-thinking": ["configs/qwen3-4b-thinking.yaml"],
           "previous (5,300 x 24)": ["configs/qwen3-4b.yaml", "epochs=null", "steps=5300", "rollout.batch_size=4",
                                     "optim.batch_size=24"]}
SOURCES = {"speculative": [], "target (speculative sampler)": ["rollout.source=target"],
           "target (autoregressive)": ["rollout.source=target", "rollout.sampler=autoregressive"]}


# ------------------------------------------------------------------------------------------- measured on this CPU


def measure(config: str, sets: list[str], batches: int) -> dict:
    """Seconds per batch of each phase, and FLOPs by role, over `batches` rollout batches (after one warm-up)."""
    spec = load_spec(config, sets + ["eval.every=0", "tracking.run_dir=/tmp/opd-bench-rollout"])
    trainer = LocalTrainer(spec, track=False)
    trainer.start(evaluate=False)
    scorer, rollout = trainer.scorer, trainer.rollout
    trainer.scorer(trainer.rollout.run(0))  # warm-up
    times = {"rollout": 0.0, "rebuild": 0.0, "score": 0.0, "learn": 0.0}
    flops = {"rollout": FlopCounter(), "rebuild": FlopCounter(), "score": 0.0, "learn": 0.0}
    sequences = slots = 0
    for step in range(batches // spec.batches_per_step):
        items = []
        for j in range(spec.batches_per_step):
            t0 = time.perf_counter()
            batch = rollout.run(1 + step * spec.batches_per_step + j)
            t1 = time.perf_counter()
            _add(flops["rollout"], batch.flops)
            if spec.rollout.rebuilt:
                rebuilt = scorer.rebuild(batch)
                _add(flops["rebuild"], rebuild_flops(rebuilt.records, scorer.params, DrafterParams.of(scorer.drafter)))
            t2 = time.perf_counter()
            item = scorer(batch)  # rebuilds again (deterministic): its time is subtracted below
            t3 = time.perf_counter()
            times["rollout"] += t1 - t0
            times["rebuild"] += t2 - t1
            times["score"] += (t3 - t2) - (t2 - t1)
            flops["score"] += item.scorer_flops
            sequences += len(batch.records)
            slots += sum(int(mb.position_mask.sum()) for mb in item.micro_batches)
            items.append(item)
        before = trainer.learner.flops.drafter_train
        t0 = time.perf_counter()
        trainer.session.train_step(items)
        times["learn"] += time.perf_counter() - t0
        flops["learn"] += trainer.learner.flops.drafter_train - before
    n = batches
    per_slot = {"rollout": flops["rollout"].total / slots, "rebuild": flops["rebuild"].total / slots,
                "score": flops["score"] / slots, "learn": flops["learn"] / slots}
    return {"seconds_per_batch": {k: v / n for k, v in times.items()},
            "samples_per_s": sequences / times["rollout"], "flops_per_trained_slot": per_slot}


def _add(total: FlopCounter, part: FlopCounter) -> None:
    total.target_forward += part.target_forward
    total.drafter_forward += part.drafter_forward


# ------------------------------------------------------------------------------------------------ the projection


def qwen3_4b_params() -> tuple[TargetParams, DrafterParams]:
    """Qwen3-4B and its 5-layer K-16 DFlash drafter (5 target features), counted on the meta device."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True)
    with torch.device("meta"):
        target = Target(Qwen3ForCausalLM(config), [1, 9, 17, 25, 33])
        drafter = DFlashDrafter(DFlashConfig.for_target(config, num_layers=5, block_size=16, mask_token_id=151669,
                                                        target_layer_ids=[1, 9, 17, 25, 33]),
                                target.embed_tokens, target.lm_head)
    return TargetParams.of(target.model), DrafterParams.of(drafter)


def per_sequence(target: TargetParams, drafter: DrafterParams, first_rejection: bool,
                 response: int) -> dict[str, dict[str, float]]:
    """FLOPs per sequence by role and kind of work, for each source, on a synthetic τ-6 rollout of `response`
    tokens at the paper's shapes, through the project's own counting functions."""
    g = torch.Generator().manual_seed(0)
    k, p = drafter.block_size, PAPER
    rec = synthetic_record(0, response, p["prompt"], 1000, k, 1 - 1 / p["tau"], g)
    text = p["prompt"] + response
    mode = "committed" if first_rejection else "draft_opd"
    scored_slots = sum(min(r + 1, k - 1) for r in rec.accepted) if first_rejection else len(rec.anchors) * (k - 1)
    packed, slots = pack(rec, k, mode), len(rec.anchors) * (k - 1)
    score = target.forward(len(packed.ids), logits=slots)
    # a rebuilding scorer runs the text once (the rebuild's forward) and the packed teacher's blocks over its keys
    score_rebuilt = target.forward(len(packed.ids) - packed.prefix_len, logits=slots)
    learn = drafter.train(context=p["prompt"] + rec.anchors[-1], blocks=len(rec.anchors), slots=scored_slots)
    speculative = decode_flops([rec], target, drafter).total
    sampling = target.forward(text, logits=response)  # vLLM forms logits at sampled positions only
    rebuild = rebuild_flops([rec], target, drafter)  # the walk's drafter steps are small calls: decode-like
    return {"speculative": {"decode": speculative, "prefill": score + learn},
            "target (vLLM sampling)": {"decode": sampling + rebuild.drafter_forward,
                                       "prefill": rebuild.target_forward + score_rebuilt + learn}}


def recipe_size(config: list[str]) -> tuple[int, int, int]:
    """(optimizer updates, sequences, response cap) of a recipe: its config and overrides."""
    spec = load_spec(config[0], config[1:], check_paths=False)
    return spec.steps, spec.steps * spec.batches_per_step * spec.rollout.batch_size, spec.rollout.max_new_tokens


def projection(decode_mfu: float, prefill_mfu: float) -> list[dict]:
    target, drafter = qwen3_4b_params()
    rows = []
    for recipe, config in RECIPES.items():
        updates, sequences, response = recipe_size(config)
        for loss, first_rejection in (("paper's loss", False), ("first-rejection presets", True)):
            for source, work in per_sequence(target, drafter, first_rejection, response).items():
                seconds = sequences * (work["decode"] / (decode_mfu * H200_BF16_DENSE)
                                       + work["prefill"] / (prefill_mfu * H200_BF16_DENSE))
                rows.append({"recipe": recipe, "updates": updates, "sequences": sequences, "response": response,
                             "loss": loss, "source": source, "decode_tflop_per_seq": work["decode"] / 1e12,
                             "prefill_tflop_per_seq": work["prefill"] / 1e12, "gpu_hours": seconds / 3600})
    return rows


# -------------------------------------------------------------------------------------------- float32 match rate


def match_rate(config: str, prompts: int) -> list[dict]:
    """Per (drafter, setting): blocks decoded, and the share the rebuild reproduces exactly, in float32."""
    from opd.data.prompts import eval_prompts
    from opd.decoding.sampling import Sampling
    from opd.decoding.speculative import SpeculativeDecoder
    from opd.models.build import build_drafter, build_models
    from opd.sources.rebuild import rebuild_records

    spec = load_spec(config, ["models.dtype=float32"])
    models = build_models(spec)
    held_out = eval_prompts(spec.data, models.tokenizer, prompts)
    drafters = {"warm": models.drafter, "random": build_drafter(spec, models.target, models.tokenizer, "random")}
    settings = {"greedy": Sampling(), "T=0.6 top-k 20 top-p 0.95": Sampling(0.6, top_k=20, top_p=0.95)}
    rows = []
    for name, drafter in drafters.items():
        decoder = SpeculativeDecoder(models.target, drafter, eos_id=models.eos_id)
        for label, sampling in settings.items():
            decoded = decoder.generate([p.ids for p in held_out], sampling, max_new_tokens=spec.eval.max_new_tokens,
                                       seed=spec.seed)
            samples = [SequenceRecord.from_text(r.key, r.prompt_ids, r.response_ids, models.eos_id) for r in decoded]
            rebuilt = rebuild_records(models.target, drafter, samples)
            pairs = [(a, b) for d, r in zip(decoded, rebuilt)
                     for a, b in zip(zip(d.anchors, d.drafts, d.accepted), zip(r.anchors, r.drafts, r.accepted))]
            same = sum(a == b for a, b in pairs)  # position by position: a divergence shifts the rest
            rows.append({"drafter": name, "sampling": label, "blocks": sum(len(d.anchors) for d in decoded),
                         "matching": same, "records_equal": sum((d.anchors, d.drafts, d.accepted) ==
                                                               (r.anchors, r.drafts, r.accepted)
                                                               for d, r in zip(decoded, rebuilt))})
    return rows


# ---------------------------------------------------------------------------------------------------- reporting


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/tiny-paper.yaml")
    parser.add_argument("--batches", type=int, default=6, help="rollout batches measured per source")
    parser.add_argument("--decode-mfu", type=float, default=0.10)
    parser.add_argument("--prefill-mfu", type=float, default=0.40)
    parser.add_argument("--projection-only", action="store_true")
    parser.add_argument("--match-only", action="store_true")
    parser.add_argument("--match-prompts", type=int, default=48)
    args = parser.parse_args()
    torch.set_num_threads(1)
    console, out = Console(width=160), {"assumptions": {"decode_mfu": args.decode_mfu, "prefill_mfu": args.prefill_mfu,
                                               "h200_bf16_dense_flops": H200_BF16_DENSE, "paper": PAPER}}
    path = RESULTS / "rollout.json"
    if path.exists():  # a partial run keeps the other parts' last results
        out = {**json.loads(path.read_text()), **out}
    if not (args.projection_only or args.match_only):
        out["cpu"] = {name: measure(args.config, sets, args.batches) for name, sets in SOURCES.items()}
        console.print(cpu_table(out["cpu"]))
    if not args.match_only:
        out["projection"] = projection(args.decode_mfu, args.prefill_mfu)
        console.print(projection_table(out["projection"], args))
    if not args.projection_only:
        out["float32_match"] = match_rate(args.config, args.match_prompts)
        console.print(match_table(out["float32_match"]))
    RESULTS.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")


def cpu_table(cpu: dict) -> Table:
    t = Table(title="Per rollout batch of 8 on this CPU (tiny, 1 thread), seconds; FLOPs per trained slot")
    for column in ("source", "samples/s", "rollout", "rebuild", "score", "learn (per batch)",
                   "rollout MF/slot", "rebuild MF/slot", "score MF/slot", "learn MF/slot"):
        t.add_column(column, justify="right")
    for name, m in cpu.items():
        s, f = m["seconds_per_batch"], m["flops_per_trained_slot"]
        t.add_row(name, f"{m['samples_per_s']:.1f}", *(f"{s[k]:.3f}" for k in ("rollout", "rebuild", "score", "learn")),
                  *(f"{f[k] / 1e6:.1f}" for k in ("rollout", "rebuild", "score", "learn")))
    return t


def match_table(rows: list[dict]) -> Table:
    t = Table(title="Rebuilt against decoded records, float32 (tiny target, held-out prompts)")
    for column in ("drafter", "sampling", "blocks", "identical blocks", "identical records"):
        t.add_column(column, justify="right")
    for r in rows:
        t.add_row(r["drafter"], r["sampling"], str(r["blocks"]), f"{r['matching'] / max(1, r['blocks']):.2%}",
                  str(r["records_equal"]))
    return t


def projection_table(rows: list[dict], args) -> Table:
    t = Table(title=f"Qwen3-4B OPD stage per recipe (responses at the cap, τ {PAPER['tau']:g}): H200 GPU-hours at "
                    f"{args.decode_mfu:.0%} decode / {args.prefill_mfu:.0%} prefill utilisation; the paper: "
                    f"~{PAPER['gpu_hours']}")
    for column in ("recipe", "updates", "sequences", "response", "loss", "source", "decode TFLOP/seq",
                   "prefill TFLOP/seq", "GPU-hours"):
        t.add_column(column, justify="right")
    for r in rows:
        t.add_row(r["recipe"], f"{r['updates']:,}", f"{r['sequences']:,}", str(r["response"]), r["loss"], r["source"],
                  f"{r['decode_tflop_per_seq']:.1f}", f"{r['prefill_tflop_per_seq']:.1f}", f"{r['gpu_hours']:.1f}")
    return t


if __name__ == "__main__":
    main()
