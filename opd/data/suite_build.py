"""`opd suite build`: a suite's prompt files and card, from each benchmark's source (opd/data/benchmarks.py).

Resumable: each benchmark's file is written whole under a temporary name and renamed into place, then the card is
rewritten (also atomically). A rerun keeps a benchmark whose card entry asks for the same thing and whose file
still has the hash the card recorded, so an interrupted build finishes the rest and never duplicates a row.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from opd.data.benchmarks import FORMATS, Benchmark, benchmark, load_rows
from opd.data.source_rows import sha256_of
from opd.data.suite import BenchmarkCard, SuiteBenchmark, SuiteCard, SuiteSpec, read_card
from opd.errors import OpdError
from opd.outputs import check_output_dir


def build_suite(suite: SuiteSpec, out: Path, files: dict[str, str], log=print) -> SuiteCard:
    """Write OUT/<benchmark>.jsonl for every benchmark of `suite` and OUT/card.json; `files`: benchmark -> a local
    copy of its source. Returns the card."""
    check_output_dir(out, "--out", "the suite's prompt files and card")
    names = [b.name for b in suite.benchmarks]
    for name, file in files.items():
        benchmark(name, names)
        _check_file(name, file)
    out.mkdir(parents=True, exist_ok=True)
    old = read_card(out)
    card = SuiteCard(suite.name, suite.seed)
    for entry in suite.benchmarks:
        request = _request(suite, entry, files.get(entry.name))
        kept = old.get(entry.name) if old is not None else None
        if kept is not None and kept.request == request and _intact(out, kept):
            log(f"{entry.name}: kept ({kept.count} prompts, {kept.origin})")
        else:
            kept = _build_one(out, benchmark(entry.name), entry, suite.seed, files.get(entry.name), request)
            log(f"{entry.name}: {kept.count} of {kept.source_rows} rows, {kept.origin}")
        card.benchmarks.append(kept)
        card.write(out)
    return card


def _request(suite: SuiteSpec, entry: SuiteBenchmark, file: str | None) -> dict:
    """Everything a benchmark's file depends on; a local file by its hash, so a replaced copy is rebuilt."""
    return {**entry.model_dump(), "seed": suite.seed, "file": file, "file_sha256": sha256_of(file) if file else None}


def _check_file(name: str, file: str) -> None:
    """A `--file` source is a readable file before it is hashed (the resume key) or parsed."""
    if not Path(file).is_file():
        what = "is a directory" if Path(file).is_dir() else "not found"
        raise OpdError(f"--file {name}={file}: {what} (expected a local jsonl, json or parquet file)")


def _intact(out: Path, card: BenchmarkCard) -> bool:
    path = out / card.file
    return path.is_file() and sha256_of(path) == card.file_sha256


def _build_one(out: Path, bench: Benchmark, entry: SuiteBenchmark, seed: int, file: str | None,
               request: dict) -> BenchmarkCard:
    source = load_rows(bench, file)
    count = entry.count or bench.count
    order = list(range(len(source.turns)))
    subset = count < len(order)
    if subset:
        random.Random(seed).shuffle(order)
        order = order[:count]
    rows = [_row(bench, i, source.turns[i], entry.turns) for i in order]
    path = out / f"{bench.name}.jsonl"
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tmp.replace(path)
    tokens = entry.max_new_tokens
    return BenchmarkCard(
        name=bench.name, category=bench.category, file=path.name, origin=source.origin, sha256=source.sha256,
        source_rows=len(source.turns), count=len(rows), subset=subset, format=bench.format, turns=entry.turns,
        max_new_tokens={"thinking_off": tokens or bench.max_tokens(False),
                        "thinking_on": tokens or bench.max_tokens(True)},
        file_sha256=sha256_of(path), request=request)


def _row(bench: Benchmark, index: int, turns: list[str], keep: int) -> dict:
    """A prompt row: the first user turn as `messages`; a two-turn suite keeps the next user turn beside it."""
    fmt = FORMATS[bench.format]
    row = {"id": f"{bench.name}-{index}", "messages": [{"role": "user", "content": fmt(turns[0])}],
           "benchmark": bench.name, "source_index": index}
    if keep > 1:
        if len(turns) < keep:
            raise OpdError(f"suite build: {bench.name} row {index + 1} has {len(turns)} turn(s) (expected {keep}, "
                           "or turns: 1)")
        row["next_turns"] = [fmt(t) for t in turns[1:keep]]
    return row


def parse_files(items: list[str]) -> dict[str, str]:
    """`--file BENCH=PATH` pairs; one line for a malformed one."""
    files = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise OpdError(f"--file {item!r}: expected BENCH=PATH (a local jsonl or parquet in the source's columns)")
        files[name] = path
    return files
