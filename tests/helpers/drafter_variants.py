"""The DFlash variants z-lab's DFlashDraftModel runs, as config.json changes on a two-layer drafter."""

from __future__ import annotations

SLIDING, FULL = "sliding_attention", "full_attention"
BLOCK = 4
# Config changes on a two-layer drafter, each a variant z-lab's DFlashDraftModel runs. Windows are short so they
# cut into the micro contexts (and, at 2 < K, into the block itself).
VARIANTS = {
    "sliding-causal": {"layer_types": [SLIDING, FULL], "use_sliding_window": True, "sliding_window": 3},
    "sliding-bidirectional": {"layer_types": [SLIDING, SLIDING], "use_sliding_window": True, "sliding_window": 2,
                              "is_causal": False},
    "causal": {"is_causal": True},
    "scaled": {"input_embedding_scale": 3.0, "dflash_config": {"output_multiplier": 0.7,
                                                               "final_logit_softcapping": 0.5}},
    "dflash2-shaped": {"layer_types": [SLIDING, SLIDING], "use_sliding_window": True, "sliding_window": 5,
                       "is_causal": False,
                       "dflash_config": {"output_multiplier": 0.196, "final_logit_softcapping": 20.0,
                                         "block_size": BLOCK}},
}


def with_change(hf: dict, change: dict) -> dict:
    """`hf` with `change` applied (a `dflash_config` change merges into it)."""
    out = {**hf, **{k: v for k, v in change.items() if k != "dflash_config"}}
    out["dflash_config"] = {**hf["dflash_config"], **change.get("dflash_config", {})}
    if "block_size" in out["dflash_config"]:
        out.pop("block_size", None)
    return out
