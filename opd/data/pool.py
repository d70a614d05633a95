"""`opd prompt-pool`: the paper's prompt pool, built reproducibly from its public sources.

The paper trains on 16K prompts: GSM8K train (2K), MATH train without the MATH-500 problems (5K), AoPS (4K) and
CodeAlpaca (5K). Each source is read from a local file (jsonl, json or parquet, in the dataset's own column
layout) or from the hub through the `datasets` library. Exact duplicates (after collapsing whitespace) are
dropped across all sources before sampling (and MATH-500's problems from every source, not only MATH), so the
held-out split, drawn from the same shuffle, shares no problem with the training pool. Sampling is seeded per
source. A card beside the output names each source (dataset id and commit, or file hash), its counts and the
seed, so the pool can be rebuilt and cited.

AoPS is ambiguous in the paper. We take the `aops_forum` rows of AI-MO/NuminaMath-CoT: the largest public set
of cleaned AoPS forum problems, with a `source` column that says which rows they are.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from opd.data.source_rows import read_file_rows, read_hub_rows, sha256_of
from opd.errors import OpdError
from opd.outputs import check_output_dir, write_text_atomic


def _codealpaca(row: dict) -> str:
    return row["instruction"] + (f"\n\n{row['input']}" if row.get("input") else "")


@dataclass(frozen=True)
class Source:
    """One public source: where it lives on the hub, its column layout and the paper's count."""

    name: str
    dataset: str
    config: str | None
    split: str
    count: int
    problem: Callable[[dict], str | None]  # the prompt text of a row; None = the row is not this source's
    columns: tuple[str, ...]  # what a local file's rows must carry


SOURCES = {s.name: s for s in (
    Source("gsm8k", "openai/gsm8k", "main", "train", 2000, lambda r: r["question"], ("question",)),
    Source("math", "EleutherAI/hendrycks_math", None, "train", 5000, lambda r: r["problem"], ("problem",)),
    Source("aops", "AI-MO/NuminaMath-CoT", None, "train", 4000,
           lambda r: r["problem"] if r["source"] == "aops_forum" else None, ("source", "problem")),
    Source("codealpaca", "sahil2801/CodeAlpaca-20k", None, "train", 5000, _codealpaca, ("instruction",)),
)}
MATH500 = ("HuggingFaceH4/MATH-500", "test")  # excluded from MATH train: the paper evaluates on them


@dataclass
class SourceCard:
    name: str
    origin: str  # "hub:<id>@<revision>" or "file:<path>"
    sha256: str | None  # the local file's hash
    rows: int  # rows of this source in the input
    duplicates: int  # dropped as an exact duplicate of an earlier problem (or a MATH-500 one)
    train: int
    heldout: int


@dataclass
class PoolCard:
    seed: int
    heldout_per_source: int
    excluded: str  # where the MATH-500 problems came from ("hub:<id>@<commit>" or "file:<path>")
    excluded_sha256: str | None
    sources: list[SourceCard] = field(default_factory=list)


def build_pool(out: Path, *, seed: int, heldout: int, files: dict[str, str], counts: dict[str, int],
               math500: str | None) -> PoolCard:
    """Write prompts.jsonl, eval_prompts.jsonl and card.json under `out`; return the card."""
    for name in (*files, *counts):
        if name not in SOURCES:
            raise OpdError(f"prompt-pool: unknown source '{name}' (expected one of {', '.join(SOURCES)})")
    excluded_rows, excluded = _read(MATH500[0], None, MATH500[1], math500, ("problem",))
    seen = {_key(r["problem"]) for r in excluded_rows}
    card, train, held = PoolCard(seed, heldout, excluded, sha256_of(math500) if math500 else None), [], []
    for s in SOURCES.values():
        rows, origin = _read(s.dataset, s.config, s.split, files.get(s.name), s.columns)
        problems = [(i, text) for i, r in enumerate(rows) if (text := s.problem(r)) and text.strip()]
        fresh = _distinct(problems, seen)
        want = counts.get(s.name, s.count)
        if len(fresh) < want + heldout:
            raise OpdError(f"prompt-pool: source {s.name} has {len(fresh)} distinct problems, fewer than its count "
                           f"{want} + {heldout} held out (expected a larger source or --count {s.name}=N)")
        picked = random.Random(f"{seed}/{s.name}").sample(fresh, want + heldout)
        held += [_row(s.name, i, text) for i, text in picked[:heldout]]
        train += [_row(s.name, i, text) for i, text in picked[heldout:]]
        sha = sha256_of(files[s.name]) if s.name in files else None
        card.sources.append(SourceCard(s.name, origin, sha, len(problems), len(problems) - len(fresh), want, heldout))
    for name, part in (("prompts.jsonl", train), ("eval_prompts.jsonl", held)):
        write_text_atomic(out / name, "".join(json.dumps(r) + "\n" for r in part))
    write_text_atomic(out / "card.json", json.dumps(asdict(card), indent=2) + "\n")
    return card


def _distinct(problems: list[tuple[int, str]], seen: set[str]) -> list[tuple[int, str]]:
    """The problems not seen before (in MATH-500, an earlier source or earlier in this one); marks them seen."""
    fresh = []
    for i, text in problems:
        if _key(text) not in seen:
            seen.add(_key(text))
            fresh.append((i, text))
    return fresh


def _key(text: str) -> str:
    """Exact duplicates up to whitespace: the same problem re-posted with other line breaks is one problem."""
    return " ".join(text.split())


def _row(source: str, index: int, text: str) -> dict:
    return {"id": f"{source}-{index}", "prompt": text.strip(), "source": source}


def _read(dataset: str, config: str | None, split: str, path: str | None,
          columns: tuple[str, ...]) -> tuple[list[dict], str]:
    """A source's rows, from `path` when given, else from the hub; and where they came from."""
    rows, origin = (read_file_rows(path, "prompt-pool"), f"file:{path}") if path else read_hub_rows(
        dataset, config, split, "prompt-pool", "pass a local file: --file SOURCE=PATH, --math500 PATH")
    for number, row in enumerate(rows, start=1):
        missing = [c for c in columns if not isinstance(row, dict) or not isinstance(row.get(c), str)]
        if missing:
            raise OpdError(f"prompt-pool: {path or dataset} row {number}: no string column '{missing[0]}' "
                           f"(expected the {dataset} layout: {', '.join(columns)})")
    return rows, origin


def run_prompt_pool(out: str, files: list[str], counts: list[str], math500: str | None, heldout: int,
                    seed: int) -> int:
    """The CLI's entry: parse SOURCE=VALUE pairs, build, and print one line per source."""
    check_output_dir(out, "--out", "prompts.jsonl, eval_prompts.jsonl and card.json")
    if heldout < 0:
        raise OpdError(f"--heldout: {heldout} (expected a count >= 0)")
    parsed = {name: int(n) for name, n in _pairs(counts, "--count", number=True).items()}
    card = build_pool(Path(out), seed=seed, heldout=heldout, files=_pairs(files, "--file"), counts=parsed,
                      math500=math500)
    for s in card.sources:
        print(f"{s.name}: {s.train} train + {s.heldout} held out, from {s.rows} rows ({s.duplicates} duplicates "
              f"dropped), {s.origin}")
    print(f"wrote {out}/prompts.jsonl, {out}/eval_prompts.jsonl and {out}/card.json (seed {seed})")
    return 0


def _pairs(items: list[str], flag: str, number: bool = False) -> dict[str, str]:
    pairs = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not value or (number and not (value.isdigit() and int(value) > 0)):
            expected = "SOURCE=N with N > 0" if number else "SOURCE=PATH"
            raise OpdError(f"{flag} {item!r}: expected {expected}")
        pairs[name] = value
    return pairs
