"""How the decoder rolls back a hybrid target's linear-attention layers, measured side by side on a small random
Qwen3.5 with Qwen3.5-9B's linear-attention heads (CPU, float32, one thread): one verification forward of a K-token block, then

- `replay`, what `opd/models/recurrent_rollback.py` does: re-run only each linear layer's recurrent rule over each row's
  kept positions, from the recorded kernel inputs;
- `re-forward`, the alternative of snapshotting the states and re-running the accepted tokens: a second target
  forward over them (timed here as one forward of the block, a lower bound: rows accept different lengths, so it
  would run per group of equal length, or padded, which a recurrent state does not ignore).

Per-position states (the third way) are counted, not timed: their memory at Qwen3.5-9B's shapes is printed.

    python bench/recurrent_rollback.py [--rows 8] [--block 16] [--prompt 256] [--hidden 2048] [--repeats 5]

Writes bench/results/recurrent_rollback.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

from opd.models.layer_kind import layer_kinds

RESULTS = Path(__file__).parent / "results" / "recurrent_rollback.json"


def small_qwen35(hidden: int) -> Qwen3_5ForCausalLM:
    """4 layers (3 Gated DeltaNet, 1 full attention) of Qwen3.5-9B's linear-attention heads (16 key, 32 value,
    128 wide) and MLP ratio, at a smaller hidden size: the state updates are full size, the projections smaller."""
    config = Qwen3_5TextConfig(vocab_size=1024, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=4,
                               num_attention_heads=16, num_key_value_heads=4, head_dim=128, linear_num_key_heads=16,
                               linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
                               attn_implementation="sdpa")
    torch.manual_seed(0)
    return Qwen3_5ForCausalLM(config).eval()


def seconds(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--block", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=2048)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = small_qwen35(args.hidden)
    rollback = layer_kinds(model).rollback(model)
    prompt = torch.randint(0, 1024, (args.rows, args.prompt))
    block = torch.randint(0, 1024, (args.rows, args.block))
    kept = torch.randint(1, args.block + 1, (args.rows,))

    def prefilled():
        cache = rollback.new_cache()
        with rollback.prefill(cache, torch.full((args.rows,), args.prompt), args.prompt):
            model(prompt, cache=cache, use_cache=True)
        return cache

    def verify():
        cache = prefilled()
        t0 = time.perf_counter()
        with rollback.recording():
            model(block, cache=cache, use_cache=True)
        return time.perf_counter() - t0, cache

    forward = min(verify()[0] for _ in range(args.repeats))

    def replay() -> float:
        _, cache = verify()
        t0 = time.perf_counter()
        rollback.keep(cache, kept)
        return time.perf_counter() - t0

    keep = min(replay() for _ in range(args.repeats))
    # Qwen3.5-9B: 32 value heads of 128 x 128 fp32 state, 24 of its 32 layers linear; 32 rows, K = 16
    per_position_gb = 32 * 16 * 24 * 32 * 128 * 128 * 4 / 1e9
    result = {"rows": args.rows, "block": args.block, "prompt": args.prompt, "hidden": args.hidden,
              "verify_forward_s": forward, "replay_keep_s": keep, "re_forward_lower_bound_s": forward,
              "replay_over_forward": keep / forward, "re_forward_over_forward": 1.0,
              "per_position_states_gb_qwen35_9b_32rows_k16": per_position_gb}
    print(f"verify forward {forward * 1e3:.1f} ms; rollback by replaying the recurrent rule {keep * 1e3:.1f} ms "
          f"({keep / forward:.2f}x the forward); by re-running the accepted tokens >= {forward * 1e3:.1f} ms (1x); "
          f"per-position states at Qwen3.5-9B, 32 rows x K 16: {per_position_gb:.1f} GB")
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
