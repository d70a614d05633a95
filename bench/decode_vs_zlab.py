"""This project's decoder against z-lab's `dflash_generate` and the target's own `generate`: tokens/s side by side.

The same held-out prompts, greedy, go through
- the target's Hugging Face `generate`, one prompt at a time (the baseline every speedup is over);
- z-lab's `dflash.model.dflash_generate` with the drafter loaded in z-lab's own `DFlashDraftModel` /
  `DFlash2DraftModel` (one prompt at a time: it decodes batch 1 only);
- this project's `SpeculativeDecoder` at batch 1 and batched (`--batch`), and with `--compile` also its compiled
  static-shape step (`SpeculativeDecoder(compiled=True)`) at both.
The two baselines run transformers' attention functions as shipped, without the project's wrappers (`as_shipped`).
Every response must be identical across all of them (asserted). Each round runs every decoder over all prompts,
decoders interleaved so the machine's drift hits all alike; a decoder's time is its best round. Both shipped tiny
drafters, DFlash 1 (opd/assets/tiny/drafter) and DFlash 2 (opd/assets/tiny/dflash2), are measured. Needs the
`interop` extra (z-lab's `dflash` package). Prints a table, writes JSON:

    python bench/decode_vs_zlab.py [--prompts 16] [--max-new-tokens 128] [--rounds 2] [--batch 16]
                                   [--device cpu|cuda] [--compile] [--out bench/results/decode_vs_zlab.json]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from opd.data.prompts import eval_prompts
from opd.decoding.sampling import Sampling
from opd.decoding.speculative import SpeculativeDecoder
from opd.models.build import build_models
from opd.models.dflash2 import DFlash2Drafter
from opd.models.packed_attention import as_shipped
from opd.models.registry import load_drafter
from opd.spec import load_spec

ROOT = Path(__file__).resolve().parents[1]
DRAFTERS = {"DFlash 1": "opd/assets/tiny/drafter", "DFlash 2": "opd/assets/tiny/dflash2"}
Decode = Callable[[], list[list[int]]]  # all prompts' responses


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def decoders(models, drafter, drafter_dir: str, prompts: list[list[int]], args) -> dict[str, Decode]:
    """name -> a function that decodes every prompt and returns the responses, in prompt order."""
    import dflash.model as zlab

    target, eos, budget = models.target, models.eos_id, args.max_new_tokens
    zlab._cuda_time = time.perf_counter  # its stats clock synchronises CUDA; stats are not asked for here
    zlab_class = zlab.DFlash2DraftModel if isinstance(drafter, DFlash2Drafter) else zlab.DFlashDraftModel
    theirs = zlab_class.from_pretrained(drafter_dir, dtype=target.dtype).to(target.device).eval()

    def hf_generate() -> list[list[int]]:
        with as_shipped():
            return [generate_one(p) for p in prompts]

    def generate_one(p: list[int]) -> list[int]:
        ids = torch.tensor([p], device=target.device)
        row = target.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=budget,
                                    do_sample=False, eos_token_id=eos, pad_token_id=eos)
        return row[0, len(p):].tolist()

    def zlab_generate() -> list[list[int]]:
        with as_shipped():
            return [zlab.dflash_generate(theirs, target.model, torch.tensor([p], device=target.device), budget,
                                         [eos])[0, len(p):].tolist() for p in prompts]

    def ours(batch: int, compiled: bool = False) -> Decode:
        decoder = SpeculativeDecoder(target, drafter, eos_id=eos, static_cache=compiled, compiled=compiled)
        return lambda: [r.response_ids for i in range(0, len(prompts), batch)
                        for r in decoder.generate(prompts[i : i + batch], Sampling(), max_new_tokens=budget)]

    rows = {"generate": hf_generate, "z-lab": zlab_generate, "ours, batch 1": ours(1),
            f"ours, batch {args.batch}": ours(args.batch)}
    if args.compile:
        rows |= {"ours compiled, batch 1": ours(1, True), f"ours compiled, batch {args.batch}": ours(args.batch, True)}
    return rows


def measure(name: str, models, drafter_dir: str, prompts: list[list[int]], args) -> list[dict]:
    """One drafter's rows: tokens/s (best round) of every decoder, identical responses asserted."""
    drafter = load_drafter(drafter_dir, models.target)
    device = models.target.device
    runs = decoders(models, drafter, drafter_dir, prompts, args)
    best: dict[str, float] = {}
    reference = runs["generate"]()  # also the warm-up of HF's generate
    for label, run in runs.items():  # warm-up (and the compiled step's compilation) outside the timed rounds
        assert run() == reference, f"{name}: {label} wrote different responses than the target's generate"
    tokens = sum(map(len, reference))
    for _ in range(args.rounds):
        for label, run in runs.items():
            sync(device)
            t0 = time.perf_counter()
            responses = run()
            sync(device)
            best[label] = min(best.get(label, float("inf")), time.perf_counter() - t0)
            assert responses == reference, f"{name}: {label} wrote different responses than the target's generate"
    rate = {label: tokens / seconds for label, seconds in best.items()}
    return [{"drafter": name, "decoder": label, "tokens": tokens, "seconds": best[label], "tokens_per_s": rate[label],
             "vs_zlab": rate[label] / rate["z-lab"], "speedup_over_generate": rate[label] / rate["generate"]}
            for label in runs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/tiny.yaml")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--compile", action="store_true", help="also the compiled static-shape step")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (the machine is shared: 1 is steadier)")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "decode_vs_zlab.json"))
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    spec = load_spec(args.config, [f"models.device={args.device}", "models.dtype=float32"])
    models = build_models(spec)
    prompts = [p.ids for p in eval_prompts(spec.data, models.tokenizer, args.prompts)]
    rows = [row for name, path in DRAFTERS.items() for row in measure(name, models, path, prompts, args)]
    table = Table(title=f"Greedy decoding, tiny target, {args.device}, {len(prompts)} prompts x {args.max_new_tokens} "
                        f"new tokens, best of {args.rounds} interleaved rounds; all responses identical")
    for column in ("drafter", "decoder", "tok/s", "vs z-lab", "speedup over generate"):
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(r["drafter"], r["decoder"], f"{r['tokens_per_s']:.0f}", f"{r['vs_zlab']:.2f}x",
                      f"{r['speedup_over_generate']:.2f}x")
    Console(width=120).print(table)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"device": args.device, "prompts": len(prompts),
                                          "max_new_tokens": args.max_new_tokens, "rounds": args.rounds,
                                          "batch": args.batch, "torch_threads": torch.get_num_threads(),
                                          "rows": rows}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
