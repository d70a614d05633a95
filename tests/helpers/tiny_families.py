"""Each drafter family's tiny configuration for the contract test (tests/test_family_contract.py), keyed by kind.

The contract runs over every family the registry holds (`opd.models.registry.FAMILIES`), so a new family is under
it the moment it registers; what the contract cannot guess is how small a drafter of that family can be and what
makes a random one decide anything (drafts a test can see accepted, a chain whose links matter). That is `TINY`,
the one place it is written, and a registered family without an entry fails the contract with what to add here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from tests.helpers import dflash2, dspark
from tests.helpers.decoding import MASK
from tests.helpers.eagle3 import head_reads_target_rows

HERE = "tests/helpers/tiny_families.py"


def _as_drawn(drafter, target) -> None:
    """A random drafter kept as the family draws it."""


@dataclass(frozen=True)
class Tiny:
    """How the contract makes a tiny drafter of one family on the 8-token micro target (6 layers, features of
    layers 1-3, float64): the family's `models.drafter` fields, validated by its own spec section and drawn by
    `family(kind).random`, then `sharpen(drafter, target)` in place (under the same seeded RNG)."""

    section: dict[str, Any]
    sharpen: Callable[[Any, Any], None] = field(default=_as_drawn)


_DFLASH = {"num_layers": 1, "block_size": 4, "mask_token_id": MASK}
_EAGLE3 = {"block_size": 4, "draft_vocab_size": 6}  # 6 of the 8 ids: the draft vocabulary's mapping is exercised

TINY: dict[str, Tiny] = {
    "dflash": Tiny(_DFLASH),
    "dflash2": Tiny(_DFLASH | dflash2.DFLASH2, lambda drafter, target: dflash2.sharpen(drafter)),
    "dspark": Tiny(_DFLASH | {"markov_rank": 4}, lambda drafter, target: dspark.sharpen(drafter)),
    "eagle3": Tiny(_EAGLE3, head_reads_target_rows),
    "peagle": Tiny(_EAGLE3 | {"mask_token_id": MASK}, head_reads_target_rows),
}


def tiny(kind: str) -> Tiny:
    """The tiny configuration of `kind`; a registered family without one fails the calling test, saying what to
    add and where."""
    if kind not in TINY:
        pytest.fail(f"drafter family {kind!r} is registered (opd.models.registry.FAMILIES) but has no tiny "
                    f"configuration for the contract test: add TINY[{kind!r}] = Tiny(section={{...}}) in {HERE}, "
                    "with the smallest models.drafter fields its section accepts on the 8-token micro target (and a "
                    "`sharpen` if a random drafter of it gets no drafts accepted)", pytrace=False)
    return TINY[kind]
