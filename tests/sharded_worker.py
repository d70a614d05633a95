"""Everything that runs the target, on the tiny Qwen3 target and drafter: run whole in the test's process and
sharded in `world` gloo processes that tests/test_sharding.py forks (`main(RANK, WORLD, PORT, OUT, MODE)`), whose rank 0 saves
what it got to OUT for tests/test_sharding.py to compare. Every rank runs the same calls (SPMD). MODE `all DIR...`:
`run_all` and the evaluator's `run_eval` on the tiny target, then `run_micro` on each float64 micro target in DIR... (keys `micro0_...`), in the
same processes (one group for all of them); `micro DIR...`:
only the micro targets; `model DIR ATTN`: the forward and packed replay of that model (`run_forward`: the micro
MoE and sink targets)."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, replace
from datetime import timedelta
from pathlib import Path
from typing import Any, cast

import torch

from opd.decoding.record import SequenceRecord
from opd.decoding.sampling import Sampling
from opd.decoding.speculative import SpeculativeDecoder
from opd.distill.replay import CommittedView, score
from opd.models.build import Models
from opd.models.lm_head import teacher_head
from opd.models.packed_attention import PackedRow, PackedRows
from opd.models.registry import load_drafter
from opd.models.sharding import in_collective, join_group, load_sharded_target, own_rank
from opd.models.target import Target
from opd.sources.rebuild import rebuild_records
from opd.spec import load_spec
from opd.tiny.micro import micro_drafter
from opd.train.evaluator import Evaluator
from tests.helpers.decoding import EOS as MICRO_EOS
from tests.helpers.decoding import MASK, PROMPT
from tests.helpers.lossless import sampled_joint

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "opd" / "assets" / "tiny"
EOS = 0
MAX_NEW_TOKENS = 24
LOSSLESS_SAMPLES = 10_000  # of the first three tokens at T=1, for the chi-square test (tests/helpers/lossless.py)


def prompts() -> list[list[int]]:
    """Three held-out prompts of different lengths, as token ids."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(TINY / "target"), local_files_only=True)
    rows = [json.loads(line) for line in (TINY / "prompts" / "heldout.jsonl").read_text().splitlines()[:3]]
    return [tokenizer(row["prompt"])["input_ids"][-24 + 4 * i:] for i, row in enumerate(rows)]


def load(world: int) -> tuple[Target, Any]:
    target = load_sharded_target(str(TINY / "target"), dtype=torch.float32, attn_implementation="sdpa",
                                 layer_ids=[1, 3], device="cpu", world=world)
    return target, load_drafter(TINY / "drafter", target)


def run_all(target: Target, drafter: Any) -> dict[str, Any]:
    """Logits and features (padded batch), greedy and sampled speculative decodes, packed replay (alone and over
    the committed view's keys), the rebuild, and the teacher's LM head over the replayed slots."""
    ids = prompts()
    width = max(map(len, ids))
    batch = torch.tensor([[EOS] * (width - len(p)) + p for p in ids])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ids])
    out = target(batch, attention_mask=mask)
    decoder = SpeculativeDecoder(target, drafter, eos_id=EOS)
    greedy = decoder.generate(ids, Sampling(), max_new_tokens=MAX_NEW_TOKENS)
    sampled = decoder.generate(ids, Sampling(1.0, top_k=20), max_new_tokens=MAX_NEW_TOKENS, seed=5)
    scored = score(target, greedy, block_size=drafter.block_size, mode="draft_opd")
    view = CommittedView.of(target, greedy, drafter.block_size, keep_kv=True)
    over_view = score(target, greedy, block_size=drafter.block_size, mode="draft_opd", view=view)
    texts = [SequenceRecord.from_text(r.key, r.prompt_ids, r.response_ids, EOS) for r in sampled]
    rebuilt = rebuild_records(target, drafter, texts, batch_size=2)
    head, teacher = teacher_head(target), cast(torch.Tensor, scored.teacher)  # full vocabulary: no teacher_topk
    return {"logits": out.logits, "features": out.features, "greedy": _blocks(greedy), "sampled": _blocks(sampled),
            "scored_teacher": scored.teacher, "scored_features": scored.features,
            "view_teacher": over_view.teacher, "rebuilt": _blocks(rebuilt),
            "teacher_logits": head(teacher.reshape(-1, teacher.shape[-1]))}


def run_eval(target: Target, drafter: Any, samples: str) -> dict[str, Any]:
    """The evaluator's rows for the warm drafter as `opd run` takes them: its held-out samples drawn into
    `samples`, τ offline on them, the speedup decoded (rows without their wall-clock rates)."""
    from transformers import AutoTokenizer

    spec = load_spec(ROOT / "configs" / "tiny.yaml", ["eval.num_prompts=3", "eval.max_new_tokens=16",
                                                      "eval.speedup_prompts=2", "eval.samples_path=null"])
    tokenizer = AutoTokenizer.from_pretrained(str(TINY / "target"), local_files_only=True)
    evaluator = Evaluator(spec, Models(target, drafter, tokenizer), rank=own_rank())
    evaluator.draw_samples(samples)
    rows = evaluator.checkpoint(None)
    untimed = [asdict(replace(r, spec_tokens_per_s=None, ar_tokens_per_s=None, speedup=None)) for r in rows]
    return {"eval_rows": untimed, "eval_samples": Path(samples).read_text().count("\n")}


def run_forward(target: Target) -> dict[str, torch.Tensor]:
    """Logits and features of one row, and the final hidden states and features of a packed replay layout over it
    (two blocks of three, one of them reaching past a 4-token window)."""
    ids = (torch.arange(12)[None] * 7) % target.vocab_size
    out = target(ids)
    layout = PackedRows((PackedRow.of(9, [2, 5], 3),), 15)
    packed = torch.cat([ids[:, :9], ids[:, 3:9]], 1)
    positions = torch.tensor([[*range(9), 3, 4, 5, 6, 7, 8]])
    hidden, features = target.hidden_states(packed, attention_mask=layout, position_ids=positions)
    return {"logits": out.logits, "features": out.features, "packed_hidden": hidden, "packed_features": features}


def run_tiny(world: int, samples: str) -> dict[str, Any]:
    """`run_all` and `run_eval` on the tiny target over `world` ranks."""
    target, drafter = load(world)
    return {**run_all(target, drafter), **run_eval(target, drafter, samples)}


def run_micro(target: Target, lossless: bool = True) -> dict[str, Any]:
    """`run_forward`, greedy and sampled speculative decodes with a random micro drafter (mixed prompts, blocks of
    4), and with `lossless`, `LOSSLESS_SAMPLES` sampled decodes of PROMPT's first three tokens at T=1, counted by
    sequence (the test compares the ranks' counts with the target's exact law, so the whole side skips them)."""
    drafter = micro_drafter(target, seed=1, block_size=4, mask_token_id=MASK)
    decoder = SpeculativeDecoder(target, drafter, eos_id=MICRO_EOS)
    prompts = [[1, 2, 3], [4, 5], [1, 1, 1, 1, 2], [3]]
    greedy = decoder.generate(prompts, Sampling(), max_new_tokens=12)
    sampled = decoder.generate(prompts, Sampling(1.0), max_new_tokens=12, seed=3)
    out = {**run_forward(target), "greedy": _blocks(greedy), "sampled": _blocks(sampled)}
    if lossless:
        out["counts"] = sampled_joint(target, drafter, PROMPT, Sampling(1.0), LOSSLESS_SAMPLES, length=3)
    return out


def load_model(path: str, attn_implementation: str, world: int, dtype: torch.dtype = torch.float32) -> Target:
    return load_sharded_target(path, dtype=dtype, attn_implementation=attn_implementation, layer_ids=[0, 2],
                               device="cpu", world=world)


def run_micros(paths: list[str], world: int, lossless: bool = True) -> dict[str, Any]:
    """`run_micro` on each micro target in `paths`, its keys prefixed `micro{i}_`."""
    return {f"micro{i}_{name}": value for i, path in enumerate(paths)
            for name, value in run_micro(load_model(path, "sdpa", world, torch.float64), lossless).items()}


def _blocks(records: list[SequenceRecord]) -> list[tuple[list[int], list[int], list[list[int]], list[int]]]:
    return [(r.response_ids, r.anchors, r.drafts, r.accepted) for r in records]


STALL_S = 2.0  # the collective timeout of `stall`'s group


def stall(target: Target, rank: int, out: Path) -> None:
    """Rank 0 runs a forward that rank 1 never joins, until its collective times out; it saves the line that
    reports it (`in_collective`). Rank 1 stays in the group meanwhile (an exit would close the connection instead
    of stalling it), then leaves."""
    if rank == 0:
        try:
            target.forward(torch.tensor([[1, 2, 3]]))
            line = "no error"
        except RuntimeError as exc:
            line = str(in_collective(exc))
        torch.save({"line": line}, out)
        return
    deadline = time.monotonic() + 3 * STALL_S
    while not out.exists() and time.monotonic() < deadline:
        time.sleep(0.1)


def main(rank: int, world: int, port: int, out: str, mode: list[str]) -> None:
    stalls = mode[:1] == ["stall"]
    join_group(f"127.0.0.1:{port}", rank, world, "cpu", **({"timeout": timedelta(seconds=STALL_S)} if stalls else {}))
    torch.set_num_threads(1)
    if stalls:
        return stall(load_model(mode[1], "sdpa", world), rank, Path(out))
    if mode[:1] == ["model"]:
        result = run_forward(load_model(mode[1], mode[2], world))
    else:
        result = {**(run_tiny(world, f"{out}.samples.jsonl") if mode[:1] == ["all"] else {}),
                  **run_micros(mode[1:], world)}
    if rank == 0:
        torch.save(result, out)

