"""`opd sft`: the DFlash SFT stage — the warm start Draft-OPD begins from, and the matched-compute baseline.

1. The target answers the prompt pool (batched autoregressive decoding); the responses are cached in the run
   directory so a restart does not regenerate them.
2. The drafter learns to predict those responses from random anchors: block [y_a, MASK...] must produce
   y_a+1 .. y_a+K−1, cross-entropy weighted exp(−(k−1)/γ_sft) (DFlash's recipe).

Run again from a warm drafter with `sft.max_flops`, it is "continued SFT" at matched training compute.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from opd.data import Prompt, prompt_key, train_prompts
from opd.decoding.autoregressive import generate_autoregressive
from opd.decoding.sampling import Sampling
from opd.losses import sft_loss
from opd.models.build import Models, build_models
from opd.models.drafter import DFlashDrafter
from opd.models.target import Target
from opd.progress import progress_bar
from opd.spec import ExperimentSpec, OptimSpec
from opd.tracking import Tracker
from opd.train.flops import FlopCounter, drafter_matmul_params, target_matmul_params
from opd.train.learner import build_optimizer


@dataclass
class SftExample:
    prompt_ids: list[int]
    response_ids: list[int]


def response_sampling(spec: ExperimentSpec) -> Sampling:
    """sft.response_temperature when set, else the rollout's sampling (both data engines use this rule)."""
    r, temperature = spec.rollout, spec.sft.response_temperature
    return Sampling.of(r) if temperature is None else Sampling(temperature, 0, 1.0)


def append_responses(prompts: list[Prompt], cache: Path, generate: Callable[[list[Prompt]], list[list[int]]],
                     chunk_size: int, label: str) -> list[SftExample]:
    """Responses for every prompt, appended to `cache` chunk by chunk, so a restart (with either engine) resumes
    after the rows already written; `generate` only runs for prompts still to do."""
    done = [json.loads(line) for line in cache.read_text().splitlines()] if cache.exists() else []
    todo = prompts[len(done):]
    with progress_bar() as bar, cache.open("a") as f:
        task = bar.add_task(label, total=len(prompts), completed=len(done))
        for i in range(0, len(todo), chunk_size):
            chunk = todo[i : i + chunk_size]
            for p, resp in zip(chunk, generate(chunk)):
                row = {"id": p.id, "prompt_ids": p.ids, "response_ids": resp}
                f.write(json.dumps(row) + "\n")
                done.append(row)
            f.flush()
            bar.update(task, completed=len(done))
    return [SftExample(d["prompt_ids"], d["response_ids"]) for d in done]


def generate_responses(spec: ExperimentSpec, models: Models, prompts: list[Prompt], cache: Path,
                       batch_size: int = 32) -> list[SftExample]:
    """The target's responses by batched HF decoding, sampled per prompt id (chunking does not change them)."""
    sampling = response_sampling(spec)

    def generate(chunk: list[Prompt]) -> list[list[int]]:
        return generate_autoregressive(models.target, [p.ids for p in chunk], sampling,
                                       max_new_tokens=spec.sft.response_max_new_tokens, eos_id=models.eos_id,
                                       seed=spec.seed, keys=[prompt_key(p.id) for p in chunk])

    return append_responses(prompts, cache, generate, batch_size, "sft data")


def sft_step_loss(target: Target, drafter: DFlashDrafter, examples: list[SftExample], *, anchors_per_seq: int,
                  gamma: float, max_length: int, generator: torch.Generator) -> tuple[torch.Tensor, int]:
    """SFT loss for a batch and the number of drafted slots it trained on."""
    seqs = [(e.prompt_ids + e.response_ids)[:max_length] for e in examples]
    width, k = max(len(s) for s in seqs), drafter.block_size
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    valid = torch.zeros(len(seqs), width, dtype=torch.bool)
    for b, s in enumerate(seqs):
        ids[b, : len(s)], valid[b, : len(s)] = torch.tensor(s), True
    anchors = [_random_anchors(len(e.prompt_ids), len(s), anchors_per_seq, generator) for e, s in zip(examples, seqs)]
    m = max(1, max(len(a) for a in anchors))
    anchor_pos = torch.zeros(len(seqs), m, dtype=torch.long)
    block_valid = torch.zeros(len(seqs), m, dtype=torch.bool)
    for b, a in enumerate(anchors):
        anchor_pos[b, : len(a)], block_valid[b, : len(a)] = torch.tensor(a, dtype=torch.long), True
    device = target.device
    ids, valid, anchor_pos, block_valid = ids.to(device), valid.to(device), anchor_pos.to(device), block_valid.to(device)
    features = target(ids, attention_mask=valid.long()).features
    offsets = torch.arange(k, device=device)
    label_pos = anchor_pos[..., None] + offsets[1:]  # [B, M, K-1]
    labels = ids.gather(1, label_pos.clamp_max(width - 1).flatten(1)).view_as(label_pos)
    label_ok = valid.gather(1, label_pos.clamp_max(width - 1).flatten(1)).view_as(label_pos) & (label_pos < width)
    block_ids = torch.full((*anchor_pos.shape, k), drafter.mask_token_id, dtype=torch.long, device=device)
    block_ids[..., 0] = ids.gather(1, anchor_pos)
    context = drafter.project_context(features.to(drafter.fc.weight.dtype))
    hidden = drafter.forward_blocks(context, valid, block_ids, anchor_pos)
    logits = drafter.logits(hidden[block_valid][:, 1:])
    mask = label_ok[block_valid]
    return sft_loss(logits, labels[block_valid], gamma=gamma, position_mask=mask), int(mask.sum())


def _random_anchors(prompt_len: int, length: int, count: int, generator: torch.Generator) -> list[int]:
    """Absolute positions a with a and a+1 both response tokens, sampled without replacement, sorted."""
    candidates = length - 1 - prompt_len
    if candidates <= 0:
        return []
    pick = torch.randperm(candidates, generator=generator)[:count].sort().values
    return (pick + prompt_len).tolist()


def run_sft(spec: ExperimentSpec, out_dir: str | None = None) -> int:
    """Generate (or reuse) target responses, train the drafter, save it in DFlash format."""
    models = build_models(spec)
    run_dir = spec.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    examples = generate_responses(spec, models, train_prompts(spec.data, models.tokenizer), run_dir / "sft_data.jsonl")
    tracker = Tracker(spec)
    try:
        flops = train_sft(spec, models, examples, tracker)
    finally:
        tracker.close()
    out = Path(out_dir or run_dir / "drafter")
    models.drafter.save_pretrained(out)
    print(f"SFT drafter saved to {out} ({flops.total:.3g} training FLOPs); MLflow run {tracker.run_id} in "
          f"{spec.tracking_uri}")
    return 0


def train_sft(spec: ExperimentSpec, models: Models, examples: list[SftExample], tracker: Tracker | None = None,
              on_step: Callable[[FlopCounter], None] | None = None) -> FlopCounter:
    """`sft.epochs` over the examples, or until `sft.max_flops` training FLOPs when that is set.

    `on_step` sees the FLOPs spent after every step (`opd reproduce` evaluates at matched-FLOPs marks)."""
    s = spec.sft
    steps_per_epoch = math.ceil(len(examples) / s.batch_size)
    steps = steps_per_epoch * s.epochs
    optim = OptimSpec(lr=s.lr, warmup_ratio=s.warmup_ratio, schedule=s.schedule, batch_size=s.batch_size)
    optimizer, scheduler = build_optimizer(models.drafter, optim, steps)
    generator = torch.Generator().manual_seed(spec.seed)
    flops = FlopCounter()
    target_params, drafter_params = target_matmul_params(models.target.model), drafter_matmul_params(models.drafter)
    models.drafter.train()
    with progress_bar() as bar:
        task = bar.add_task("sft", total=steps)
        for step in range(steps):
            if step % steps_per_epoch == 0:
                order = torch.randperm(len(examples), generator=generator).tolist()
            j = (step % steps_per_epoch) * s.batch_size
            batch = [examples[i] for i in order[j : j + s.batch_size]]
            loss, slots = sft_step_loss(models.target, models.drafter, batch, anchors_per_seq=s.anchors_per_seq,
                                        gamma=s.gamma, max_length=s.max_length, generator=generator)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(models.drafter.parameters(), spec.optim.grad_clip or float("inf"))
            optimizer.step()
            scheduler.step()
            flops.add_target(target_params, sum(len(e.prompt_ids) + len(e.response_ids) for e in batch))
            flops.add_drafter(drafter_params, slots * models.drafter.block_size // (models.drafter.block_size - 1),
                              train=True)
            bar.update(task, completed=step + 1, description=f"sft loss {loss.item():.3f}")
            if tracker:
                tracker.log({"sft_loss": loss.item(), "lr": scheduler.get_last_lr()[0], "flops_total": flops.total},
                            step + 1)
            if on_step:
                on_step(flops)
            if s.max_flops is not None and flops.total >= s.max_flops:
                break
    models.drafter.eval()
    return flops
