"""MTP heads in vLLM's `speculators` 0.9.0 (installed as the interop extra is): `MTPConverter` extracts a tiny
Qwen3.5 target's own `mtp.*` head and the project reads it as its warm drafter, and the project's head exported in
speculators' layout loads in `MTPDraftModel`, whose own MTP layer gives the project's logits on a fixed chain, for a
Qwen3 target (a fresh head) and a Qwen3.5 target (its own head).

speculators' training forward keeps every chain step at its column's position and lets step k attend to step k's
other columns (its training-time approximation); vLLM runs the chain as this project does (opd/models/mtp.py).
So the chain here is speculators' MTP layer itself, called as vLLM chains it: each step a new causal column at
the next position, fed the layer's own output. Float64; the layers' norms round to float32, as vLLM's do.
"""

from __future__ import annotations

import json

import pytest
import torch

from opd.commands.preflight import check_drafter, check_target
from opd.formats.mtp import MTPSpec
from opd.model_dir import ModelDir
from opd.models.registry import detect, family, load_drafter
from tests.helpers import mtp as helper
from tests.helpers.decoding import drafted_alone
from tests.helpers.speculators import speculators_model

converter = pytest.importorskip("speculators.convert.mtp.converter")
K, TOLERANCE = 4, 1e-6
IDS = torch.tensor([[1, 2, 3, 4, 5, 6, 2, 3, 4]])


def their_chain(model, target, anchor: int, steps: int) -> torch.Tensor:
    """Logits [steps, V] of speculators' `mtp_layers[0]` chained from `anchor` with no cache: columns (h_p, x_{p+1})
    at positions 0..a-1 (h the target's last hidden state after its final norm), then one column per step fed the
    layer's own (final-normed) output and the previous step's argmax, causal throughout; logits = its lm_head."""
    hidden = target(IDS[:, :anchor]).features[0, :, -target.hidden_size:]
    tokens = IDS[0, 1:anchor + 1].tolist()
    out = []
    for _ in range(steps):
        length = len(tokens)
        positions = torch.arange(length)[None]
        causal = torch.full((length, length), torch.finfo(torch.float64).min, dtype=torch.float64).triu(1)
        state = model.mtp_layers[0](hidden_states=hidden[None], token_embeddings=model.embed_tokens(
            torch.tensor([tokens])), attention_mask=causal[None, None], position_ids=positions,
            position_embeddings=model.rotary_emb(hidden[None], positions))[0, -1]
        logits = model.lm_head(state)
        out.append(logits)
        hidden = torch.cat([hidden, state[None]])
        tokens.append(int(logits.argmax()))
    return torch.stack(out)


def our_chain(drafter, target, anchor: int) -> torch.Tensor:
    return drafted_alone(drafter, target(IDS).features, IDS, anchor)[1]


def test_mtp_converter_extracts_the_head_the_project_reads_as_its_warm_drafter(tmp_path):
    directory = helper.target_dir("qwen3_5", tmp_path / "target")
    target = helper.load(directory)
    converter.MTPConverter().convert(str(directory), str(tmp_path / "converted"), base_model=str(directory),
                                     num_speculative_steps=K - 1, validate=False)
    check_drafter(str(tmp_path / "converted"), check_target(ModelDir.read(directory), [target.num_layers - 1]), MTPSpec())
    converted = load_drafter(tmp_path / "converted", target)
    own = family("mtp").initial(MTPSpec(block_size=K), target, None)
    assert converted.form.name == "speculators" and converted.block_size == K
    assert converted.state_dict().keys() == own.state_dict().keys()
    assert all(torch.equal(converted.state_dict()[n], t) for n, t in own.state_dict().items())
    for anchor in (1, 5, 8):
        torch.testing.assert_close(our_chain(converted, target, anchor), our_chain(own, target, anchor))


@pytest.mark.parametrize("name", ["qwen3", "qwen3_5"])
def test_the_speculators_export_gives_the_projects_logits_in_mtp_draft_model(name, tmp_path):
    directory = helper.target_dir(name, tmp_path / "target", head=name != "qwen3")
    target = helper.load(directory)
    drafter = family("mtp").initial(MTPSpec(block_size=K, from_target=name != "qwen3"), target, None)
    helper.sharpen(drafter)
    family("mtp").save_speculators(drafter, tmp_path / "export", str(directory))
    model = speculators_model(tmp_path / "export", torch.float64)
    assert type(model).__name__ == "MTPDraftModel" and model.config.num_speculative_steps == K - 1
    with torch.no_grad():
        for anchor in (1, 5, 8):
            torch.testing.assert_close(our_chain(drafter, target, anchor), their_chain(model, target, anchor, K - 1),
                                       rtol=TOLERANCE, atol=TOLERANCE)


def test_serve_bench_passes_vllms_mtp_method_with_the_exports_draft_count(tmp_path):
    """`opd serve-bench --draft` on the speculators export: vLLM's `mtp` method (which its per-model names such as
    `deepseek_mtp` and `qwen3_next_mtp` resolve to), the head chained for the K-1 tokens speculators' config
    proposes."""
    directory = helper.target_dir("qwen3_5", tmp_path / "target")
    drafter = family("mtp").initial(MTPSpec(block_size=K), helper.load(directory), None)
    family("mtp").save_speculators(drafter, tmp_path / "export", str(directory))
    written = json.loads((tmp_path / "export" / "config.json").read_text())["speculators_config"]
    assert written["algorithm"] == "mtp"
    exported = ModelDir.read(tmp_path / "export")
    assert detect(exported).vllm_config(exported, K) == {
        "method": "mtp", "model": str(tmp_path / "export"),
        "num_speculative_tokens": written["proposal_methods"][0]["speculative_tokens"]}
