"""What the static-cache and compiled decode paths are compared on: the per-sequence keys of MIXED_PROMPTS and the
facts of a record that must match between two paths."""

from __future__ import annotations

from tests.helpers.decoding import MIXED_PROMPTS

KEYS = list(range(100, 100 + len(MIXED_PROMPTS)))


def facts(records) -> list[tuple]:
    return [(r.response_ids, r.accepted, r.anchors, r.drafts, r.finish_reason) for r in records]
