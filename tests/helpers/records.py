"""Training inputs made up without decoding: a consistent rollout record with random acceptance, and SFT
examples of uneven lengths."""

from __future__ import annotations

import torch

from opd.decoding.record import SequenceRecord
from opd.train.sft import SftExample

EXAMPLES = [SftExample([1, 2, 3], [5, 6, 7, 8, 9, 10, 11, 12]), SftExample([4, 4], [9, 8, 7, 6, 5, 4]),
            SftExample([7], [3, 3, 2, 1, 9, 9, 8, 8, 7, 7, 6])]


def synthetic_record(seed: int, prompt: list[int], length: int, vocab: int = 39, k: int = 5) -> SequenceRecord:
    """A consistent rollout record with random acceptance (0..K-1, full accepts included): replay only needs
    the committed tokens, anchors, drafts and counts, and this controls how uneven they are."""
    gen = torch.Generator().manual_seed(seed)
    response = torch.randint(0, vocab, (length,), generator=gen).tolist()
    anchors, drafts, accepted, a = [], [], [], 0
    while a < length - 1:
        r = min(int(torch.randint(0, k, (1,), generator=gen)), length - 1 - a)
        wrong = [(t + 1) % vocab for t in response[a + 1 + r : a + k]]  # differs from what was committed
        tail = torch.randint(0, vocab, (k - 1 - r - len(wrong),), generator=gen).tolist()
        anchors.append(a), drafts.append(response[a + 1 : a + 1 + r] + wrong + tail), accepted.append(r)
        a += r + 1
    return SequenceRecord(key=seed, prompt_ids=prompt, response_ids=response, anchors=anchors, drafts=drafts,
                          accepted=accepted, finish_reason="length")
