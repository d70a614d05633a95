"""A benchmark suite: which benchmarks a drafter's table has (`configs/suites/*.yaml`), the directory `opd suite
build` writes for it (one prompt file per benchmark and a card), and those prompts as a target sees them.

A suite YAML names registry benchmarks (opd/data/benchmarks.py) and may change a benchmark's count, its max new
tokens (both thinking modes: the tiny target answers in 128) or, for MT-Bench, its turns:

    name: paper
    seed: 0                  # the subset shuffle's seed (the authors': 0)
    benchmarks:
      - name: gsm8k
      - name: mtbench
        turns: 2             # the transformers harness: the target's own first answer, then the second question

Prompt files are `messages` rows (one user turn; MT-Bench's later user turns ride along in `next_turns`), so a
chat target renders them through its own template. A raw target (the tiny one, trained without a template)
reads the user turn's text as its prompt.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from opd.data.benchmarks import BENCHMARKS
from opd.data.prompts import Prompt
from opd.data.render import Rendering, check_tokenizer, render
from opd.data.source_rows import sha256_of
from opd.errors import OpdError
from opd.model_dir import ModelDir
from opd.spec import SamplingSpec

SUITES_DIR = Path("configs/suites")  # `--suite NAME` resolves here, relative to the repository root
CARD = "card.json"


class SuiteBenchmark(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    count: int | None = Field(None, ge=1)  # None: the registry's (the authors' subset size)
    max_new_tokens: int | None = Field(None, ge=1)  # None: the registry's per thinking mode
    turns: Literal[1, 2] = 1  # MT-Bench only: 2 feeds the first answer back, as the transformers harness does

    @field_validator("name")
    @classmethod
    def _known(cls, name: str) -> str:
        if name not in BENCHMARKS:
            raise ValueError(f"unknown benchmark {name!r} (expected one of {', '.join(BENCHMARKS)})")
        return name

    @model_validator(mode="after")
    def _turns(self) -> SuiteBenchmark:
        if self.turns == 2 and not BENCHMARKS[self.name].multi_turn:
            raise ValueError(f"turns: 2 but {self.name} has one turn per row (expected 1)")
        return self


class SuiteSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    seed: int = 0
    benchmarks: list[SuiteBenchmark] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique(self) -> SuiteSpec:
        names = [b.name for b in self.benchmarks]
        if dupes := sorted({n for n in names if names.count(n) > 1}):
            raise ValueError(f"benchmark {dupes[0]!r} is listed twice (expected each once)")
        return self


def load_suite(name: str) -> SuiteSpec:
    """`name` as a YAML path, else configs/suites/NAME.yaml; one line naming the field on any problem."""
    path = Path(name) if Path(name).suffix in (".yaml", ".yml") else SUITES_DIR / f"{name}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in SUITES_DIR.glob("*.yaml"))
        raise OpdError(f"--suite {name}: no {path} (expected a suite YAML or one of: {', '.join(known) or 'none'}, "
                       "run from the repository root)")
    try:
        return SuiteSpec.model_validate(yaml.safe_load(path.read_text()) or {})
    except yaml.YAMLError as exc:
        raise OpdError(f"{path}: not valid YAML ({' '.join(str(exc).split())})") from None
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        msg = "unknown field" if err["type"] == "extra_forbidden" else err["msg"].removeprefix("Value error, ")
        raise OpdError(f"{path}: {where + ': ' if where else ''}{msg}") from None


@dataclass
class BenchmarkCard:
    """What one benchmark's prompt file holds and where it came from."""

    name: str
    category: str
    file: str  # the prompt file, inside the suite directory
    origin: str  # "package:...", "hub:<id>@<commit>" or "file:<path>"
    sha256: str | None  # of the source file read; hub sources are pinned by their commit
    source_rows: int
    count: int  # rows written: the first `count` after the seed's shuffle, or every row when fewer
    subset: bool  # whether the rows were shuffled and cut (the source had more than `count`)
    format: str
    turns: int
    max_new_tokens: dict[str, int]  # {"thinking_off": n, "thinking_on": n}
    file_sha256: str  # of the prompt file: a resumed build keeps it only while it is intact
    request: dict = field(default_factory=dict)  # what was asked (count, turns, tokens, seed, --file): resume key


@dataclass
class SuiteCard:
    suite: str
    seed: int
    benchmarks: list[BenchmarkCard] = field(default_factory=list)

    def get(self, name: str) -> BenchmarkCard | None:
        return next((b for b in self.benchmarks if b.name == name), None)

    def write(self, out: Path) -> None:
        """Atomically: an interrupted write leaves the previous card."""
        tmp = out / f"{CARD}.tmp"
        tmp.write_text(json.dumps(asdict(self), indent=2) + "\n")
        tmp.replace(out / CARD)


def read_card(out: Path) -> SuiteCard | None:
    """The card of a built suite directory, or None when there is none yet."""
    path = out / CARD
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        return SuiteCard(data["suite"], data["seed"], [BenchmarkCard(**b) for b in data["benchmarks"]])
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise OpdError(f"{path}: not a suite card ({exc}; expected the card `opd suite build` writes, or an "
                       "empty --out directory)") from None


def built_suite(out: str | Path, field: str = "--suite") -> SuiteCard:
    """A built suite directory's card, every benchmark's file present and as the build wrote it (a file cut or
    edited since would be evaluated short, or not parse), or one line naming the fix; `field` names where the
    directory was given (the flag, or a spec's `eval.suite`)."""
    out = Path(out)
    card = read_card(out)
    if card is None or not card.benchmarks:
        raise OpdError(f"{field} {out}: no {CARD} (expected a directory `opd suite build --out {out}` wrote)")
    for b in card.benchmarks:
        if not (out / b.file).is_file():
            raise OpdError(f"{field} {out}: {b.file} is missing (expected `opd suite build` to finish writing it)")
        if sha256_of(out / b.file) != b.file_sha256:
            raise OpdError(f"{field} {out}: {b.file} is not the file the build wrote (its sha256 differs from "
                           f"{CARD}'s: cut or edited since; expected `opd suite build --suite {card.suite} --out {out}` "
                           "to rebuild it)")
    return card


def read_rows(path: Path) -> list[dict]:
    """A prompt file's rows; a line that is not JSON (a file cut mid-row) is one line naming it."""
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise OpdError(f"{path} line {number}: not JSON ({exc.msg}; expected the rows `opd suite build` "
                               "writes: rebuild the suite with it)") from None
    return rows


def suite_prompts(rows: list[dict], tokenizer, rendering: Rendering, max_prompt_tokens: int | None,
                  where: str) -> list[Prompt]:
    """Suite rows as the target sees them: the chat template over their `messages`, or under `raw` the one user
    turn's text. A prompt longer than `max_prompt_tokens` (None: any length) is one line naming the setting to
    raise."""
    check_tokenizer(tokenizer, rendering)
    prompts = []
    for row in rows:
        messages = row["messages"]
        if rendering.mode == "raw" and len(messages) > 1:
            raise OpdError(f"{where}: {row['id']} has {len(messages)} turns, which a raw target cannot read "
                           "(expected data.render: chat, or turns: 1)")
        text = messages[0]["content"] if rendering.mode == "raw" else None
        rendered = render(text, None if text is not None else messages, tokenizer, rendering)
        prompts.append(Prompt(row["id"], rendered.text, rendered.ids))
    longest = max(prompts, key=lambda p: len(p.ids))
    if max_prompt_tokens is not None and len(longest.ids) > max_prompt_tokens:
        raise OpdError(f"{where}: {longest.id} renders to {len(longest.ids)} tokens, more than "
                       f"data.max_prompt_tokens={max_prompt_tokens} (expected --set data.max_prompt_tokens="
                       f"{len(longest.ids)}, the longest of its prompts)")
    return prompts


@dataclass
class BenchmarkPrompts:
    """One benchmark of a built suite as the target reads it, checked before any benchmark's first sample."""

    card: BenchmarkCard
    rows: list[dict]
    prompts: list[Prompt]
    max_new_tokens: int  # its answer cap in this rendering's thinking mode
    longest: int  # its longest prompt in tokens; with turns: 2, the second turn's with a full-length first answer


def suite_inputs(card: SuiteCard, suite_dir: Path, tokenizer, rendering: Rendering, context: int | None,
                 field: str) -> list[BenchmarkPrompts]:
    """Every benchmark's rows parsed and rendered, and each prompt with its answer within the target's `context`
    (None: unbounded), so a bad benchmark is refused before the first sample of any other is drawn. A benchmark
    is its prompts: they are not held to data.max_prompt_tokens, the training prompts' cap."""
    out = []
    for bench in card.benchmarks:
        where = f"{field} {suite_dir / bench.file}"
        if bench.turns == 2 and rendering.mode == "raw":
            raise OpdError(f"{where}: turns: 2, but a raw target (data.render: raw) cannot read MT-Bench's second "
                           "turn (expected data.render: chat on a target with a chat template, or turns: 1 in the "
                           "suite)")
        rows = read_rows(suite_dir / bench.file)
        prompts = suite_prompts(rows, tokenizer, rendering, None, where)
        tokens = bench.max_new_tokens["thinking_on" if thinking(rendering) else "thinking_off"]
        longest = max(prompts, key=lambda p: len(p.ids))
        length, what = len(longest.ids), longest.id
        if bench.turns == 2:  # the second turn holds the first answer, at most `tokens` long
            second = suite_prompts(second_turn_rows(rows, [""] * len(rows), "check"), tokenizer, rendering, None,
                                   where)
            longest = max(second, key=lambda p: len(p.ids))
            length, what = len(longest.ids) + tokens, f"{longest.id.split('#')[0]}'s second turn"
        check_context(what, length, tokens, context, where)
        out.append(BenchmarkPrompts(bench, rows, prompts, tokens, length))
    return out


def check_context(what: str, length: int, tokens: int, context: int | None, where: str) -> None:
    """A prompt and its answer within the target's position range: the limit that binds a suite, since its prompts
    are the benchmark's and are not cut."""
    if context is not None and length + tokens > context:
        raise OpdError(f"{where}: {what} is {length} tokens, which with {tokens} new tokens pass the target's "
                       f"context of {context} (max_position_embeddings; expected shorter prompts, or a smaller "
                       "max_new_tokens in the suite)")


def target_context(target_path: str) -> int | None:
    """The target's context length from its config.json (None where it names none), read without loading it."""
    directory = ModelDir.find(target_path, "target model")
    return directory.int_or_none("max_position_embeddings") if directory is not None else None


def scored_settings(settings: list[SamplingSpec]) -> list[SamplingSpec]:
    """The point-mass eval settings a suite is scored at (its blocks are rebuilt offline, which sampled drafts
    cannot be); none is one line naming eval.sampling."""
    scored = [s for s in settings if s.draft == "argmax"]
    if not scored:
        raise OpdError(f"eval.sampling: every setting ({', '.join(s.name for s in settings)}) has draft: sample, "
                       "but a suite is scored offline on point-mass drafts (expected at least one setting with "
                       "draft: argmax)")
    return scored


def thinking(rendering: Rendering) -> bool:
    """Whether the target thinks (the longer token budget): a chat template's default is Qwen3's, on."""
    return rendering.mode == "chat" and rendering.enable_thinking is not False


def second_turn_rows(rows: list[dict], answers: list[str], setting: str) -> list[dict]:
    """MT-Bench's second turn as the transformers harness asks it: the first question, the target's own first
    answer as the assistant turn (where a served chat keeps it in the history), then the second question. Ids
    name the setting: each setting's first answer is its own sample, so its second-turn prompt is its own."""
    return [{"id": f"{row['id']}#turn2@{setting}",
             "messages": [*row["messages"], {"role": "assistant", "content": answer},
                          {"role": "user", "content": row["next_turns"][0]}]}
            for row, answer in zip(rows, answers)]
