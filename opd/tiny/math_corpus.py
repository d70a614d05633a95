"""Procedurally generated grade-school math word problems with worked, step-by-step solutions.

Why this exists: the tiny target model (`opd/tiny/build.py`) is trained on 2 CPU cores (its model card,
opd/assets/tiny/target/README.md, says for how long) and must still behave like a real target: rarely loop, be confident
where text is predictable and uncertain at real choice points. A few-million-parameter model can master a narrow, clean
domain, so we generate one.

In every problem the arithmetic and the structure of the solution follow from the numbers, so most tokens
are predictable. Names, objects, numbers and the wording of the question and of each step are drawn at
random, which gives the model genuine choice points. Every answer is computed in Python, and every equation
is built by `_eq`, so the text cannot disagree with the arithmetic.

Problems are built backwards (answer first, then the inputs) wherever a division must come out exact.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple


@dataclass(frozen=True)
class Problem:
    """One example: the prompt to condition on and the worked solution the target should write."""

    id: str
    family: str
    prompt: str
    response: str


class _Draft(NamedTuple):
    """What a family returns; `_render` adds the shared wording around it."""

    question: str  # the word problem, without the "Question:" frame
    goal: str  # e.g. "how much Maya spends in total", used by an optional opening line
    steps: list[str]  # one clause per step, each holding exactly one "a op b = c" equation
    answer: int  # the result of the last step's equation


NAMES = (
    "Aaron", "Abby", "Adam", "Alice", "Amir", "Anna", "Ben", "Bella", "Carlos", "Chloe",
    "Daniel", "Dana", "Eli", "Emma", "Ethan", "Eva", "Felix", "Fiona", "Gabe", "Grace",
    "Hana", "Henry", "Ian", "Ivy", "Jack", "Jade", "Jonas", "Julia", "Kai", "Kara",
    "Leo", "Lily", "Liam", "Lucy", "Mark", "Maya", "Mia", "Noah", "Nina", "Omar",
    "Olivia", "Owen", "Paul", "Priya", "Quinn", "Rosa", "Ryan", "Sam", "Sara", "Theo",
    "Tina", "Uma", "Victor", "Vera", "Will", "Wendy", "Xavier", "Yara", "Zack", "Zoe",
)
STORES = (
    "the market", "a bookstore", "the bakery", "a toy shop", "the school fair", "the corner store",
    "a garden center", "the mall", "a craft store", "the farmers market",
)
SHOP_ITEMS = (  # (plural name, lowest price, highest price) in whole dollars
    ("notebooks", 2, 6), ("pencils", 1, 3), ("apples", 1, 3), ("sandwiches", 4, 9), ("toy cars", 3, 12),
    ("books", 5, 15), ("shirts", 8, 20), ("cupcakes", 2, 5), ("bottles of juice", 2, 4),
    ("movie tickets", 5, 12), ("plants", 4, 10), ("comic books", 3, 8), ("packs of stickers", 1, 4),
    ("bags of rice", 6, 14), ("pens", 1, 4), ("muffins", 2, 4), ("candles", 3, 7), ("puzzles", 6, 15),
)
THINGS = (
    "stickers", "marbles", "shells", "stamps", "cards", "beads", "coins", "rocks", "buttons",
    "feathers", "crayons", "pebbles", "postcards", "badges",
)
FOODS = ("cookies", "cupcakes", "muffins", "apples", "oranges", "candies", "strawberries", "eggs", "donuts")
CONTAINERS = ("boxes", "bags", "jars", "trays", "baskets", "packs")
PEOPLE = ("friends", "classmates", "cousins", "teammates", "neighbors")
JOBS = (
    "babysitting", "walking dogs", "washing cars", "tutoring", "serving at a cafe", "mowing lawns",
    "helping at a bakery", "delivering newspapers",
)
MOVERS = (  # (first mention, later mention, verb phrase, lowest speed, highest speed)
    ("{name}", "{name}", "drives", 30, 80), ("{name}", "{name}", "cycles", 8, 20),
    ("{name}", "{name}", "walks", 3, 6), ("A train", "the train", "travels", 40, 90),
    ("A boat", "the boat", "sails", 10, 30), ("A bus", "the bus", "travels", 25, 60),
)
ACTIVITIES = ("practices piano", "reads", "jogs", "studies", "swims", "draws", "plays chess", "practices guitar")
RECIPE_DISHES = ("muffins", "pancakes", "cookies", "bread rolls", "waffles", "pies")
INGREDIENTS = (  # (name, lowest amount per item, highest amount per item)
    ("grams of flour", 10, 30), ("grams of sugar", 5, 15), ("milliliters of milk", 10, 25),
    ("grams of butter", 5, 10),
)
SALE_ITEMS = ("jacket", "backpack", "lamp", "bike helmet", "pair of shoes", "board game", "watch", "desk chair",
              "toaster", "suitcase", "rug", "tent")
UNITS = (("meters", "meter"), ("feet", "foot"))  # (plural, singular) lengths for rectangles
PLOTS = ("garden", "room", "playground", "yard", "field", "patio", "classroom", "parking lot")
GOALS = ("bike", "video game", "guitar", "tablet", "pair of skates", "telescope", "camera", "skateboard")
CORDS = ("ribbon", "rope", "piece of string", "roll of yarn", "wire")
VEHICLES = ("bus", "train", "tram", "ferry")
FRACTIONS = (  # (phrase, unit-fraction phrase, numerator, denominator)
    ("half", "half", 1, 2), ("a third", "a third", 1, 3), ("two thirds", "a third", 2, 3),
    ("a quarter", "a quarter", 1, 4), ("three quarters", "a quarter", 3, 4), ("a fifth", "a fifth", 1, 5),
    ("two fifths", "a fifth", 2, 5), ("three fifths", "a fifth", 3, 5), ("four fifths", "a fifth", 4, 5),
    ("a sixth", "a sixth", 1, 6), ("five sixths", "a sixth", 5, 6), ("a tenth", "a tenth", 1, 10),
    ("three tenths", "a tenth", 3, 10),
)
GROUPS = (  # (the whole, members, what some of them do, what the others do)
    ("a class", "students", "walk to school", "do not walk to school"),
    ("a parking lot", "cars", "are red", "are not red"),
    ("a shelf", "books", "are novels", "are not novels"),
    ("a basket", "fruits", "are apples", "are not apples"),
    ("a garden", "flowers", "are roses", "are not roses"),
    ("a bag", "marbles", "are blue", "are not blue"),
    ("a club", "members", "play chess", "do not play chess"),
)
MULTIPLES = ((2, "twice"), (3, "three times"), (4, "four times"), (5, "five times"))

FIRST_OPENERS = ("First, ", "To start, ", "To begin, ", "First of all, ", "", "We start here: ")
MIDDLE_OPENERS = ("Next, ", "Then ", "After that, ", "Now ", "", "Then, ")
LAST_OPENERS = ("So ", "That means ", "Therefore, ", "Finally, ", "This means ", "Putting it together, ")
# An optional opening line restating the goal; without it the first step opens the response.
GOAL_LINES = ("We need to find {goal}.", "We want to know {goal}.", "Our job is to find {goal}.",
              "Let's work out {goal}.")
GOAL_LINE_PROBABILITY = 0.6

_OPS: dict[str, Callable[[int, int], int]] = {
    "+": lambda a, b: a + b,
    "-": lambda a, b: a - b,
    "*": lambda a, b: a * b,
    "/": lambda a, b: a // b,
}


def _eq(a: int, op: str, b: int) -> tuple[str, int]:
    """Return ("a op b = c", c); the only way equations are written, so text and value always agree."""
    value = _OPS[op](a, b)
    if value < 0 or (op == "/" and value * b != a):
        raise ValueError(f"family built an inexact or negative step: {a} {op} {b}")
    return f"{a} {op} {b} = {value}", value


def _money_list(rng: random.Random, count: int) -> list[tuple[str, int, int]]:
    """Draw `count` different shop items with a quantity and a unit price: (item, quantity, price)."""
    return [(item, rng.randint(2, 8), rng.randint(lo, hi)) for item, lo, hi in rng.sample(SHOP_ITEMS, count)]


def _join(parts: Sequence[str]) -> str:
    """English list: "a", "a and b", "a, b and c"."""
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


def _capitalize(text: str) -> str:
    """Upper-case the first letter only (str.capitalize would lower-case the names)."""
    return text[:1].upper() + text[1:]


def _purchase_steps(rng: random.Random, name: str, basket: list[tuple[str, int, int]]) -> tuple[list[str], int]:
    """Steps pricing each item, then adding the costs; shared by the shopping and change families."""
    steps, costs = [], []
    for item, count, price in basket:
        text, cost = _eq(count, "*", price)
        steps.append(rng.choice((
            f"the {item} cost {text} dollars.",
            f"{count} {item} at ${price} each cost {text} dollars.",
            f"{name} pays {text} dollars for the {item}.",
            f"multiplying the number of {item} by the price gives {text} dollars.",
        )))
        costs.append(cost)
    total = costs[0]
    for cost in costs[1:]:
        text, total = _eq(total, "+", cost)
        steps.append(rng.choice((
            f"the total is {text} dollars.",
            f"adding the costs gives {text} dollars.",
            f"{name} spends {text} dollars altogether.",
        )))
    return steps, total


def _shopping(rng: random.Random) -> _Draft:
    """Total cost of two or three kinds of items."""
    name, store = rng.choice(NAMES), rng.choice(STORES)
    basket = _money_list(rng, rng.choice((2, 3)))
    buys = _join([f"{count} {item} at ${price} each" for item, count, price in basket])
    question = rng.choice((
        f"{name} goes to {store} and buys {buys}. How much does {name} spend in total?",
        f"At {store}, {name} buys {buys}. How much money does {name} spend altogether?",
        f"{name} buys {buys} from {store}. What is the total cost?",
        f"{name} is shopping at {store}. {name} picks up {buys}. How much does {name} pay?",
    ))
    steps, total = _purchase_steps(rng, name, basket)
    return _Draft(question, f"how much {name} spends in total", steps, total)


def _change(rng: random.Random) -> _Draft:
    """Change from a bill after buying one or two kinds of items."""
    name, store = rng.choice(NAMES), rng.choice(STORES)
    basket = _money_list(rng, rng.choice((1, 2)))
    steps, cost = _purchase_steps(rng, name, basket)
    bill = rng.choice([b for b in (20, 50, 100, 200, 500) if b > cost][:2])  # one of the two smallest that cover it
    buys = _join([f"{count} {item} at ${price} each" for item, count, price in basket])
    question = rng.choice((
        f"{name} buys {buys} at {store}. {name} pays with ${bill}. How much change does {name} get?",
        f"At {store}, {name} buys {buys} and hands the cashier ${bill}. How much change should {name} get back?",
        f"{name} has ${bill} and buys {buys}. How much money does {name} have left?",
    ))
    text, change = _eq(bill, "-", cost)
    steps.append(rng.choice((
        f"the change is {text} dollars.",
        f"{name} gets back {text} dollars.",
        f"taking the cost away from ${bill} leaves {text} dollars.",
    )))
    return _Draft(question, f"how much change {name} gets", steps, change)


def _sharing(rng: random.Random) -> _Draft:
    """Items in containers shared equally, maybe after keeping the few that would not divide evenly."""
    name, thing, box, people = rng.choice(NAMES), rng.choice(THINGS), rng.choice(CONTAINERS), rng.choice(PEOPLE)
    boxes, per_box = rng.randint(2, 9), rng.randint(3, 12)
    friends = rng.randint(2, min(8, boxes * per_box // 2))
    text, total = _eq(boxes, "*", per_box)
    keep = total % friends
    keeps = f" {name} keeps {keep} and shares the rest" if keep else f" {name} shares them"
    question = rng.choice((
        f"{name} has {boxes} {box} with {per_box} {thing} in each.{keeps} equally among {friends} {people}. "
        f"How many {thing} does each of them get?",
        f"There are {per_box} {thing} in each of {name}'s {boxes} {box}.{keeps} equally with {friends} {people}. "
        f"How many {thing} does each one receive?",
        f"{name} buys {boxes} {box} of {thing}, and each holds {per_box}.{keeps} equally among {friends} {people}. "
        f"How many does each get?",
    ))
    steps = [rng.choice((f"{name} has {text} {thing}.", f"the {box} hold {text} {thing} in total."))]
    if keep:
        text, total = _eq(total, "-", keep)
        steps.append(rng.choice((f"keeping {keep} leaves {text} {thing} to share.",
                                 f"{name} shares {text} {thing}.")))
    text, each = _eq(total, "/", friends)
    steps.append(rng.choice((f"each one gets {text} {thing}.", f"dividing equally gives {text} {thing} each.",
                             f"each of the {friends} {people} receives {text} {thing}.")))
    return _Draft(question, f"how many {thing} each one gets", steps, each)


def _speed(rng: random.Random) -> _Draft:
    """Distance, rate and time: two legs of a trip, same speed for longer, or time left to go."""
    name = rng.choice(NAMES)
    first, later, verb, lo, hi = rng.choice(MOVERS)
    first, later = first.format(name=name), later.format(name=name)
    unit = rng.choice(("kilometers", "miles"))
    kind = rng.choice(("legs", "same", "remaining"))
    if kind == "legs":
        s1, h1, s2, h2 = rng.randint(lo, hi), rng.randint(2, 5), rng.randint(lo, hi), rng.randint(2, 4)
        question = rng.choice((
            f"{first} {verb} at {s1} {unit} per hour for {h1} hours, then at {s2} {unit} per hour for {h2} hours. "
            f"How far does {later} go in total?",
            f"{first} {verb} for {h1} hours at {s1} {unit} an hour. After that, {later} {verb} for {h2} hours at "
            f"{s2} {unit} an hour. What is the total distance?",
        ))
        t1, d1 = _eq(s1, "*", h1)
        t2, d2 = _eq(s2, "*", h2)
        t3, total = _eq(d1, "+", d2)
        steps = [rng.choice((f"the first part is {t1} {unit}.", f"in the first {h1} hours {later} goes {t1} {unit}.")),
                 rng.choice((f"the second part is {t2} {unit}.", f"in the next {h2} hours {later} goes {t2} {unit}.")),
                 rng.choice((f"the total distance is {t3} {unit}.", f"{later} goes {t3} {unit} in all."))]
        return _Draft(question, "the total distance", steps, total)
    if kind == "same":
        speed, h1 = rng.randint(lo, hi), rng.randint(2, 6)
        h2 = rng.choice([h for h in range(2, 10) if h != h1])
        d1 = speed * h1
        question = rng.choice((
            f"{first} {verb} {d1} {unit} in {h1} hours. At the same speed, how far does {later} go in {h2} hours?",
            f"{first} {verb} {d1} {unit} in {h1} hours. Going at the same speed, how many {unit} will {later} "
            f"cover in {h2} hours?",
        ))
        t1, speed = _eq(d1, "/", h1)
        t2, d2 = _eq(speed, "*", h2)
        steps = [rng.choice((f"the speed is {t1} {unit} per hour.", f"{later} covers {t1} {unit} each hour.")),
                 rng.choice((f"in {h2} hours {later} goes {t2} {unit}.", f"the distance is {t2} {unit}."))]
        return _Draft(question, f"how far {later} goes in {h2} hours", steps, d2)
    speed, hours, done = rng.randint(lo, hi), rng.randint(2, 8), rng.randint(5, 60)
    trip = done + speed * hours
    question = rng.choice((
        f"{first} needs to travel {trip} {unit}. So far {later} has gone {done} {unit}. If {later} {verb} at "
        f"{speed} {unit} per hour, how many more hours will it take?",
        f"A trip is {trip} {unit} long. {first} has already covered {done} {unit} and {verb} at {speed} {unit} "
        f"per hour. How many hours are left?",
    ))
    t1, rest = _eq(trip, "-", done)
    t2, hours = _eq(rest, "/", speed)
    steps = [rng.choice((f"{t1} {unit} are left.", f"the distance still to go is {t1} {unit}.")),
             rng.choice((f"it takes {t2} more hours.", f"the time left is {t2} hours."))]
    return _Draft(question, "how many hours are left", steps, hours)


def _wages(rng: random.Random) -> _Draft:
    """Pay per hour, hours per day, days; sometimes minus a purchase."""
    name, job = rng.choice(NAMES), rng.choice(JOBS)
    rate, hours, days = rng.randint(5, 20), rng.randint(2, 8), rng.randint(2, 6)
    spend = rng.choice((0, rng.randint(5, rate * hours * days - 1)))
    spends = f" Then {name} spends ${spend} on a {rng.choice(GOALS)}." if spend else ""
    ask = f"How much money does {name} have left?" if spend else f"How much money does {name} earn in total?"
    question = rng.choice((
        f"{name} earns ${rate} per hour {job}. {name} works {hours} hours a day for {days} days.{spends} {ask}",
        f"{name} makes ${rate} an hour {job} and works {hours} hours each day for {days} days.{spends} {ask}",
        f"For {days} days, {name} works {hours} hours a day {job} and earns ${rate} per hour.{spends} {ask}",
    ))
    t1, daily = _eq(rate, "*", hours)
    t2, total = _eq(daily, "*", days)
    steps = [rng.choice((f"{name} earns {t1} dollars per day.", f"one day of work pays {t1} dollars.")),
             rng.choice((f"over {days} days {name} earns {t2} dollars.", f"the total pay is {t2} dollars."))]
    if spend:
        t3, total = _eq(total, "-", spend)
        steps.append(rng.choice((f"{name} has {t3} dollars left.", f"after spending, {t3} dollars remain.")))
    return _Draft(question, f"how much money {name} ends up with", steps, total)


def _ages(rng: random.Random) -> _Draft:
    """Chained age relations, optionally projected into the future."""
    a, b, c = rng.sample(NAMES, 3)
    age, gap = rng.randint(3, 15), rng.randint(2, 10)
    times, times_word = rng.choice(MULTIPLES[:2])
    later = rng.choice((0, rng.randint(2, 10)))
    ask = f"How old will {c} be in {later} years?" if later else f"How old is {c}?"
    question = rng.choice((
        f"{a} is {age} years old. {b} is {gap} years older than {a}. {c} is {times_word} as old as {b}. {ask}",
        f"{b} is {gap} years older than {a}, who is {age}. {c}'s age is {times_word} {b}'s age. {ask}",
        f"{a} is {age}. {b} is {gap} years older than {a}, and {c} is {times_word} as old as {b}. {ask}",
    ))
    t1, age_b = _eq(age, "+", gap)
    t2, age_c = _eq(age_b, "*", times)
    steps = [rng.choice((f"{b} is {t1} years old.", f"{b}'s age is {t1}.",
                         f"{b} is {gap} years older than {a}, so {b} is {t1}.")),
             rng.choice((f"{c} is {t2} years old.", f"{c}'s age is {t2}.",
                         f"{c}, who is {times_word} as old as {b}, is {t2}."))]
    if later:
        t3, age_c = _eq(age_c, "+", later)
        steps.append(rng.choice((f"in {later} years {c} will be {t3}.", f"{c} will be {t3} years old.")))
    return _Draft(question, f"{c}'s age", steps, age_c)


def _discount(rng: random.Random) -> _Draft:
    """Percent off a price, worked as "10% is a tenth", then the sale price or the saving."""
    name, store = rng.choice(NAMES), rng.choice(STORES)
    item = rng.choice(SALE_ITEMS)
    ask_saving = rng.random() < 0.4
    price, percent = 10 * rng.randint(2, 40), 10 * rng.randint(2 if ask_saving else 1, 6)  # saving needs 2 steps
    ask = f"How much does {name} save?" if ask_saving else f"How much does {name} pay?"
    question = rng.choice((
        f"A {item} costs ${price} at {store}. It is on sale for {percent}% off. {name} buys it. {ask}",
        f"{name} wants a {item} that costs ${price}. The store gives a {percent}% discount. {ask}",
        f"At {store}, a ${price} {item} is marked {percent}% off, and {name} buys one. {ask}",
    ))
    t1, tenth = _eq(price, "/", 10)
    steps = [rng.choice((f"10% of {price} is {t1} dollars.", f"ten percent of the price is {t1} dollars."))]
    off = tenth
    if percent > 10:
        t2, off = _eq(tenth, "*", percent // 10)
        steps.append(rng.choice((f"{percent}% is {t2} dollars.", f"the discount is {t2} dollars.")))
    if not ask_saving:
        t3, paid = _eq(price, "-", off)
        steps.append(rng.choice((f"{name} pays {t3} dollars.", f"the sale price is {t3} dollars.")))
        return _Draft(question, f"how much {name} pays", steps, paid)
    return _Draft(question, f"how much {name} saves", steps, off)


def _profit(rng: random.Random) -> _Draft:
    """Buy a batch at one price, sell some or all at a higher price."""
    name, item = rng.choice(NAMES), rng.choice(FOODS + THINGS)
    count, cost = rng.randint(5, 30), rng.randint(1, 6)
    sell = cost + rng.randint(1, 5)
    sold = rng.choice((count, rng.randint((count * cost) // sell + 1, count)))
    sells = f"sells all of them for ${sell} each" if sold == count else f"sells {sold} of them for ${sell} each"
    question = rng.choice((
        f"{name} buys {count} {item} for ${cost} each and {sells}. How much profit does {name} make?",
        f"{name} pays ${cost} each for {count} {item}, then {sells}. What is {name}'s profit?",
        f"To raise money, {name} buys {count} {item} at ${cost} each and {sells}. How much money does {name} gain?",
    ))
    t1, spent = _eq(count, "*", cost)
    t2, earned = _eq(sold, "*", sell)
    t3, profit = _eq(earned, "-", spent)
    steps = [rng.choice((f"{name} spends {t1} dollars.", f"buying the {item} costs {t1} dollars.")),
             rng.choice((f"selling brings in {t2} dollars.", f"{name} earns {t2} dollars from sales.")),
             rng.choice((f"the profit is {t3} dollars.", f"{name} makes {t3} dollars."))]
    return _Draft(question, f"{name}'s profit", steps, profit)


def _recipe(rng: random.Random) -> _Draft:
    """Scale a recipe via the amount per item."""
    name, dish = rng.choice(NAMES), rng.choice(RECIPE_DISHES)
    ingredient, lo, hi = rng.choice(INGREDIENTS)
    batch, each, wanted = rng.randint(2, 12), rng.randint(lo, hi), rng.randint(2, 30)
    amount = batch * each
    question = rng.choice((
        f"A recipe for {batch} {dish} uses {amount} {ingredient}. How many {ingredient} does {name} need "
        f"to make {wanted} {dish}?",
        f"{name} uses {amount} {ingredient} to bake {batch} {dish}. How many {ingredient} are needed "
        f"for {wanted} {dish}?",
        f"To make {batch} {dish} you need {amount} {ingredient}. {name} wants to make {wanted} {dish}. "
        f"How many {ingredient} are needed?",
    ))
    t1, each = _eq(amount, "/", batch)
    t2, need = _eq(each, "*", wanted)
    steps = [rng.choice((f"one of the {dish} needs {t1} {ingredient}.", f"each one uses {t1} {ingredient}.")),
             rng.choice((f"{wanted} {dish} need {t2} {ingredient}.", f"{name} needs {t2} {ingredient}."))]
    return _Draft(question, f"how many {ingredient} are needed", steps, need)


def _perimeter(rng: random.Random) -> _Draft:
    """Fence around a rectangle, sometimes priced per unit length."""
    name, plot = rng.choice(NAMES), rng.choice(PLOTS)
    unit, unit_one = rng.choice(UNITS)
    length, width = rng.randint(4, 30), rng.randint(3, 20)
    price = rng.choice((0, rng.randint(2, 8)))
    ask = (f"Fencing costs ${price} per {unit_one}. How much does the fence cost?"
           if price else f"How many {unit} of fence are needed to go around it?")
    question = rng.choice((
        f"{name}'s {plot} is a rectangle {length} {unit} long and {width} {unit} wide. {ask}",
        f"A rectangular {plot} measures {length} {unit} by {width} {unit}. {name} wants to put a fence around it. "
        f"{ask}",
        f"{name} has a {plot} shaped like a rectangle. It is {length} {unit} long and {width} {unit} wide. {ask}",
    ))
    t1, half = _eq(length, "+", width)
    t2, fence = _eq(half, "*", 2)
    steps = [rng.choice((f"one length plus one width is {t1} {unit}.", f"the length plus the width is {t1} {unit}.")),
             rng.choice((f"the perimeter is {t2} {unit}.", f"going all the way around takes {t2} {unit}."))]
    if price:
        t3, fence = _eq(fence, "*", price)
        steps.append(rng.choice((f"the fence costs {t3} dollars.", f"{name} pays {t3} dollars.")))
    return _Draft(question, "the cost of the fence" if price else "the perimeter", steps, fence)


def _area(rng: random.Random) -> _Draft:
    """Area of a rectangle, then either its covering cost or the total with a second rectangle."""
    name, (unit, unit_one) = rng.choice(NAMES), rng.choice(UNITS)
    plot, other = rng.sample(PLOTS, 2)
    length, width = rng.randint(3, 20), rng.randint(2, 15)
    t1, area = _eq(length, "*", width)
    if rng.random() < 0.5:
        price = rng.randint(2, 5)
        question = rng.choice((
            f"{name}'s {plot} is {length} {unit} long and {width} {unit} wide. Covering it costs ${price} per "
            f"square {unit_one}. How much does it cost to cover?",
            f"A rectangular {plot} measures {length} by {width} {unit}. {name} covers it with tiles that cost "
            f"${price} per square {unit_one}. What is the total cost?",
        ))
        t2, cost = _eq(area, "*", price)
        steps = [rng.choice((f"the area is {t1} square {unit}.", f"the {plot} covers {t1} square {unit}.")),
                 rng.choice((f"the cost is {t2} dollars.", f"{name} pays {t2} dollars."))]
        return _Draft(question, "the cost to cover it", steps, cost)
    length2, width2 = rng.randint(3, 15), rng.randint(2, 10)
    question = rng.choice((
        f"{name} has a {plot} that is {length} by {width} {unit} and a {other} that is {length2} by {width2} "
        f"{unit}. Both are rectangles. What is their total area in square {unit}?",
        f"A rectangular {plot} is {length} {unit} long and {width} {unit} wide. Next to it is a rectangular {other}, "
        f"{length2} {unit} long and {width2} {unit} wide. What is the total area?",
    ))
    t2, area2 = _eq(length2, "*", width2)
    t3, total = _eq(area, "+", area2)
    steps = [f"the {plot} has an area of {t1} square {unit}.", f"the {other} has an area of {t2} square {unit}.",
             rng.choice((f"the total area is {t3} square {unit}.", f"together they cover {t3} square {unit}."))]
    return _Draft(question, "the total area", steps, total)


def _compare(rng: random.Random) -> _Draft:
    """One person has a multiple of another's amount; ask the difference or the sum."""
    a, b = rng.sample(NAMES, 2)
    thing, base = rng.choice(THINGS), rng.randint(3, 40)
    times, times_word = rng.choice(MULTIPLES)
    ask_more = rng.random() < 0.6
    ask = (f"How many more {thing} does {b} have than {a}?" if ask_more
           else f"How many {thing} do they have together?")
    question = rng.choice((
        f"{a} has {base} {thing}. {b} has {times_word} as many {thing} as {a}. {ask}",
        f"{b} has {times_word} as many {thing} as {a}, and {a} has {base}. {ask}",
        f"{a} collected {base} {thing}, and {b} collected {times_word} as many. {ask}",
    ))
    t1, more = _eq(base, "*", times)
    steps = [rng.choice((f"{b} has {t1} {thing}.", f"{times_word} {base} is {t1}.",
                         f"{b} has {times_word} as many as {a}, so {b} has {t1} {thing}."))]
    if ask_more:
        t2, answer = _eq(more, "-", base)
        steps.append(rng.choice((f"{b} has {t2} more {thing}.", f"the difference is {t2} {thing}.")))
    else:
        t2, answer = _eq(more, "+", base)
        steps.append(rng.choice((f"together they have {t2} {thing}.", f"the total is {t2} {thing}.")))
    goal = f"how many more {thing} {b} has" if ask_more else f"how many {thing} they have together"
    return _Draft(question, goal, steps, answer)


def _saving(rng: random.Random) -> _Draft:
    """Weeks of saving needed to reach a price."""
    name, goal = rng.choice(NAMES), rng.choice(GOALS)
    saved, weekly, weeks = rng.randint(5, 100), rng.randint(5, 25), rng.randint(2, 20)
    price = saved + weekly * weeks
    question = rng.choice((
        f"{name} wants to buy a {goal} that costs ${price}. {name} has ${saved} and saves ${weekly} each week. "
        f"How many weeks will it take to have enough?",
        f"A {goal} costs ${price}. {name} already has ${saved} and puts away ${weekly} every week. In how many "
        f"weeks can {name} buy the {goal}?",
        f"{name} is saving for a ${price} {goal}. {name} starts with ${saved} and adds ${weekly} per week. How "
        f"many weeks does {name} need to save?",
    ))
    t1, rest = _eq(price, "-", saved)
    t2, weeks = _eq(rest, "/", weekly)
    steps = [rng.choice((f"{name} still needs {t1} dollars.", f"the amount left to save is {t1} dollars.",
                         f"the {goal} costs {price} dollars and {name} has {saved}, so {name} still needs "
                         f"{t1} dollars.")),
             rng.choice((f"it takes {t2} weeks.", f"{name} needs to save for {t2} weeks.",
                         f"saving {weekly} dollars a week, {name} needs {t2} weeks."))]
    return _Draft(question, "how many weeks it takes", steps, weeks)


def _collecting(rng: random.Random) -> _Draft:
    """Items gathered per day, plus a starting amount and/or minus a gift."""
    name, friend = rng.sample(NAMES, 2)
    thing, per_day, days = rng.choice(THINGS), rng.randint(2, 15), rng.randint(2, 10)
    mode = rng.choice(("start", "gift", "both"))  # at least one, so there are at least two steps
    start = rng.randint(3, 50) if mode != "gift" else 0
    gift = rng.randint(1, per_day * days - 1) if mode != "start" else 0
    starts = f"{name} has {start} {thing}. " if start else ""
    gives = f" Then {name} gives {gift} to {friend}." if gift else ""
    question = rng.choice((
        f"{starts}{name} finds {per_day} {thing} every day for {days} days.{gives} How many {thing} does {name} "
        f"have now?",
        f"{starts}For {days} days, {name} collects {per_day} {thing} a day.{gives} How many {thing} does {name} "
        f"have at the end?",
    ))
    t1, total = _eq(per_day, "*", days)
    steps = [rng.choice((f"{name} collects {t1} {thing}.", f"in {days} days that is {t1} {thing}."))]
    if start:
        t2, total = _eq(start, "+", total)
        steps.append(rng.choice((f"together with the {start} from before, that is {t2}.", f"adding the {start} gives {t2}.")))
    if gift:
        t3, total = _eq(total, "-", gift)
        steps.append(rng.choice((f"after giving {gift} away, {name} has {t3}.", f"{name} keeps {t3} {thing}.")))
    return _Draft(question, f"how many {thing} {name} has", steps, total)


def _time_units(rng: random.Random) -> _Draft:
    """Minutes to hours (exact), or hours to minutes."""
    name, activity = rng.choice(NAMES), rng.choice(ACTIVITIES)
    days = rng.randint(2, 6)
    if rng.random() < 0.5:
        minutes = 60 * rng.randint(1, 5) // days  # exact: 60 is divisible by every day count 2..6
        question = rng.choice((
            f"{name} {activity} for {minutes} minutes a day for {days} days. How many hours is that in total?",
            f"Every day for {days} days, {name} {activity} for {minutes} minutes. How many hours does {name} spend?",
        ))
        t1, total = _eq(minutes, "*", days)
        t2, hours = _eq(total, "/", 60)
        steps = [rng.choice((f"that is {t1} minutes.", f"the total time is {t1} minutes.",
                             f"{minutes} minutes on each of {days} days makes {t1} minutes.")),
                 rng.choice((f"in hours that is {t2}.", f"with 60 minutes in an hour, that is {t2} hours."))]
        return _Draft(question, "the total time in hours", steps, hours)
    hours = rng.randint(2, 4)
    question = rng.choice((
        f"{name} {activity} for {hours} hours a day for {days} days. How many minutes is that in total?",
        f"For {days} days, {name} {activity} {hours} hours each day. How many minutes does {name} spend?",
    ))
    t1, total = _eq(hours, "*", days)
    t2, minutes = _eq(total, "*", 60)
    steps = [rng.choice((f"that is {t1} hours.", f"the total time is {t1} hours.")),
             rng.choice((f"in minutes that is {t2}.", f"with 60 minutes in an hour, that makes {t2} minutes."))]
    return _Draft(question, "the total time in minutes", steps, minutes)


def _length_units(rng: random.Random) -> _Draft:
    """Meters to centimeters, then cut into equal pieces or minus a used part."""
    name, cord = rng.choice(NAMES), rng.choice(CORDS)
    meters, piece = rng.randint(2, 9), rng.choice((5, 10, 20, 25, 50))
    t1, cm = _eq(meters, "*", 100)
    steps = [rng.choice((f"{meters} meters is {t1} centimeters.", f"the {cord} is {t1} centimeters long.",
                         f"a meter has 100 centimeters, so the {cord} is {t1} centimeters long."))]
    if rng.random() < 0.5:
        question = rng.choice((
            f"{name} has a {cord} that is {meters} meters long and cuts it into pieces of {piece} centimeters. "
            f"How many pieces does {name} get?",
            f"A {cord} {meters} meters long is cut into equal pieces, each {piece} centimeters long. How many "
            f"pieces are there?",
        ))
        t2, pieces = _eq(cm, "/", piece)
        steps.append(rng.choice((f"there are {t2} pieces.", f"{name} gets {t2} pieces.")))
        return _Draft(question, "how many pieces there are", steps, pieces)
    used = rng.randint(1, cm - 1)
    question = rng.choice((
        f"{name} has a {cord} that is {meters} meters long and uses {used} centimeters of it. How many "
        f"centimeters are left?",
        f"A {cord} is {meters} meters long. {name} cuts off {used} centimeters. How many centimeters remain?",
    ))
    t2, left = _eq(cm, "-", used)
    steps.append(rng.choice((f"{t2} centimeters are left.", f"what remains is {t2} centimeters.")))
    return _Draft(question, "how many centimeters are left", steps, left)


def _leftovers(rng: random.Random) -> _Draft:
    """Packing into full containers; the remainder is the answer."""
    name, food, box = rng.choice(NAMES), rng.choice(FOODS), rng.choice(CONTAINERS)
    size, full = rng.randint(3, 12), rng.randint(2, 15)
    total = size * full + rng.randint(1, size - 1)
    question = rng.choice((
        f"{name} has {total} {food} and puts them into {box} of {size}. How many {food} are left over after "
        f"filling as many {box} as possible?",
        f"{name} packs {total} {food} into {box} that each hold {size}. Only full {box} are sold. How many {food} "
        f"are left?",
        f"There are {total} {food}. {name} fills {box} with {size} {food} each. How many {food} do not fit into "
        f"a full one?",
    ))
    t1, packed = _eq(size, "*", full)
    t2, left = _eq(total, "-", packed)
    steps = [rng.choice((f"{full} full {box} hold {t1} {food}.", f"{name} can fill {full} {box}, since {t1}.",
                         f"each of the {box} holds {size}, so {full} full {box} use {t1} {food}.")),
             rng.choice((f"{t2} {food} are left over.", f"the leftover is {t2} {food}."))]
    return _Draft(question, f"how many {food} are left over", steps, left)


def _fraction(rng: random.Random) -> _Draft:
    """A fraction of a group, or the rest of the group."""
    whole, members, some, others = rng.choice(GROUPS)
    phrase, unit_phrase, num, den = rng.choice(FRACTIONS)
    total = den * rng.randint(2, 12)
    ask_rest = num == 1 or rng.random() < 0.5  # a unit fraction alone would be a one-step problem
    ask = f"How many {members} {others}?" if ask_rest else f"How many {members} {some}?"
    question = rng.choice((
        f"There are {total} {members} in {whole}. {_capitalize(phrase)} of them {some}. {ask}",
        f"{_capitalize(phrase)} of the {total} {members} in {whole} {some}. {ask}",
        f"{_capitalize(whole)} has {total} {members}, and {phrase} of them {some}. {ask}",
    ))
    t1, part = _eq(total, "/", den)
    steps = [rng.choice((f"{unit_phrase} of {total} is {t1}.", f"{total} split into {den} equal parts gives {t1}."))]
    if num > 1:
        t2, part = _eq(part, "*", num)
        steps.append(rng.choice((f"{phrase} of {total} is {t2}.", f"{t2} {members} {some}.")))
    answer = part
    if ask_rest:
        t3, answer = _eq(total, "-", part)
        steps.append(rng.choice((f"the rest is {t3} {members}.", f"{t3} {members} {others}.")))
    return _Draft(question, f"how many {members} {others if ask_rest else some}", steps, answer)


def _passengers(rng: random.Random) -> _Draft:
    """People getting off and on a vehicle at one or two stops."""
    vehicle = rng.choice(VEHICLES)
    start = rng.randint(10, 50)
    off, on = rng.randint(1, start - 1), rng.randint(1, 20)
    now = start - off + on
    off2 = rng.choice((0, rng.randint(1, now - 1)))
    second = f" At the next stop, {off2} people get off." if off2 else ""
    question = rng.choice((
        f"A {vehicle} has {start} people on it. At the first stop, {off} get off and {on} get on.{second} How "
        f"many people are on the {vehicle} now?",
        f"There are {start} passengers on a {vehicle}. At a stop {off} people leave and {on} board.{second} "
        f"How many people are on the {vehicle}?",
    ))
    t1, mid = _eq(start, "-", off)
    t2, now = _eq(mid, "+", on)
    steps = [rng.choice((f"after {off} get off, {t1} people remain.", f"{t1} people stay on.")),
             rng.choice((f"with {on} new people there are {t2}.", f"there are {t2} people on board."))]
    if off2:
        t3, now = _eq(now, "-", off2)
        steps.append(rng.choice((f"after the next stop there are {t3}.", f"{t3} people are left on the {vehicle}.")))
    return _Draft(question, f"how many people are on the {vehicle}", steps, now)


FAMILIES: dict[str, Callable[[random.Random], _Draft]] = {
    "shopping": _shopping,
    "change": _change,
    "sharing": _sharing,
    "speed": _speed,
    "wages": _wages,
    "ages": _ages,
    "discount": _discount,
    "profit": _profit,
    "recipe": _recipe,
    "perimeter": _perimeter,
    "area": _area,
    "compare": _compare,
    "saving": _saving,
    "collecting": _collecting,
    "time_units": _time_units,
    "length_units": _length_units,
    "leftovers": _leftovers,
    "fraction": _fraction,
    "passengers": _passengers,
}
_FAMILY_NAMES = tuple(FAMILIES)


def _render(rng: random.Random, draft: _Draft) -> tuple[str, str]:
    """Frame the question and give each step a randomly worded opener; returns (prompt, response)."""
    lines = []
    if rng.random() < GOAL_LINE_PROBABILITY:
        lines.append(_capitalize(rng.choice(GOAL_LINES).format(goal=draft.goal)))
    last = len(draft.steps) - 1
    for i, clause in enumerate(draft.steps):
        openers = FIRST_OPENERS if i == 0 else LAST_OPENERS if i == last else MIDDLE_OPENERS
        lines.append(_capitalize(rng.choice(openers) + clause))
    lines.append(f"The answer is {draft.answer}.")
    return f"Question: {draft.question}\nAnswer:\n", "\n".join(lines)


def generate(seed: int, n: int) -> list[Problem]:
    """Deterministic for a given seed (uses random.Random(seed), never the global RNG).

    One RNG drives everything in order, so generate(seed, k) is a prefix of generate(seed, n) for k <= n.
    """
    rng = random.Random(seed)
    problems = []
    for index in range(n):
        family = rng.choice(_FAMILY_NAMES)
        prompt, response = _render(rng, FAMILIES[family](rng))
        problems.append(Problem(f"math-{seed}-{index}", family, prompt, response))
    return problems
