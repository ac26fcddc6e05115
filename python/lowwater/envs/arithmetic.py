"""Procedurally generated multi-step arithmetic word problems (the embedded default).

Each problem is a short story whose answer takes two to four calculator steps.
Problems are a pure function of ``(seed, index)``, so a taskset needs no data
file and streams lazily, and every process that knows the seed can rebuild
any problem (the scripted model does, to answer it).

Each problem also carries a reference solution in GSM8K's format: prose with
calculator annotations ``<<expr=value>>`` and a last line ``A: value``, so
the same replay machinery that serves GSM8K's recorded solutions as
multi-turn tool use serves these.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator

import attrs

from lowwater.envs.calculator import evaluate, format_result

NAMES = ["Ada", "Bilal", "Chen", "Dara", "Emeka", "Farah", "Goran", "Hana", "Ines", "Jonas", "Kemi", "Luis"]


@attrs.frozen
class Problem:
    """One generated problem.

    Attributes:
        task_id: ``"arith-{seed}-{index}"``, stable across runs.
        question: the word problem shown to the agent.
        answer: the final answer as the calculator formats it (e.g. ``"50"``).
        solution: a GSM8K-style reference solution with ``<<expr=value>>``
            annotations and a final ``A: answer`` line.
        steps: the calculator expressions, in order.
    """

    task_id: str
    question: str
    answer: str
    solution: str
    steps: tuple[str, ...]


def _bakery(rng: random.Random, name: str) -> tuple[str, list[tuple[str, str]]]:
    trays, per, sold, bag = rng.randint(3, 15), rng.randint(6, 30), rng.randint(5, 40), rng.randint(3, 9)
    total = trays * per
    sold = min(sold, total - bag)
    left = total - sold
    q = (
        f"{name} bakes {trays} trays of rolls with {per} rolls on each tray. {name} sells {sold} rolls "
        f"and packs the rest into bags of {bag}. How many full bags does {name} pack?"
    )
    return q, [
        (f"{trays}*{per}", f"{name} bakes {{}} rolls."),
        (f"{total}-{sold}", "{} rolls are left."),
        (f"{left}//{bag}", "That fills {} bags."),
    ]


def _savings(rng: random.Random, name: str) -> tuple[str, list[tuple[str, str]]]:
    weekly, weeks, price, count = rng.randint(5, 60), rng.randint(4, 20), rng.randint(3, 25), rng.randint(2, 6)
    q = (
        f"{name} saves ${weekly} every week for {weeks} weeks, then buys {count} books that cost ${price} each. "
        f"How many dollars does {name} have left?"
    )
    saved, spent = weekly * weeks, price * count
    return q, [
        (f"{weekly}*{weeks}", f"{name} saves ${{}}."),
        (f"{price}*{count}", "The books cost ${}."),
        (f"{saved}-{spent}", "{} dollars are left."),
    ]


def _garden(rng: random.Random, name: str) -> tuple[str, list[tuple[str, str]]]:
    # rows * plants is a multiple of 20, so every offered percentage gives whole plants.
    rows, plants, dead_pct, per_basket = (
        5 * rng.randint(1, 4),
        4 * rng.randint(2, 6),
        rng.choice([10, 20, 25, 50]),
        rng.randint(2, 5),
    )
    total = rows * plants
    lost = total * dead_pct // 100
    q = (
        f"{name} plants {rows} rows of tomatoes with {plants} plants in each row. {dead_pct}% of the plants die. "
        f"Each surviving plant gives {per_basket} tomatoes. How many tomatoes does {name} harvest?"
    )
    return q, [
        (f"{rows}*{plants}", "There are {} plants."),
        (f"{total}*{dead_pct}/100", "{} plants die."),
        (f"{total}-{lost}", "{} plants survive."),
        (f"{total - lost}*{per_basket}", "They give {} tomatoes."),
    ]


def _trip(rng: random.Random, name: str) -> tuple[str, list[tuple[str, str]]]:
    speed, hours, back_speed = rng.randint(30, 90), rng.randint(2, 6), rng.choice([20, 30, 40, 60])
    dist = speed * hours
    q = (
        f"{name} drives at {speed} km per hour for {hours} hours, then cycles back the same distance at "
        f"{back_speed} km per hour. How many hours does the whole trip take?"
    )
    return q, [
        (f"{speed}*{hours}", "The distance is {} km."),
        (f"{dist}/{back_speed}", "Cycling back takes {} hours."),
        (f"{hours}+{format_result(evaluate(f'{dist}/{back_speed}'))}", "The trip takes {} hours."),
    ]


Template = Callable[[random.Random, str], tuple[str, list[tuple[str, str]]]]

TEMPLATES: dict[str, Template] = {"bakery": _bakery, "savings": _savings, "garden": _garden, "trip": _trip}
"""The story templates by name: ``template(rng, name) -> (question, plan)``, where
``plan`` is ``[(expression, sentence with one "{}" for the worked step)]``.
Each draws its numbers from ``rng`` in a fixed order; the scripted model
(:mod:`lowwater.serve_model.scripted`) replays them to recognise a question."""

_KINDS = tuple(TEMPLATES.values())  # the order problem() draws from: part of every seed's taskset


def problem(seed: int, index: int) -> Problem:
    """Problem ``index`` of the taskset with ``seed`` (deterministic, O(1))."""
    rng = random.Random(f"lowwater-arith:{seed}:{index}")
    name = rng.choice(NAMES)
    question, plan = _KINDS[rng.randrange(len(_KINDS))](rng, name)
    lines, steps, value = [], [], ""
    for expr, sentence in plan:
        value = format_result(evaluate(expr))
        steps.append(expr)
        lines.append(sentence.format(f"{expr}=<<{expr}={value}>>{value}"))
    lines.append(f"A: {value}")
    return Problem(f"arith-{seed}-{index}", question, value, "\n".join(lines), tuple(steps))


def problems(seed: int, n: int) -> Iterator[Problem]:
    """The first ``n`` problems of the taskset with ``seed``, generated lazily."""
    for index in range(n):
        yield problem(seed, index)
