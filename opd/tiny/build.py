"""`opd build-tiny`: build the shipped tiny target (tokenizer, prompt sets, Qwen3 weights, model card) offline.

A tiny target is only useful if it behaves like a real one (`opd/tiny/quality.py`): raw standard-library source
gives a model that loops on every prompt, which makes every τ meaningless. So the corpus is narrow and clean —
procedurally generated grade-school math with worked solutions whose wording varies at random — and the
model is trained until it writes those solutions fluently. The build checkpoints as it goes and resumes.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

from opd.errors import OpdError
from opd.tiny.math_corpus import Problem, generate
from opd.tiny.quality import TargetQuality, measure_quality

SPECIAL_TOKENS = {"eos": "<|endoftext|>", "pad": "<|pad|>", "mask": "<|mask|>"}
# Generator seeds: the training corpus, the rollout prompt pool and the held-out prompts share none.
CORPUS_SEED, TRAIN_PROMPT_SEED, HELDOUT_SEED = 1, 2, 3


@dataclass
class BuildConfig:
    """Everything that determines the shipped target; recorded verbatim on the model card."""

    out_dir: str = "runs/tiny-target"  # a fresh directory: the shipped one (SHIPPED) only with --force
    work_dir: str = "work_tiny"
    seed: int = 0
    corpus_problems: int = 300_000
    train_prompts: int = 4_000
    heldout_prompts: int = 200
    vocab_size: int = 2048
    hidden_size: int = 256
    num_layers: int = 6
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 768
    seq_len: int = 256
    batch_size: int = 16
    steps: int = 1500
    lr: float = 1.5e-3
    warmup_steps: int = 100
    checkpoint_every: int = 100


def build_tokenizer(texts: list[str], vocab_size: int):
    """Byte-level BPE with eos, pad and mask reserved (the drafter needs a mask token in the vocabulary)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS.values()),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=SPECIAL_TOKENS["eos"],
        pad_token=SPECIAL_TOKENS["pad"],
        mask_token=SPECIAL_TOKENS["mask"],
    )


def write_prompts(path: Path, problems: list[Problem]) -> None:
    """Prompt sets are jsonl with stable ids; the reference response is kept for SFT and inspection."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for p in problems:
            f.write(json.dumps({"id": p.id, "prompt": p.prompt, "reference": p.response}) + "\n")


def qwen3_config(cfg: BuildConfig, tokenizer):
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.hidden_size // cfg.num_heads,
        max_position_embeddings=2048,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )


def encode_corpus(tokenizer, problems: list[Problem]) -> tuple[torch.Tensor, torch.Tensor]:
    """One token stream of `prompt response eos` documents, plus the offset where each document starts."""
    ids = tokenizer([p.prompt + p.response for p in problems], add_special_tokens=False)["input_ids"]
    starts, stream, pos = [], [], 0
    for doc in ids:
        starts.append(pos)
        stream.extend(doc)
        stream.append(tokenizer.eos_token_id)
        pos += len(doc) + 1
    return torch.tensor(stream, dtype=torch.int32), torch.tensor(starts, dtype=torch.int64)


def batch_at(step: int, cfg: BuildConfig, stream: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
    """Windows that begin at document starts, chosen by a per-step seed so a resumed build sees the same data."""
    g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
    usable = starts[starts + cfg.seq_len + 1 <= len(stream)]
    pick = usable[torch.randint(len(usable), (cfg.batch_size,), generator=g)]
    rows = [stream[s : s + cfg.seq_len + 1] for s in pick.tolist()]
    return torch.stack(rows).long()


def lr_at(step: int, cfg: BuildConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train(cfg: BuildConfig, model, stream: torch.Tensor, starts: torch.Tensor, work: Path) -> list[float]:
    """AdamW on packed windows; checkpoints model + optimizer + step so an interrupted build resumes."""
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.1)
    ckpt, start, losses = work / "train_state.pt", 0, []
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        start, losses = state["step"], state["losses"]
    model.train()
    columns = [TextColumn("[bold]train tiny target"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
               TextColumn("loss {task.fields[loss]:.3f}"), TimeRemainingColumn()]
    with Progress(*columns) as bar:
        task = bar.add_task("train", total=cfg.steps, completed=start, loss=float("nan"))
        for step in range(start, cfg.steps):
            for group in opt.param_groups:
                group["lr"] = lr_at(step, cfg)
            batch = batch_at(step, cfg, stream, starts)
            loss = _lm_loss(model, batch)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            losses.append(loss.item())
            bar.update(task, completed=step + 1, loss=sum(losses[-20:]) / len(losses[-20:]))
            if (step + 1) % cfg.checkpoint_every == 0 or step + 1 == cfg.steps:
                tmp = ckpt.with_suffix(".tmp")
                torch.save({"model": model.state_dict(), "optim": opt.state_dict(), "step": step + 1,
                            "losses": losses}, tmp)
                tmp.replace(ckpt)
    model.eval()
    return losses


def _lm_loss(model, batch: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=batch[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


CHECK_PROMPTS = 32  # the card also records quality on this many held-out prompts, which the tests re-measure


def write_card(out: Path, cfg: BuildConfig, quality: TargetQuality, check: TargetQuality, n_params: int,
               tokens_seen: int, build_seconds: float, command: str) -> None:
    """The model card is both documentation and the contract the tests check the shipped weights against."""
    card = {"command": command, "build": asdict(cfg), "params": n_params, "tokens_seen": tokens_seen,
            "build_seconds": round(build_seconds), "quality": asdict(quality),
            f"check_{CHECK_PROMPTS}": {k: v for k, v in asdict(check).items() if k != "samples"}}
    (out / "card.json").write_text(json.dumps(card, indent=2) + "\n")
    samples = "\n\n".join(f"**Prompt**\n```\n{s['prompt']}```\n**Greedy continuation**\n```\n{s['output']}\n```"
                          for s in quality.samples[:3])
    (out / "README.md").write_text(f"""# Tiny target (shipped)

A Qwen3-architecture model ({n_params / 1e6:.2f}M parameters, {cfg.num_layers} layers, hidden {cfg.hidden_size},
vocab {quality.vocab_size}) trained from scratch on procedurally generated grade-school math word problems with
worked solutions (`opd/tiny/math_corpus.py`). It exists so that τ measured on a laptop means something.

- Rebuild: `{command}` (seed {cfg.seed}, {cfg.steps} steps of {cfg.batch_size}x{cfg.seq_len} tokens,
  {tokens_seen / 1e6:.1f}M tokens, {build_seconds / 60:.0f} minutes on 2 CPU cores; resumable).
- Data: corpus generator seed {CORPUS_SEED} ({cfg.corpus_problems} problems); rollout prompt pool seed
  {TRAIN_PROMPT_SEED} ({cfg.train_prompts} prompts, `prompts/train.jsonl`); held-out prompts seed {HELDOUT_SEED}
  ({cfg.heldout_prompts} prompts, `prompts/heldout.jsonl`). No seed is shared, and held-out prompts that also
  occur in the corpus are dropped from it.

## Behaviour on held-out prompts (greedy, {quality.max_new_tokens} new tokens)

| metric | value |
|---|---|
| held-out loss (nats/token, response tokens) | {quality.heldout_loss:.4f} |
| loop rate (an 8-token chunk repeated 3+ times) | {quality.loop_rate:.1%} |
| positions with top-1 probability > 0.9 along its own outputs | {quality.confident_share:.1%} |
| continuations ending in eos | {quality.eos_rate:.1%} |
| final answers correct | {quality.answer_accuracy:.1%} |

## Samples

{samples}
""")


def build(cfg: BuildConfig, command: str) -> None:
    from transformers import Qwen3ForCausalLM

    t0 = time.time()
    torch.manual_seed(cfg.seed)
    out, work = Path(cfg.out_dir), Path(cfg.work_dir)
    (out / "target").mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    heldout = generate(HELDOUT_SEED, cfg.heldout_prompts)
    held_prompts = {p.prompt for p in heldout}
    corpus = [p for p in generate(CORPUS_SEED, cfg.corpus_problems) if p.prompt not in held_prompts]
    write_prompts(out / "prompts" / "train.jsonl", generate(TRAIN_PROMPT_SEED, cfg.train_prompts))
    write_prompts(out / "prompts" / "heldout.jsonl", heldout)
    tokenizer = build_tokenizer([p.prompt + p.response for p in corpus[:50_000]], cfg.vocab_size)
    tokenizer.save_pretrained(out / "target")
    stream, starts = encode_corpus(tokenizer, corpus)
    model = Qwen3ForCausalLM(qwen3_config(cfg, tokenizer))
    train(cfg, model, stream, starts, work)
    # Ship bf16 (as Qwen3 does), and measure the card on exactly what ships.
    model.to(torch.bfloat16).save_pretrained(out / "target", max_shard_size="6MB")
    model.to(torch.float32)
    quality = measure_quality(model, tokenizer, heldout)
    check = measure_quality(model, tokenizer, heldout[:CHECK_PROMPTS])
    n_params = sum(p.numel() for p in model.parameters())
    write_card(out / "target", cfg, quality, check, n_params, cfg.steps * cfg.batch_size * cfg.seq_len,
               time.time() - t0, command)


SHIPPED = Path(__file__).resolve().parents[1] / "assets" / "tiny"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="opd build-tiny", description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for name, default in asdict(BuildConfig()).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(default), default=default,
                            help=name.replace("_", " "))
    parser.add_argument("--force", action="store_true",
                        help=f"allow --out-dir to be the shipped tiny target ({SHIPPED}), which the tests use")
    args = vars(parser.parse_args(argv))
    force = args.pop("force")
    cfg = BuildConfig(**args)
    if Path(cfg.out_dir).resolve() == SHIPPED and not force:
        raise OpdError(f"--out-dir: {cfg.out_dir} is the shipped tiny target, which the configs and tests use "
                       "(expected a new directory, or --force to rebuild it in place)")
    build(cfg, " ".join(["opd build-tiny", *(argv or [])]))
    print(f"tiny target written to {Path(cfg.out_dir).resolve()} (target/, prompts/, card)")
    return 0
