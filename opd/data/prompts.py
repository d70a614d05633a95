"""Prompt files and the tokenizer: checked up front, so bad input fails before any compute, naming the line.

A prompt file is jsonl, one object per line with a unique `id` and either a non-empty `prompt` string or chat
`messages` ([{role, content}, ...], roles system, user and assistant, every content non-empty, the last turn the
user's: the one the target answers); other fields, such as a reference answer, are kept but unused. Each row is
rendered to ids by `opd.data.render` (raw text, or the tokenizer's chat template) and its rendered length
checked. With `skip_bad_lines` a few bad lines are skipped and counted instead of stopping the run.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from opd.data.render import Rendering, check_tokenizer, messages_of, render
from opd.errors import OpdError

if TYPE_CHECKING:
    from opd.spec import DataSpec


@dataclass(frozen=True)
class Prompt:
    id: str
    text: str  # as the target sees it: the prompt, or the rendered chat template
    ids: list[int]


@dataclass
class PromptSet:
    prompts: list[Prompt]
    skipped: list[str] = field(default_factory=list)  # one "file:line: why" per skipped line

    def skipped_note(self, field_name: str) -> str | None:
        """One line saying how many lines `data.skip_bad_lines` skipped and why the first was, or None."""
        if not self.skipped:
            return None
        return (f"note: {field_name}: {len(self.skipped)} line(s) skipped (data.skip_bad_lines), "
                f"the first {self.skipped[0]}")


def prompt_key(prompt_id: str, epoch: int = 0) -> int:
    """A stable integer per (prompt, epoch): its keyed random numbers are the same in every run, batch and actor."""
    return zlib.crc32(f"{prompt_id}#{epoch}".encode())


def load_tokenizer(path: str):
    """A local HF tokenizer that has the eos and mask tokens a DFlash drafter needs."""
    from transformers import AutoTokenizer

    if not Path(path).is_dir():
        raise OpdError(f"tokenizer: {path} is not a directory (expected a local HF tokenizer)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise OpdError(f"tokenizer {path}: {str(exc).strip().splitlines()[0]}") from exc
    if tokenizer.eos_token_id is None:
        raise OpdError(f"tokenizer {path}: no eos token (set eos_token in tokenizer_config.json)")
    return tokenizer


def mask_token_id(tokenizer, override: int | None) -> int:
    """The drafter's mask token: the spec's `models.drafter.mask_token_id`, else the tokenizer's mask token."""
    if override is not None:
        return override
    if tokenizer.mask_token_id is None:
        raise OpdError("tokenizer has no mask token: add one or set models.drafter.mask_token_id")
    return tokenizer.mask_token_id


def load_prompts(path: str, tokenizer, *, max_prompt_tokens: int, skip_bad_lines: bool = False,
                 limit: int | None = None, rendering: Rendering = Rendering()) -> PromptSet:
    """Parse, validate and render a prompt file; raises OpdError on the first bad line unless skipping."""
    file = Path(path)
    if not file.is_file():
        raise OpdError(f"prompts: {path} not found (expected a jsonl file with id and prompt or messages fields)")
    check_tokenizer(tokenizer, rendering)
    result, seen = PromptSet([]), set[str]()
    for number, raw in enumerate(file.read_bytes().splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            prompt = _parse_line(raw, tokenizer, max_prompt_tokens, seen, rendering)
        except ValueError as exc:
            where = f"{path}:{number}: {exc}"
            if not skip_bad_lines:
                raise OpdError(where + " (set data.skip_bad_lines: true to skip such lines)") from None
            result.skipped.append(where)
            continue
        seen.add(prompt.id)
        result.prompts.append(prompt)
        if limit is not None and len(result.prompts) == limit:
            break
    if not result.prompts:
        raise OpdError(f"prompts: {path} has no usable prompt ({len(result.skipped)} lines skipped)")
    return result


def spec_prompts(data: DataSpec, path: str, tokenizer, limit: int | None = None) -> PromptSet:
    """A prompt file read as the spec says: its rendering, length limit and bad-line policy."""
    return load_prompts(path, tokenizer, max_prompt_tokens=data.max_prompt_tokens,
                        skip_bad_lines=data.skip_bad_lines, limit=limit, rendering=Rendering.of(data))


def train_prompts(data: DataSpec, tokenizer) -> list[Prompt]:
    """The spec's rollout/SFT prompt pool."""
    return spec_prompts(data, data.train_prompts, tokenizer).prompts


def eval_prompts(data: DataSpec, tokenizer, limit: int | None = None) -> list[Prompt]:
    """The first `limit` of the spec's held-out prompts."""
    return spec_prompts(data, data.eval_prompts, tokenizer, limit).prompts


def _parse_line(raw: bytes, tokenizer, max_prompt_tokens: int, seen: set[str], rendering: Rendering) -> Prompt:
    try:
        record = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise ValueError("not UTF-8") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON ({exc.msg}; expected JSONL, one JSON object per line)") from None
    if not isinstance(record, dict):
        raise ValueError("expected a JSON object with id and prompt or messages")
    if "id" not in record:
        raise ValueError("missing field 'id'")
    messages = messages_of(record)
    if messages is None:
        if "prompt" not in record:
            raise ValueError("missing field 'prompt' (or 'messages')")
        if not isinstance(record["prompt"], str) or not record["prompt"].strip():
            raise ValueError("empty prompt (expected a non-empty string)")
    prompt_id = str(record["id"])
    if prompt_id in seen:
        raise ValueError(f"duplicate id '{prompt_id}'")
    rendered = render(record.get("prompt"), messages, tokenizer, rendering)
    if len(rendered.ids) > max_prompt_tokens:
        raise ValueError(f"rendered prompt has {len(rendered.ids)} tokens, more than "
                         f"data.max_prompt_tokens={max_prompt_tokens}")
    return Prompt(prompt_id, rendered.text, rendered.ids)
