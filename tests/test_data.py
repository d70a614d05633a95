"""Prompt files: every bad line is refused with its file and line number, or skipped and counted."""

from __future__ import annotations

import pytest

from opd.data.prompts import load_prompts, load_tokenizer
from opd.errors import OpdError

GOOD = b'{"id": "a", "prompt": "Question: 1 + 1?\\n"}\n'
BAD_LINES = {
    "empty prompt": (b'{"id": "b", "prompt": "  "}', "empty prompt"),
    "too long": (b'{"id": "b", "prompt": "' + b"word " * 400 + b'"}', "more than data.max_prompt_tokens"),
    "not utf-8": (b'{"id": "b", "prompt": "\xff\xfe"}', "not UTF-8"),
    "garbage": (b"this is not json", "not JSON"),
    "a CSV row": (b"id,prompt", "not JSON (Expecting value; expected JSONL, one JSON object per line)"),
    "missing prompt": (b'{"id": "b"}', "missing field 'prompt'"),
    "missing id": (b'{"prompt": "hi"}', "missing field 'id'"),
    "not an object": (b"[1, 2]", "expected a JSON object"),
    "duplicate id": (b'{"id": "a", "prompt": "again"}', "duplicate id 'a'"),
}


@pytest.fixture(scope="module")
def tokenizer(micro_assets):
    return load_tokenizer(micro_assets["target"])


@pytest.mark.parametrize("case", BAD_LINES)
def test_bad_line_is_refused_with_file_and_line(tmp_path, tokenizer, case):
    line, message = BAD_LINES[case]
    path = tmp_path / "p.jsonl"
    path.write_bytes(GOOD + line + b"\n")
    with pytest.raises(OpdError) as err:
        load_prompts(str(path), tokenizer, max_prompt_tokens=64)
    assert f"{path}:2: " in str(err.value) and message in str(err.value) and "\n" not in str(err.value)


def test_bad_lines_can_be_skipped_and_counted(tmp_path, tokenizer):
    path = tmp_path / "p.jsonl"
    path.write_bytes(GOOD + b"".join(line + b"\n" for line, _ in BAD_LINES.values()))
    result = load_prompts(str(path), tokenizer, max_prompt_tokens=64, skip_bad_lines=True)
    assert [p.id for p in result.prompts] == ["a"] and len(result.skipped) == len(BAD_LINES)


def test_file_empty_after_filtering_is_refused(tmp_path, tokenizer):
    path = tmp_path / "p.jsonl"
    path.write_bytes(b"garbage\n\n")
    with pytest.raises(OpdError, match="no usable prompt"):
        load_prompts(str(path), tokenizer, max_prompt_tokens=64, skip_bad_lines=True)
    with pytest.raises(OpdError, match="not found"):
        load_prompts(str(tmp_path / "missing.jsonl"), tokenizer, max_prompt_tokens=64)


def test_a_tokenizer_without_a_mask_token_is_refused_unless_the_spec_names_one(micro_assets):
    from opd.data.prompts import mask_token_id

    tokenizer = load_tokenizer(micro_assets["target"])
    assert mask_token_id(tokenizer, None) == tokenizer.mask_token_id
    tokenizer.mask_token = None
    with pytest.raises(OpdError, match="tokenizer has no mask token"):
        mask_token_id(tokenizer, None)
    assert mask_token_id(tokenizer, 5) == 5
