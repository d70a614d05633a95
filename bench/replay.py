"""Packed versus naive replay on the tiny target: anchors scored per second, teacher and student together.

    python bench/replay.py [--random-target] [--lengths 256,512] [--batches 1,4] [--naive-anchors 32] [--threads N]

Synthetic speculative-decoding records (random tokens, a ~40-token prompt, anchors a_{m+1} = a_m + r_m + 1 with
r_m in 0..K-1 drawn as K-1 Bernoulli acceptances that stop at the first rejection) are replayed two ways:

- packed: `opd.distill.replay.score` (one packed target forward for every block of the batch, block-sparse attention) +
  `student_hidden` (one drafter forward over all blocks, attention a chunk of blocks at a time);
- naive: the per-anchor reference loop of tests/test_replay.py, one anchor at a time: a plain causal target
  forward on prompt + response[:a+1] + draft[:K-2] (teacher log-probs at the K-1 slots), then a fresh drafter
  cache extended with that forward's features at positions < a and one single-block `draft`. The features are
  reused from the teacher forward (the test runs a second target forward for them), so the baseline is the
  cheaper of the two per-anchor loops.

The naive loop is timed on an evenly spaced subset of the anchors (so prefix lengths are representative) and its
rate is anchors measured / seconds. Everything runs in one process under torch.no_grad, packed and naive
interleaved repeat by repeat after one warm-up; the median of the repeats is reported. Also reported: the largest
difference between the two (float32), a check that both compute the same thing. On a machine that is busy with
other work, pass `--threads 1`: oversubscribed intra-op threads can make every forward many times slower.
Writes bench/results/replay.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from opd.decoding.record import SequenceRecord
from opd.distill.losses import teacher_distribution
from opd.distill.replay import score, student_hidden
from opd.formats.dflash import default_target_layer_ids
from opd.models.build import DTYPES, build_models, initial_drafter
from opd.models.dflash import DFlashConfig, DFlashDrafter
from opd.models.target import Target
from opd.spec import load_spec

RESULTS = Path(__file__).parent / "results" / "replay.json"
# The shipped target's shape (opd/tiny/build.py BuildConfig), used when its config.json is not there yet.
TINY_SHAPE = dict(vocab_size=2048, hidden_size=256, intermediate_size=768, num_hidden_layers=6,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=2048,
                  rope_theta=10000.0, tie_word_embeddings=True)


# ------------------------------------------------------------------------------------------------ models


def random_models(spec, seed: int) -> tuple[Target, DFlashDrafter, str]:
    """A random Qwen3 target shaped like the shipped one (its config.json if present) and a random drafter."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    m = spec.models
    config_file = Path(m.target_path, "config.json")
    if config_file.is_file():
        config, shape = Qwen3Config.from_json_file(str(config_file)), f"random, shape of {config_file}"
    else:
        config, shape = Qwen3Config(**TINY_SHAPE), "random, hidden 256 / 6 layers / vocab 2048"
    config._attn_implementation = m.attn_implementation or "sdpa"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config).to(DTYPES[m.dtype])
    layer_ids = m.layer_ids or default_target_layer_ids(config.num_hidden_layers, m.drafter.num_layers)
    target = Target(model, layer_ids)
    try:
        from opd.data.prompts import load_tokenizer

        tokenizer = load_tokenizer(m.tokenizer)
        if len(tokenizer) > target.vocab_size:
            raise ValueError("tokenizer larger than the random target's vocabulary")
        return target, initial_drafter(spec.models, target, tokenizer, seed), shape
    except Exception:  # no usable tokenizer yet: the mask token is only an id to a random drafter
        config = DFlashConfig.for_target(target.config, num_layers=m.drafter.num_layers,
                                         block_size=m.drafter.block_size, mask_token_id=target.vocab_size - 1,
                                         target_layer_ids=target.layer_ids)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return target, DFlashDrafter(config, target.embed_tokens, target.lm_head), shape


# ------------------------------------------------------------------------------------------------ records


def synthetic_record(key: int, length: int, prompt_len: int, vocab: int, block_size: int, accept_rate: float,
                     g: torch.Generator) -> SequenceRecord:
    """A rollout as speculative decoding records it: the accepted drafts are the committed tokens after the
    anchor, the rest of each draft is random; the bonus token is the next anchor."""
    def tokens(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=g).tolist()

    k1 = block_size - 1
    rec = SequenceRecord(key=key, prompt_ids=tokens(prompt_len), response_ids=tokens(length), finish_reason="length")
    anchor = 0
    while anchor < length:
        accepted = 0
        while accepted < k1 and torch.rand((), generator=g).item() < accept_rate:
            accepted += 1
        accepted = min(accepted, length - 1 - anchor)  # max_new_tokens cuts the last block
        rec.anchors.append(anchor)
        rec.accepted.append(accepted)
        rec.drafts.append(rec.response_ids[anchor + 1 : anchor + 1 + accepted] + tokens(k1 - accepted))
        anchor += accepted + 1
    return rec


# ------------------------------------------------------------------------------------------------ the two ways


def packed(target: Target, drafter: DFlashDrafter, records: list[SequenceRecord], block_size: int):
    """Teacher log-probs [N, K-1, V] and student logits [N, K-1, V] of all N blocks."""
    batch = score(target, records, block_size=block_size, mode="draft_opd")
    return teacher_distribution(target.lm_head(batch.teacher)), drafter.logits(student_hidden(drafter, batch))


def naive(target: Target, drafter: DFlashDrafter, records: list[SequenceRecord], subset: list[tuple[int, int]],
          block_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The per-anchor loop: one causal target forward and one cached single-block draft per (record, block)."""
    out, device = [], target.device
    for i, m in subset:
        rec = records[i]
        committed = rec.prompt_ids + rec.response_ids
        a = len(rec.prompt_ids) + rec.anchors[m]
        t = target(torch.tensor([committed[: a + 1] + rec.drafts[m][: block_size - 2]], device=device))
        teacher = teacher_distribution(t.logits[:, a : a + block_size - 1])[0]
        cache = drafter.new_cache(1)
        drafter.extend_cache(cache, t.features[:, :a], torch.arange(a, device=device)[None],
                             torch.ones(1, a, dtype=torch.bool, device=device))
        _, student = drafter.draft(cache, torch.tensor([committed[a]], device=device), torch.tensor([a], device=device))
        out.append((teacher, student[0]))
    return out


def evenly_spaced(records: list[SequenceRecord], n: int) -> list[tuple[int, int]]:
    every = [(i, m) for i, r in enumerate(records) for m in range(r.num_steps)]
    if n <= 0 or n >= len(every):
        return every
    return [every[round(j * (len(every) - 1) / (n - 1))] for j in range(n)] if n > 1 else every[:1]


def timed(fn) -> tuple[float, object]:
    t0 = time.perf_counter()
    result = fn()
    return time.perf_counter() - t0, result


def bench_length(target, drafter, length: int, batches: list[int], args, block_size: int, g) -> list[dict]:
    vocab = target.vocab_size
    records = [synthetic_record(i, length, args.prompt_len, vocab, block_size, args.accept_rate, g)
               for i in range(max(batches))]
    subset = evenly_spaced(records, args.naive_anchors)
    runs = {b: (lambda b=b: packed(target, drafter, records[:b], block_size)) for b in batches}
    runs["naive"] = lambda: naive(target, drafter, records, subset, block_size)
    times: dict = {k: [] for k in runs}
    results = {k: fn() for k, fn in runs.items()}  # warm-up
    for _ in range(args.repeats):  # interleaved, so every configuration sees the same background load
        for k, fn in runs.items():
            seconds, results[k] = timed(fn)
            times[k].append(seconds)
    naive_s = statistics.median(times["naive"])
    naive_rate = len(subset) / naive_s

    # Same computation? Compare the naive anchors with the largest packed batch (float32, so ~1e-5).
    teacher, student = results[max(batches)]
    offsets = [0]
    for r in records:
        offsets.append(offsets[-1] + r.num_steps)
    diff = max(max((teacher[offsets[i] + m] - t).abs().max().item(), (student[offsets[i] + m] - s).abs().max().item())
               for (i, m), (t, s) in zip(subset, results["naive"]))

    rows = []
    for b in batches:
        anchors = sum(r.num_steps for r in records[:b])
        packed_s = statistics.median(times[b])
        rows.append({
            "length": length, "batch": b, "anchors": anchors,
            "tau": sum(r.tau for r in records[:b]) / b,
            "packed_s": packed_s, "packed_anchors_s": anchors / packed_s,
            "naive_anchors_measured": len(subset), "naive_anchors_total": sum(r.num_steps for r in records),
            "naive_s": naive_s, "naive_ms_per_anchor": 1000 * naive_s / len(subset), "naive_anchors_s": naive_rate,
            "naive_s_scaled_to_batch": anchors / naive_rate,
            "ratio": (anchors / packed_s) / naive_rate,
            "max_abs_diff": diff,
            "packed_s_all": times[b], "naive_s_all": times["naive"],
        })
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/tiny-paper.yaml")
    parser.add_argument("--random-target", action="store_true",
                        help="a random target shaped like the shipped one (for before the asset exists)")
    parser.add_argument("--lengths", default="256,512")
    parser.add_argument("--batches", default="1,4")
    parser.add_argument("--prompt-len", type=int, default=40)
    parser.add_argument("--accept-rate", type=float, default=0.7,
                        help="per-token acceptance; 0.7 with K=8 gives an anchor every ~3.1 tokens")
    parser.add_argument("--naive-anchors", type=int, default=32,
                        help="anchors the naive loop times per length, evenly spaced over the records (0 = all)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0 = torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    spec = load_spec(args.config, check_paths=False)
    if args.random_target:
        target, drafter, target_name = random_models(spec, spec.seed)
    else:
        models = build_models(spec, "random")
        target, drafter, target_name = models.target, models.drafter, spec.models.target_path
    block_size = drafter.block_size
    batches = [int(b) for b in args.batches.split(",")]
    g = torch.Generator().manual_seed(spec.seed)
    rows = []
    with torch.no_grad():
        for length in (int(n) for n in args.lengths.split(",")):
            rows += bench_length(target, drafter, length, batches, args, block_size, g)

    table = Table(title=f"Replay, packed vs naive per-anchor loop: target {target_name}, drafter random, "
                        f"K={block_size}, {torch.get_num_threads()} threads, median of {args.repeats}\n"
                        f"naive: timed on the 'naive anchors' subset, rate = anchors measured / seconds")
    columns = [("length", "length"), ("batch", "batch"), ("anchors", "anchors"), ("tau", "τ"),
               ("packed_s", "packed s"), ("packed_anchors_s", "packed anchors/s"),
               ("naive_anchors", "naive anchors"), ("naive_ms_per_anchor", "naive ms/anchor"),
               ("naive_anchors_s", "naive anchors/s"), ("ratio", "packed/naive"), ("max_abs_diff", "max |Δ|")]
    for _, title in columns:
        table.add_column(title, justify="right")
    for r in rows:
        cells = []
        for key, _ in columns:
            if key == "naive_anchors":
                cells.append(f"{r['naive_anchors_measured']}/{r['naive_anchors_total']}")
            elif key == "max_abs_diff":
                cells.append(f"{r[key]:.1e}")
            elif key == "ratio":
                cells.append(f"{r[key]:.1f}x")
            else:
                cells.append(f"{r[key]:.3f}" if isinstance(r[key], float) else str(r[key]))
        table.add_row(*cells)
    Console(width=None if sys.stdout.isatty() else 160).print(table)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({
        "config": args.config, "target": target_name, "drafter": "random", "block_size": block_size,
        "dtype": str(target.dtype).removeprefix("torch."), "torch_threads": torch.get_num_threads(),
        "prompt_len": args.prompt_len, "accept_rate": args.accept_rate, "repeats": args.repeats,
        "naive": "per-anchor causal target forward + fresh drafter cache + single-block draft; timed on an evenly "
                 "spaced subset of anchors, rate = anchors measured / seconds",
        "rows": rows}, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
