"""EAGLE-3 checkpoint format: config.json and model.safetensors round trips, what vLLM reads, the layer-id
conventions, every refusal, and the draft vocabulary."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from opd.errors import OpdError
from opd.formats.eagle3 import (
    ARCHITECTURE,
    ARCHITECTURES,
    CONFIG_FILE,
    WEIGHTS_FILE,
    Eagle3Config,
    default_aux_layer_ids,
    draft_vocab,
    expected_shapes,
    read_config,
    read_tensors,
    write_checkpoint,
)
from opd.model_dir import ModelDir
from opd.models.eagle3 import Eagle3Family

TINY_TARGET = Path(__file__).resolve().parents[1] / "opd/assets/tiny/target"
V, H, L, VD, K = 40, 32, 6, 12, 4
TARGET_HF = {"num_hidden_layers": L, "hidden_size": H, "intermediate_size": 48, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 8, "rms_norm_eps": 1e-6, "max_position_embeddings": 256,
             "vocab_size": V, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
             "hidden_act": "silu"}
# vLLM's parameter names for a one-layer drafter (vllm/model_executor/models/llama_eagle3.py, Eagle3LlamaForCausalLM)
VLLM_PARAMS = {"model.fc.weight", "model.norm.weight", "lm_head.weight", "draft_id_to_target_id",
               "model.layers.0.hidden_norm.weight", "model.layers.0.input_layernorm.weight",
               "model.layers.0.post_attention_layernorm.weight", "model.layers.0.self_attn.qkv_proj.weight",
               "model.layers.0.self_attn.o_proj.weight", "model.layers.0.mlp.gate_up_proj.weight",
               "model.layers.0.mlp.down_proj.weight"}


def _vllm_name(name: str) -> str | None:
    """vLLM's rename on load: t2d skipped, d2t -> draft_id_to_target_id, `model.` on all but lm_head, then
    `midlayer.` -> `layers.0.` and q/k/v, gate/up stacked (Eagle3LlamaForCausalLM.load_weights, hf_to_vllm_mapper)."""
    if name == "t2d":
        return None
    if name == "d2t":
        return "draft_id_to_target_id"
    name = name if name.startswith("lm_head") else "model." + name
    name = name.replace("midlayer.", "layers.0.")
    for part, stacked in ((".q_proj", ".qkv_proj"), (".k_proj", ".qkv_proj"), (".v_proj", ".qkv_proj"),
                          (".gate_proj", ".gate_up_proj"), (".up_proj", ".gate_up_proj")):
        name = name.replace(part, stacked)
    return name


def _config(**overrides) -> Eagle3Config:
    return Eagle3Config.for_target(SimpleNamespace(to_dict=lambda: dict(TARGET_HF)), draft_vocab_size=VD,
                                   block_size=K, **overrides)


def _target(num_layers: int = L) -> SimpleNamespace:
    return SimpleNamespace(hidden_size=H, vocab_size=V, num_layers=num_layers, layer_ids=[1, 2, 2])


def _state(config: Eagle3Config, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    state = {name: torch.randn(shape, generator=gen) for name, shape in expected_shapes(config).items()}
    state["d2t"], state["t2d"] = draft_vocab(torch.randint(0, 9, (config.vocab_size,), generator=gen), VD)
    return state


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    write_checkpoint(tmp_path, _config(), _state(_config()), torch.float32)
    return tmp_path


def _edit_config(directory: Path, edit) -> Path:
    path = directory / CONFIG_FILE
    hf = json.loads(path.read_text())
    edit(hf)
    path.write_text(json.dumps(hf))
    return path


def test_round_trip(tmp_path: Path) -> None:
    config, state = _config(), _state(_config(), seed=3)
    write_checkpoint(tmp_path, config, {**state, "embed_tokens.weight": torch.zeros(V, H)}, torch.float32)
    loaded = read_config(ModelDir.read(tmp_path), _target(), block_size=99)
    assert loaded == config and loaded.block_size == K  # the file's block_size wins over the argument
    assert loaded.aux_layer_ids == [2, 3, 3] and loaded.target_layer_ids == [1, 2, 2]
    tensors = read_tensors(tmp_path / WEIGHTS_FILE, loaded)
    assert tensors.keys() == state.keys() == expected_shapes(config).keys()
    for name, t in tensors.items():
        assert tuple(t.shape) == expected_shapes(config)[name]
        assert torch.equal(t, state[name]), name
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool


def test_written_dtype_and_shapes(tmp_path: Path) -> None:
    config = _config()
    write_checkpoint(tmp_path, config, _state(config), torch.bfloat16)
    stored = load_file(str(tmp_path / WEIGHTS_FILE))
    assert {n: tuple(t.shape) for n, t in stored.items()} == expected_shapes(config)
    assert {t.dtype for n, t in stored.items() if n not in ("d2t", "t2d")} == {torch.bfloat16}
    assert json.loads((tmp_path / CONFIG_FILE).read_text())["torch_dtype"] == "bfloat16"
    with pytest.raises(ValueError, match="fc.weight"):
        write_checkpoint(tmp_path, config, {**_state(config), "fc.weight": torch.zeros(1)}, torch.float32)


def test_config_carries_what_vllm_reads(checkpoint: Path) -> None:
    hf = json.loads((checkpoint / CONFIG_FILE).read_text())
    assert hf["architectures"] == [ARCHITECTURE] and set(hf["architectures"]) <= ARCHITECTURES
    assert {"LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM"} <= ARCHITECTURES
    assert hf["model_type"] == "llama" and hf["num_hidden_layers"] == 1 and hf["hidden_act"] == "silu"
    assert hf["draft_vocab_size"] == VD and hf["target_hidden_size"] == H and hf["vocab_size"] == V
    assert hf["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [2, 3, 3], "use_aux_hidden_state": True}
    assert hf["rope_theta"] == 10000.0 and hf["rope_scaling"] is None and hf["tie_word_embeddings"] is False
    assert hf["block_size"] == K
    names = {_vllm_name(n) for n in load_file(str(checkpoint / WEIGHTS_FILE))} - {None}
    assert names == VLLM_PARAMS
    # transformers reads the RoPE base back
    assert AutoConfig.from_pretrained(checkpoint, local_files_only=True).rope_parameters["rope_theta"] == 10000.0


def test_for_shipped_tiny_target() -> None:
    config = Eagle3Config.for_target(AutoConfig.from_pretrained(TINY_TARGET, local_files_only=True),
                                     draft_vocab_size=512, block_size=8)
    assert (config.hidden_size, config.num_attention_heads, config.num_key_value_heads) == (256, 4, 2)
    assert (config.head_dim, config.intermediate_size, config.vocab_size, config.rope_theta) == (64, 768, 2048, 1e4)
    assert config.aux_layer_ids == default_aux_layer_ids(6) == [2, 3, 3]
    assert default_aux_layer_ids(36) == [2, 18, 33]
    assert Eagle3Family().vllm_config(ModelDir(Path("/d"), {}), 8) == {"method": "eagle3", "model": "/d",
                                                                       "num_speculative_tokens": 7}


@pytest.mark.parametrize(("place", "ids", "want"), [
    ("eagle_config", [1, 17, 32], [2, 18, 33]),  # SpecForge's output-of-layer ids
    ("top", [1, 17, 32], [2, 18, 33]),
    ("eagle_config", [2, 18, 33], [2, 18, 33]),  # ours: entering ids pass through
    (None, None, [2, 18, 33]),  # absent: the default
])
def test_layer_id_conventions(place, ids, want) -> None:
    hf = _config().to_hf_dict()
    del hf["eagle_config"]
    if place == "top":
        hf["eagle_aux_hidden_state_layer_ids"] = ids
    elif place:
        hf["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True}
    config = Eagle3Config.from_hf_dict(hf, num_target_layers=36, block_size=K)
    assert config.aux_layer_ids == want and config.target_layer_ids == [i - 1 for i in want]


def test_first_entering_id_one_is_refused() -> None:
    with pytest.raises(OpdError, match="start at 1"):
        _config(aux_layer_ids=[1, 3, 4])
    assert _config(aux_layer_ids=[2, 4, 5]).aux_layer_ids == [2, 4, 5]


def _set(key, value):
    return lambda hf: hf.__setitem__(key, value)


@pytest.mark.parametrize(("edit", "field"), [
    (_set("architectures", ["Qwen3ForCausalLM"]), "architectures"),
    (_set("num_hidden_layers", 2), "num_hidden_layers"),
    (_set("vocab_size", V + 1), "vocab_size"),
    (lambda hf: hf.pop("draft_vocab_size"), "draft_vocab_size"),
    (_set("draft_vocab_size", 0), "draft_vocab_size"),
    (_set("draft_vocab_size", V + 1), "draft_vocab_size"),
    (_set("target_hidden_size", 2 * H), "target_hidden_size"),
    (_set("hidden_size", 2 * H), "'hidden_size'"),
    (lambda hf: hf["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[2, 3]), "exactly 3"),
    (lambda hf: hf["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[2, 3, 6]), "layer ids beyond the target"),
    (lambda hf: hf["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[0, 2, 3]), "layer ids beyond the target"),
    (lambda hf: hf["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[1, 3, 5]), "layer ids beyond the target"),
    (lambda hf: hf["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[4, 2, 3]), "ascending"),
    (lambda hf: hf["eagle_config"].update(use_aux_hidden_state=False), "use_aux_hidden_state"),
    (lambda hf: hf.update(fc_norm=True, norm_before_fc=True), "'fc_norm' and 'norm_before_fc' are both true"),
    (lambda hf: hf.update(fc_norm=True) or hf["eagle_config"].update(norm_before_fc=True), "both true"),
    (_set("norm_output", "yes"), "'norm_output' must be true, false or null"),
    (_set("norm_before_residual", True), "norm_before_residual"),
    (_set("rope_scaling", {"rope_type": "llama3", "factor": 8.0}), "rope_scaling"),
    (_set("attention_bias", True), "attention_bias"),
    (_set("hidden_act", "gelu"), "hidden_act"),
    (_set("block_size", 1), "block_size"),
])
def test_config_errors(checkpoint: Path, edit, field: str) -> None:
    path = _edit_config(checkpoint, edit)
    with pytest.raises(OpdError, match=field) as info:
        read_config(ModelDir.read(path.parent), _target(), block_size=K)
    assert str(path) in str(info.value) and "\n" not in str(info.value)


def test_config_file_errors(tmp_path: Path) -> None:
    with pytest.raises(OpdError, match="config.json not found"):
        read_config(ModelDir.read(tmp_path), _target(), block_size=K)
    (tmp_path / CONFIG_FILE).write_text("{")
    with pytest.raises(OpdError, match="not valid JSON"):
        read_config(ModelDir.read(tmp_path), _target(), block_size=K)
    hf = _config().to_hf_dict()
    del hf["block_size"]
    (tmp_path / CONFIG_FILE).write_text(json.dumps(hf))
    assert read_config(ModelDir.read(tmp_path), _target(), block_size=7).block_size == 7


def _ids_to_d2t(ids: list[int]) -> torch.Tensor:
    return torch.tensor(ids) - torch.arange(len(ids))


def _mask(ids: list[int]) -> torch.Tensor:
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    return t2d


GOOD = list(range(0, 2 * VD, 2))  # 12 ascending target ids


@pytest.mark.parametrize(("change", "message"), [
    ({"d2t": None}, "missing d2t"),
    ({"t2d": None}, "missing t2d"),
    ({"norm.weight": None}, r"missing tensor\(s\) norm.weight"),
    ({"midlayer.self_attn.q_norm.weight": torch.zeros(8)}, r"unexpected tensor\(s\) midlayer.self_attn.q_norm"),
    ({"fc.weight": torch.zeros(H, 2 * H)}, "tensor fc.weight has shape"),
    ({"t2d": _mask(GOOD[:-1])}, "t2d marks 11"),
    ({"d2t": _ids_to_d2t([1, 0] + GOOD[2:])}, "not strictly increasing"),
    ({"d2t": _ids_to_d2t(GOOD[:-1] + [V])}, "not strictly increasing"),
    ({"t2d": _mask(GOOD[:-1] + [GOOD[-1] + 1])}, "t2d is not true"),
    ({"d2t": _ids_to_d2t(GOOD).float()}, "integer offsets"),
])
def test_tensor_errors(checkpoint: Path, change: dict, message: str) -> None:
    path = checkpoint / WEIGHTS_FILE
    tensors = {**load_file(str(path)), "d2t": _ids_to_d2t(GOOD), "t2d": _mask(GOOD)}
    for name, t in change.items():
        tensors.pop(name) if t is None else tensors.__setitem__(name, t)
    save_file(tensors, str(path))
    with pytest.raises(OpdError, match=message) as info:
        read_tensors(path, read_config(ModelDir.read(checkpoint), _target(), block_size=K))
    assert str(path) in str(info.value) and "\n" not in str(info.value)


def test_weights_file_errors(tmp_path: Path) -> None:
    with pytest.raises(OpdError, match="model.safetensors: drafter weights not found"):
        read_tensors(tmp_path / WEIGHTS_FILE, _config())
    (tmp_path / WEIGHTS_FILE).write_bytes(b"not safetensors")
    with pytest.raises(OpdError, match="unreadable safetensors"):
        read_tensors(tmp_path / WEIGHTS_FILE, _config())


def test_draft_vocab_most_frequent_sorted() -> None:
    counts = torch.tensor([5, 0, 9, 9, 1, 7, 0, 3])
    d2t, t2d = draft_vocab(counts, 4)
    ids = torch.arange(4) + d2t
    assert ids.tolist() == [0, 2, 3, 5]  # counts 5, 9, 9, 7
    assert d2t.dtype == torch.int64 and d2t.tolist() == [0, 1, 1, 2]
    assert t2d.dtype == torch.bool and t2d.nonzero().flatten().tolist() == [0, 2, 3, 5]
    # ties go to the lower id
    assert (torch.arange(2) + draft_vocab(torch.tensor([1.0, 2.0, 2.0, 2.0]), 2)[0]).tolist() == [1, 2]


def test_draft_vocab_fills_sparse_counts() -> None:
    counts = torch.zeros(10)
    counts[[7, 4]] = torch.tensor([3.0, 1.0])
    d2t, t2d = draft_vocab(counts, 5)
    assert (torch.arange(5) + d2t).tolist() == [0, 1, 2, 4, 7]  # the two seen ids, then the lowest unused
    assert int(t2d.sum()) == 5
    with pytest.raises(OpdError, match="draft vocabulary size 11"):
        draft_vocab(counts, 11)
