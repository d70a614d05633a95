"""The zlab suite (configs/suites/zlab.yaml) against z-lab's own harness, `dflash.benchmark`: from rows in each
source's own columns, `opd suite build` writes z-lab's prompt texts row by row and picks z-lab's subset in z-lab's
order, and the suite's counts, seed and lengths are the ones the package documents and defaults to."""

from __future__ import annotations

import importlib.metadata
import json
import re
import sys
import types
from pathlib import Path

import pytest
import yaml

from opd.cli import main
from opd.data.benchmarks import BENCHMARKS, HubDataset
from opd.data.suite import read_card, read_rows

zlab = pytest.importorskip("dflash.benchmark", reason="z-lab's dflash package is not installed (the interop extra)")

ZLAB_SUITE = Path(__file__).resolve().parents[1] / "configs" / "suites" / "zlab.yaml"
TRICKY = "  {x} \\frac{1}{2} é\t\n"  # braces, a backslash, non-ASCII and edge whitespace: nothing may format or strip


def source_rows(name: str, n: int) -> list[dict]:
    """n rows of z-lab dataset `name` in its hub columns, extra columns included, as `datasets` serves them."""
    def row(i: int) -> dict:
        text = f"Question {i}:{TRICKY}"
        return {
            "gsm8k": {"question": text, "answer": f"#### {i}"},
            "math500": {"problem": text, "solution": "...", "answer": str(i), "subject": "Algebra", "level": 1,
                        "unique_id": f"test/algebra/{i}.json"},
            "humaneval": {"task_id": f"HumanEval/{i}", "prompt": f"def f{i}(x):\n    \"\"\"{TRICKY}\"\"\"\n",
                          "canonical_solution": "    return x\n", "test": "def check(c): ...", "entry_point": f"f{i}"},
            "mbpp": {"source_file": "x.ipynb", "task_id": i, "prompt": text, "code": "...", "test_imports": [],
                     "test_list": ["assert True"]},
            "mt-bench": {"prompt": [text, f"Follow-up {i}:{TRICKY}"], "prompt_id": i, "category": "writing",
                         "reference": []},
        }[name]
    return [row(i) for i in range(n)]


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def fake_hub(monkeypatch, sources: dict[str, list[dict]]) -> None:
    """A `datasets` whose load_dataset serves `sources` at the hub id, config and split this project's registry
    names for each benchmark: z-lab's loader finds its rows only where both name the same dataset."""
    served = {}
    for name, rows in sources.items():
        hub = next(s for s in BENCHMARKS[name].sources if isinstance(s, HubDataset))
        served[(hub.dataset, *([hub.config] if hub.config else []), hub.split)] = rows

    def load_dataset(*args: str, split: str) -> list[dict]:
        assert (*args, split) in served, f"z-lab loads {(*args, split)}, the registry names {list(served)}"
        return served[(*args, split)]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))


def build(tmp_path: Path, suite: Path, sources: dict[str, list[dict]]) -> Path:
    out = tmp_path / "suite"
    files = [f"--file={name}={write_jsonl(tmp_path / f'{name}.jsonl', rows)}" for name, rows in sources.items()]
    assert main(["suite", "build", "--suite", str(suite), "--out", str(out), *files]) == 0
    return out


def turns(row: dict) -> list[str]:
    """A suite row's user turns, as z-lab's harness sends them one after the other."""
    return [row["messages"][0]["content"], *row.get("next_turns", [])]


def zlab_turns(name: str, source_row: dict) -> list[str]:
    fmt = zlab.DATASETS[name]["format"]
    return fmt(source_row) if zlab.DATASETS[name].get("multi_turn") else [fmt(source_row)]


def documented_count() -> int:
    """The subset size the package's README runs its benchmark with (`--max-samples N`, `--num-prompts N`)."""
    readme = importlib.metadata.distribution("dflash").read_text("METADATA")
    (count,) = set(re.findall(r"--(?:max-samples|num-prompts) (\d+)", readme))
    return int(count)


def default_max_new_tokens() -> int:
    from dflash.cli import _parser

    return _parser().parse_args(["benchmark", "transformers", "--model", "m", "--dataset", "gsm8k"]).max_new_tokens


def test_the_zlab_suite_is_z_labs_prompts_subsets_and_lengths(tmp_path, monkeypatch):
    n = documented_count()
    sources = {name: source_rows(name, 80 if name == "mt-bench" else n + 22) for name in zlab.DATASETS}
    out = build(tmp_path, ZLAB_SUITE, sources)
    fake_hub(monkeypatch, sources)
    card = read_card(out)
    assert card.seed == 42 and [b.name for b in card.benchmarks] == list(zlab.DATASETS)
    for name in zlab.DATASETS:
        rows, entry = read_rows(out / f"{name}.jsonl"), card.get(name)
        for row in rows:  # row by row, z-lab's format over the source row the suite row came from
            assert turns(row) == zlab_turns(name, sources[name][row["source_index"]]), name
        picked = [item["turns"] for item in zlab._select_dataset(zlab.load_and_process_dataset(name), n)]
        if entry.subset:  # fewer than the source: the same rows in the same order
            assert [turns(r) for r in rows] == picked and len(rows) == n, name
        else:  # MT-Bench's 80 < n: z-lab takes them all in shuffled order, the suite in the source's
            assert sorted(map(turns, rows)) == sorted(picked) and len(rows) == len(sources[name]), name
        assert entry.max_new_tokens == {"thinking_off": default_max_new_tokens(),
                                        "thinking_on": default_max_new_tokens()}, name
        assert entry.turns == (2 if zlab.DATASETS[name].get("multi_turn") else 1), name
    assert [card.get(name).subset for name in zlab.DATASETS] == [True] * 4 + [False]


def test_a_smaller_subset_of_every_source_is_z_labs_in_its_order(tmp_path, monkeypatch):
    spec = yaml.safe_load(ZLAB_SUITE.read_text())
    for entry in spec["benchmarks"]:
        entry["count"] = 7
    suite = tmp_path / "zlab7.yaml"
    suite.write_text(yaml.safe_dump(spec))
    sources = {name: source_rows(name, 20) for name in zlab.DATASETS}
    out = build(tmp_path, suite, sources)
    fake_hub(monkeypatch, sources)
    for name in zlab.DATASETS:
        picked = [item["turns"] for item in zlab._select_dataset(zlab.load_and_process_dataset(name), 7)]
        assert [turns(r) for r in read_rows(out / f"{name}.jsonl")] == picked, name


def test_mt_bench_refuses_fastchats_layout_in_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # no hub: the local file is all there is
    suite = tmp_path / "mt.yaml"
    suite.write_text(yaml.safe_dump({"name": "mt", "seed": 42, "benchmarks": [{"name": "mt-bench", "turns": 2}]}))
    fastchat = write_jsonl(tmp_path / "question.jsonl", [{"question_id": 81, "category": "writing",
                                                           "turns": ["First?", "Second?"]}])
    assert main(["suite", "build", "--suite", str(suite), "--out", str(tmp_path / "o"),
                 "--file", f"mt-bench={fastchat}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "expected HuggingFaceH4/mt_bench_prompts's column 'prompt'" in err[0], err
