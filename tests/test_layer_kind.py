"""The layer-kind seam (opd/models/layer_kind.py): every decoder layer is mapped once to its registered kind, a
layer type nothing registers is refused in one line naming it and its layers, and each kind's narrowing by position
is what HF's own mask overlays compute."""

from __future__ import annotations

import pytest
import torch
from transformers import Gemma4TextConfig, Qwen3_5TextConfig, Qwen3Config

from opd.errors import OpdError
from opd.models.kinds.full import FullAttention
from opd.models.kinds.gated_deltanet import GatedDeltaNet
from opd.models.kinds.sliding import SlidingAttention
from opd.models.layer_kind import layer_kinds

SMALL = dict(vocab_size=8, hidden_size=16, intermediate_size=32, num_hidden_layers=4, num_attention_heads=2,
             num_key_value_heads=1, head_dim=8)


class _Skeleton(torch.nn.Module):
    """What `layer_kinds` reads of a model: its config."""

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config


def test_each_layer_is_mapped_to_its_registered_kind_once():
    layers = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
    kinds = layer_kinds(_Skeleton(Gemma4TextConfig(**SMALL, layer_types=layers, sliding_window=3)))
    assert [type(k) for k in kinds.of_layer] == [SlidingAttention, FullAttention] * 2
    assert kinds.of_layer[0] is kinds.of_layer[2] and kinds.by_name["sliding_attention"].layers == (0, 2)
    assert kinds.narrowed and list(kinds.attention) == ["sliding_attention", "full_attention"]
    hybrid = layer_kinds(_Skeleton(Qwen3_5TextConfig(**SMALL, linear_num_key_heads=1, linear_num_value_heads=2)))
    assert isinstance(hybrid.of_layer[0], GatedDeltaNet) and list(hybrid.attention) == ["full_attention"]
    assert not hybrid.narrowed and hybrid.static_cache_problem().startswith("a target that has linear-attention")
    plain = layer_kinds(_Skeleton(Qwen3Config(**SMALL)))
    assert set(plain.by_name) == {"full_attention"} and plain.static_cache_problem() is None


def test_an_unregistered_layer_type_is_refused_in_one_line_naming_it_and_its_layers():
    config = Qwen3Config(**SMALL)
    config.layer_types = ["full_attention", "mystery_attention", "full_attention", "mystery_attention"]
    with pytest.raises(OpdError, match=r"layers \[1, 3\] are 'mystery_attention'; no registered layer kind") as e:
        layer_kinds(_Skeleton(config))
    assert "\n" not in str(e.value)


def test_the_sliding_window_is_hfs_overlay_on_positions():
    from transformers.masking_utils import sliding_window_overlay

    kind = SlidingAttention(Gemma4TextConfig(**SMALL, sliding_window=3), (0,))
    q, k = torch.arange(12)[:, None], torch.arange(12)[None, :]
    overlay = sliding_window_overlay(3)
    expected = torch.tensor([[bool(overlay(0, 0, i, j)) for j in range(12)] for i in range(12)])
    assert torch.equal(kind.sees(q, k) & (k <= q), expected & (k <= q))
    assert [kind.lowest_key(p) for p in (0, 2, 7)] == [0, 0, 5]


def test_the_attention_chunk_is_hfs_overlay_on_positions():
    from transformers import Llama4TextConfig
    from transformers.masking_utils import chunked_overlay

    from opd.models.kinds.chunked import ChunkedAttention

    kind = ChunkedAttention(Llama4TextConfig(**SMALL, attention_chunk_size=3), (0,))
    q, k = torch.arange(12)[:, None], torch.arange(12)[None, :]
    overlay = chunked_overlay(3, torch.zeros(1, dtype=torch.long))
    expected = torch.tensor([[bool(overlay(0, 0, i, j)) for j in range(12)] for i in range(12)])
    assert torch.equal(kind.sees(q, k) & (k <= q), expected & (k <= q))
    assert [kind.lowest_key(p) for p in (0, 2, 3, 7)] == [0, 0, 3, 6]
