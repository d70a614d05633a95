"""The policy-lag rule: which published draft version a rollout batch may be produced with.

Its own module because the ledger actor and the scorer apply it too, and they must not import the rollout's
models (torch and transformers cost every such actor seconds of start-up)."""

from __future__ import annotations

from opd.spec import ExperimentSpec


def required_version(index: int, spec: ExperimentSpec) -> int:
    """The oldest published version batch `index` may be drafted with: rollout never runs further ahead of the
    learner than `max_policy_lag` allows, so (absent failures) the learner never has to discard a batch.
    Versions are published every `broadcast_every` steps, so the requirement is rounded up to the next of them
    (published by step `step` because the spec keeps max_policy_lag >= broadcast_every - 1)."""
    r = spec.resources
    step = index // spec.batches_per_step
    return max(0, -(-(step - r.max_policy_lag) // r.broadcast_every) * r.broadcast_every)


def claim_version(index: int, spec: ExperimentSpec) -> int:
    """The oldest published version with which rollout may start batch `index`. A speculative rollout drafts it,
    so that is `required_version`. A rebuilt one only samples the target: the scorer applies max_policy_lag when
    it rebuilds (`required_version` again, waiting there if it must), so rollout may run `queue_size` batches
    further ahead, which bounds what waits at the scorer."""
    if not spec.rollout.rebuilt:
        return required_version(index, spec)
    return required_version(max(0, index - spec.resources.queue_size), spec)


def survives_restore(drafted_with: int, restored: int) -> bool:
    """Whether a batch drafted with weight version `drafted_with` may still be trained after the learner restarted
    from a checkpoint whose published weights are version `restored`. Versions up to `restored` are the weights the
    restored learner published too (training is deterministic from the checkpoint), so such a batch is reused: the
    restored learner's steps are no further along, so it is within max_policy_lag wherever it was. A later version
    is the dead learner's, which the restored learner will publish again under the same number with other weights:
    such a batch is dropped and produced again (counted stale), so no step trains on weights that no longer exist."""
    return drafted_with <= restored
