"""The compiled decoding step (`SpeculativeDecoder(compiled=...)`, on the static-cache path) writes exactly what
the eager decoder writes, for DFlash 1, DFlash 2 and EAGLE-3, and compiles each forward once per batch shape.

The fast tests compile with torch.compile's "eager" backend: Dynamo captures the same graphs and installs the
same guards as with inductor (what breaks a compiled step: graph breaks, recompiles, in-place cache updates lost
from the graph), in seconds. Inductor itself, whose fused kernels round differently, is checked on the shipped
tiny target with both shipped drafters (`slow`: a CPU compile takes about a minute), and on a GPU (`gpu`).
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo

from opd.decoding.sampling import Sampling
from opd.decoding.speculative import SpeculativeDecoder
from opd.errors import OpdError
from opd.tiny.micro import micro_drafter, micro_target
from tests.helpers.decoding import EOS, MASK, MIXED_PROMPTS, constant_drafter, target  # noqa: F401 (target: a fixture)
from tests.helpers.dflash2 import dflash2_drafter
from tests.helpers.static_cache import KEYS, facts
from tests.helpers.tiny_assets import tiny_target_and_prompts


def decode(decoder: SpeculativeDecoder, prompts: list[list[int]], sampling: Sampling, max_new_tokens: int = 24):
    return decoder.generate(prompts, sampling, max_new_tokens=max_new_tokens, seed=3, keys=KEYS[: len(prompts)])


# make test compiles the greedy step; sampled drafts and EAGLE-3's chain, through the same compiled forwards, under
# make test-all (each compile costs tens of CPU seconds)
@pytest.mark.parametrize("sampling", [Sampling(), pytest.param(Sampling(temperature=0.8, top_k=3, sample_drafts=True),
                                                               marks=pytest.mark.slow)],
                         ids=["greedy", "sampled-drafts"])
def test_compiled_writes_what_eager_writes(target, sampling):
    """DFlash 1, DFlash 2 and a drafter that is often accepted (the constant one has no logits to sample drafts
    from); ragged rows that finish at different steps, batched and one at a time; after the first batch of each
    shape no forward recompiles."""
    torch._dynamo.reset()
    drafters = [micro_drafter(target, seed=1, block_size=4, mask_token_id=MASK), dflash2_drafter(target)]
    for drafter in drafters + ([] if sampling.sample_drafts else [constant_drafter(target, 5)]):
        eager = SpeculativeDecoder(target, drafter, eos_id=EOS)
        compiled = SpeculativeDecoder(target, drafter, eos_id=EOS, static_cache=True, compiled="eager")
        assert facts(decode(compiled, MIXED_PROMPTS, sampling)) == facts(decode(eager, MIXED_PROMPTS, sampling))
        decode(compiled, MIXED_PROMPTS[:1], sampling)  # batch 1's shapes compile here
        with torch._dynamo.config.patch(error_on_recompile=True):
            for prompt in MIXED_PROMPTS[1:3]:
                assert facts(decode(compiled, [prompt], sampling)) == facts(decode(eager, [prompt], sampling))


@pytest.mark.slow
def test_compiled_eagle3_writes_what_eager_writes():
    """EAGLE-3's chain drafts through the same compiled step (its cache carries layer states besides K/V)."""
    from tests.helpers.eagle3 import trained_like

    torch._dynamo.reset()
    target = micro_target(seed=0, vocab_size=8, num_layers=6, layer_ids=[1, 2, 3])
    drafter = trained_like(target)
    eager = SpeculativeDecoder(target, drafter, eos_id=EOS)
    compiled = SpeculativeDecoder(target, drafter, eos_id=EOS, static_cache=True, compiled="eager")
    assert facts(decode(compiled, MIXED_PROMPTS, Sampling())) == facts(decode(eager, MIXED_PROMPTS, Sampling()))
    decode(compiled, MIXED_PROMPTS[:1], Sampling())
    with torch._dynamo.config.patch(error_on_recompile=True):
        for prompt in MIXED_PROMPTS[1:3]:
            assert facts(decode(compiled, [prompt], Sampling())) == facts(decode(eager, [prompt], Sampling()))


def test_compiled_needs_the_static_cache(target):
    drafter = micro_drafter(target, seed=1, block_size=4, mask_token_id=MASK)
    with pytest.raises(OpdError, match="static_cache"):
        SpeculativeDecoder(target, drafter, eos_id=EOS, compiled=True)


def inductor_matches_eager(device: str) -> None:
    """The shipped tiny target with each shipped drafter, greedy, batch 1 and batched: inductor's compiled step
    writes the eager decoder's responses and blocks."""
    from opd.models.registry import load_drafter

    torch._dynamo.reset()
    target, prompts = tiny_target_and_prompts(4)
    target = target.to(device)
    for path in ("opd/assets/tiny/drafter", "opd/assets/tiny/dflash2"):
        drafter = load_drafter(path, target).to(device)
        eos = target.config.eos_token_id
        eager = SpeculativeDecoder(target, drafter, eos_id=eos)
        compiled = SpeculativeDecoder(target, drafter, eos_id=eos, static_cache=True, compiled=True)
        for batch in (prompts[:1], prompts):
            assert facts(decode(compiled, batch, Sampling(), 32)) == facts(decode(eager, batch, Sampling(), 32))


@pytest.mark.slow
def test_inductor_writes_what_eager_writes_on_the_tiny_target():
    inductor_matches_eager("cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_inductor_writes_what_eager_writes_on_a_gpu():
    inductor_matches_eager("cuda")
