"""How long the rollout caches get: the target KV cache and the drafter's context cache, per verify step.

    python bench/rollout_cache.py [--max-new-tokens 128,256,512] [--prompts 8] [--static]

Decodes one batch of held-out prompts greedily with the shipped tiny target and warm drafter, and reports the
caches' peak length (columns) and peak bytes over the steps, next to the longest row's prompt + response (what a
cache that holds only the text needs) and the tokens emitted (a digest, to check two versions emit the same).
It only observes the decoder from outside (wrapping the two models' calls), so the same script measures an older
checkout with PYTHONPATH pointing at it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time

import torch

from opd.data.prompts import eval_prompts
from opd.decoding.sampling import Sampling
from opd.decoding.speculative import SpeculativeDecoder
from opd.models.build import build_models
from opd.spec import load_spec


def cache_bytes(cache) -> int:
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values)
               if t is not None)


def draft_bytes(cache) -> int:
    return sum(t.numel() * t.element_size() for t in (*cache.keys, *cache.values, cache.positions, cache.valid))


def measure(models, prompts: list[list[int]], max_new_tokens: int, static: bool, eos_id: int) -> dict:
    """Peak lengths and bytes of both caches over one greedy decode of `prompts` as one batch."""
    peak = {"target_len": 0, "target_bytes": 0, "draft_len": 0, "draft_bytes": 0}
    target_forward, draft = models.target.forward, models.drafter.draft

    def spy_target(ids, **kw):
        out = target_forward(ids, **kw)
        peak["target_len"] = max(peak["target_len"], int(out.past_key_values.get_seq_length()))
        peak["target_bytes"] = max(peak["target_bytes"], cache_bytes(out.past_key_values))
        return out

    def spy_draft(cache, anchor_ids, anchor_positions):
        peak["draft_len"] = max(peak["draft_len"], cache.positions.shape[1])
        peak["draft_bytes"] = max(peak["draft_bytes"], draft_bytes(cache))
        return draft(cache, anchor_ids, anchor_positions)

    models.target.forward, models.drafter.draft = spy_target, spy_draft
    try:
        decoder = SpeculativeDecoder(models.target, models.drafter, eos_id=eos_id, static_cache=static)
        t0 = time.perf_counter()
        records = decoder.generate(prompts, Sampling(), max_new_tokens=max_new_tokens)
        seconds = time.perf_counter() - t0
    finally:
        del models.target.forward, models.drafter.draft
    tokens = json.dumps([r.response_ids for r in records]).encode()
    return {"max_new_tokens": max_new_tokens, "static": static, **peak, "seconds": round(seconds, 2),
            "steps": max(r.num_steps for r in records),
            "text_len": max(len(r.prompt_ids) + len(r.response_ids) for r in records),
            "tau": sum(sum(a + 1 for a in r.accepted) for r in records) / sum(r.num_steps for r in records),
            "tokens_sha": hashlib.sha256(tokens).hexdigest()[:12]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/tiny-paper.yaml")
    parser.add_argument("--max-new-tokens", default="128,256,512")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--static", action="store_true", help="also measure rollout.static_cache (experimental)")
    parser.add_argument("--ignore-eos", action="store_true",
                        help="stop only at the length limit (the drafter's mask token, never emitted, stands in "
                             "for eos), so every row reaches max_new_tokens")
    args = parser.parse_args()
    torch.manual_seed(0)
    spec = load_spec(args.config, check_paths=False)
    models = build_models(spec, spec.models.drafter_path)
    prompts = [p.ids for p in eval_prompts(spec.data, models.tokenizer, args.prompts)]
    eos_id = models.drafter.mask_token_id if args.ignore_eos else models.eos_id
    for n in map(int, args.max_new_tokens.split(",")):
        for static in (False, True) if args.static else (False,):
            print(json.dumps(measure(models, prompts, n, static, eos_id)), flush=True)


if __name__ == "__main__":
    main()
