"""Served completions as target samples: a serving log read into rows of the sample store (opd/sources/store.py).

A completion served through lossless speculative decoding is a sample of the target at the serving setting,
whatever drafter served it, so a user's logs are rollouts that cost no decoding: a run with `rollout.source:
samples` rebuilds the drafter's blocks from them exactly, as from `opd gen-samples` rows. A row is kept only where
it is the target's sample as the run will see it:
- the prompt is rendered by the run's own rendering (opd/data/render.py); where the log holds the prompt's token
  ids, the rendering must give the same ids;
- the completion's token ids are the log's where it has them; otherwise its text is tokenized, and kept only when
  decoding those ids gives the text back;
- the sampling setting is the request's, or the one given for the whole import.
Everything else is skipped and counted by reason, never changed. The prompts go to a prompts file beside the
samples (the run's `data.train_prompts`), one per distinct rendered prompt; a prompt served several times at one
setting gives samples 0, 1, ... of it.

Three log formats, detected per file from its first row:
- `openai`: `{"request": {"model", "messages", "temperature", ...}, "response": {"model", "choices": [...]}}`, as
  gateways and proxies log the chat-completions API;
- `vllm`: the same, with vLLM's `prompt_token_ids` in the response and `token_ids` in each choice
  (`return_token_ids`);
- `plain`: `{"messages" | "prompt", "response", optional "temperature", "top_p", "top_k"}`.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from opd.data.render import Rendering, messages_of, render
from opd.errors import OpdError

FORMATS = ("openai", "vllm", "plain")
SAMPLING_KEYS = ("temperature", "top_p", "top_k")
MALFORMED = "malformed line"


@dataclass(frozen=True)
class Served:
    """One served completion as a log holds it; `skip` is why it cannot be a sample (None: it may be)."""

    where: str  # file:line
    messages: list[dict[str, str]] | None
    prompt: str | None
    text: str
    prompt_ids: list[int] | None = None
    completion_ids: list[int] | None = None
    sampling: dict[str, float] | None = None
    model: str | None = None
    finish_reason: str | None = None
    stop_reason: Any = None  # vLLM: the stop string or token that ended it
    skip: str | None = None
    extra_choices: int = 0
    problem: str | None = None  # a malformed line's one-line error


@dataclass
class Imported:
    """What an import made: sample rows, the prompt rows they name, and the count of every row read by outcome."""

    rows: list[dict] = field(default_factory=list)
    prompts: dict[str, dict] = field(default_factory=dict)
    counts: Counter = field(default_factory=Counter)  # (setting or "-", outcome) -> rows
    formats: dict[str, str] = field(default_factory=dict)  # file -> the format read
    malformed: list[str] = field(default_factory=list)  # each malformed line's error


def detect(first: dict) -> str:
    """The format of a log from its first row."""
    if "request" in first and "response" in first:
        response = first["response"] if isinstance(first["response"], dict) else {}
        choices = response.get("choices") or [{}]
        return "vllm" if "prompt_token_ids" in response or "token_ids" in choices[0] else "openai"
    if "response" in first and ("messages" in first or "prompt" in first):
        return "plain"
    raise ValueError("neither a request/response pair nor a {messages | prompt, response} row")


def read_log(path: Path, fmt: str | None) -> tuple[str, Iterator[Served]]:
    """The format of `path` (`fmt`, or detected from its first row) and its completions, one per row, read as they
    are taken (a day of logs need not fit in memory); a row that is not JSON is one line naming file:line."""
    first = next(_numbered(path), None)
    if first is None:
        raise OpdError(f"{path}: empty (expected a JSONL log of served completions)")
    if fmt is None:
        n, line = first
        try:
            fmt = detect(_json(line, f"{path}:{n}"))
        except ValueError as exc:
            raise OpdError(f"{path}:{n}: {exc} (expected one of the formats {', '.join(FORMATS)}; --format picks "
                           "one)") from None
    return fmt, (_parsed(line, fmt, f"{path}:{n}") for n, line in _numbered(path))


def _numbered(path: Path) -> Iterator[tuple[int, str]]:
    """The non-blank lines of `path` with their numbers."""
    with path.open(encoding="utf-8") as f:
        yield from ((n, line) for n, line in enumerate(f, start=1) if line.strip())


def _parsed(line: str, fmt: str, where: str) -> Served:
    """A row's completion, or a skip naming why the line is not one (malformed JSON is counted, not fatal)."""
    try:
        return _served(_json(line, where), fmt, where)
    except OpdError as exc:
        return Served(where, None, None, "", skip=MALFORMED, problem=str(exc))
    except (AttributeError, TypeError):
        return Served(where, None, None, "", skip=MALFORMED, problem=f"{where}: not a {fmt} row")


def _json(line: str, where: str) -> dict:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise OpdError(f"{where}: not JSON ({exc.msg}; expected one JSON object per line)") from None
    if not isinstance(row, dict):
        raise OpdError(f"{where}: expected a JSON object")
    return row


def _served(row: dict, fmt: str, where: str) -> Served:
    if fmt == "plain":
        prompt, messages = _prompt_of(row)
        return Served(where, messages, prompt, row.get("response") or "", sampling=_sampling(row))
    request, response = row.get("request") or {}, row.get("response") or {}
    prompt, messages = _prompt_of(request)
    choices = response.get("choices") or []
    if not choices:
        return Served(where, messages, prompt, "", skip="no choices in the response")
    choice = choices[0]
    message = choice.get("message") or {}
    skip = "tool calls" if message.get("tool_calls") else None
    return Served(where, messages, prompt, message.get("content") or "",
                  prompt_ids=response.get("prompt_token_ids"), completion_ids=choice.get("token_ids"),
                  sampling=_sampling(request), model=response.get("model") or request.get("model"),
                  finish_reason=choice.get("finish_reason"), stop_reason=choice.get("stop_reason"), skip=skip,
                  extra_choices=len(choices) - 1)


def _prompt_of(row: dict) -> tuple[str | None, list[dict[str, str]] | None]:
    if "messages" in row:
        return None, [{"role": m.get("role"), "content": m.get("content")} for m in row["messages"]]
    return row.get("prompt"), None


def _sampling(row: dict) -> dict[str, float] | None:
    """The request's sampling setting, None when it names no temperature (the server's default is unknown). A
    missing top_p is 1 and a missing or negative top_k (vLLM's -1) is 0: both mean off, as in the spec."""
    if row.get("temperature") is None:
        return None
    top_p, top_k = row.get("top_p"), row.get("top_k")
    return {"temperature": float(row["temperature"]), "top_p": 1.0 if top_p is None else float(top_p),
            "top_k": 0 if top_k is None or top_k < 0 else int(top_k)}


@dataclass(frozen=True)
class Target:
    """What a row is checked against: the run's tokenizer and rendering, its length cap, the model name the logs
    must name (None: any), and the setting for rows that name none (None: such rows are skipped)."""

    tokenizer: Any
    rendering: Rendering
    max_new_tokens: int
    model: str | None = None
    sampling: dict[str, float] | None = None


def sample_of(served: Served, target: Target) -> tuple[list[int], list[int], dict[str, float]] | str:
    """(prompt ids, completion ids, setting) of a served completion, or why it is skipped."""
    if served.skip:
        return served.skip
    if target.model is not None and served.model not in (None, target.model):
        return "another model"
    setting = served.sampling or target.sampling
    if setting is None:
        return "no sampling setting (none in the request and no --temperature)"
    try:
        rendered = render(served.prompt, messages_of({"messages": served.messages}) if served.messages else None,
                          target.tokenizer, target.rendering)
    except (ValueError, TypeError) as exc:
        return f"prompt not renderable ({exc})"
    if served.prompt_ids is not None and list(served.prompt_ids) != rendered.ids:
        return "prompt renders to other token ids than the log's"
    completion = completion_ids(served, target.tokenizer)
    if isinstance(completion, str):
        return completion
    if len(completion) > target.max_new_tokens:
        return "longer than rollout.max_new_tokens"
    return rendered.ids, completion, setting


def completion_ids(served: Served, tokenizer) -> list[int] | str:
    """The completion's token ids, eos included where the target stopped on it; or why there are none."""
    stopped_on_string = isinstance(served.stop_reason, str)
    if stopped_on_string and not served.text.endswith(served.stop_reason):
        return "cut by a stop string that is not in the text"
    if served.completion_ids is not None:
        ids = list(served.completion_ids)
    else:
        if not served.text:
            return "empty completion"
        ids = tokenizer(served.text, add_special_tokens=False)["input_ids"]
        if tokenizer.decode(ids) != served.text:
            return "text does not round trip through the tokenizer"
        if served.finish_reason == "stop" and not stopped_on_string:
            ids.append(tokenizer.eos_token_id)  # the server stopped on the target's eos, which the text leaves out
    return ids or "empty completion"


def prompt_id(ids: list[int]) -> str:
    """A prompt's id in the imported pool: the same rendered prompt, served many times, is one prompt."""
    return "served-" + hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16]


def import_logs(paths: list[Path], fmt: str | None, target: Target, made_by: dict,
                tick: Callable[[], None] = lambda: None) -> Imported:
    """Every served completion of `paths` as a sample row (with `made_by`: the run's provenance and the logs'
    digests), or counted by why it is skipped; `tick` after each row (a progress bar)."""
    out, numbers = Imported(), Counter[tuple]()
    for path in paths:
        out.formats[str(path)], served_rows = read_log(path, fmt)
        for served in served_rows:
            tick()
            out.counts["-", "n > 1: choices beyond the first"] += served.extra_choices
            if served.problem is not None:
                out.malformed.append(served.problem)
            got = sample_of(served, target)
            if isinstance(got, str):
                out.counts[_setting_name(served.sampling or target.sampling), got] += 1
                continue
            prompt_ids, completion, setting = got
            pid = prompt_id(prompt_ids)
            key = tuple(setting[k] for k in SAMPLING_KEYS)
            out.prompts.setdefault(pid, {"id": pid, **({"messages": served.messages} if served.messages
                                                       else {"prompt": served.prompt})})
            out.rows.append({"id": pid, "prompt_ids": prompt_ids, "response_ids": completion,
                             "sampling": setting, "sample": numbers[key, pid], **made_by,
                             "flops": {"target_forward": 0.0, "drafter_forward": 0.0, "drafter_train": 0.0}})
            numbers[key, pid] += 1
            out.counts[_setting_name(setting), "imported"] += 1
    return out


def _setting_name(setting: dict[str, float] | None) -> str:
    if setting is None:
        return "-"
    return f"T={setting['temperature']:g} top_p={setting['top_p']:g} top_k={setting['top_k']:g}"


def log_facts(path: Path) -> tuple[str, int]:
    """A log file's digest, kept in each row's provenance (which logs a sample file was made from), and its rows
    (the progress bar's total), in one read of its bytes."""
    digest, rows = hashlib.sha256(), 0
    with path.open("rb") as f:
        for line in f:
            digest.update(line)
            rows += bool(line.strip())
    return digest.hexdigest()[:16], rows
