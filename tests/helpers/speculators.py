"""vLLM's `speculators` (0.9.0) as the tests drive it: its model classes imported without its training data
pipeline, a checkpoint loaded as speculators loads it (eager attention), and each family's training forward run on
given blocks with its random choices pinned, giving the logits it computes at each block's drafted slots.

speculators' package `__init__` imports its training data pipeline (openai, datasets, hs_connectors) through
EAGLE-3's data module for one type alias; `make test` installs speculators without those, and the model classes
need none of it, so that module is stood in for. speculators' DFlash families draft a block from its training
forward (`_backbone_forward`, the one every DFlash family there shares) at anchors chosen so its random anchor
pick takes them all; EAGLE-3's chain is its training-time test with the text's own tokens fed to the chain (its
teacher forcing); P-EAGLE's random COD sampling is replaced by the compared blocks; XPress's Jacobi passes are its
consistency rounds. With transformers 5.24,
speculators' EAGLE-3 `from_pretrained` keeps a randomly initialised embedding (it reloads the verifier's only
where it is NaN), so `speculators_model` reloads it, as speculators' DFlash classes do; and its XPress
`from_pretrained` leaves the refiner's non-persistent `causal_tril` uninitialised memory (built in `__init__` on
the meta device, never saved), so `speculators_model` builds it again as `XPressRefinerHead.__init__` does.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path
from unittest import mock

import pytest
import torch

sys.modules.setdefault("speculators.train.data", types.SimpleNamespace(BatchType=dict))  # type: ignore[arg-type]
speculators = pytest.importorskip("speculators", reason="speculators is not installed (pip install .[interop])")
attention = pytest.importorskip("speculators.models.attention")
entrypoints = pytest.importorskip("speculators.convert.entrypoints")
eagle3_core = pytest.importorskip("speculators.models.eagle3.core")
dspark_core = pytest.importorskip("speculators.models.dspark.core")
peagle_core = pytest.importorskip("speculators.models.peagle.core")
xpress_core = pytest.importorskip("speculators.models.xpress.core")

Text = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # ids [1,T], the target's final hidden [1,T,H], features


def speculators_model(directory: str | Path, dtype: torch.dtype = torch.float32):
    """speculators' model class for a checkpoint, run eagerly in `dtype`."""
    model = speculators.SpeculatorModel.from_pretrained(str(directory))  # type: ignore[attr-defined]
    model.config.transformer_layer_config._attn_implementation = "eager"
    model._create_mask_fn = attention.create_float_mask
    if type(model).__name__ == "Eagle3DraftModel":
        model._attn_impl = "eager"
        model._load_verifier_weights(overwrite_embed_tokens=True)
    if type(model).__name__ == "XPressDraftModel":  # its non-persistent mask is loaded as uninitialised memory
        model.refiner_head.causal_tril = torch.tril(torch.ones(model.block_size, model.block_size))
    return model.to(dtype).eval()


def _zeros(text: Text) -> torch.Tensor:
    return torch.zeros(1, text[0].shape[1], dtype=torch.long)


def _following(ids: torch.Tensor) -> torch.Tensor:
    """A column pairs position p with the token after it (EAGLE-3's and P-EAGLE's input ids)."""
    return torch.cat([ids[:, 1:], ids[:, -1:]], dim=1)


def _anchor_mask(text: Text, anchors: list[int]) -> torch.Tensor:
    """Exactly these anchors valid, so speculators' random pick of len(anchors) anchors takes them all."""
    mask = torch.zeros(1, text[0].shape[1])
    mask[0, anchors] = 1
    return mask


def _captured(module, name: str, keep):
    """Patch `module.compute_metrics` (speculators' loss) to hand its arguments to `keep` and return a zero loss."""
    return mock.patch.object(module, name, lambda *a, **k: (keep(*a, **k), (torch.zeros(()), {}))[1])


@torch.no_grad()
def dflash_blocks(model, text: Text, anchors: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden [M,K,H], logits [M,K,V]) of speculators' DFlash or DFlash 2 blocks at `anchors`, the anchor's slot
    included."""
    ids, last, features = text
    hidden, logits, *_ = model._backbone_forward(features, ids, _anchor_mask(text, anchors), last, _zeros(text),
                                                 max_anchors=len(anchors))
    return hidden.view(len(anchors), model.block_size, -1), logits.view(len(anchors), model.block_size, -1)


@torch.no_grad()
def dspark_slots(model, text: Text, anchors: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(Markov-biased logits [M,K-1,V], confidence logits [M,K-1]) of speculators' DSpark blocks at `anchors`, each
    slot given the text's token before it."""
    ids, last, features = text
    seen = {}
    with _captured(dspark_core, "compute_metrics",
                   lambda logits, targets, confidence, *rest, **kw: seen.update(logits=logits, confidence=confidence)):
        model(features, ids, _anchor_mask(text, anchors), last, _zeros(text), max_anchors=len(anchors))
    return seen["logits"].view(len(anchors), model.block_size, -1), seen["confidence"].view(len(anchors), -1)


@torch.no_grad()
def eagle3_chain(model, text: Text, anchors: list[int], steps: int) -> torch.Tensor:
    """Logits [M,steps,V] of speculators' EAGLE-3 chain after each anchor (step s of anchor a: row a-1 of its
    s-th training-time-test step), the text's own tokens fed to the chain."""
    ids, last, features = text
    length, logits = ids.shape[1], []
    with _captured(eagle3_core, "compute_metrics", lambda step, *rest, **kw: logits.append(step)):
        model(features, _following(ids), _zeros(text), loss_mask=torch.ones(1, length),
              position_ids=torch.arange(length)[None], verifier_last_hidden_states=last, ttt_steps=steps)
    rows = torch.tensor(anchors) - 1
    return torch.stack([step[0, rows] for step in logits], dim=1)


@torch.no_grad()
def peagle_slots(model, text: Text, anchors: list[int], block_size: int) -> torch.Tensor:
    """Logits [M,K-1,V] of speculators' P-EAGLE after each anchor: column a-1 (depth 0), then its K-2 mask slots,
    its COD sampling replaced by these blocks."""
    ids, last, features = text
    length, slots = ids.shape[1], block_size - 2
    depth0 = torch.arange(length)  # its depth-0 rows are the columns; depth s >= 1 the mask slots of column a-1
    layout = (torch.cat([depth0, torch.tensor([a - 1 for a in anchors] * slots)]),
              torch.cat([depth0 * 0, torch.arange(1, slots + 1).repeat_interleave(len(anchors))]))
    seen = {}
    with mock.patch.object(peagle_core, "generate_cod_sample_indices", lambda *a, **k: layout), \
            _captured(peagle_core, "compute_metrics", lambda logits, *rest, **kw: seen.update(logits=logits[0])):
        model(features, _following(ids), _zeros(text), loss_mask=torch.ones(1, length),
              verifier_last_hidden_states=last, num_depths=block_size - 1)
    columns = seen["logits"][[a - 1 for a in anchors]][:, None]
    return torch.cat([columns, seen["logits"][length:].view(slots, len(anchors), -1).transpose(0, 1)], dim=1)


@torch.no_grad()
def mtp_chain(model, text: Text, anchors: list[int], steps: int) -> torch.Tensor:
    """Logits [M,steps,V] of speculators' MTP layer chained after each anchor as vLLM chains it: causal columns
    (h_p, x_{p+1}) at positions 0..a-1, then one column per step at the next position, fed the layer's own output
    and the text's token (h: the last target state the drafter reads, the last H of the features; in a spec, the
    target's final hidden state). speculators' training forward keeps every step at its column's position, so its
    layer is called here directly."""
    ids, _, features = text
    width = model.config.transformer_layer_config.hidden_size
    out = []
    for anchor in anchors:
        hidden, rows = features[0, :anchor, -width:], []
        for step in range(steps):
            length = anchor + step
            positions = torch.arange(length)[None]
            causal = torch.full((length, length), torch.finfo(hidden.dtype).min, dtype=hidden.dtype).triu(1)
            state = model.mtp_layers[0](hidden_states=hidden[None], token_embeddings=model.embed_tokens(
                ids[:, 1:length + 1]), attention_mask=causal[None, None], position_ids=positions,
                position_embeddings=model.rotary_emb(hidden[None], positions))[0, -1]
            rows.append(model.lm_head(state))
            hidden = torch.cat([hidden, state[None]])
        out.append(torch.stack(rows))
    return torch.stack(out)


def xpress_rounds(model, text: Text, anchors: list[int], passes: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(the backbone's logits [M,K,V], each Jacobi round's refined logits [M,K,V]) of speculators' XPress blocks
    at `anchors`, slot 0 the anchor's: its consistency rounds start from the backbone's argmax and feed each round
    the previous round's argmax, the recurrence of inference-time Jacobi decoding."""
    ids, last, features = text
    seen = {}
    with _captured(xpress_core, "compute_metrics",
                   lambda tf, rounds, base, *rest, **kw: seen.update(rounds=rounds, base=base)):
        model(features, ids, _anchor_mask(text, anchors), last, _zeros(text), max_anchors=len(anchors),
              consistency_weight=1.0, consistency_passes=passes, base_anchor_weight=1.0)
    shape = (len(anchors), model.block_size, -1)
    return seen["base"].view(shape), [r.view(shape) for r in seen["rounds"]]


def drafted_logits(model, text: Text, anchors: list[int], block_size: int) -> torch.Tensor:
    """Logits [M,K-1,V] at the drafted slots of the blocks at `anchors`, by speculators' class of `model` (its
    draft vocabulary's for the EAGLE-3 families); each slot after the first given the text's token before it."""
    name = type(model).__name__
    if name in ("DFlashDraftModel", "DFlash2DraftModel"):
        return dflash_blocks(model, text, anchors)[1][:, 1:]
    if name == "DSparkDraftModel":
        return dspark_slots(model, text, anchors)[0]
    if name == "Eagle3DraftModel":
        return eagle3_chain(model, text, anchors, block_size - 1)
    if name == "PEagleDraftModel":
        return peagle_slots(model, text, anchors, block_size)
    if name == "MTPDraftModel":
        return mtp_chain(model, text, anchors, block_size - 1)
    if name == "XPressDraftModel":  # the last of its checkpoint's passes: the logits its drafts are the argmax of
        return xpress_rounds(model, text, anchors, model.config.num_jacobi_passes)[1][-1][:, 1:]
    pytest.fail(f"speculators' {name} has no forward here: add it to drafted_logits in {__name__}", pytrace=False)


@pytest.fixture(scope="module", autouse=True)
def quiet():
    """speculators logs every loading and conversion step through loguru."""
    from loguru import logger

    logger.disable("speculators")
    yield
    logger.enable("speculators")
