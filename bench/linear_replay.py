"""What packed replay of drafted blocks costs on a hybrid target (Gated DeltaNet and full attention), against one
causal forward over the same number of tokens, side by side in one run (CPU, float32, one thread).

The target is `recurrent_rollback.small_qwen35`: Qwen3.5-9B's linear-attention heads (16 key, 32 value, 128 wide)
and layer mix (3 linear, 1 full) at a smaller hidden size. A text of `--text` tokens is replayed with blocks of
`--block` tokens whose acceptance lengths are drawn around `--tau`, so the packed rows hold the text and
(K − 2) tokens per drafted block, as `opd.distill.replay.pack` lays them out. Timed, best of `--repeats`:

- `packed`: the teacher's forward (`Target.hidden_states` on the `PackedRows` layout): linear layers run the text
  in segments, advance each block's state to its anchor and run the blocks from there (opd/models/linear_replay.py);
- `causal`: one plain causal forward over as many tokens as the packed rows (the issue's yardstick, ≤ 2×);
- `text`: one causal forward over the text alone (what the committed layout costs).

    python bench/linear_replay.py [--text 1024] [--block 16] [--tau 5] [--hidden 2048] [--repeats 3]

Writes bench/results/linear_replay.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from recurrent_rollback import small_qwen35  # noqa: E402

from opd.decoding.record import SequenceRecord  # noqa: E402
from opd.distill.replay import packed_inputs  # noqa: E402
from opd.models.linear_replay import SEGMENT  # noqa: E402
from opd.models.target import Target  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "linear_replay.json"


def record(text: int, block: int, tau: float, vocab: int, seed: int = 0) -> SequenceRecord:
    """A record of a `text`-token response whose blocks accept about tau − 1 drafts each."""
    g = torch.Generator().manual_seed(seed)
    response = torch.randint(vocab, (text,), generator=g).tolist()
    rec, anchor = SequenceRecord(0, torch.randint(vocab, (32,), generator=g).tolist(), response), 0
    while anchor < text - 1:
        accepted = min(int(torch.poisson(torch.tensor(tau - 1.0), generator=g)), block - 1, text - 1 - anchor)
        rec.anchors.append(anchor)
        rec.drafts.append(response[anchor + 1 : anchor + 1 + accepted] + [0] * (block - 1 - accepted))
        rec.accepted.append(accepted)
        anchor += accepted + 1
    rec.clip_to_response()
    return rec


def best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--text", type=int, default=1024)
    parser.add_argument("--block", type=int, default=16)
    parser.add_argument("--tau", type=float, default=5.0)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    target = Target(small_qwen35(args.hidden), [1, 2])
    rec = record(args.text, args.block, args.tau, target.vocab_size)
    packed, ids, positions, layout = packed_inputs([rec], args.block, "draft_opd")
    length, text = ids.shape[1], packed[0].prefix_len
    plain = torch.randint(target.vocab_size, (1, length))

    times = {
        "packed": best(lambda: target.hidden_states(ids, attention_mask=layout, position_ids=positions), args.repeats),
        "causal": best(lambda: target.hidden_states(plain), args.repeats),
        "text": best(lambda: target.hidden_states(plain[:, :text]), args.repeats),
    }
    result = {"text_tokens": text, "packed_tokens": length, "blocks": len(rec.anchors), "block": args.block,
              "tau": rec.tau, "hidden": args.hidden, "segment": SEGMENT, "seconds": times,
              "packed_over_causal": times["packed"] / times["causal"],
              "packed_over_text": times["packed"] / times["text"]}
    print(f"{'forward':<10}{'tokens':>8}{'seconds':>10}{'vs causal':>11}")
    for name, tokens in (("packed", length), ("causal", length), ("text", text)):
        print(f"{name:<10}{tokens:>8}{times[name]:>10.2f}{times[name] / times['causal']:>10.2f}x")
    print(f"{len(rec.anchors)} blocks of K={args.block} at τ {rec.tau:.2f} over a {text}-token text (prompt 32)")
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
