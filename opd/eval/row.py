"""What one held-out evaluation setting measured: `opd eval` prints it, training logs it, and it crosses the
object store inside a StepReport (so it sits below opd/train and opd/eval/online.py alike)."""

from __future__ import annotations

from dataclasses import dataclass, field

from opd.eval.expected import ExpectedAcceptance


@dataclass
class EvalRow:
    sampling: str
    prompts: int
    tau: float
    tau_token_weighted: float
    survival: list[float]
    first_rejection: list[float]
    spec_tokens_per_s: float | None  # None offline: nothing was decoded
    ar_tokens_per_s: float | None
    speedup: float | None
    greedy_match: float | None  # share of responses identical to autoregressive decoding (greedy only)
    # On the states this setting's decoding visited: the exact expected acceptance under every point-mass setting
    # (opd/eval/expected.py), keyed by setting name; empty when not diagnosed.
    expected: dict[str, ExpectedAcceptance] = field(default_factory=dict)
    tau_ci: float = 0.0  # half-width of the 95% interval of `tau` over the prompts
    offline: bool = False  # τ from blocks rebuilt on stored target samples (opd/eval/offline.py), not decoded
    # τ's ceiling on the same text (opd/eval/ceiling.py): offline, the argmax oracle's; for sampled drafts, full
    # acceptance (q = p); None for point-mass settings decoded without stored samples
    ceiling: float | None = None
