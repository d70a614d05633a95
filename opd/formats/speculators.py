"""vLLM's `speculators` checkpoint layout (speculators 0.9.0): what every family's translation shares, and DFlash's.

`speculators` is the format library of vLLM's own training and serving. Its checkpoints keep the public drafters'
tensor names (DFlash's `layers.*`, `fc`, `hidden_norm`, `norm`; DFlash 2's convolutions and codebooks) but wrap the
config: `speculators_model_type` names the family, the drafter's own Qwen3 fields sit in `transformer_layer_config`
(written as a diff against Qwen3Config's defaults), and `speculators_config` says the algorithm, the tokens it
drafts per step and the verifier. Its layer ids (`aux_hidden_state_layer_ids`) name the residual stream entering
target layer i, one more than z-lab's `target_layer_ids` (the output of layer i), as speculators' own z-lab
converter maps them; it does not record the target's depth, so reading one needs the target at hand.

Reading translates a speculators config.json into the public layout the family's reader takes (z-lab's for DFlash,
SpecForge's for EAGLE-3, whose `layers.0.*` tensors are SpecForge's `midlayer.*`), so every check of that reader
holds; writing goes the other way. Each family's own translation lives in its format module, on the DFlash
backbone's here where it has one. What the layout cannot say (a reduced draft vocabulary,
an anchor slot that drafts, z-lab's logit scalars, causal full-attention layers) is a one-line OpdError naming the
field.
"""

from __future__ import annotations

from typing import Any

from opd.errors import OpdError

MODEL_TYPE = "speculators_model_type"
VERSION = "0.9.0"
DFLASH_ARCHITECTURE = "DFlashDraftModel"  # z-lab's, the public layout's
# what a public DFlash config.json holds beside the drafter's own Qwen3 fields
PUBLIC_ONLY = ("architectures", "block_size", "dflash_config", "num_target_layers", "is_causal", "dtype")


def is_speculators(config: dict[str, Any]) -> bool:
    """Whether a drafter's config.json is in speculators' layout."""
    return MODEL_TYPE in config


def model_type(config: dict[str, Any]) -> str | None:
    """The family speculators' layout names (`speculators_model_type`), None for another layout."""
    value = config.get(MODEL_TYPE)
    return value if isinstance(value, str) else None


def proposed_tokens(hf: dict[str, Any]) -> Any:
    """The tokens a speculators config's first proposal drafts per step (`speculative_tokens`), as written (None
    when absent): the chain's or block's length, which the layout records nowhere else."""
    wrapper = hf.get("speculators_config")
    proposals = wrapper.get("proposal_methods") if isinstance(wrapper, dict) else None
    first = proposals[0] if isinstance(proposals, list) and proposals else None
    return first.get("speculative_tokens") if isinstance(first, dict) else None


def layer_fields(layer: Any) -> dict[str, Any]:
    """`transformer_layer_config` with the defaults of its transformers config class filled in, as speculators
    builds it (it writes only the fields that differ from them)."""
    from transformers import AutoConfig

    if not isinstance(layer, dict):
        raise OpdError(f"config field 'transformer_layer_config' must be an object, got {layer!r}")
    fields = {k: v for k, v in layer.items() if k != "model_type"}
    return AutoConfig.for_model(layer.get("model_type", "qwen3"), **fields).to_dict()


def backbone_public(hf: dict[str, Any], block_size: Any, num_target_layers: int | None,
                    non_causal: bool = False) -> dict[str, Any]:
    """The public DFlash config.json of the DFlash backbone a speculators DFlash-family config describes, with the
    block size the public layout counts (`block_size`: anchor included); `non_causal`: the family's reading of a
    sliding config that leaves `sliding_window_non_causal` out."""
    layer = layer_fields(hf.get("transformer_layer_config"))
    _check_dflash_wrapper(hf, layer["vocab_size"])
    dflash: dict[str, Any] = {"mask_token_id": hf.get("mask_token_id"),
                              "target_layer_ids": [i - 1 for i in hf["aux_hidden_state_layer_ids"]]}
    sliding = "sliding_attention" in (layer.get("layer_types") or [])
    out = {k: v for k, v in layer.items() if k not in PUBLIC_ONLY}
    out |= {"architectures": [DFLASH_ARCHITECTURE], "block_size": block_size, "dflash_config": dflash,
            "use_sliding_window": layer.get("sliding_window") is not None}
    if sliding and hf.get("sliding_window_non_causal", non_causal):
        out["is_causal"] = False  # every layer sees its whole block, as z-lab's top-level flag says
    if num_target_layers is not None:
        out["num_target_layers"] = num_target_layers
    return out


def _check_dflash_wrapper(hf: dict[str, Any], vocab_size: int) -> None:
    """The speculators fields a public DFlash drafter has no counterpart for must hold their public meaning."""
    if hf.get("draft_vocab_size", vocab_size) != vocab_size:
        raise OpdError(f"config field 'draft_vocab_size' is {hf['draft_vocab_size']}, a reduced draft vocabulary "
                       f"(expected the target's {vocab_size}: DFlash drafters here draft the whole vocabulary)")
    ids = hf.get("aux_hidden_state_layer_ids")
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and i >= 1 for i in ids):
        raise OpdError(f"config field 'aux_hidden_state_layer_ids' must list target layer ids >= 1, got {ids!r}")


def speculators_config(algorithm: str, speculative_tokens: int, verifier: str | None,
                       architectures: list[str]) -> dict[str, Any]:
    """speculators' `speculators_config`: greedy proposals of `speculative_tokens` per step, and the verifier
    (`verifier`: its path or hub id, from which speculators reloads the embedding and LM head it does not save)."""
    return {"algorithm": algorithm, "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens,
                                  "accept_tolerance": 0.0, "verifier_accept_k": 1}],
            "verifier": {"name_or_path": verifier, "architectures": architectures}}


def dflash_speculators(public: dict[str, Any], verifier: str | None, verifier_architectures: list[str],
                       kind: str) -> dict[str, Any]:
    """speculators' config.json of kind `kind` for the DFlash backbone of a public DFlash config.json (as
    `DFlashConfig.to_hf_dict` writes it); a family on that backbone adds its own fields."""
    dflash = public.get("dflash_config", {})
    extra = sorted(set(dflash) - {"mask_token_id", "target_layer_ids"})
    if extra:
        raise OpdError(f"config field 'dflash_config.{extra[0]}' has no counterpart in speculators' {kind} layout")
    if public.get("is_causal"):
        raise OpdError("config field 'is_causal' is true (causal full-attention layers), which speculators' "
                       f"{kind} layout cannot say")
    sliding = "sliding_attention" in public.get("layer_types", [])
    layer = {k: v for k, v in public.items() if k not in PUBLIC_ONLY} | {"model_type": "qwen3"}
    block = public["block_size"]
    return {MODEL_TYPE: kind, "speculators_version": VERSION, "architectures": [DFLASH_ARCHITECTURE],
            "transformer_layer_config": layer, "draft_vocab_size": public["vocab_size"], "block_size": block,
            "target_hidden_size": None, "mask_token_id": dflash["mask_token_id"],
            "aux_hidden_state_layer_ids": [i + 1 for i in dflash["target_layer_ids"]],
            "sliding_window_non_causal": sliding and public.get("is_causal") is False,
            "sample_from_anchor": False,
            "speculators_config": speculators_config(kind, block - 1, verifier, verifier_architectures),
            "tie_word_embeddings": False}
