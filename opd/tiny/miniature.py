"""A published checkpoint in miniature: its real `config.json` with only the sizes shrunk, written as it is published.

Tests that build targets from transformers' text-only config classes (`Qwen3_5TextConfig`, ...) never meet what a
user's download holds: a multimodal wrapper (`...ForConditionalGeneration`) with the text fields under
`text_config`, the body under `model.language_model.*` beside a vision tower, an MTP head in the same shards,
quantized experts. A miniature keeps all of that and shrinks only hidden size, layers, heads, experts and
vocabulary, so every command can be run on it on a CPU in seconds.

The published configs are JSON fixtures (`bench/fixtures/targets/*.json`, each naming its source in `_source`).
The builder is seeded; nothing is downloaded. The tokenizer is the shipped tiny one with the published chat template
(`bench/fixtures/targets/templates/`, each naming its source) and every chat token it emits, so `data.render: chat`
and the family's switches (`enable_thinking`, `reasoning_effort`) render as the published tokenizer renders them.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from opd.model_dir import WEIGHTS_INDEX

FIXTURES = Path(__file__).resolve().parents[2] / "bench" / "fixtures" / "targets"
TINY_TOKENIZER = Path(__file__).resolve().parents[1] / "assets" / "tiny" / "target"
SHARD_BYTES = 300_000  # small enough that every miniature is split into shards named by an index, as published

# What each size shrinks to. A key found at any level of the config (text, vision, audio) is set, never added.
SIZES: dict[str, int] = {
    "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
    "num_attention_heads": 4, "head_dim": 16, "global_head_dim": 16, "num_heads": 4,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 2, "experts_per_token": 2,
    "n_group": 1, "topk_group": 1, "hidden_size_per_layer_input": 8, "kv_lora_rank": 16, "q_lora_rank": 32,
    "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16, "first_k_dense_replace": 1,
    "depth": 1, "out_hidden_size": 64, "num_position_embeddings": 64, "patch_size": 4, "spatial_merge_size": 2,
    "temporal_patch_size": 2,
}
MIN_LAYERS = 4
VISION_KEYS = ("vision_config", "audio_config")
VISION_LAYERS = 1


@dataclass(frozen=True)
class Miniature:
    """A written miniature: its directory and the facts a spec must be fitted to (its depth, the tokens)."""

    path: Path
    num_layers: int
    vocab_size: int
    mask_token_id: int
    architecture: str
    quantization: str | None


def published_config(name: str) -> dict[str, Any]:
    """The published config.json of fixture `name` (e.g. "qwen3.5-9b"), without its `_source` note."""
    path = FIXTURES / f"{name}.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    config.pop("_source", None)
    return config


def text_section(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's fields: nested under `text_config` in a multimodal config, else the config itself."""
    nested = config.get("text_config")
    return nested if isinstance(nested, dict) else config


def shrunk(config: dict[str, Any], vocab_size: int, special: dict[str, int]) -> dict[str, Any]:
    """`config` with sizes shrunk and every other field as published; token ids are the tiny tokenizer's."""
    out = json.loads(json.dumps(config))
    text = text_section(out)
    _shrink_sizes(out)
    for key in VISION_KEYS:
        if isinstance(out.get(key), dict):
            _shrink_tower(out[key], int(text["hidden_size"]))
    layers = _layer_count(text)
    text["num_hidden_layers"] = layers
    if isinstance(text.get("layer_types"), list):
        text["layer_types"] = text["layer_types"][:layers]
    if "num_key_value_heads" in text:
        text["num_key_value_heads"] = min(int(text["num_key_value_heads"]), 2)
    if "num_kv_shared_layers" in text:
        text["num_kv_shared_layers"] = min(int(text["num_kv_shared_layers"]), max(layers - 2, 0))
    for section in {id(out): out, id(text): text}.values():
        for key in ("vocab_size", "vocab_size_per_layer_input"):
            if key in section:
                section[key] = vocab_size
        for key, token in special.items():
            if key in section:
                section[key] = token
    return out


def _shrink_sizes(section: dict[str, Any]) -> None:
    for key, value in list(section.items()):
        if isinstance(value, dict) and key not in VISION_KEYS and key != "quantization_config":
            _shrink_sizes(value)
        elif key in SIZES and isinstance(value, int) and not isinstance(value, bool):
            section[key] = SIZES[key]


def _shrink_tower(section: dict[str, Any], text_hidden: int) -> None:
    """A vision or audio tower shrinks to one small layer; its output still matches the text width."""
    _shrink_sizes(section)
    for key in ("hidden_size", "intermediate_size"):
        if key in section:
            section[key] = SIZES[key] // 2
    for key in ("num_hidden_layers", "depth"):
        if key in section:
            section[key] = VISION_LAYERS
    if "out_hidden_size" in section:
        section["out_hidden_size"] = text_hidden
    if isinstance(section.get("fullatt_block_indexes"), list):
        section["fullatt_block_indexes"] = []
    if "deepstack_visual_indexes" in section:
        section["deepstack_visual_indexes"] = []


def _layer_count(text: dict[str, Any]) -> int:
    """Enough layers that every published layer type appears at least once (Gemma 4: five sliding to one full)."""
    types = text.get("layer_types")
    if not isinstance(types, list) or not types:
        return MIN_LAYERS
    wanted, seen = set(types), set()
    for i, kind in enumerate(types):
        seen.add(kind)
        if seen == wanted:
            return max(MIN_LAYERS, i + 1)
    return MIN_LAYERS


# -- the tokenizer ------------------------------------------------------------------------------------------------

TEMPLATES = FIXTURES / "templates"
CHAT_TOKEN = re.compile(r"<\|[^<>|\s]*\|>|<\|[^<>|\s]*>|<[^<>|\s]*\|>|</?[a-z_]+>")  # <|im_end|>, <|turn>, <think>


@dataclass(frozen=True)
class ChatStyle:
    """A published checkpoint's chat template (`TEMPLATES/<template>.jinja`, each naming its source) and the
    tokens it ends a turn with and begins a text with."""

    template: str
    end_of_turn: str
    bos: str | None = None


QWEN3 = ChatStyle("qwen3", "<|im_end|>")
QWEN3_5 = ChatStyle("qwen3.5", "<|im_end|>")
GPT_OSS = ChatStyle("gpt-oss", "<|return|>")
CHAT_STYLES = {
    "qwen3-4b": QWEN3, "qwen3-8b": QWEN3, "qwen3-30b-a3b": ChatStyle("qwen3-thinking-2507", "<|im_end|>"),
    "qwen3.5-9b": QWEN3_5, "qwen3.5-122b-a10b": QWEN3_5, "qwen3.5-397b-a17b": QWEN3_5,
    "llama3.1-8b": ChatStyle("llama3.1", "<|eot_id|>", "<|begin_of_text|>"),
    "gemma4-31b": ChatStyle("gemma4", "<turn|>", "<bos>"), "gpt-oss-20b": GPT_OSS, "gpt-oss-120b": GPT_OSS,
}


def chat_style(name: str) -> ChatStyle:
    """The chat style of published fixture `name`."""
    if name not in CHAT_STYLES:
        raise KeyError(f"no chat template for {name!r} (expected one of {', '.join(sorted(CHAT_STYLES))}; add its "
                       f"published template to {TEMPLATES})")
    return CHAT_STYLES[name]


def tokenizer_for(name: str) -> Any:
    """The shipped tiny tokenizer with the published chat template of fixture `name` and every chat token it
    emits (Qwen's think and tool tags as added tokens, the rest special), so a prompt renders as the published
    tokenizer renders it, in the tiny vocabulary."""
    from transformers import AutoTokenizer

    style = chat_style(name)
    template = (TEMPLATES / f"{style.template}.jinja").read_text(encoding="utf-8")
    tokens = sorted(set(CHAT_TOKEN.findall(template)) | {style.end_of_turn} | ({style.bos} if style.bos else set()))
    tokenizer = AutoTokenizer.from_pretrained(TINY_TOKENIZER)
    tokenizer.add_special_tokens({"additional_special_tokens": [t for t in tokens if "|" in t or t == style.bos]})
    tokenizer.add_tokens([t for t in tokens if "|" not in t and t != style.bos])
    if style.bos:
        tokenizer.bos_token = style.bos
    tokenizer.chat_template = template
    return tokenizer


def _generation_config(style: ChatStyle) -> dict[str, Any]:
    """The published generation_config.json where the fixtures hold it (sampling defaults), else none."""
    path = TEMPLATES / f"{style.template}.generation_config.json"
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


# -- the checkpoint -----------------------------------------------------------------------------------------------

def build(name: str, directory: str | Path, seed: int = 0) -> Miniature:
    """Write the miniature of published fixture `name` into `directory`: config, sharded weights with their index
    (quantized as published, with the MTP head where the model ships one), tokenizer, generation_config.json."""
    import transformers

    directory = Path(directory)
    published = _with_default_towers(published_config(name))
    tokenizer = tokenizer_for(name)
    end_of_turn = tokenizer.convert_tokens_to_ids(chat_style(name).end_of_turn)
    special = {"eos_token_id": end_of_turn, "pad_token_id": tokenizer.pad_token_id,
               "bos_token_id": tokenizer.bos_token_id if chat_style(name).bos else tokenizer.eos_token_id}
    config_dict = shrunk(published, _padded(len(tokenizer)), special)
    architecture = str(config_dict["architectures"][0])
    config = transformers.AutoConfig.for_model(**{k: v for k, v in config_dict.items() if k != "quantization_config"})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = getattr(transformers, architecture)(config)
    dtype = getattr(torch, str(published.get("torch_dtype") or published.get("dtype") or "bfloat16"))
    model = model.to(dtype)
    if directory.exists():
        shutil.rmtree(directory)
    model.save_pretrained(directory, max_shard_size=SHARD_BYTES)
    _write_config(directory, config_dict)
    _quantize_as_published(directory, config_dict)
    _write_mtp_head(directory, config_dict, seed)
    tokenizer.save_pretrained(directory)
    _write_generation_config(directory, chat_style(name), special, tokenizer.eos_token_id)
    quantization = config_dict.get("quantization_config", {}).get("quant_method")
    return Miniature(directory, int(text_section(config_dict)["num_hidden_layers"]), _padded(len(tokenizer)),
                     int(tokenizer.mask_token_id), architecture, quantization)


def _with_default_towers(published: dict[str, Any]) -> dict[str, Any]:
    """A tower the fixture leaves out (a hand copy of the text fields) takes transformers' default for the
    architecture, which is the published one's shape, so that it too is shrunk rather than built full size."""
    from transformers import AutoConfig

    full = AutoConfig.for_model(**{k: v for k, v in published.items() if k != "quantization_config"}).to_dict()
    missing = {k: full[k] for k in VISION_KEYS if isinstance(full.get(k), dict) and k not in published}
    return published | missing


def _padded(tokens: int) -> int:
    """The vocabulary rounded up to a multiple of 64, as published vocabularies are padded beyond the tokenizer."""
    return -(-tokens // 64) * 64


def _write_config(directory: Path, config: dict[str, Any]) -> None:
    """The shrunk published config.json as is: transformers' own writing would drop or reorder published fields."""
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def _write_generation_config(directory: Path, style: ChatStyle, special: dict[str, int], end_of_text: int) -> None:
    """The published generation_config.json (its sampling defaults) with the tiny tokenizer's token ids."""
    config = _generation_config(style) | {"eos_token_id": [special["eos_token_id"], end_of_text],
                                          "pad_token_id": special["pad_token_id"],
                                          "bos_token_id": special["bos_token_id"]}
    (directory / "generation_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def _quantize_as_published(directory: Path, config: dict[str, Any]) -> None:
    """Rewrite each shard with the published quantization (opd/models/quantization.py's writers), the index with
    the new names."""
    if "quantization_config" not in config:
        return
    from safetensors.torch import load_file, save_file

    from opd.models.quantization import quantize_state_dict

    index_path = directory / WEIGHTS_INDEX
    index = json.loads(index_path.read_text(encoding="utf-8"))
    weight_map: dict[str, str] = {}
    for shard in sorted(set(index["weight_map"].values())):
        tensors = quantize_state_dict(load_file(directory / shard), config)
        save_file({n: t.contiguous() for n, t in tensors.items()}, directory / shard, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(tensors, shard)
    index["weight_map"] = dict(sorted(weight_map.items()))
    index_path.write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")


def _write_mtp_head(directory: Path, config: dict[str, Any], seed: int) -> None:
    """A random MTP head in a shard of its own, named by the index, where the published model ships one (Qwen3.5's
    `mtp.*`): transformers' model class has no module for it, so a target load must leave it unread."""
    from safetensors.torch import save_file

    from opd.formats.mtp import LAYOUTS, MTPSpec, to_layout
    from opd.models.registry import family
    from opd.models.target import load_target

    text = text_section(config)
    layout = next((form for form in LAYOUTS.values() if str(text.get("model_type")) in form.model_types), None)
    if layout is None or not layout.count_field or not text.get(layout.count_field):
        return
    layers = int(text["num_hidden_layers"])
    target = load_target(str(directory), dtype=torch.float32, layer_ids=[layers - 1])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 1)
        head = family("mtp").initial(MTPSpec(from_target=False), target, None)
    tensors = to_layout(head.state_dict(), layout, layers)
    save_file({n: t.to(target.dtype).contiguous() for n, t in tensors.items()}, directory / "mtp.safetensors",
              metadata={"format": "pt"})
    index_path = directory / WEIGHTS_INDEX
    index = json.loads(index_path.read_text(encoding="utf-8"))
    index["weight_map"] |= dict.fromkeys(tensors, "mtp.safetensors")
    index_path.write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
