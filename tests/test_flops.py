"""FLOP accounting against hand counts (opd/models/flops.py's convention): every token each model processes.

The micro target (hidden 32, MLP 64, 4 heads of 8, 2 KV heads, 4 layers; LM head vocabulary x 32) and the micro spec's
drafter (1 layer, block 4, features of 2 target layers) are small enough to count their weights by hand; the
record below is small enough to count its packed tokens by hand."""

from __future__ import annotations

import pytest

from opd.decoding.record import SequenceRecord
from opd.models.build import build_models
from opd.models.flops import DrafterParams, TargetParams, decode_flops
from opd.spec import load_spec
from opd.tiny.micro import micro_target
from opd.train.learner import Learner
from opd.train.messages import AnchorBatch
from opd.train.scorer import Scorer
from opd.train.sft import SftExample, train_sft
from tests.helpers.dspark import dspark_drafter

H, MLP, Q, KV, K = 32, 64, 32, 16, 4  # hidden, intermediate, q width, k/v width, block
LAYER = H * Q + 2 * H * KV + Q * H + 3 * H * MLP + 2 * 8 + 2 * H  # q k v o, mlp, q/k norms, two layer norms
TARGET_BODY = 4 * LAYER + H  # four layers and the final norm
CONTEXT = 2 * H * H + H + 2 * H * KV  # fc over two target layers' features and its norm, the layer's k and v
BLOCK = LAYER + H  # the one drafter layer and the final norm

# prompt 3 tokens, response 10; blocks at response anchors 0, 3 and 5 (K-1 = 3 drafted tokens each)
RECORD = SequenceRecord(key=0, prompt_ids=[1, 2, 3], response_ids=[5, 6, 7, 8, 9, 10, 11, 12, 13, 14],
                        anchors=[0, 3, 5], drafts=[[6, 9, 9], [9, 10, 30], [11, 12, 13]], accepted=[1, 2, 3])
PREFIX = 3 + 5 + 1  # the committed text up to the last anchor
PACKED = PREFIX + 3 * (K - 2)  # each block appends its first K-2 drafted tokens (the last predicts nothing scored)
SLOTS = 3 * (K - 1)


@pytest.fixture
def models(micro_spec_file):
    spec = load_spec(micro_spec_file, ["optim.micro_batch_size=1", "optim.batch_size=2", "rollout.batch_size=1"])
    return spec, build_models(spec)


def head(m) -> int:
    """The LM head's weights: vocabulary x hidden (the micro tokenizer's vocabulary)."""
    return m.target.vocab_size * H


def test_parameter_split_matches_the_hand_count(models):
    _, m = models
    assert TargetParams.of(m.target.model) == TargetParams(body=TARGET_BODY, head=head(m))
    assert DrafterParams.of(m.drafter) == DrafterParams(context=CONTEXT, block=BLOCK, head=head(m), block_size=K,
                                                        block_tokens=K)


def test_replay_counts_the_packed_blocks_and_the_teachers_head(models):
    spec, m = models
    scorer = Scorer(spec, m.target)
    batch = AnchorBatch(0, 0, [RECORD, RECORD], flops=None)
    micro = scorer(batch).micro_batches
    assert scorer.replay_flops(batch.records, micro) == 2 * 2.0 * (TARGET_BODY * PACKED + head(m) * SLOTS)
    assert scorer(batch).scorer_flops == 2 * 2.0 * (TARGET_BODY * PACKED + head(m) * SLOTS)
    # The old count: the prefix only, through body and head: 9 of the 15 tokens the target actually ran.
    assert sum(int(mb.context_valid.shape[0] * mb.features.shape[1]) for mb in micro) == 2 * PREFIX


def test_the_learner_counts_context_blocks_and_the_loss_slots(models):
    spec, m = models
    learner = Learner(spec, m.drafter)
    micro = Scorer(spec, m.target)(AnchorBatch(0, 0, [RECORD], flops=None)).micro_batches
    learner.train_step(micro)
    trainable = CONTEXT * PREFIX + BLOCK * 3 * K
    assert learner.flops.drafter_train == 6.0 * trainable + 4.0 * head(m) * SLOTS  # the frozen head: no weight grad


def test_sft_counts_the_decoder_without_head_and_every_anchor(models):
    spec, m = models
    spec.sft.anchors_per_seq, spec.sft.batch_size, spec.sft.epochs = 100, 1, 1  # every anchor: a = 3..9
    flops = train_sft(spec, m, [SftExample([1, 2, 3], [5, 6, 7, 8, 9, 10, 11, 12])])
    # 11 tokens, 7 blocks; slots a+k must be a real token (< 11): anchors 3..7 keep 3, anchor 8 keeps 2, 9 keeps 1
    tokens, blocks, slots = 11, 7, 5 * 3 + 2 + 1
    assert flops.target_forward == 2.0 * TARGET_BODY * tokens  # features only: no LM head
    trainable = CONTEXT * tokens + BLOCK * blocks * K
    assert flops.drafter_train == 6.0 * trainable + 4.0 * head(m) * slots and flops.drafter_forward == 0


def test_decoding_counts_k_verified_tokens_whatever_the_layers_run():
    """A DSpark block runs K-1 tokens through its layers but the target still verifies K per step (the anchor and
    K-1 drafts) and the head forms K-1 slots; the same drafter counted as if its layers ran K would overcount."""
    target = micro_target(seed=0, vocab_size=16, layer_ids=[0, 2, 3])
    drafter = dspark_drafter(target, block_size=K)
    params = DrafterParams.of(drafter)
    assert (params.block_size, params.block_tokens) == (K, K - 1)
    steps, prompt = 3, len(RECORD.prompt_ids)
    flops = decode_flops([RECORD], TargetParams(body=TARGET_BODY, head=7), params)
    assert flops.target_forward == 2.0 * (TARGET_BODY + 7) * (prompt + K * steps)
    assert flops.drafter_forward == params.forward(context=prompt + K * steps, blocks=steps, slots=(K - 1) * steps)
    assert params.forward(context=0, blocks=1, slots=0) == 2.0 * params.block * (K - 1) + params.token_extra
