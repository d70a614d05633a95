"""Operations dispatched per batch-1 verification step: this project's decoder against z-lab's `dflash_generate`.

On the shipped tiny target a step is bound by per-operation overhead, and on a shared CPU wall-clock ratios move by
±20% between runs, so this counts instead: every ATen operation that reaches the dispatcher (a `TorchDispatchMode`),
split by where it was called from (the target's forward, the prefill's included; the drafter's forward; extending
the drafter's context; packing the caches; everything else), divided by the verification steps. The counts do not
depend on the machine's load. A second count, of the operations that compute, takes an operation made of others
(a linear layer, sdpa) by its parts and leaves out the views (a slice, an unsqueeze, a cast or reshape with nothing
to do): on a GPU those launch no kernel, so it is the closer proxy for a launch-bound step.
Both decoders decode the same held-out prompts greedily, one at a time, with both shipped tiny drafters.

    python bench/step_ops.py [--prompts 4] [--max-new-tokens 128] [--out bench/results/step_ops.json]
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from opd.data.prompts import eval_prompts
from opd.decoding.sampling import Sampling
from opd.decoding.speculative import SpeculativeDecoder
from opd.models.build import build_models
from opd.models.dflash2 import DFlash2Drafter
from opd.models.packed_attention import as_shipped
from opd.models.registry import load_drafter
from opd.spec import load_spec

ROOT = Path(__file__).resolve().parents[1]
DRAFTERS = {"DFlash 1": "opd/assets/tiny/drafter", "DFlash 2": "opd/assets/tiny/dflash2"}


class PhaseCounter(TorchDispatchMode):
    """Counts the operations dispatched while it is active, under the innermost phase entered: all of them
    (`counts`), and those that compute (`computing`). An operation that transformers or torch implements from
    others (`aten.linear`, `aten.scaled_dot_product_attention`, which turns a bool mask into an additive one in
    kernels of its own first) counts once in `counts` and by its parts in `computing`; a part counts there unless
    it returns its own input's storage without writing to it (a view, or a reshape or cast with nothing to do),
    which on a GPU launches no kernel."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()
        self.computing: Counter[str] = Counter()
        self.phases = ["other"]
        self.inside = 0  # how deep inside operations made of others this dispatch is

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if not self.inside:
            self.counts[self.phases[-1]] += 1
        if torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd"):
            self.inside += 1
            try:
                with self:
                    out = func.decompose(*args, **kwargs)
            finally:
                self.inside -= 1
            if out is not NotImplemented:
                return out
        out = func(*args, **kwargs)
        if func._schema.is_mutable or not _aliases(out, args):
            self.computing[self.phases[-1]] += 1
        return out

    def tag(self, owner: Any, method: str, phase: str) -> None:
        """Count the operations `owner.method` dispatches under `phase` (the attribute is replaced on the object)."""
        inner: Callable[..., Any] = getattr(owner, method)

        def counted(*args: Any, **kwargs: Any) -> Any:
            with self.phase(phase):
                return inner(*args, **kwargs)

        setattr(owner, method, counted)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self.phases.append(name)
        try:
            yield
        finally:
            self.phases.pop()


def _aliases(out: Any, args: tuple) -> bool:
    """Whether an operation's output shares its first argument's storage."""
    return (isinstance(out, torch.Tensor) and bool(args) and isinstance(args[0], torch.Tensor)
            and out.untyped_storage().data_ptr() == args[0].untyped_storage().data_ptr())


def count(name: str, models: Any, prompts: list[list[int]], max_new_tokens: int
          ) -> dict[str, dict[str, dict[str, float]]]:
    """Per count (all operations, computing ones) and decoder, the operations per verification step by phase, for
    one drafter."""
    import dflash.model as zlab

    target = models.target
    ours = load_drafter(DRAFTERS[name], target)
    zlab_class = zlab.DFlash2DraftModel if isinstance(ours, DFlash2Drafter) else zlab.DFlashDraftModel
    theirs = zlab_class.from_pretrained(DRAFTERS[name], dtype=target.dtype).to(target.device).eval()
    decoder = SpeculativeDecoder(target, ours, eos_id=models.eos_id)
    counter = PhaseCounter()
    counter.tag(target.model, "forward", "target forward")
    counter.tag(decoder, "_draft", "drafter forward")
    counter.tag(ours, "extend_cache", "drafter context")  # the prefill's; each step's is folded into the draft
    counter.tag(ours, "defer_context", "drafter context")
    counter.tag(ours, "commit_context", "drafter context")
    counter.tag(decoder, "_keep_slots", "cache packing")
    counter.tag(theirs, "forward", "drafter forward")  # z-lab projects the new context inside its forward
    counter.tag(theirs, "compute_logits", "drafter forward")
    if isinstance(ours, DFlash2Drafter):
        counter.tag(theirs, "propose", "drafter forward")
    with counter:
        steps = sum(len(decoder.generate([p], Sampling(), max_new_tokens=max_new_tokens)[0].accepted)
                    for p in prompts)
    mine, counter.counts, computing, counter.computing = counter.counts, Counter(), counter.computing, Counter()
    with counter, as_shipped():  # z-lab's decoder as its users run it: transformers' own attention
        for p in prompts:
            zlab.dflash_generate(theirs, target.model, torch.tensor([p], device=target.device), max_new_tokens,
                                 [models.eos_id])
    # Both decoders verify the same blocks (identical drafts, so identical acceptance): the same step count.
    return {kind: {decoder_name: {phase: n / steps for phase, n in sorted(counts.items())}
                   | {"total": sum(counts.values()) / steps}
                   for decoder_name, counts in (("ours", ours_counts), ("z-lab", theirs_counts))}
            for kind, ours_counts, theirs_counts in (("all", mine, counter.counts),
                                                      ("computing", computing, counter.computing))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "step_ops.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    spec = load_spec("configs/tiny.yaml", ["models.device=cpu", "models.dtype=float32"])
    models = build_models(spec)
    prompts = [p.ids for p in eval_prompts(spec.data, models.tokenizer, args.prompts)]
    result = {name: count(name, models, prompts, args.max_new_tokens) for name in DRAFTERS}
    for kind in ("all", "computing"):
        print(f"{kind} operations per step")
        for name, kinds in result.items():
            for decoder_name, phases in kinds[kind].items():
                print(f"{name:9}{decoder_name:7}" + "  ".join(f"{phase} {n:.1f}" for phase, n in phases.items()))
    Path(args.out).write_text(json.dumps({
        "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
        "ops_per_step": {name: kinds["all"] for name, kinds in result.items()},
        "computing_ops_per_step": {name: kinds["computing"] for name, kinds in result.items()}}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
