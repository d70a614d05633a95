"""The math corpus must be reproducible, cover every family, vary its wording and never teach wrong arithmetic."""

import re

import pytest

from opd.tiny.math_corpus import FAMILIES, generate

# One binary equation "a op b = c"; the lookarounds stop it matching inside a longer chain such as "1 + 2 + 3 = 6".
EQUATION = re.compile(r"(?<![\d+*/=-] )(?<!\d)(\d+) ([-+*/]) (\d+) = (\d+)(?!\d| [-+*/=])")
FINAL_LINE = re.compile(r"The answer is (\d+)\.")
SAMPLE = 2000


@pytest.fixture(scope="module")
def sample():
    return generate(seed=7, n=SAMPLE)


def _texts(problems):
    return [(p.family, p.prompt, p.response) for p in problems]


def test_same_seed_gives_same_list_and_different_seeds_differ():
    assert generate(3, 200) == generate(3, 200)
    assert _texts(generate(3, 200)) != _texts(generate(4, 200))  # the texts differ, not just the ids
    assert generate(3, 50) == generate(3, 200)[:50]


def test_every_family_appears_and_ids_are_unique(sample):
    assert {p.family for p in sample} == set(FAMILIES)
    assert len(FAMILIES) >= 15
    assert len({p.id for p in sample}) == SAMPLE
    assert sample[5].id == "math-7-5"


def _check_arithmetic(response: str) -> None:
    """Every "=" belongs to one correct binary equation, there are 2..5 of them, and the last one is the answer."""
    *lines, final = response.split("\n")
    answer = FINAL_LINE.fullmatch(final)
    assert answer, f"last line is not 'The answer is N.': {final!r}"
    results = []
    for line in lines:
        equations = EQUATION.findall(line)
        assert len(equations) == line.count("="), f"malformed equation in {line!r}"
        for a, op, b, c in equations:
            a, b, c = int(a), int(b), int(c)
            expected = {"+": a + b, "-": a - b, "*": a * b, "/": a // b}[op]
            assert c == expected and (op != "/" or a == b * c), f"wrong arithmetic in {line!r}"
            results.append(c)
    assert 2 <= len(results) <= 5, response
    assert int(answer.group(1)) == results[-1], response


def test_every_equation_is_right_and_the_answer_is_the_last_result(sample):
    for problem in sample:
        _check_arithmetic(problem.response)


@pytest.mark.parametrize("bad", [
    "First, 4 * 12 = 47 dollars.\nSo 47 + 1 = 48.\nThe answer is 48.",  # wrong product
    "First, 4 * 12 = 48 dollars.\nSo 48 + 1 = 49.\nThe answer is 48.",  # answer is not the last result
    "First, 1 + 2 + 3 = 6.\nSo 6 * 2 = 12.\nThe answer is 12.",  # chained equation
    "First, 7 / 2 = 3.\nSo 3 * 2 = 6.\nThe answer is 6.",  # inexact division
    "So 4 * 12 = 48.\nThe answer is 48.",  # a single step
])
def test_the_arithmetic_check_catches_mistakes(bad):
    with pytest.raises(AssertionError):
        _check_arithmetic(bad)


def test_wording_varies(sample):
    assert len({p.response for p in sample}) > SAMPLE - 10
    assert len({p.response.split("\n")[0] for p in sample}) > 20
    assert len({p.prompt.split()[1] for p in sample}) > 20  # questions do not all open the same way
    step_openings = {line.split()[0] for p in sample for line in p.response.split("\n")[:-1]}
    assert len(step_openings) > 30  # steps are not all introduced the same way


def test_text_is_plain_ascii_and_framed_consistently(sample):
    for p in sample:
        for text in (p.prompt, p.response):
            assert text.isascii() and "\t" not in text and "\n\n" not in text and "  " not in text
        assert p.prompt.startswith("Question: ") and p.prompt.endswith("\nAnswer:\n")
        assert not p.response.endswith("\n") and p.response.startswith(p.response[0].upper())


def test_lengths_suit_a_small_model(sample):
    prompt_words = sorted(len(p.prompt.split()) for p in sample)
    response_words = sorted(len(p.response.split()) for p in sample)
    assert 15 <= prompt_words[0] and prompt_words[-1] <= 70
    assert 18 <= response_words[0] and response_words[-1] <= 100
    assert 25 <= response_words[SAMPLE // 2] <= 60  # the median
