"""A speculative rollout's record is rebuilt exactly from (prompt, response, drafter).

Micro models in float64 (no argmax ties); the decoder's own records are the reference, block by block.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from opd.decoding.record import SequenceRecord
from opd.decoding.sampling import Sampling
from opd.decoding.speculative import SpeculativeDecoder
from opd.errors import OpdError
from opd.models.dflash import DFlashDrafter
from opd.models.target import load_target
from opd.sources.rebuild import matching_prefix, rebuild_records
from opd.tiny.micro import micro_drafter, micro_target

EOS, MASK = 6, 7
PROMPTS = [[1, 2, 3], [4, 5], [1, 1, 1, 1, 2], [3], [2, 2], [0, 1, 2, 3, 4, 5], [5, 4], [1]]
SAMPLINGS = {"greedy": Sampling(), "t1": Sampling(1.0), "topk_topp": Sampling(0.8, top_k=4, top_p=0.9)}
EOS_TINY = 0
TINY = Path(__file__).resolve().parents[1] / "opd" / "assets" / "tiny"


@pytest.fixture(scope="module")
def target():
    return micro_target(seed=0, vocab_size=8, layer_ids=[0, 2, 3])


def blocks(record) -> list[tuple[int, list[int], int]]:
    return list(zip(record.anchors, record.drafts, record.accepted))


def texts(pairs):
    return [SequenceRecord.from_text(i, prompt, response, EOS) for i, (prompt, response) in enumerate(pairs)]


def decode_and_rebuild(target, drafter, sampling, *, max_new_tokens, seed=0, static_cache=False, batch_size=3,
                       eos_id=EOS, prompts=PROMPTS):
    decoder = SpeculativeDecoder(target, drafter, eos_id=eos_id, static_cache=static_cache)
    decoded = decoder.generate(prompts, sampling, max_new_tokens=max_new_tokens, seed=seed)
    samples = [SequenceRecord.from_text(r.key, r.prompt_ids, r.response_ids, eos_id) for r in decoded]
    rebuilt = rebuild_records(target, drafter, samples, batch_size=batch_size)
    return decoded, rebuilt


def tied_drafter(target):
    """Adversarial: a zero final norm makes every logit 0, so every draft is an exact argmax tie (broken toward
    token 0, which the micro target commits often): acceptance decided by tie-breaking alone."""
    drafter = micro_drafter(target, seed=3, block_size=4, mask_token_id=MASK)
    with torch.no_grad():
        drafter.norm.weight.zero_()
    return drafter


@pytest.mark.parametrize("sampling", SAMPLINGS.values(), ids=SAMPLINGS.keys())
@pytest.mark.parametrize("drafter_seed", [1, 2, "ties"])
@pytest.mark.parametrize("static_cache", [False, True], ids=["growing", "static"])
def test_rebuilt_records_equal_the_decoders(target, sampling, drafter_seed, static_cache):
    drafter = (tied_drafter(target) if drafter_seed == "ties" else
               micro_drafter(target, seed=drafter_seed, block_size=4, mask_token_id=MASK))
    decoded, rebuilt = decode_and_rebuild(target, drafter, sampling, max_new_tokens=20,
                                          seed=3 if drafter_seed == "ties" else drafter_seed,
                                          static_cache=static_cache)
    for dec, reb in zip(decoded, rebuilt):
        assert (reb.response_ids, reb.finish_reason) == (dec.response_ids, dec.finish_reason)
        assert blocks(reb) == blocks(dec)


def test_the_micro_cases_cover_both_endings(target):
    """The equality above is only worth something if the walk meets both endings and both outcomes of a slot.
    Random micro drafters accept 0 or 1 drafts, so long acceptances and final blocks whose accepted drafts ran
    past the response end (the clipped rule) are covered by the warm tiny drafter below."""
    finishes, accepted = set(), set()
    for drafter_seed in (1, 2):
        drafter = micro_drafter(target, seed=drafter_seed, block_size=4, mask_token_id=MASK)
        for sampling in SAMPLINGS.values():
            decoded, _ = decode_and_rebuild(target, drafter, sampling, max_new_tokens=20, seed=drafter_seed)
            for dec in decoded:
                finishes.add(dec.finish_reason)
                accepted.update(dec.accepted)
    assert finishes == {"eos", "length"}
    assert accepted == {0, 1}


def test_matching_prefix_by_hand():
    """Drafts are accepted up to the first mismatch; a draft that runs past the response end counts only the
    response tokens it matches."""
    assert matching_prefix([1, 2, 3], [1, 2, 7]) == 2
    assert matching_prefix([8, 8, 8], [5, 6, 1]) == 0
    assert matching_prefix([6, 4, 4], [6]) == 1 and matching_prefix([6], []) == 0


def test_a_response_of_one_token_and_chunking_do_not_matter(target):
    drafter = micro_drafter(target, seed=1, block_size=4, mask_token_id=MASK)
    samples = texts([([1, 2], [EOS]), ([3], [4, 5, 1, 2, 3, 4, 5, 0, 1]), ([2, 2, 2], [1, 2])])
    one = rebuild_records(target, drafter, samples, batch_size=1)
    many = rebuild_records(target, drafter, samples, batch_size=8)
    assert [blocks(r) for r in one] == [blocks(r) for r in many]
    assert blocks(one[0]) == [] and one[0].finish_reason == "eos" and one[1].finish_reason == "length"


def test_an_empty_prompt_or_response_is_one_error(target):
    drafter = micro_drafter(target, seed=1, block_size=4, mask_token_id=MASK)
    with pytest.raises(OpdError, match="rebuild sample 1: empty response"):
        rebuild_records(target, drafter, texts([([1], [2, 3]), ([1], [])]))
    with pytest.raises(OpdError, match="rebuild sample 0: empty prompt"):
        rebuild_records(target, drafter, texts([([], [2, 3])]))


def _tiny_models():
    config = json.loads((TINY / "drafter" / "config.json").read_text())
    target = load_target(str(TINY / "target"), dtype=torch.float64,
                         layer_ids=config["dflash_config"]["target_layer_ids"])
    drafter = DFlashDrafter.from_pretrained(TINY / "drafter", target).to(torch.float64)
    return target, drafter


def test_rebuild_on_the_shipped_tiny_models():
    from transformers import AutoTokenizer

    target, drafter = _tiny_models()
    tokenizer = AutoTokenizer.from_pretrained(str(TINY / "target"))
    rows = [json.loads(line) for line in (TINY / "prompts" / "heldout.jsonl").read_text().splitlines()[:4]]
    prompts = [tokenizer(row["prompt"])["input_ids"] for row in rows]
    finishes, accepted, unrejected_ends = set(), set(), 0
    for sampling in (Sampling(), Sampling(0.6, top_k=20, top_p=0.95)):
        decoded, rebuilt = decode_and_rebuild(target, drafter, sampling, max_new_tokens=48, eos_id=EOS_TINY,
                                              prompts=prompts, batch_size=4)
        for dec, reb in zip(decoded, rebuilt):
            assert blocks(reb) == blocks(dec)
            finishes.add(dec.finish_reason)
            accepted.update(dec.accepted)
            # the final-block rule: no block counts a draft past the response end (the decoder's verification
            # accepted some there: without the clip this fails)
            assert all(a + r + 1 <= len(dec.response_ids) for a, r in zip(dec.anchors, dec.accepted))
            unrejected_ends += bool(dec.anchors) and dec.ends_unrejected(-1)
    # The warm drafter meets every acceptance length 0 .. K−1, both endings and final blocks that reach the end.
    assert (finishes, accepted) == ({"eos", "length"}, set(range(drafter.block_size)))
    assert unrejected_ends > 0



def test_a_cached_target_view_rebuilds_the_same_records(target):
    """Offline evaluation computes the target's features once and rebuilds any drafter from them."""
    from opd.sources.rebuild import text_features

    drafter = micro_drafter(target, seed=2, block_size=4, mask_token_id=MASK)
    decoded = SpeculativeDecoder(target, drafter, eos_id=EOS).generate(PROMPTS, Sampling(1.0), max_new_tokens=16)
    samples = texts([(r.prompt_ids, r.response_ids) for r in decoded])
    view = text_features(target, samples, batch_size=3)
    assert [v.shape[0] for v in view] == [len(r.prompt_ids) + len(r.response_ids) for r in samples]
    cached = rebuild_records(target, drafter, samples, batch_size=5, features=view)
    assert [blocks(r) for r in cached] == [blocks(r) for r in rebuild_records(target, drafter, samples)]
    assert [blocks(r) for r in cached] == [blocks(r) for r in decoded]
