"""Does a target behave like a real one? Three checks on held-out prompts: loops, confidence, loss.

A target that loops makes speculative decoding look great for the wrong reason (the drafter just copies the
loop), and a target that is never confident gives τ ≈ 1 whatever the drafter does. These numbers go on the
model card and the tests re-measure them on the shipped weights.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

import torch

LOOP_CHUNK, LOOP_REPEATS, CONFIDENT_P = 8, 3, 0.9


@dataclass
class TargetQuality:
    heldout_loss: float
    loop_rate: float
    confident_share: float
    eos_rate: float
    answer_accuracy: float
    vocab_size: int
    max_new_tokens: int
    samples: list[dict] = field(default_factory=list)


def has_loop(tokens: list[int], chunk: int = LOOP_CHUNK, repeats: int = LOOP_REPEATS) -> bool:
    """True when some `chunk`-token window occurs `repeats` or more times."""
    counts = Counter(tuple(tokens[i : i + chunk]) for i in range(len(tokens) - chunk + 1))
    return any(c >= repeats for c in counts.values())


def final_answer(text: str) -> str | None:
    match = re.search(r"The answer is (-?[\d.]+)\.", text)
    return match.group(1) if match else None


@torch.no_grad()
def response_loss(model, tokenizer, problems) -> float:
    """Mean NLL per response token (eos included), each problem scored alone."""
    total, count = 0.0, 0
    for p in problems:
        prompt = tokenizer(p.prompt, add_special_tokens=False)["input_ids"]
        resp = tokenizer(p.response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        ids = torch.tensor([prompt + resp])
        logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
        targets = ids[0, 1:]
        nll = -logp.gather(-1, targets[:, None])[:, 0][len(prompt) - 1 :]
        total, count = total + nll.sum().item(), count + len(resp)
    return total / count


@torch.no_grad()
def greedy_continuations(model, tokenizer, prompts: list[str], max_new_tokens: int, batch_size: int = 32):
    """Greedy outputs (cut at eos) and the target's top-1 probability at each emitted position."""
    tokenizer.padding_side = "left"
    outputs, top1 = [], []
    for i in range(0, len(prompts), batch_size):
        enc = tokenizer(prompts[i : i + batch_size], return_tensors="pt", padding=True, add_special_tokens=False)
        gen = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                             output_scores=True, return_dict_in_generate=True)
        probs = torch.stack([s.float().softmax(-1).amax(-1) for s in gen.scores], 1)  # [B, new]
        new = gen.sequences[:, enc["input_ids"].shape[1] :]
        for row, p in zip(new.tolist(), probs):
            n = row.index(tokenizer.eos_token_id) + 1 if tokenizer.eos_token_id in row else len(row)
            outputs.append(row[:n])
            top1.append(p[:n].tolist())
    return outputs, top1


def measure_quality(model, tokenizer, problems, max_new_tokens: int = 128) -> TargetQuality:
    model.eval()
    outputs, top1 = greedy_continuations(model, tokenizer, [p.prompt for p in problems], max_new_tokens)
    texts = [tokenizer.decode(o, skip_special_tokens=True) for o in outputs]
    probs = [x for row in top1 for x in row]
    correct = [final_answer(t) == final_answer(p.response) for t, p in zip(texts, problems)]
    return TargetQuality(
        heldout_loss=response_loss(model, tokenizer, problems),
        loop_rate=sum(has_loop(o) for o in outputs) / len(outputs),
        confident_share=sum(x > CONFIDENT_P for x in probs) / len(probs),
        eos_rate=sum(tokenizer.eos_token_id in o for o in outputs) / len(outputs),
        answer_accuracy=sum(correct) / len(correct),
        vocab_size=len(tokenizer),
        max_new_tokens=max_new_tokens,
        samples=[{"prompt": p.prompt, "output": t} for p, t in zip(problems[:5], texts[:5])],
    )
