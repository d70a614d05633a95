"""The learner's view of the target: only its embedding and LM head, read from the target's files.

Against the full model loaded by transformers: the same tensors (tied and untied, one file and sharded), the same
drafter, student hidden states, loss and step; and a learner that never loads the target nor reads a decoder
tensor.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from opd.distill.replay import student_hidden
from opd.errors import OpdError
from opd.models.dflash import DFlashDrafter
from opd.models.shared_head import load_shared_head
from opd.models.target import load_target
from opd.spec import load_spec
from opd.train.distributed import Group
from opd.train.learner import Learner
from opd.train.local import LocalTrainer
from opd.train.session import LearnerRank, TrainingSession

HEAD_TENSORS = {"model.embed_tokens.weight", "lm_head.weight"}


@pytest.fixture
def tensors_read(monkeypatch) -> list[str]:
    """Every tensor name `load_shared_head` reads from a safetensors file, in order."""
    import opd.models.shared_head as shared_head

    names: list[str] = []
    real_open = shared_head.safe_open

    class Recording:
        def __init__(self, *args, **kwargs) -> None:
            self.inner = real_open(*args, **kwargs)

        def __enter__(self):
            self.inner.__enter__()
            return self

        def __exit__(self, *exc) -> None:
            self.inner.__exit__(*exc)

        def keys(self):
            return self.inner.keys()

        def get_tensor(self, name: str) -> torch.Tensor:
            names.append(name)
            return self.inner.get_tensor(name)

    monkeypatch.setattr(shared_head, "safe_open", Recording)
    return names


def write_target(directory: Path, *, tied: bool, sharded: bool) -> Path:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128,
                         tie_word_embeddings=tied)
    torch.manual_seed(1)
    model = Qwen3ForCausalLM(config)
    if not tied:  # a head that differs from the embedding, so a mix-up cannot pass
        torch.nn.init.normal_(model.lm_head.weight)
    model.save_pretrained(directory, max_shard_size="20KB" if sharded else "1GB")
    return directory


def test_the_head_is_the_full_models_embedding_and_lm_head_and_nothing_else_is_read(micro_assets, tensors_read):
    head = load_shared_head(micro_assets["target"], dtype=torch.float32, layer_ids=[1, 2])
    full = load_target(micro_assets["target"], dtype=torch.float32, layer_ids=[1, 2])
    assert torch.equal(head.embed_tokens.weight, full.embed_tokens.weight)
    assert torch.equal(head.lm_head.weight, full.lm_head.weight)
    assert (head.hidden_size, head.vocab_size, head.num_layers, head.layer_ids) == \
        (full.hidden_size, full.vocab_size, full.num_layers, full.layer_ids)
    assert sorted(tensors_read) == sorted(HEAD_TENSORS)  # no decoder layer's weight was read
    assert not head.embed_tokens.weight.requires_grad and not head.lm_head.weight.requires_grad


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("sharded", [False, True], ids=["one-file", "sharded"])
def test_tied_untied_and_sharded_checkpoints(tmp_path, tensors_read, tied, sharded):
    from transformers import AutoModelForCausalLM

    path = write_target(tmp_path / "target", tied=tied, sharded=sharded)
    assert (path / "model.safetensors.index.json").is_file() == sharded
    if sharded:  # the head tensors sit in other shards than most decoder tensors
        shards = set(json.loads((path / "model.safetensors.index.json").read_text())["weight_map"].values())
        assert len(shards) > 2
    head = load_shared_head(str(path), dtype=torch.float64, layer_ids=[0, 2])
    full = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
    assert head.embed_tokens.weight.dtype == torch.float64
    assert torch.equal(head.embed_tokens.weight, full.get_input_embeddings().weight)
    assert torch.equal(head.lm_head.weight, full.get_output_embeddings().weight)
    assert (head.lm_head.weight is head.embed_tokens.weight) == tied
    assert set(tensors_read) == ({"model.embed_tokens.weight"} if tied else HEAD_TENSORS)


def test_a_checkpoint_without_its_lm_head_is_one_line(tmp_path):
    from safetensors.torch import load_file, save_file

    path = write_target(tmp_path / "target", tied=False, sharded=False)
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["lm_head.weight"]
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(OpdError, match=r"target model .*: no LM head tensor \(expected one of lm_head\.weight, or the same under a "
                                         r"published prefix: model\.language_model\., .*\)$"):
        load_shared_head(str(path), dtype=torch.float32, layer_ids=[1])
    with pytest.raises(OpdError, match=r"layer_ids \[5\]: expected non-empty ids in \[0, 3\)"):
        load_shared_head(str(path), dtype=torch.float32, layer_ids=[5])


def test_a_drafter_on_the_head_trains_exactly_as_on_the_target(micro_spec_file):
    """Student hidden states, loss and the step's new weights are identical, bit for bit."""
    spec = load_spec(micro_spec_file)
    trainer = LocalTrainer(spec, track=False)
    batches = [mb for i in range(2) for mb in trainer.scorer(trainer.rollout.run(i)).micro_batches]
    head = load_shared_head(spec.models.target_path, dtype=torch.float32, layer_ids=spec.models.layer_ids)
    on_head = DFlashDrafter.from_pretrained(spec.models.drafter_path, head)
    on_target = trainer.learner.drafter
    for batch in batches:
        assert torch.equal(student_hidden(on_head, batch), student_hidden(on_target, batch))
    metrics = Learner(spec, on_head).train_step(batches), trainer.learner.train_step(batches)
    assert metrics[0].loss == metrics[1].loss and metrics[0].grad_norm == metrics[1].grad_norm
    for name, value in on_target.state_dict().items():
        assert torch.equal(on_head.state_dict()[name], value), name


def test_the_learner_never_loads_the_target(micro_spec_file, monkeypatch, tensors_read):
    """TrainingSession and every LearnerRank build, resume and step without instantiating the target model."""
    spec = load_spec(micro_spec_file, ["eval.every=0"])
    trainer = LocalTrainer(spec, track=False)  # rollout and scorer: they hold the target
    items = [trainer.scorer(trainer.rollout.run(i)) for i in range(spec.batches_per_step)]

    def refuse(*args, **kwargs):
        raise AssertionError("the learner loaded the whole target")

    from transformers import AutoModelForCausalLM

    monkeypatch.setattr("opd.models.build.load_target", refuse)
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", refuse)
    session = TrainingSession(spec, track=False)
    session.start()
    report = session.train_step(items)
    expected = trainer.session.train_step(items)
    assert report.metrics["loss"] == expected.metrics["loss"]
    rank = LearnerRank(spec, Group())
    rank.start(session.checkpoint())  # a rank > 0 resumes from rank 0's checkpoint, on the head alone
    for name, value in session.drafter.state_dict().items():
        assert torch.equal(rank.learner.drafter.state_dict()[name], value), name
    assert set(tensors_read) == HEAD_TENSORS and len(tensors_read) == 4  # two learners, two tensors each
