"""Each drafter family's tiny configuration for the contract test (tests/test_family_contract.py), keyed by kind,
and a tiny drafter of it drawn as its family draws one (`draw`: the contract's and `opd export`'s tests).

The contract runs over every family the registry holds (`opd.models.registry.FAMILIES`), so a new family is under
it the moment it registers; what the contract cannot guess is how small a drafter of that family can be and what
makes a random one decide anything (drafts a test can see accepted, a chain whose links matter). That is `TINY`,
the one place it is written, and a registered family without an entry fails the contract with what to add here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import pytest
import torch

from opd.models.registry import family
from opd.spec.load import validate_spec
from tests.helpers import dflash2, dspark, xpress
from tests.helpers.decoding import MASK
from tests.helpers.eagle3 import head_reads_target_rows
from tests.helpers.specs import MINIMAL

HERE = "tests/helpers/tiny_families.py"


def _as_drawn(drafter, target) -> None:
    """A random drafter kept as the family draws it."""


@dataclass(frozen=True)
class Tiny:
    """How the contract makes a tiny drafter of one family on the 8-token micro target (6 layers, features of
    layers 1-3, float64): the family's `models.drafter` fields, validated by its own spec section and drawn by
    `family(kind).initial`, then `sharpen(drafter, target)` in place (under the same seeded RNG)."""

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
    "mtp": Tiny({"block_size": 4, "from_target": False}),
    "xpress": Tiny(_DFLASH | xpress.XPRESS, lambda drafter, target: xpress.sharpen(drafter)),
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


@cache
def spec_of(kind: str):
    """The smallest spec whose `models.drafter` is the family's tiny section: validated as a user's would be."""
    drafter = {"kind": kind, **tiny(kind).section}
    return validate_spec({**MINIMAL, "models": {"target_path": "t", "drafter": drafter}}, check_paths=False)


def draw(kind: str, target, seed: int = 1):
    """A random drafter of `kind` as its family draws one under a seeded RNG, fitted to random token counts as
    SFT data would fit it (`fit_to_data`: EAGLE-3's draft vocabulary), then sharpened as its tiny entry says."""
    found = family(kind)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        drafter = found.initial(spec_of(kind).models.drafter, target, None)
        found.fit_to_data(drafter, torch.rand(target.vocab_size))
        tiny(kind).sharpen(drafter, target)
    return drafter
