"""One-GPU benchmark at Qwen3-4B's shapes: decoding, packed replay and the learner step, within a time budget.

    python bench/gpu.py [--budget-s 420] [--tiny] [--drafter dflash|eagle3] [--[no-]compile] [--json OUT]

Random weights, so no checkpoint or download is needed: a Qwen3 target with Qwen3-4B's shapes (hidden 2560,
36 layers, 32 query / 8 KV heads of 128, MLP 9728, vocabulary 151936) and, by `--drafter`, a 5-layer DFlash
drafter with block 16 (default) or an EAGLE-3 drafter with block 8 (a chain of 7 drafts), a 32,000-token draft
vocabulary and the target's default fused layers (entering 2, L//2, L-3), bf16 on CUDA. Both run through the
family interface (decode, `score` + `student_hidden`, `Learner`), so the rows compare like for like. Decoding
uses flash_attention_2 when flash-attn is installed, else sdpa; replay and the learner always use sdpa, because
packed replay needs a 4-D attention mask that flash-attn does not take.

- decode: greedy autoregressive vs speculative decoding at batch 1 and 16, at the largest batch also the
  opt-in static-shape speculative path (`rollout.static_cache`: StaticCache, finished rows kept), and with
  `--compile` (the default on a GPU) the compiled static-shape step (`SpeculativeDecoder(compiled=True)`)
  at every batch, its compilation in the warm-up run. A random
  drafter's drafts are almost never accepted (τ ≈ 1), so these rows measure the *cost* side — tokens/s and latency
  per step (one target forward, or one draft + verify step) — not the speedup a trained drafter gives; `opd eval`
  measures that.
- replay: `opd.distill.replay.score` + `student_hidden` (teacher and student hidden states at the slots) on synthetic rollout
  records (bench/replay.py), anchors and committed tokens per second at batch 1 and 4.
- learner: `Learner.train_step` (student replay, acceptance-aware loss, backward, AdamW) on one scored sequence.

Each section may run until a deadline (cumulative shares of the budget, so time a section leaves is inherited
by the next); a measurement never starts after its section's deadline, so the run ends within the budget plus
one measurement, and what was skipped is listed. A section that fails is recorded and the others still run.
`--tiny` swaps in small shapes so the whole script runs on a CPU in seconds (tests/test_gpu.py runs it).
Writes bench/results/gpu.json (gpu_tiny.json with --tiny; an `_eagle3` suffix with --drafter eagle3).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from replay import synthetic_record  # bench/replay.py, beside this script
from rich.console import Console
from rich.table import Table

from opd.decoding.autoregressive import generate_autoregressive
from opd.decoding.sampling import Sampling
from opd.decoding.speculative import SpeculativeDecoder
from opd.distill.replay import score, student_hidden
from opd.eval.acceptance import AcceptanceStats
from opd.formats.dflash import default_target_layer_ids
from opd.formats.eagle3 import Eagle3Config
from opd.models.dflash import DFlashConfig, DFlashDrafter
from opd.models.eagle3 import Eagle3Drafter
from opd.models.protocol import Drafter
from opd.models.registry import FAMILIES
from opd.models.target import Target
from opd.spec import validate_spec
from opd.train.learner import Learner

RESULTS = Path(__file__).parent / "results"
QWEN3_4B = dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)
TINY = dict(QWEN3_4B, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024)
EAGLE3_BLOCK_SIZE = 8  # SpecForge's training unroll: 7 chain drafts after the anchor
EAGLE3_DRAFT_VOCAB = 32000  # the public Qwen3 EAGLE-3 drafters' (or the whole vocabulary, if smaller)


@dataclass(frozen=True)
class Plan:
    shapes: dict
    drafter_layers: int  # DFlash
    block_size: int  # DFlash; EAGLE-3 takes EAGLE3_BLOCK_SIZE
    eagle3_layers: list[int] | None  # EAGLE-3's fused (entering) layer ids; None: the target's default
    prompt_len: int
    new_tokens: int
    decode_batches: tuple[int, ...]
    replay_length: int
    replay_batches: tuple[int, ...]
    repeats: int


FULL_PLAN = Plan(QWEN3_4B, drafter_layers=5, block_size=16, eagle3_layers=None, prompt_len=256, new_tokens=128,
                 decode_batches=(1, 16), replay_length=1024, replay_batches=(1, 4), repeats=3)
# 4 layers leave EAGLE-3 only entering ids 2..3 (the default [2, 2, 1] is not ascending): one layer fused twice.
TINY_PLAN = Plan(TINY, drafter_layers=1, block_size=4, eagle3_layers=[2, 3, 3], prompt_len=8, new_tokens=8,
                 decode_batches=(1, 4), replay_length=32, replay_batches=(1, 2), repeats=2)
SHARES = {"decode": 0.55, "replay": 0.75, "learner": 0.95}  # cumulative: section deadline = start + share·budget


class Clock:
    """Wall time since start, section deadlines, and the measurements skipped for lack of time."""

    def __init__(self, budget_s: float, device: torch.device) -> None:
        self.start, self.budget_s, self.device = time.monotonic(), budget_s, device
        self.skipped: list[str] = []

    def deadline(self, section: str) -> float:
        return self.start + SHARES[section] * self.budget_s

    def measure(self, name: str, fn: Callable[[], dict], deadline: float, repeats: int) -> dict | None:
        """One warm-up, then up to `repeats` timed runs, none started after `deadline`; the median run's seconds
        and the last run's counts, or None (listed as skipped) when not even one timed run fitted."""
        times, result = [], None
        if time.monotonic() < deadline:
            fn()
        while len(times) < repeats and time.monotonic() < deadline:
            self.sync()
            t0 = time.perf_counter()
            result = fn()
            self.sync()
            times.append(time.perf_counter() - t0)
        if not times:
            self.skipped.append(name)
            return None
        return {**result, "seconds": statistics.median(times), "runs": len(times)}

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def build(plan: Plan, device: torch.device, dtype: torch.dtype, attn: str,
          kind: str = "dflash") -> tuple[Target, Drafter]:
    """Random target and drafter of `kind` created directly on the device (a 4B model initialised on a CPU takes
    minutes); the target captures the layers the drafter reads."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(**plan.shapes)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn)
        if kind == "eagle3":
            eagle3 = Eagle3Config.for_target(config, draft_vocab_size=min(EAGLE3_DRAFT_VOCAB, config.vocab_size),
                                             block_size=EAGLE3_BLOCK_SIZE, aux_layer_ids=plan.eagle3_layers)
            target = Target(model, eagle3.target_layer_ids)
            return target, Eagle3Drafter(eagle3, target.embed_tokens, target.lm_head)
        target = Target(model, default_target_layer_ids(config.num_hidden_layers, plan.drafter_layers))
        drafter_config = DFlashConfig.for_target(config, plan.drafter_layers, plan.block_size,
                                                 mask_token_id=config.vocab_size - 1, target_layer_ids=target.layer_ids)
        drafter = DFlashDrafter(drafter_config, target.embed_tokens, target.lm_head)
    return target, drafter


def describe(drafter: Drafter, kind: str) -> dict:
    """The drafter's shape for the result file."""
    c = drafter.config
    if kind == "eagle3":
        return {"kind": kind, "block_size": drafter.block_size, "draft_vocab_size": c.draft_vocab_size,
                "aux_layer_ids": c.aux_layer_ids}
    return {"kind": kind, "num_layers": c.num_hidden_layers, "block_size": drafter.block_size}


def bench_decode(target: Target, drafter: Drafter, plan: Plan, clock: Clock, compiled: bool = False) -> list[dict]:
    """`compiled`: also the compiled static-shape step (`SpeculativeDecoder(compiled=True)`) at every batch; its
    warm-up run compiles."""
    vocab, eos = target.vocab_size, target.vocab_size - 2  # eos: an ordinary id the prompts never contain
    decoders = {mode: SpeculativeDecoder(target, drafter, eos_id=eos, static_cache=mode != "dynamic",
                                         compiled=mode == "compiled")
                for mode in ("dynamic", "static", "compiled")}
    g = torch.Generator().manual_seed(0)
    rows, deadline = [], clock.deadline("decode")
    for batch in plan.decode_batches:
        prompts = torch.randint(0, vocab - 2, (batch, plan.prompt_len), generator=g).tolist()

        def autoregressive() -> dict:
            out = generate_autoregressive(target, prompts, Sampling(), max_new_tokens=plan.new_tokens, eos_id=eos)
            return {"tokens": sum(map(len, out)), "steps": max(map(len, out))}

        def speculative(mode: str = "dynamic") -> dict:
            decoder = decoders[mode]
            steps = decoder.timings["steps"]
            out = decoder.generate(prompts, Sampling(), max_new_tokens=plan.new_tokens)
            return {"tokens": sum(len(r.response_ids) for r in out), "steps": int(decoder.timings["steps"] - steps),
                    "tau": AcceptanceStats.from_records(out, drafter.block_size).tau_token_weighted}

        modes = [("autoregressive", autoregressive), ("speculative", speculative)]
        if batch == max(plan.decode_batches):  # fixed shapes matter most where finished rows would leave the batch
            modes.append(("speculative_static", lambda: speculative("static")))
        if compiled:  # a batch-1 step is bound by kernel launches, so compiling matters most there
            modes.append(("speculative_compiled", lambda: speculative("compiled")))
        for mode, fn in modes:
            r = clock.measure(f"decode {mode} batch {batch}", fn, deadline, plan.repeats)
            if r:
                rows.append({"mode": mode, "batch": batch, **r, "tokens_per_s": r["tokens"] / r["seconds"],
                             "ms_per_step": 1000 * r["seconds"] / max(1, r["steps"])})
    return rows


def replay_records(target: Target, plan: Plan, batch: int, block_size: int) -> list:
    g = torch.Generator().manual_seed(1)
    return [synthetic_record(i, plan.replay_length, plan.prompt_len, target.vocab_size, block_size, 0.7, g)
            for i in range(batch)]


def bench_replay(target: Target, drafter: Drafter, plan: Plan, clock: Clock) -> list[dict]:
    records, rows = replay_records(target, plan, max(plan.replay_batches), drafter.block_size), []
    for batch in plan.replay_batches:
        def replay(b: int = batch) -> dict:
            with torch.no_grad():
                scored = score(target, records[:b], block_size=drafter.block_size)
                student_hidden(drafter, scored.to(target.device))
            return {"anchors": int(scored.block_valid.sum()), "tokens": sum(len(r.response_ids) for r in records[:b])}

        r = clock.measure(f"replay batch {batch}", replay, clock.deadline("replay"), plan.repeats)
        if r:
            rows.append({"batch": batch, "length": plan.replay_length, **r,
                         "anchors_per_s": r["anchors"] / r["seconds"], "tokens_per_s": r["tokens"] / r["seconds"]})
    return rows


def bench_learner(target: Target, drafter: Drafter, plan: Plan, clock: Clock) -> list[dict]:
    """The paper's learner settings (optim and loss defaults, one sequence per micro-batch)."""
    spec = validate_spec({"steps": 1000, "models": {"target_path": "random"},
                          "data": {"train_prompts": "-", "eval_prompts": "-"}}, check_paths=False)
    learner = Learner(spec, drafter)
    scored = score(target, replay_records(target, plan, 1, drafter.block_size), block_size=drafter.block_size)

    def step() -> dict:
        metrics = learner.train_step([scored])
        return {"anchors": int(scored.block_valid.sum()), "loss": metrics.loss, "skipped_step": metrics.skipped}

    r = clock.measure("learner step", step, clock.deadline("learner"), plan.repeats)
    if r is None:
        return []
    return [{"micro_batches": 1, "length": plan.replay_length, **r, "anchors_per_s": r["anchors"] / r["seconds"]}]


def print_table(result: dict) -> None:
    table = Table(title=f"bench/gpu.py: {result['drafter']['kind']} drafter, {result['device_name']}, "
                        f"{result['dtype']}, decode attention "
                        f"{result['attn_implementation']}, random weights (τ is meaningless)")
    for column in ("section", "setting", "runs", "median s", "throughput", "ms/step"):
        table.add_column(column, justify="right")
    for r in result["decode"]:
        table.add_row("decode", f"{r['mode']} batch {r['batch']}", str(r["runs"]), f"{r['seconds']:.3f}",
                      f"{r['tokens_per_s']:.1f} tok/s", f"{r['ms_per_step']:.2f}")
    for r in result["replay"]:
        table.add_row("replay", f"batch {r['batch']} x {r['length']} tokens", str(r["runs"]), f"{r['seconds']:.3f}",
                      f"{r['anchors_per_s']:.1f} anchors/s", "-")
    for r in result["learner"]:
        table.add_row("learner", f"1 sequence, {r['anchors']} anchors", str(r["runs"]), f"{r['seconds']:.3f}",
                      f"{r['anchors_per_s']:.1f} anchors/s", f"{1000 * r['seconds']:.1f}")
    console = Console(width=None if sys.stdout.isatty() else 160)
    console.print(table)
    for line in [f"skipped (time budget): {s}" for s in result["skipped"]] + \
                [f"[red]{k} failed: {v}[/red]" for k, v in result["errors"].items()]:
        console.print(line)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="small shapes, runs on a CPU in seconds")
    parser.add_argument("--budget-s", type=float, default=420.0, help="wall-time budget for all sections")
    parser.add_argument("--drafter", choices=list(FAMILIES), default="dflash", help="drafter family (default: dflash)")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="also the compiled decoding step at every batch (default: on a GPU)")
    parser.add_argument("--json", metavar="OUT", help="default: bench/results/gpu.json (gpu_tiny.json with --tiny, "
                                                      "gpu_eagle3.json / gpu_tiny_eagle3.json with --drafter eagle3)")
    args = parser.parse_args(argv)
    plan = TINY_PLAN if args.tiny else FULL_PLAN
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    attn = "flash_attention_2" if device.type == "cuda" and importlib.util.find_spec("flash_attn") else "sdpa"
    clock = Clock(args.budget_s, device)
    target, drafter = build(plan, device, dtype, attn, args.drafter)
    result = {"tiny": args.tiny, "device": device.type,
              "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "dtype": str(dtype).removeprefix("torch."), "attn_implementation": attn,
              "replay_attn_implementation": "sdpa", "target_shapes": plan.shapes,
              "drafter": describe(drafter, args.drafter),
              "prompt_len": plan.prompt_len, "new_tokens": plan.new_tokens, "budget_s": args.budget_s,
              "build_s": time.monotonic() - clock.start,
              "note": "random weights: acceptance (tau) is meaningless, decode rows measure tokens/s and step latency"}
    errors: dict[str, str] = {}
    compiled = device.type == "cuda" if args.compile is None else args.compile
    result["compiled_decoding"] = compiled
    sections = (("decode", lambda *a: bench_decode(*a, compiled=compiled)), ("replay", bench_replay),
                ("learner", bench_learner))
    for section, fn in sections:
        if section == "replay":
            target.model.set_attn_implementation("sdpa")
        try:
            result[section] = fn(target, drafter, plan, clock)
        except Exception as exc:  # a benchmark reports a broken section and still measures the others
            result[section], errors[section] = [], f"{type(exc).__name__}: {exc}"
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    result |= {"skipped": clock.skipped, "errors": errors, "elapsed_s": time.monotonic() - clock.start}
    if device.type == "cuda":
        result["max_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    print_table(result)
    name = ("gpu_tiny" if args.tiny else "gpu") + ("_eagle3" if args.drafter == "eagle3" else "")
    out = Path(args.json) if args.json else RESULTS / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out} in {result['elapsed_s']:.0f} s")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
