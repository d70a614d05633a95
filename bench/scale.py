"""The replay data path at Qwen3's real vocabulary and hidden sizes, on a CPU: the replaced path beside the new one.

    python bench/scale.py [--hidden 2560 4096] [--lengths 128 256 512] [--old-max-length 128]
                          [--json bench/results/scale.json] [--sft-only] [--attention-only] [--project-only]

The entry point of four measurements, each in a module of its own beside this script, and of the projection they
feed (bench/projection.py):

- bench/scale_data_path.py: per response length, the bytes the scorer ships per sequence and the scorer's and
  learner's peak memory per micro-batch, at each `--hidden`;
- bench/scale_transfer.py: once, the object store's rate for a scored batch and a drafter weight publish + landing;
- bench/scale_attention.py: one sequence's attention in one Qwen3-4B layer at real lengths (`--attention-only`
  runs just that, merged into --json);
- bench/scale_sft.py: the SFT step at Qwen3-4B's vocabulary and width (`--sft-only` runs just that, into
  --sft-json).

Then each role's GPU memory is projected for the shipped configs (`projection.project`). `--data-path-only` runs
the first two and takes the attention from `--attention-json`; `--project-only [--markdown]` re-projects stored
measurements (attention from `--attention-json`); `--budget-only` projects the thinking configs' token budgets.
Writes bench/results/scale.json. No assertions: numbers depend on the machine.
"""

from __future__ import annotations

import argparse
import gc
import json
from pathlib import Path

import torch
from projection import VOCAB, budget_projection, print_budget, print_projection, project  # bench/*.py, beside this
from rich.console import Console
from scale_attention import measure_attention, print_attention
from scale_data_path import build, chunk_bytes_per_slot, measure_length, print_data_path
from scale_sft import measure_sft, print_sft
from scale_transfer import object_store_rates, print_transfer


def parse_args() -> argparse.Namespace:
    """The flags of every measurement and mode (one namespace, stored whole in the result's `args`)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, nargs="+", default=[2560, 4096])
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 256, 512])
    parser.add_argument("--old-max-length", type=int, default=128, help="the replaced path only up to this length")
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--tau", type=float, default=6.0)
    parser.add_argument("--chunk", type=int, default=128, help="loss chunk (slots) measured here")
    parser.add_argument("--transfer-length", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--projection-prompt", type=int, default=512)
    parser.add_argument("--projection-chunk", type=int, default=400, help="optim.loss_chunk_size projected")
    parser.add_argument("--json", default="bench/results/scale.json")
    parser.add_argument("--project-only", action="store_true",
                        help="re-project the measurements in --json (attention from --attention-json if it has none)")
    parser.add_argument("--attention-json", default="bench/results/scale-attention.json")
    parser.add_argument("--markdown", action="store_true", help="print the projection as markdown tables")
    parser.add_argument("--attention-points", nargs="+", default=["2048:6", "2048:1.5", "4096:6", "4096:1.5"],
                        help="attention: response:τ points measured")
    parser.add_argument("--attention-old-max", type=int, default=16_000,
                        help="attention: the dense path only up to this packed length")
    parser.add_argument("--attention-only", action="store_true",
                        help="measure only the attention points; merge them into --json")
    parser.add_argument("--sft-length", type=int, default=2048, help="SFT: the new step's response length")
    parser.add_argument("--sft-old-length", type=int, default=256, help="SFT: the replaced step's response length")
    parser.add_argument("--sft-anchors", type=int, nargs="+", default=[8, 24], help="SFT: anchors measured")
    parser.add_argument("--sft-chunk", type=int, default=64, help="SFT: loss chunk (slots) measured here")
    parser.add_argument("--sft-project-anchors", type=int, default=512, help="SFT: sft.anchors_per_seq projected")
    parser.add_argument("--sft-only", action="store_true",
                        help="measure only the SFT step (the loss chunk's bytes per slot read from --json)")
    parser.add_argument("--sft-json", default="bench/results/scale-sft.json", help="where --sft-only writes")
    parser.add_argument("--data-path-only", action="store_true",
                        help="measure the per-sequence data path and object store only (minutes, not the attention "
                             "and SFT sections' half hour); attention for the projection from --attention-json")
    parser.add_argument("--budget-only", action="store_true",
                        help="project learner and scorer memory at thinking lengths, fixed micro-batches of "
                             "--budget-count sequences against the thinking configs' token budgets (from --json)")
    parser.add_argument("--budget-count", type=int, default=4, help="sequences per fixed micro-batch compared")
    return parser.parse_args()


def read_json(path: str) -> dict:
    """A stored result, or an empty one where the file does not exist yet."""
    stored = Path(path)
    return json.loads(stored.read_text()) if stored.exists() else {}


def write_json(path: str, result: dict) -> None:
    """Write a result, creating its folder (bench/results/ on a fresh checkout)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result, indent=1, default=str))


def stored_inputs(args: argparse.Namespace) -> tuple[dict, dict[int, list[dict]], list[dict]]:
    """--json's result, its measurements keyed by hidden size, and its attention rows (--attention-json's where it
    has none): what the projection modes re-project without measuring."""
    result = json.loads(Path(args.json).read_text())
    measured = {int(h): rows for h, rows in result["measured"].items()}
    attention = result.get("attention") or json.loads(Path(args.attention_json).read_text())["attention"]
    return result, measured, attention


def attention_only(args: argparse.Namespace) -> None:
    """Measure `--attention-points` and merge them into --json's attention rows (same response and τ replaced)."""
    torch.set_num_threads(2)
    result = read_json(args.json)
    fresh = measure_attention(args)
    keep = [r for r in result.get("attention", []) if (r["response"], r["tau"]) not in
            {(f["response"], f["tau"]) for f in fresh}]
    result["attention"] = keep + fresh
    print_attention(result["attention"])
    write_json(args.json, result)


def sft_only(args: argparse.Namespace) -> None:
    """Measure only the SFT step, the loss chunk's bytes per slot read from --json (a default where it has none)."""
    args.sft_chunk_bytes_per_slot = read_json(args.json).get("chunk_bytes_per_slot", 8 * VOCAB * 4)
    torch.set_num_threads(2)
    sft = measure_sft(args)
    print_sft(sft, args)
    write_json(args.sft_json, {"args": vars(args), **sft})


def budget_only(args: argparse.Namespace) -> None:
    """Project the thinking configs' token budgets from --json's measurements."""
    result, _, attention = stored_inputs(args)
    print_budget(budget_projection(result["chunk_bytes_per_slot"], attention, args.budget_count), args.budget_count)


def project_only(args: argparse.Namespace) -> None:
    """Re-project --json's measurements and write the projection back into it."""
    result, measured, attention = stored_inputs(args)
    result["projected"] = project(measured, result["chunk_bytes_per_slot"], attention)
    print_tables(result, args.markdown)
    write_json(args.json, result)


def measure_data_path(args: argparse.Namespace) -> tuple[dict[int, list[dict]], dict]:
    """The data path at each `--hidden` (every `--lengths` at the first, the first two after: two points fit the
    activations' slope), and the transfers once on the first target, so that no target is built twice."""
    measured: dict[int, list[dict]] = {}
    once: dict = {}
    for i, hidden in enumerate(args.hidden):
        target, drafter = build(hidden)
        lengths = args.lengths if i == 0 else args.lengths[:2]
        measured[hidden] = [measure_length(target, drafter, n, args) for n in lengths]
        Console().print(f"hidden {hidden}: measured {lengths}")
        if i == 0:
            once = object_store_rates(target, args)
        del target, drafter
        gc.collect()
    return measured, once


def print_tables(result: dict, as_markdown: bool = False) -> None:
    """The data path, the transfers and the projection."""
    print_data_path(result["measured"])
    print_transfer(result["once"])
    print_projection(result["projected"], as_markdown)


def measure_all(args: argparse.Namespace) -> None:
    """Every measurement (attention and SFT unless --data-path-only), the projection, one result in --json."""
    torch.set_num_threads(2)
    measured, once = measure_data_path(args)
    result = {"args": vars(args), "measured": measured, "once": once,
              "chunk_bytes_per_slot": chunk_bytes_per_slot(measured[args.hidden[0]], args.chunk)}
    if args.data_path_only:
        result["attention"] = json.loads(Path(args.attention_json).read_text())["attention"]
    else:
        result["attention"] = measure_attention(args)
    result["projected"] = project(measured, result["chunk_bytes_per_slot"], result["attention"])
    print_tables(result, args.markdown)
    if not args.data_path_only:
        args.sft_chunk_bytes_per_slot = result["chunk_bytes_per_slot"]  # in result["args"] too: vars() is live
        result["sft"] = measure_sft(args)
        print_attention(result["attention"])
        print_sft(result["sft"], args)
    write_json(args.json, result)
    Console().print(f"wrote {args.json}")


def main() -> None:
    args = parse_args()
    if args.attention_only:
        attention_only(args)
    elif args.sft_only:
        sft_only(args)
    elif args.budget_only:
        budget_only(args)
    elif args.project_only:
        project_only(args)
    else:
        measure_all(args)


if __name__ == "__main__":
    main()
