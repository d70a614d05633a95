"""What a DFlash 2 block costs to draft against a DFlash 1 block of the same depth and block size, on the shipped tiny
target: FLOPs per block (the counters of opd/models/flops.py) and CPU wall-clock, side by side in one run.

Both drafters decode the same held-out prompts greedily (`SpeculativeDecoder`), interleaved batch by batch, and the
decoder's own timers split each verification step into drafting, verification and bookkeeping; the drafting time
per block is the ratio the issue asks for. Parameter counts come from the drafters themselves. Last, the DFlash 2
drafter decodes the same prompts drafting its logits' argmax instead of its selector's path: what the selector adds.

    python bench/dflash2_cost.py [--prompts 32] [--max-new-tokens 128] [--batch 8] [--rounds 2] [--compiled]

`--compiled` decodes with the compiled static-shape step (`SpeculativeDecoder(compiled=True)`; a warm-up batch
per drafter compiles it first). Writes bench/results/dflash2_cost.json (dflash2_cost_compiled.json).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from opd.data.prompts import eval_prompts
from opd.decoding.sampling import Sampling
from opd.decoding.speculative import SpeculativeDecoder
from opd.eval.acceptance import AcceptanceStats
from opd.models.build import build_models
from opd.models.flops import DrafterParams
from opd.spec import load_spec

RESULTS = Path(__file__).parent / "results"
DRAFTERS = {"DFlash 1": "opd/assets/tiny/drafter", "DFlash 2": "opd/assets/tiny/dflash2"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--compiled", action="store_true", help="the compiled static-shape decoding step")
    args = parser.parse_args()
    torch.set_num_threads(1)
    spec = load_spec("configs/tiny.yaml", ["engine=local"])
    base = build_models(spec)
    prompts = [p.ids for p in eval_prompts(spec.data, base.tokenizer, args.prompts)]
    drafters = {name: base.drafter if name == "DFlash 1" else build_models(spec, path).drafter
                for name, path in DRAFTERS.items()}
    decoders = {name: SpeculativeDecoder(base.target, d, eos_id=base.eos_id, static_cache=args.compiled,
                                         compiled=args.compiled) for name, d in drafters.items()}
    for decoder in decoders.values():  # the warm-up (and the compilation) is not timed
        decoder.generate(prompts[: args.batch], Sampling(), max_new_tokens=args.max_new_tokens)
        decoder.timings.clear()
    records: dict[str, list] = {name: [] for name in drafters}
    for _ in range(args.rounds):
        for i in range(0, len(prompts), args.batch):
            for name, decoder in decoders.items():  # interleaved: the machine's drift hits both alike
                records[name] += decoder.generate(prompts[i : i + args.batch], Sampling(),
                                                  max_new_tokens=args.max_new_tokens)
    rows = {}
    for name, drafter in drafters.items():
        params, timings, k = DrafterParams.of(drafter), decoders[name].timings, drafter.block_size
        steps = timings["steps"]
        rows[name] = {"parameters": sum(p.numel() for p in drafter.parameters()),
                      "block_flops": params.forward(context=0, blocks=1, slots=k - 1),
                      "context_flops_per_token": params.forward(context=1, blocks=0, slots=0),
                      "draft_ms_per_step": 1000 * timings["draft"] / steps,
                      "step_ms": 1000 * (timings["draft"] + timings["verify"] + timings["bookkeeping"]) / steps,
                      "tau": AcceptanceStats.from_records(records[name], k).tau}
    two_drafter = drafters["DFlash 2"]
    two_drafter.choose = lambda hidden, logits, anchor_ids: logits.argmax(-1)  # the selector bypassed
    plain = [r for i in range(0, len(prompts), args.batch) for r in SpeculativeDecoder(
        base.target, two_drafter, eos_id=base.eos_id).generate(prompts[i : i + args.batch], Sampling(),
                                                                max_new_tokens=args.max_new_tokens)]
    rows["DFlash 2"]["tau_logits_argmax"] = AcceptanceStats.from_records(plain, two_drafter.block_size).tau
    one, two = rows["DFlash 1"], rows["DFlash 2"]
    ratios = {"block_flops": two["block_flops"] / one["block_flops"],
              "draft_wall": two["draft_ms_per_step"] / one["draft_ms_per_step"],
              "step_wall": two["step_ms"] / one["step_ms"]}
    print(f"{'drafter':<10}{'params':>11}{'block GFLOP':>13}{'draft ms/step':>15}{'step ms':>9}{'greedy τ':>10}")
    for name, r in rows.items():
        print(f"{name:<10}{r['parameters']:>11,}{r['block_flops'] / 1e9:>13.4f}{r['draft_ms_per_step']:>15.2f}"
              f"{r['step_ms']:>9.2f}{r['tau']:>10.3f}")
    print(f"DFlash 2 drafting its logits' argmax, not the selector's path: greedy τ {two['tau_logits_argmax']:.3f}")
    print(f"DFlash 2 / DFlash 1: block FLOPs {ratios['block_flops']:.3f}x, drafting wall {ratios['draft_wall']:.2f}x, "
          f"whole step {ratios['step_wall']:.2f}x ({len(prompts)} prompts x {args.rounds} rounds, batch {args.batch})")
    out = RESULTS / ("dflash2_cost_compiled.json" if args.compiled else "dflash2_cost.json")
    out.write_text(json.dumps({"drafters": rows, "ratios": ratios, "prompts": len(prompts), "rounds": args.rounds,
                               "batch": args.batch, "compiled": args.compiled}, indent=2) + "\n")


if __name__ == "__main__":
    main()
