"""The reworded prompt family must be a second, independent held-out set: its own seed, every question worded
differently from anything the generator writes, numbers and references untouched, and the shipped file current."""

import json
import re
from pathlib import Path

import pytest

from opd.tiny import build
from opd.tiny.math_corpus import generate
from opd.tiny.reworded import (
    PREFIX,
    QUESTION_RULES,
    REWORDED_PROMPTS,
    REWORDED_SEED,
    SUFFIX,
    generate_reworded,
    main,
    question_of,
)

PROMPTS = Path(__file__).resolve().parents[1] / "opd" / "assets" / "tiny" / "prompts"
SHIPPED = PROMPTS / "reworded.jsonl"
SAMPLE = 2000
NUMBERS = re.compile(r"\$?\d+%?")  # every number with its unit sign, in order
WORDS = re.compile(r"[a-z]+")


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def pairs():
    """(original, reworded) for the same draws; seed 12 so the check does not only cover the shipped draws."""
    return list(zip(generate(12, SAMPLE), generate_reworded(12, SAMPLE), strict=True))


def test_deterministic_and_prefix_stable():
    assert generate_reworded(REWORDED_SEED, 50) == generate_reworded(REWORDED_SEED, 50)
    assert generate_reworded(REWORDED_SEED, 20) == generate_reworded(REWORDED_SEED, 50)[:20]
    assert [p.prompt for p in generate_reworded(12, 50)] != [p.prompt for p in generate_reworded(13, 50)]


def test_seed_is_distinct_from_every_build_seed():
    build_seeds = {build.CORPUS_SEED, build.TRAIN_PROMPT_SEED, build.HELDOUT_SEED}
    assert len(build_seeds) == 3 and REWORDED_SEED not in build_seeds
    with pytest.raises(SystemExit):  # the command refuses a build seed
        main(["--out", "/dev/null", "--seed", str(build.HELDOUT_SEED)])


def test_every_question_is_reworded_and_numbers_references_and_frame_are_kept(pairs):
    for original, reworded in pairs:
        assert reworded.prompt != original.prompt
        assert reworded.prompt.startswith(PREFIX) and reworded.prompt.endswith(SUFFIX)
        assert NUMBERS.findall(reworded.prompt) == NUMBERS.findall(original.prompt), reworded.prompt
        assert (reworded.response, reworded.family) == (original.response, original.family)
        question = question_of(reworded.prompt)
        assert question.isascii() and "  " not in question and "\n" not in question
        assert question.endswith("?") and question[0].isupper()


def test_every_reworded_question_uses_a_word_no_generated_question_uses(pairs):
    """So no reworded prompt can equal any generated one: not the corpus, train or held-out prompts."""
    generated = {w for seed in (build.CORPUS_SEED, build.TRAIN_PROMPT_SEED, build.HELDOUT_SEED)
                 for p in generate(seed, 5_000) for w in WORDS.findall(question_of(p.prompt).lower())}
    for _, reworded in pairs:
        assert set(WORDS.findall(question_of(reworded.prompt).lower())) - generated, reworded.prompt


def test_every_question_rule_is_reachable(pairs):
    """A rule no family's question matches would be dead weight (or a typo that leaves a template unmatched)."""
    asks = [question_of(o.prompt).rsplit(". ", 1)[-1] for o, _ in pairs]
    for pattern, _ in QUESTION_RULES:
        assert any(re.fullmatch(pattern, ask) for ask in asks), pattern


def test_shipped_file_is_what_the_command_writes(tmp_path):
    out = tmp_path / "reworded.jsonl"
    assert main(["--out", str(out)]) == 0
    assert out.read_bytes() == SHIPPED.read_bytes()
    rows = _read(SHIPPED)
    assert len(rows) == REWORDED_PROMPTS and all(set(r) == {"id", "prompt", "reference"} for r in rows)
    assert rows[0]["id"] == f"reworded-{REWORDED_SEED}-0" and len({r["prompt"] for r in rows}) == len(rows)


def test_no_overlap_with_the_train_and_heldout_files():
    shipped = _read(SHIPPED)
    others = _read(PROMPTS / "train.jsonl") + _read(PROMPTS / "heldout.jsonl")
    assert not {r["id"] for r in shipped} & {r["id"] for r in others}
    assert not {r["prompt"] for r in shipped} & {r["prompt"] for r in others}
