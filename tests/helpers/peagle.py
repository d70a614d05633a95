"""A P-EAGLE drafter on a micro target whose head reads the target's rows for its draft ids, so its drafts get
accepted more often than a random one's."""

from __future__ import annotations

import torch

from opd.formats.eagle3 import draft_vocab
from opd.formats.peagle import PEagleSpec
from opd.models.peagle import PEagleDrafter
from opd.models.registry import family
from tests.helpers.decoding import MASK
from tests.helpers.eagle3 import head_reads_target_rows


def trained_like(target, seed: int = 1, block_size: int = 4, draft_vocab_size: int = 6) -> PEagleDrafter:
    """A random P-EAGLE drafter (pard token MASK, a random draft vocabulary of `draft_vocab_size` ids) whose head is
    the target's rows for its draft ids."""
    section = PEagleSpec(block_size=block_size, draft_vocab_size=draft_vocab_size, mask_token_id=MASK)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        drafter = family("peagle").initial(section, target, None)
        counts = torch.rand(target.vocab_size)
    drafter.set_vocab(*draft_vocab(counts, draft_vocab_size))
    head_reads_target_rows(drafter, target)
    return drafter
