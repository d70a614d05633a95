"""Autoregressive vs speculative decoding on the shipped tiny target: tokens/s, τ and where a step's time goes.

    python bench/decode.py [--prompts 16] [--max-new-tokens 128] [--drafters random,warm]

Every configuration runs in this one process, AR and speculative interleaved batch by batch, so the ratios are
side by side. Writes bench/results/decode.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from opd.data.prompts import eval_prompts
from opd.decoding.autoregressive import generate_autoregressive
from opd.decoding.sampling import Sampling
from opd.decoding.speculative import SpeculativeDecoder
from opd.eval.acceptance import AcceptanceStats
from opd.models.build import build_models
from opd.spec import load_spec

RESULTS = Path(__file__).parent / "results" / "decode.json"


def bench(models, prompts, batch_size: int, max_new_tokens: int) -> dict:
    decoder = SpeculativeDecoder(models.target, models.drafter, eos_id=models.eos_id)
    sampling, spec_s, ar_s, spec_tok, ar_tok, records = Sampling(), 0.0, 0.0, 0, 0, []
    for i in range(0, len(prompts), batch_size):
        ids = [p.ids for p in prompts[i : i + batch_size]]
        t0 = time.perf_counter()
        out = decoder.generate(ids, sampling, max_new_tokens=max_new_tokens)
        t1 = time.perf_counter()
        ar = generate_autoregressive(models.target, ids, sampling, max_new_tokens=max_new_tokens, eos_id=models.eos_id)
        t2 = time.perf_counter()
        spec_s, ar_s = spec_s + t1 - t0, ar_s + t2 - t1
        spec_tok, ar_tok = spec_tok + sum(len(r.response_ids) for r in out), ar_tok + sum(len(a) for a in ar)
        records += out
    t = decoder.timings
    step_time = t["draft"] + t["verify"] + t["bookkeeping"]
    return {"batch": batch_size, "ar_tok_s": ar_tok / ar_s, "spec_tok_s": spec_tok / spec_s,
            "speedup": (spec_tok / spec_s) / (ar_tok / ar_s),
            "tau": AcceptanceStats.from_records(records, models.drafter.block_size).tau_token_weighted,
            "steps": int(t["steps"]), "ms_per_step": 1000 * step_time / max(1, t["steps"]),
            "draft_share": t["draft"] / step_time, "verify_share": t["verify"] / step_time,
            "bookkeeping_share": t["bookkeeping"] / step_time}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/tiny-paper.yaml")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--drafters", default="random,warm")
    args = parser.parse_args()
    torch.manual_seed(0)
    spec = load_spec(args.config, check_paths=False)
    rows = []
    for name in args.drafters.split(","):
        path = "random" if name == "random" else spec.models.drafter_path
        if name != "random" and not (path and Path(path, "config.json").exists()):
            continue
        models = build_models(spec, path)
        prompts = eval_prompts(spec.data, models.tokenizer, args.prompts)
        for batch in (1, 8):
            rows.append({"drafter": name, **bench(models, prompts, batch, args.max_new_tokens)})
    table = Table(title=f"Decoding, tiny target, greedy, {args.prompts} prompts x {args.max_new_tokens} new tokens",
                  width=160)
    columns = ["drafter", "batch", "ar_tok_s", "spec_tok_s", "speedup", "tau", "ms_per_step", "draft_share",
               "verify_share", "bookkeeping_share"]
    for c in columns:
        table.add_column(c, justify="right")
    for r in rows:
        table.add_row(*(f"{r[c]:.3f}" if isinstance(r[c], float) else str(r[c]) for c in columns))
    Console().print(table)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"config": args.config, "torch_threads": torch.get_num_threads(), "rows": rows},
                                  indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
