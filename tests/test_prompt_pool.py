"""`opd prompt-pool` on small fixture files in each source's own column layout: seeded counts, exact
de-duplication across sources, MATH-500 left out, a held-out split disjoint from the pool, and the card."""

from __future__ import annotations

import hashlib
import json
import sys

import pytest

from opd.cli import main

GSM8K = [{"question": f"Sam has {n} pens and buys 2 more. How many?", "answer": f"#### {n + 2}"} for n in range(7)]
GSM8K.append({"question": "Sam has 0 pens  and buys 2\nmore. How many?", "answer": "#### 2"})  # whitespace dup
MATH500 = [{"problem": f"Find $x$ if $x + {n} = 10$.", "solution": "", "answer": str(10 - n), "subject": "Algebra",
            "level": 1, "unique_id": f"test/algebra/{n}.json"} for n in range(3)]
MATH = [{"problem": f"Compute ${n}^2$.", "level": "Level 1", "type": "Algebra", "solution": f"${n * n}$"}
        for n in range(6)]
MATH += [{**MATH500[0], "level": "Level 1", "type": "Algebra"},  # a MATH-500 problem: left out
         {"problem": GSM8K[1]["question"], "level": "Level 1", "type": "Algebra", "solution": ""}]  # a GSM8K dup
AOPS = [{"source": "aops_forum", "problem": f"Prove that {n} divides {n}^3 - {n}.", "solution": "", "messages": []}
        for n in range(2, 8)]
AOPS += [{"source": "olympiads", "problem": f"Olympiad {n}.", "solution": "", "messages": []} for n in range(4)]
CODEALPACA = [{"instruction": f"Write a function that returns {n}.", "input": "", "output": ""} for n in range(5)]
CODEALPACA.append({"instruction": "Sort this list.", "input": "[3, 1, 2]", "output": ""})


@pytest.fixture
def sources(tmp_path) -> dict[str, str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    files = {"gsm8k": tmp_path / "gsm8k.jsonl", "math": tmp_path / "math.jsonl", "aops": tmp_path / "aops.parquet",
             "codealpaca": tmp_path / "codealpaca.json", "math500": tmp_path / "math500.jsonl"}
    for name, rows in (("gsm8k", GSM8K), ("math", MATH), ("math500", MATH500)):
        files[name].write_text("".join(json.dumps(r) + "\n" for r in rows))
    pq.write_table(pa.Table.from_pylist([{**r, "messages": ["x"]} for r in AOPS]), files["aops"])
    files["codealpaca"].write_text(json.dumps(CODEALPACA))
    return {name: str(path) for name, path in files.items()}


def pool_args(sources: dict[str, str], out, seed: int = 0, count: int = 3) -> list[str]:
    args = ["prompt-pool", "--out", str(out), "--heldout", "2", "--seed", str(seed), "--math500", sources["math500"]]
    for name in ("gsm8k", "math", "aops", "codealpaca"):
        args += ["--file", f"{name}={sources[name]}", "--count", f"{name}={count}"]
    return args


def read(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_pool_counts_dedup_heldout_and_card(sources, tmp_path, capsys):
    assert main(pool_args(sources, tmp_path / "pool")) == 0
    train, held = read(tmp_path / "pool" / "prompts.jsonl"), read(tmp_path / "pool" / "eval_prompts.jsonl")
    per_source = {name: sum(r["source"] == name for r in train) for name in ("gsm8k", "math", "aops", "codealpaca")}
    assert per_source == {"gsm8k": 3, "math": 3, "aops": 3, "codealpaca": 3} and len(held) == 4 * 2
    texts = [" ".join(r["prompt"].split()) for r in train + held]
    assert len(set(texts)) == len(texts)  # no duplicate anywhere, so the held-out split shares nothing with train
    assert len({r["id"] for r in train + held}) == len(texts)
    assert not {m["problem"] for m in MATH500} & set(texts)
    allowed = ({r["question"] for r in GSM8K} | {r["problem"] for r in MATH[:6]}
               | {r["problem"] for r in AOPS if r["source"] == "aops_forum"}
               | {r["instruction"] for r in CODEALPACA[:5]} | {"Sort this list.\n\n[3, 1, 2]"})
    assert {r["prompt"] for r in train + held} <= allowed  # only this source's rows, CodeAlpaca's input appended

    card = json.loads((tmp_path / "pool" / "card.json").read_text())
    assert card["seed"] == 0 and card["heldout_per_source"] == 2
    assert card["excluded_sha256"] == hashlib.sha256(open(sources["math500"], "rb").read()).hexdigest()
    by_name = {s["name"]: s for s in card["sources"]}
    # hand count: GSM8K's whitespace variant; MATH's MATH-500 problem and its GSM8K copy
    assert {n: (s["rows"], s["duplicates"]) for n, s in by_name.items()} == {
        "gsm8k": (8, 1), "math": (8, 2), "aops": (6, 0), "codealpaca": (6, 0)}
    assert by_name["aops"]["origin"] == f"file:{sources['aops']}"
    assert by_name["aops"]["sha256"] == hashlib.sha256(open(sources["aops"], "rb").read()).hexdigest()
    assert "gsm8k: 3 train + 2 held out" in capsys.readouterr().out


def test_the_seed_decides_the_sample(sources, tmp_path):
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        assert main(pool_args(sources, tmp_path / name, seed)) == 0
    same, other = ((tmp_path / x / "prompts.jsonl").read_text() for x in ("b", "c"))
    assert (tmp_path / "a" / "prompts.jsonl").read_text() == same != other


def test_pool_rows_load_as_prompts(sources, tmp_path, micro_assets):
    from opd.data.prompts import load_prompts, load_tokenizer

    assert main(pool_args(sources, tmp_path / "pool")) == 0
    prompts = load_prompts(str(tmp_path / "pool" / "prompts.jsonl"), load_tokenizer(micro_assets["target"]),
                           max_prompt_tokens=512).prompts
    assert len(prompts) == 12


def one_error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def test_bad_input_is_one_line(sources, tmp_path, capsys, monkeypatch):
    assert main(pool_args(sources, tmp_path / "p", count=6)) == 2  # GSM8K has 7 distinct: 6 + 2 do not fit
    assert "source gsm8k has 7 distinct problems, fewer than its count 6 + 2" in one_error(capsys)
    (tmp_path / "bad.jsonl").write_text(json.dumps({"prompt": "no question column"}) + "\n")
    args = pool_args({**sources, "gsm8k": str(tmp_path / "bad.jsonl")}, tmp_path / "p")
    assert main(args) == 2 and "row 1: no string column 'question'" in one_error(capsys)
    assert main(pool_args(sources, tmp_path / "p") + ["--count", "gsm8k=x"]) == 2
    assert "expected SOURCE=N" in one_error(capsys)
    assert main(pool_args(sources, tmp_path / "p") + ["--file", "wiki=a.jsonl"]) == 2
    assert "unknown source 'wiki'" in one_error(capsys)
    monkeypatch.setitem(sys.modules, "datasets", None)
    assert main(["prompt-pool", "--out", str(tmp_path / "p"), "--math500", sources["math500"]]) == 2
    assert "pip install datasets" in one_error(capsys)


def test_a_corrupt_parquet_file_is_one_line(sources, tmp_path, capsys):
    whole = open(sources["aops"], "rb").read()
    cut = tmp_path / "cut.parquet"
    cut.write_bytes(whole[: len(whole) // 2])  # a download that stopped halfway
    assert main(pool_args({**sources, "aops": str(cut)}, tmp_path / "p")) == 2
    assert one_error(capsys).startswith(f"error: prompt-pool: {cut}: unreadable (Could not open Parquet input "
                                        "source") and not (tmp_path / "p").exists()


def test_a_csv_given_as_jsonl_names_jsonl(sources, tmp_path, capsys):
    csv = tmp_path / "gsm8k.csv"
    csv.write_text("question,answer\nSam has 3 pens.,#### 3\n")
    assert main(pool_args({**sources, "gsm8k": str(csv)}, tmp_path / "p")) == 2
    assert one_error(capsys) == (f"error: prompt-pool: {csv}: unreadable (line 1: Expecting value); expected "
                                 "JSONL, one JSON object per line")


def test_an_out_that_is_a_file_is_refused_before_any_read(sources, tmp_path, capsys, monkeypatch):
    import opd.data.pool

    monkeypatch.setattr(opd.data.pool, "_read", lambda *a: pytest.fail("sources read before --out was checked"))
    out = tmp_path / "pool.jsonl"
    out.write_text("kept\n")
    assert main(pool_args(sources, out)) == 2
    assert one_error(capsys) == (f"error: --out: {out} is a file (expected a directory for prompts.jsonl, "
                                 "eval_prompts.jsonl and card.json)")
    assert out.read_text() == "kept\n"
