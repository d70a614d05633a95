"""Benchmark-suite inputs: one row per source in its real columns, a source file and a suite definition written
from them, and the single `error:` line a bad input must give."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

# One row per source, in its real columns (extra columns included, as the hub serves them).
SOURCES = {
    "gsm8k": [{"question": "Natalia sold clips to 48 of her friends. How many clips did she sell?",
               "answer": "She sold 48 clips.\n#### 48"}],
    "math500": [{"problem": "Convert the point $(0,3)$ to polar coordinates.", "solution": "...",
                 "answer": "\\left( 3, \\frac{\\pi}{2} \\right)", "subject": "Precalculus", "level": 2,
                 "unique_id": "test/precalculus/807.json"}],
    "aime24": [{"id": 60, "problem": "Every morning Aya goes for a $9$-kilometer-long walk.", "solution": "...",
                "answer": "204", "url": "https://artofproblemsolving.com/wiki", "year": "2024"}],
    "aime25": [{"problem": "Find the sum of all integer bases $b>9$ for which $17_b$ divides $97_b$.",
                "answer": "70", "id": "0"}],
    "mbpp": [{"source_file": "Benchmark Questions Verification V2.ipynb", "task_id": 2,
              "prompt": "Write a function to find the shared elements from the given two lists.",
              "code": "def similar_elements(a, b): ...", "test_imports": [], "test_list": ["assert True"]}],
    "humaneval": [{"task_id": "HumanEval/0", "prompt": "def add(a: int, b: int) -> int:\n    \"\"\"Sum.\"\"\"\n",
                   "canonical_solution": "    return a + b\n", "test": "def check(c): ...", "entry_point": "add"}],
    "mtbench": [{"question_id": 81, "category": "writing",
                 "turns": ["Compose a travel blog post about Hawaii.", "Rewrite it starting every sentence with A."]}],
}
def write(path: Path, rows: list[dict]) -> str:
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def suite_yaml(tmp_path: Path, benchmarks: list[dict], name: str = "t") -> str:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"name": name, "seed": 0, "benchmarks": benchmarks}))
    return str(path)


def one_error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]
