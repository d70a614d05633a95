"""A second held-out prompt family: math-corpus problems from an unused seed, with every question reworded.

Why this exists: held-out τ on `prompts/heldout.jsonl` is measured on the generator's own wordings (another seed,
same sentence templates the target was trained on). To check that a result generalises, this family changes
both the draw (generator seed `REWORDED_SEED`, which no build step uses) and the wording of each question.
Nothing trains or tunes on it: not the target, the warm drafter, its SFT data or Draft-OPD rollouts.

How: `generate(seed, n)` from `opd/tiny/math_corpus.py` draws the problems; then each question is rewritten
at the phrase level, driven by a separate RNG (`random.Random(f"reworded-{seed}")`, never the global one):

- its final question sentence is always replaced by one of a few alternatives (`QUESTION_RULES`, one rule per
  question sentence the families write, e.g. "How much money does Noah gain?" -> "What net profit does Noah
  make?"); every alternative holds a word that no generated question uses, so no reworded question can equal
  a generated one (the train, held-out and corpus prompts included);
- each matching clause-level rule in `PHRASE_RULES` ("buys" -> "purchases", "at $3 each" -> "at $3 apiece",
  "is 4 years older than" -> "was born 4 years before", ...) fires with probability `PHRASE_PROBABILITY`.

No rule adds, drops or reorders a number, the "Question: ...\\nAnswer:\\n" frame is kept exactly (the tiny
target knows only that frame), and the reference is the generator's worked response, unchanged.

The shift is real for the tiny target too: on the first draws of seed 11 its greedy final answers are right less often
with only the question sentence reworded than as generated, and least often as shipped, with no loops and every response
ending in eos (measured when the family was added; no file in bench/results holds it). So τ here measures the drafter on
a target that is itself partly off its training distribution, not the drafter alone.

Regenerate the shipped file (200 prompts, ids `reworded-<seed>-<i>`, same jsonl schema as heldout.jsonl):

    python -m opd.tiny.reworded --out opd/assets/tiny/prompts/reworded.jsonl
"""

from __future__ import annotations

import argparse
import random
import re
from dataclasses import replace
from pathlib import Path

from opd.tiny.math_corpus import GROUPS, Problem, generate

# Not CORPUS_SEED, TRAIN_PROMPT_SEED or HELDOUT_SEED (1, 2, 3 in opd/tiny/build.py), nor the tests' seed 7.
REWORDED_SEED = 11
REWORDED_PROMPTS = 200
PHRASE_PROBABILITY = 0.5
PREFIX, SUFFIX = "Question: ", "\nAnswer:\n"

_NAME = r"(?P<n>[A-Z][a-z]+)"  # a person's name (math_corpus.NAMES)
_MEMBERS = "|".join(members for _, members, _, _ in GROUPS)
_DOINGS = "|".join(re.escape(d) for _, _, some, others in GROUPS for d in (some, others))

# (pattern matched against the whole final question sentence, alternatives for Match.expand). First match wins;
# every question sentence a family can write matches one rule (tested), so every question is reworded.
QUESTION_RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    # shopping, change, wages, discount
    (rf"How much does {_NAME} spend in total\?",
     (r"What is the overall amount \g<n> spends?", r"How many dollars does \g<n> spend overall?")),
    (rf"How much money does {_NAME} spend altogether\?",
     (r"What sum of money does \g<n> spend?", r"How many dollars does \g<n> spend altogether?")),
    (r"What is the total cost\?", ("What is the overall cost?", "How many dollars is that altogether?")),
    (rf"How much does {_NAME} pay\?",
     (r"What does \g<n> end up paying?", r"How many dollars does \g<n> pay?", r"What price does \g<n> pay?")),
    (rf"How much change does {_NAME} get\?",
     (r"How much change is returned to \g<n>?", r"What change comes back to \g<n>?")),
    (rf"How much change should {_NAME} get back\?",
     (r"What change is owed to \g<n>?", r"How much change should come back to \g<n>?")),
    (rf"How much money does {_NAME} have left\?",
     (r"How much money does \g<n> have remaining?", r"What amount of money is still left for \g<n>?")),
    (rf"How much money does {_NAME} earn in total\?",
     (r"What are \g<n>'s total earnings?", r"How many dollars does \g<n> earn altogether?")),
    (rf"How much does {_NAME} save\?",
     (r"How many dollars does \g<n> save?", r"What amount does \g<n> save thanks to the sale?")),
    # sharing
    (r"How many (?P<t>\w+) does each of them get\?",
     (r"How many \g<t> does every single one of them get?", r"What is each person's share of the \g<t>?")),
    (r"How many (?P<t>\w+) does each one receive\?",
     (r"How many \g<t> does each person end up with?", r"How many \g<t> are in each share?")),
    (r"How many does each get\?", ("How many does each person receive?", "What is the size of each share?")),
    # speed
    (r"How far does (?P<n>.+) go in total\?",
     (r"What overall distance does \g<n> cover?", "How long is the whole journey?")),
    (r"What is the total distance\?", ("How long is the whole journey?", "What distance is covered overall?")),
    (r"At the same speed, how far does (?P<n>.+) go in (?P<h>\d+) hours\?",
     (r"Keeping that speed, how far does \g<n> go in \g<h> hours?",
      r"How far does \g<n> get in \g<h> hours at that pace?")),
    (r"Going at the same speed, how many (?P<u>\w+) will (?P<n>.+) cover in (?P<h>\d+) hours\?",
     (r"At an unchanged pace, how many \g<u> will \g<n> cover in \g<h> hours?",
      r"How many \g<u> will \g<n> travel in \g<h> hours at this steady pace?")),
    (r"If (?P<n>.+) (?P<v>\w+) at (?P<s>\d+) (?P<u>\w+) per hour, how many more hours will it take\?",
     (r"How many more hours are required if \g<n> \g<v> at \g<s> \g<u> per hour?",
      r"Moving at \g<s> \g<u> per hour, how many more hours does \g<n> need?")),
    (r"How many hours are left\?",
     ("How many hours of travel still remain?", "How much longer does the trip take, in hours?")),
    # ages
    (rf"How old will {_NAME} be in (?P<y>\d+) years\?",
     (r"How old will \g<n> be \g<y> years from today?", r"What age will \g<n> reach in \g<y> years?")),
    (rf"How old is {_NAME}\?", (r"What is \g<n>'s current age?", r"What age has \g<n> reached?")),
    # profit
    (rf"How much profit does {_NAME} make\?",
     (r"How many dollars of profit does \g<n> earn?", r"What is the net gain for \g<n>?")),
    (rf"What is {_NAME}'s profit\?", (r"How large is \g<n>'s profit?", r"What net gain does \g<n> make?")),
    (rf"How much money does {_NAME} gain\?",
     (r"How many dollars does \g<n> gain?", r"What net profit does \g<n> make?")),
    # recipe
    (rf"How many (?P<i>[\w ]+) does {_NAME} need to make (?P<w>\d+) (?P<d>[\w ]+)\?",
     (r"To make \g<w> \g<d>, how many \g<i> must \g<n> use?",
      r"How many \g<i> are required for \g<n> to make \g<w> \g<d>?")),
    (r"How many (?P<i>[\w ]+) are needed for (?P<w>\d+) (?P<d>[\w ]+)\?",
     (r"For \g<w> \g<d>, how many \g<i> are required?", r"What quantity of \g<i> goes into \g<w> \g<d>?")),
    (r"How many (?P<i>[\w ]+) are needed\?",
     (r"How many \g<i> are required?", r"What quantity of \g<i> is needed?")),
    # perimeter, area
    (r"How much does the fence cost\?",
     ("What is the price of the fence?", "How many dollars does the whole fence cost?")),
    (r"How many (?P<u>\w+) of fence are needed to go around it\?",
     (r"How many \g<u> of fencing does it take to enclose it?",
      r"How long must a fence be to surround it, in \g<u>?")),
    (r"How much does it cost to cover\?",
     ("What is the price of covering it?", "How many dollars does it take to cover it?")),
    (r"What is their total area in square (?P<u>\w+)\?",
     (r"How many square \g<u> do the two cover combined?", r"What area, in square \g<u>, do they cover between them?")),
    (r"What is the total area\?", ("How much area do they cover combined?", "What is their combined area?")),
    # compare
    (r"How many more (?P<t>\w+) does (?P<b>\w+) have than (?P<a>\w+)\?",
     (r"By how many \g<t> is \g<b> ahead of \g<a>?", r"How many extra \g<t> does \g<b> have compared with \g<a>?")),
    (r"How many (?P<t>\w+) do they have together\?",
     (r"How many \g<t> do the two have combined?", r"What is the sum of their \g<t>?")),
    # saving
    (r"How many weeks will it take to have enough\?",
     ("How many weeks must pass before there is enough?", "How many weeks until the savings are enough?")),
    (rf"In how many weeks can {_NAME} buy the (?P<g>[\w ]+)\?",
     (r"After how many weeks can \g<n> afford the \g<g>?", r"How many weeks must pass before \g<n> can buy the \g<g>?")),
    (rf"How many weeks does {_NAME} need to save\?",
     (r"For how many weeks must \g<n> keep saving?", "How many weeks of saving are required?")),
    # collecting
    (rf"How many (?P<t>\w+) does {_NAME} have now\?",
     (r"How many \g<t> does \g<n> own at this point?", r"What is \g<n>'s current count of \g<t>?")),
    (rf"How many (?P<t>\w+) does {_NAME} have at the end\?",
     (r"How many \g<t> does \g<n> finish with?", r"In the end, how many \g<t> are in \g<n>'s collection?")),
    # time_units
    (r"How many (?P<u>hours|minutes) is that in total\?",
     (r"What does that add up to in \g<u>?", r"Altogether, how many \g<u> does that come to?")),
    (rf"How many (?P<u>hours|minutes) does {_NAME} spend\?",
     (r"How many \g<u> does \g<n> spend on it overall?", r"How much time does \g<n> spend, in \g<u>?")),
    # length_units
    (rf"How many pieces does {_NAME} get\?",
     (r"How many pieces does \g<n> obtain?", "How many pieces result from the cutting?")),
    (r"How many pieces are there\?", ("How many pieces result?", "What number of pieces does that give?")),
    (r"How many centimeters are left\?",
     ("What length is left, in centimeters?", "How many centimeters of it are still unused?")),
    (r"How many centimeters remain\?", ("How many centimeters are still there?", "What length remains, in centimeters?")),
    # leftovers
    (r"How many (?P<f>\w+) are left over after filling as many (?P<b>\w+) as possible\?",
     (r"Once as many \g<b> as possible are full, how many \g<f> remain?",
      r"After filling the most \g<b> possible, how many \g<f> are extra?")),
    (r"How many (?P<f>\w+) are left\?", (r"How many \g<f> remain unpacked?", r"How many \g<f> cannot be sold?")),
    (r"How many (?P<f>\w+) do not fit into a full one\?",
     (r"How many \g<f> are left out of the full ones?", r"How many \g<f> cannot go into a full one?")),
    # fraction
    (rf"How many (?P<m>{_MEMBERS}) (?P<d>{_DOINGS})\?",
     (r"How many of these \g<m> \g<d>?", r"What number of the \g<m> \g<d>?")),
    # passengers
    (r"How many people are on the (?P<v>\w+) now\?",
     (r"How many people does the \g<v> carry now?", r"How many riders are on the \g<v> at this point?")),
    (r"How many people are on the (?P<v>\w+)\?",
     (r"How many people are aboard the \g<v>?", r"How many passengers does the \g<v> carry?")),
)

# (pattern searched for in the sentences before the question, alternatives for re.sub). Each rule that matches
# fires with probability PHRASE_PROBABILITY and rewrites every occurrence the same way.
PHRASE_RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    # buying and selling
    (r"\bbuys\b", ("purchases",)),
    (r" at \$(\d+) each\b", (r" at $\1 apiece", r" priced at $\1 each")),
    (r" for \$(\d+) each\b", (r" for $\1 apiece",)),
    (r"\bgoes to\b", ("visits", "heads to")),
    (r"\bis shopping at\b", ("is at", "visits")),
    (r"\bpicks up\b", ("grabs", "chooses")),
    (r"\bhands the cashier\b", ("gives the cashier", "pays the cashier")),
    (r"\bpays with\b", ("pays using", "hands over")),
    (r"\bTo raise money, ", ("For a fundraiser, ", "To raise funds, ")),
    (r"\bsells all of them\b", ("sells every one of them", "sells the whole batch")),
    (r"\bpays \$(\d+) each for\b", (r"spends $\1 apiece on", r"pays $\1 apiece for")),
    (r"\bcosts \$", ("is priced at $", "sells for $")),
    # sharing
    (r" with (\d+) (\w+) in each\b", (r" holding \1 \2 apiece", r", each containing \1 \2")),
    (r"\bkeeps (\d+) and shares the rest equally\b",
     (r"sets aside \1 and splits the rest evenly", r"keeps \1 for later and divides the rest evenly")),
    (r"\bshares them equally\b", ("splits them evenly", "divides them evenly")),
    (r"\band each holds\b", ("and each contains", "with each containing")),
    # speed
    (r" per hour\b", (" every hour", " each hour")),
    (r" an hour\b", (" every hour", " each hour")),
    (r"\bAfter that, ", ("Later, ", "Afterwards, ")),
    (r", then at\b", (", and after that at", ", then switches to")),
    (r"\bSo far\b", ("Up to now", "Until now")),
    (r"\bneeds to travel\b", ("has to travel", "must travel")),
    (r"\bhas already covered\b", ("has already traveled", "has done")),
    (r"^A trip is\b", ("A journey is", "The whole trip is")),
    # wages
    (r"\bearns \$", ("gets paid $", "is paid $")),
    (r"\bmakes \$(\d+)", (r"gets $\1",)),
    (r"\bworks (\d+) hours\b", (r"puts in \1 hours",)),
    (r"\bThen (\w+) spends \$(\d+) on\b", (r"Later \1 uses $\2 to buy", r"After that \1 pays $\2 for")),
    # ages
    (r"\bis (\d+) years older than\b", (r"was born \1 years before",)),
    (r"\b(\d+) years old\.", (r"\1 years of age.",)),
    (r", who is (\d+)\.", (r", whose age is \1.",)),
    (r"\bas old as\b", ("the age of",)),
    # discount
    (r"\bIt is on sale for (\d+)% off\.", (r"It is discounted by \1%.", r"There is a \1% sale on it.")),
    (r"\bThe store gives a (\d+)% discount\.", (r"The store takes \1% off.", r"It is \1% off at the store.")),
    (r"\bis marked (\d+)% off\b", (r"is reduced by \1%", r"has a \1% markdown")),
    (r"\bwants a\b", ("would like a", "has an eye on a")),
    # recipe
    (r"^A recipe for\b", ("A recipe that makes", "A recipe yielding")),
    (r"\buses (\d+) (grams|milliliters)\b", (r"needs \1 \2", r"requires \1 \2")),
    (r"^To make (\d+) (.+?) you need\b", (r"To bake \1 \2 you need", r"Making \1 \2 takes")),
    (r"\bwants to make\b", ("plans to make", "is going to make")),
    # perimeter, area
    (r"\bis a rectangle (\d+) (\w+) long and (\d+) \w+ wide\b", (r"is a \1 by \3 \2 rectangle",)),
    (r"\bwants to put a fence around it\b", ("plans to fence it in", "wants to build a fence around it")),
    (r"\bshaped like a rectangle\b", ("in the shape of a rectangle", "that is rectangular")),
    (r"\bFencing costs \$(\d+) per (\w+)\.", (r"A fence costs $\1 for each \2.", r"Each \2 of fencing costs $\1.")),
    (r"\bCovering it costs \$(\d+) per square (\w+)\.",
     (r"It costs $\1 per square \2 to cover it.", r"Each square \2 costs $\1 to cover.")),
    (r"\bmeasures (\d+) by (\d+)\b", (r"is \1 by \2",)),
    (r"\bcovers it with tiles that cost\b", ("lays tiles on it that cost", "puts down tiles costing")),
    (r"\bNext to it is\b", ("Beside it is", "Right next to it is")),
    (r"\bBoth are rectangles\.", ("Each is a rectangle.", "The two are rectangles.")),
    # compare, saving, collecting
    (r"\bcollected\b", ("gathered",)),
    (r"\bwants to buy\b", ("hopes to buy", "would like to buy")),
    (r"\bsaves \$(\d+) each week\b", (r"puts aside $\1 every week", r"saves $\1 weekly")),
    (r"\bputs away\b", ("sets aside", "saves")),
    (r"\bis saving for\b", ("is saving up for",)),
    (r"\bstarts with\b", ("begins with",)),
    (r"\badds \$(\d+) per week\b", (r"adds $\1 every week", r"adds $\1 weekly")),
    (r"\bfinds (\d+) (\w+) every day\b", (r"picks up \1 \2 each day", r"discovers \1 \2 daily")),
    (r"\bcollects (\d+) (\w+) a day\b", (r"gathers \1 \2 per day", r"collects \1 \2 daily")),
    (r"\bThen (\w+) gives (\d+) to\b", (r"Afterwards \1 hands \2 to", r"Later \1 gives \2 away to")),
    # time and length units
    (r"\bminutes a day\b", ("minutes daily", "minutes each day")),
    (r"\bhours a day\b", ("hours daily", "hours each day")),
    (r"^Every day for\b", ("Each day for", "On each of")),
    (r"\bhours each day\b", ("hours per day",)),
    (r"\bcuts it into pieces of (\d+) centimeters\b",
     (r"cuts it into pieces that are \1 centimeters long", r"divides it into \1-centimeter pieces")),
    (r"\bcuts off\b", ("snips off", "removes")),
    (r"\bis cut into equal pieces, each (\d+) centimeters long\b",
     (r"is cut into equal pieces of \1 centimeters each", r"is divided into equal \1-centimeter pieces")),
    (r"\buses (\d+) centimeters of it\b", (r"uses up \1 centimeters of it",)),
    # leftovers, fraction, passengers
    (r"\bputs them into\b", ("packs them into", "sorts them into")),
    (r"\bpacks (\d+)\b", (r"places \1", r"loads \1")),
    (r"\bOnly full (\w+) are sold\.", (r"Only full \1 can be sold.", r"Just the full \1 get sold.")),
    (r"\bfills (\w+) with\b", (r"loads \1 with", r"packs \1 with")),
    (r"\bthat each hold\b", ("that hold", "with room for")),
    (r"\bof them\b", ("of these", "of those")),
    (r"^There are (\d+) (\w+) in\b", (r"Altogether there are \1 \2 in",)),
    (r"\bget off\b", ("step off", "get out")),
    (r"\bget on\b", ("climb on", "step on")),
    (r"\b(\d+) people leave and (\d+) board\b", (r"\1 people step off and \2 climb aboard",)),
    (r"\bAt the first stop\b", ("At its first stop", "At stop one")),
    (r"\bAt the next stop\b", ("At the following stop", "At the stop after that")),
    (r"\bhas (\d+) people on it\b", (r"is carrying \1 people", r"carries \1 people")),
    (r"^There are (\d+) passengers on a (\w+)\b", (r"A \2 is carrying \1 passengers",)),
)

_QUESTION_RULES = [(re.compile(p), alts) for p, alts in QUESTION_RULES]
_PHRASE_RULES = [(re.compile(p), alts) for p, alts in PHRASE_RULES]


def split_question(question: str) -> tuple[str, str]:
    """(the sentences before the question, with their final period; the final question sentence)."""
    cut = question.rfind(". ")
    return (question[: cut + 1], question[cut + 2 :]) if cut >= 0 else ("", question)


def reword_question(question: str, rng: random.Random) -> str:
    """Reword one question (the text inside the "Question: ...\\nAnswer:\\n" frame); numbers are untouched."""
    body, ask = split_question(question)
    for pattern, alternatives in _QUESTION_RULES:
        match = pattern.fullmatch(ask)
        if match:
            ask = match.expand(rng.choice(alternatives))
            break
    else:
        raise ValueError(f"no rewording rule for the question sentence {ask!r}")
    for pattern, alternatives in _PHRASE_RULES:
        if pattern.search(body) and rng.random() < PHRASE_PROBABILITY:
            body = pattern.sub(rng.choice(alternatives), body)
    return f"{body} {ask}" if body else ask


def question_of(prompt: str) -> str:
    """The question inside the frame; raises if the prompt is not framed as the generator frames it."""
    if not (prompt.startswith(PREFIX) and prompt.endswith(SUFFIX)):
        raise ValueError(f"not a framed math-corpus prompt: {prompt!r}")
    return prompt[len(PREFIX) : -len(SUFFIX)]


def generate_reworded(seed: int = REWORDED_SEED, n: int = REWORDED_PROMPTS) -> list[Problem]:
    """generate(seed, n) with every question reworded; deterministic, and a prefix for a smaller n."""
    rng = random.Random(f"reworded-{seed}")
    return [replace(p, id=f"reworded-{seed}-{i}",
                    prompt=PREFIX + reword_question(question_of(p.prompt), rng) + SUFFIX)
            for i, p in enumerate(generate(seed, n))]


def main(argv: list[str] | None = None) -> int:
    from opd.tiny.build import CORPUS_SEED, HELDOUT_SEED, TRAIN_PROMPT_SEED, BuildConfig, write_prompts

    parser = argparse.ArgumentParser(prog="python -m opd.tiny.reworded", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="jsonl to write, e.g. "
                        "opd/assets/tiny/prompts/reworded.jsonl")
    parser.add_argument("--seed", type=int, default=REWORDED_SEED)
    parser.add_argument("-n", "--num-prompts", type=int, default=REWORDED_PROMPTS)
    args = parser.parse_args(argv)
    if args.seed in (CORPUS_SEED, TRAIN_PROMPT_SEED, HELDOUT_SEED):
        parser.error(f"seed {args.seed} is one the tiny build trains or evaluates on")
    problems = generate_reworded(args.seed, args.num_prompts)
    cfg = BuildConfig()
    taken = {p.prompt for p in generate(TRAIN_PROMPT_SEED, cfg.train_prompts) + generate(HELDOUT_SEED,
                                                                                         cfg.heldout_prompts)}
    if clash := [p.id for p in problems if p.prompt in taken]:
        raise SystemExit(f"reworded prompts equal to train/held-out prompts: {clash}")
    write_prompts(args.out, problems)
    print(f"wrote {len(problems)} reworded prompts (seed {args.seed}) to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
