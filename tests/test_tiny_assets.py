"""The shipped tiny target: loads offline with plain transformers and still measures what its card says."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from opd.tiny.build import CHECK_PROMPTS, HELDOUT_SEED
from opd.tiny.math_corpus import generate
from opd.tiny.quality import has_loop, measure_quality

TARGET = Path(__file__).resolve().parents[1] / "opd" / "assets" / "tiny" / "target"
pytestmark = pytest.mark.skipif(not (TARGET / "card.json").exists(), reason="tiny target not built")


@pytest.fixture(scope="module")
def shipped():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    os.environ["HF_HUB_OFFLINE"] = "1"
    model = AutoModelForCausalLM.from_pretrained(TARGET, dtype="float32", local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(TARGET, local_files_only=True)
    return model, tokenizer, json.loads((TARGET / "card.json").read_text())


def test_tokenizer_round_trips_and_reserves_special_tokens(shipped):
    _, tokenizer, _ = shipped
    text = generate(99, 1)[0].prompt + "Ünïcode, tabs\tand 12345 * 6 = 74070."
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    assert None not in (tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.mask_token_id)


def test_held_out_quality_matches_the_card(shipped):
    model, tokenizer, card = shipped
    quality = measure_quality(model, tokenizer, generate(HELDOUT_SEED, CHECK_PROMPTS))
    expected = card[f"check_{CHECK_PROMPTS}"]
    assert quality.heldout_loss == pytest.approx(expected["heldout_loss"], abs=2e-3)
    assert abs(quality.loop_rate - expected["loop_rate"]) <= 1 / CHECK_PROMPTS  # one prompt's slack for float noise
    assert card["quality"]["loop_rate"] < 0.10  # a real target rarely loops


def test_loop_detector():
    assert has_loop([1, 2, 3, 4, 5, 6, 7, 8] * 3)
    assert not has_loop(list(range(64)))
