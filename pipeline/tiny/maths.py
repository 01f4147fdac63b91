"""Generated arithmetic word problems with worked answers: the tiny pair's maths kind, and its dialogue kind.

Every problem is a function of (seed, index) alone: ``problem(i)`` draws its numbers from ``random.Random`` seeded
with the string ``"tiny-maths:<seed>:<i>"`` (string seeds hash with SHA-512, the same on every platform and Python
3 version), so a problem's text never depends on which other problems were generated. Its stable id is
``"%06d" % i`` (``maths/000123`` in prompt ids). Answers are exact integers, worked step by step and ending with
``The answer is N.``; about a quarter of the problems have a follow-up question and answer, so they are
conversations of two or four turns (``[{"role": "user"|"assistant", "content": ...}, ...]``), rendered for training through the
tiny tokenizer's chat template.
"""

from __future__ import annotations

import random
from typing import Callable

NAMES = [
    "Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Gus", "Hana", "Ivan", "Jo", "Kofi", "Lena", "Mateo", "Nia",
    "Omar", "Priya", "Quinn", "Rosa", "Sam", "Tariq", "Uma", "Victor", "Wen", "Yara", "Zoe",
]
# (plural item, container, plural container)
PACKED = [
    ("pencils", "box", "boxes"), ("eggs", "carton", "cartons"), ("apples", "bag", "bags"), ("cookies", "tin", "tins"),
    ("bottles", "crate", "crates"), ("books", "shelf", "shelves"), ("marbles", "jar", "jars"),
    ("stickers", "sheet", "sheets"), ("candles", "pack", "packs"), ("tiles", "stack", "stacks"),
]
THINGS = ["notebook", "sandwich", "ticket", "pen", "mug", "plant", "scarf", "lamp", "ball", "cake"]
ITEMS = ["stamps", "shells", "cards", "coins", "beads", "stones", "badges", "buttons", "flowers", "toys"]
# (vehicle, unit, lowest and highest speed, multiples of 5)
VEHICLES = [("train", "km", 60, 200), ("car", "km", 40, 120), ("cyclist", "km", 10, 30), ("boat", "miles", 5, 40),
            ("bus", "km", 30, 90)]
PLACES = ["garden", "room", "field", "pool", "yard", "playground", "kitchen floor", "car park"]
GOODS = ["coat", "bike", "camera", "chair", "guitar", "jacket", "tent", "watch"]


def _turns(*pairs: str) -> list[dict]:
    return [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(pairs)]


def _packed(r: random.Random) -> list[dict]:
    item, box, boxes = r.choice(PACKED)
    n, k = r.randint(2, 19), r.randint(3, 24)
    q = f"A shop sells {n} {boxes} of {k} {item}. How many {item} is that in total?"
    a = f"Each {box} holds {k} {item}, so {n} of them hold {n} * {k} = {n * k} {item}.\nThe answer is {n * k}."
    if r.random() < 0.4:
        j = r.randint(1, 9)
        fq = f"And if the shop gets {j} more {boxes}, how many {item} does it have?"
        fa = f"It then has {n} + {j} = {n + j} of them, so {n + j} * {k} = {(n + j) * k} {item}.\n" \
             f"The answer is {(n + j) * k}."
        return _turns(q, a, fq, fa)
    return _turns(q, a)


def _share(r: random.Random) -> list[dict]:
    name, item = r.choice(NAMES), r.choice(ITEMS)
    k, each = r.randint(2, 12), r.randint(2, 25)
    total = k * each
    q = f"{name} has {total} {item} and shares them equally among {k} friends. How many {item} does each friend get?"
    a = f"{total} / {k} = {each}, so each friend gets {each} {item}.\nThe answer is {each}."
    if r.random() < 0.4:
        extra = r.randint(1, 5)
        fq = f"If {extra} more friends join, how many more {item} does {name} need so that each friend still gets {each}?"
        need = (k + extra) * each
        fa = f"Then {k} + {extra} = {k + extra} friends need {k + extra} * {each} = {need} {item}, " \
             f"which is {need} - {total} = {need - total} more than {name} has.\nThe answer is {need - total}."
        return _turns(q, a, fq, fa)
    return _turns(q, a)


def _change(r: random.Random) -> list[dict]:
    name, thing = r.choice(NAMES), r.choice(THINGS)
    n, p = r.randint(2, 9), r.randint(2, 15)
    cost = n * p
    bill = next(b for b in (10, 20, 50, 100, 200) if b > cost)
    q = f"{name} buys {n} {thing}s at ${p} each and pays with a ${bill} note. How much change does {name} get?"
    a = f"The {thing}s cost {n} * {p} = {cost} dollars.\nThe change is {bill} - {cost} = {bill - cost} dollars.\n" \
        f"The answer is {bill - cost}."
    return _turns(q, a)


def _distance(r: random.Random) -> list[dict]:
    veh, unit, lo, hi = r.choice(VEHICLES)
    v, t = r.randint(lo // 5, hi // 5) * 5, r.randint(2, 9)
    q = f"A {veh} travels at {v} {unit} per hour for {t} hours. How far does it go?"
    a = f"Distance = speed * time = {v} * {t} = {v * t} {unit}.\nThe answer is {v * t}."
    if r.random() < 0.4:
        t2 = r.randint(1, 5)
        fq = f"How far does it go if it keeps going for another {t2} hours?"
        fa = f"In {t} + {t2} = {t + t2} hours it goes {v} * {t + t2} = {v * (t + t2)} {unit}.\n" \
             f"The answer is {v * (t + t2)}."
        return _turns(q, a, fq, fa)
    return _turns(q, a)


def _area(r: random.Random) -> list[dict]:
    place = r.choice(PLACES)
    a_, b_ = r.randint(3, 40), r.randint(2, 30)
    q = f"A rectangular {place} is {a_} m long and {b_} m wide. What is its area?"
    a = f"Area = length * width = {a_} * {b_} = {a_ * b_} square metres.\nThe answer is {a_ * b_}."
    if r.random() < 0.5:
        fq = "And what is its perimeter?"
        fa = f"Perimeter = 2 * (length + width) = 2 * ({a_} + {b_}) = 2 * {a_ + b_} = {2 * (a_ + b_)} m.\n" \
             f"The answer is {2 * (a_ + b_)}."
        return _turns(q, a, fq, fa)
    return _turns(q, a)


def _discount(r: random.Random) -> list[dict]:
    good = r.choice(GOODS)
    price = r.randint(2, 30) * 20
    pct = r.choice([5, 10, 15, 20, 25, 30, 40, 50])
    off = price * pct // 100
    q = f"A {good} costs ${price}. It is on sale for {pct}% off. What is the sale price?"
    a = f"{pct}% of {price} is {price} * {pct} / 100 = {off} dollars.\nThe sale price is {price} - {off} = " \
        f"{price - off} dollars.\nThe answer is {price - off}."
    return _turns(q, a)


def _age(r: random.Random) -> list[dict]:
    n1, n2 = r.sample(NAMES, 2)
    a_, d, y = r.randint(4, 40), r.randint(1, 15), r.randint(2, 20)
    q = f"{n1} is {a_} years old. {n2} is {d} years older than {n1}. How old will {n2} be in {y} years?"
    a = f"{n2} is {a_} + {d} = {a_ + d} years old now.\nIn {y} years {n2} will be {a_ + d} + {y} = {a_ + d + y}.\n" \
        f"The answer is {a_ + d + y}."
    if r.random() < 0.4:
        z = r.randint(1, a_ + d - 1)
        fq = f"And how old was {n2} {z} years ago?"
        fa = f"{z} years ago {n2} was {a_ + d} - {z} = {a_ + d - z}.\nThe answer is {a_ + d - z}."
        return _turns(q, a, fq, fa)
    return _turns(q, a)


def _remaining(r: random.Random) -> list[dict]:
    name, item = r.choice(NAMES), r.choice(ITEMS)
    n = r.randint(20, 90)
    g, b = r.randint(1, n - 5), r.randint(1, 30)
    q = f"{name} had {n} {item}, gave away {g} of them and then bought {b} more. How many {item} does {name} have now?"
    a = f"After giving some away, {name} has {n} - {g} = {n - g} {item}.\nAfter buying more, {name} has " \
        f"{n - g} + {b} = {n - g + b} {item}.\nThe answer is {n - g + b}."
    return _turns(q, a)


def _average(r: random.Random) -> list[dict]:
    k = r.randint(3, 5)
    mean = r.randint(8, 30)
    vals = [r.randint(mean - 6, mean + 6) for _ in range(k - 1)]
    last = k * mean - sum(vals)
    vals.append(last)
    listed = ", ".join(map(str, vals[:-1])) + f" and {vals[-1]}"
    q = f"The temperatures on {k} days were {listed} degrees. What was the average temperature?"
    s = " + ".join(map(str, vals))
    a = f"The sum is {s} = {k * mean}.\nThe average is {k * mean} / {k} = {mean} degrees.\nThe answer is {mean}."
    return _turns(q, a)


def _reading(r: random.Random) -> list[dict]:
    name = r.choice(NAMES)
    p, d = r.randint(5, 40), r.randint(3, 25)
    q = f"{name} reads {p} pages a day. How many days does it take to read a {p * d}-page book?"
    a = f"{p * d} / {p} = {d}, so it takes {d} days.\nThe answer is {d}."
    return _turns(q, a)


def _workers(r: random.Random) -> list[dict]:
    rate, w, h = r.randint(3, 20), r.randint(2, 9), r.randint(2, 8)
    q = f"Each worker packs {rate} parcels an hour. How many parcels do {w} workers pack in {h} hours?"
    a = f"Together they pack {w} * {rate} = {w * rate} parcels an hour.\nIn {h} hours they pack {w * rate} * {h} = " \
        f"{w * rate * h} parcels.\nThe answer is {w * rate * h}."
    if r.random() < 0.4:
        more = r.randint(1, 4)
        fq = f"How many would they pack if {more} more workers joined them?"
        fa = f"{w} + {more} = {w + more} workers pack {w + more} * {rate} = {(w + more) * rate} parcels an hour, " \
             f"so {(w + more) * rate} * {h} = {(w + more) * rate * h} parcels.\nThe answer is {(w + more) * rate * h}."
        return _turns(q, a, fq, fa)
    return _turns(q, a)


def _minutes(r: random.Random) -> list[dict]:
    h, m = r.randint(1, 9), r.randint(1, 59)
    q = f"How many minutes are there in {h} hours and {m} minutes?"
    a = f"{h} hours is {h} * 60 = {h * 60} minutes.\n{h * 60} + {m} = {h * 60 + m} minutes.\n" \
        f"The answer is {h * 60 + m}."
    if r.random() < 0.4:
        fq = "And how many seconds is that?"
        fa = f"{h * 60 + m} * 60 = {(h * 60 + m) * 60} seconds.\nThe answer is {(h * 60 + m) * 60}."
        return _turns(q, a, fq, fa)
    return _turns(q, a)


TEMPLATES: list[Callable[[random.Random], list[dict]]] = [
    _packed, _share, _change, _distance, _area, _discount, _age, _remaining, _average, _reading, _workers, _minutes,
]


def problem(index: int, seed: int = 0) -> list[dict]:
    """Problem ``index`` as chat turns (user question, assistant worked answer[, follow-up, answer])."""
    r = random.Random(f"tiny-maths:{seed}:{index}")
    return r.choice(TEMPLATES)(r)


def problem_id(index: int) -> str:
    return f"{index:06d}"


__all__ = ["TEMPLATES", "problem", "problem_id"]
