"""Write train.csv and validation.csv: short synthetic film reviews labelled 1 (positive) or 0.

Run from anywhere: `python examples/data/reviews/make_reviews.py`. The output is deterministic
(a fixed seed), so the shipped CSV files are exactly what this script writes.

Each review is drawn from one of three patterns, so the task has a clear lexical signal and still
needs a little more than counting words:

- plain (70%):    "the acting was superb and i would watch it again."   -> the adjective's label
- negated (15%):  "honestly the plot was not dull."                     -> the opposite label
- contrast (15%): "the soundtrack was lovely but the ending felt weak." -> the label after "but"
"""

from __future__ import annotations

import csv
import os
import random
from typing import List, Tuple

SEED = 1234
NUM_TRAIN = 600
NUM_VALIDATION = 200

SUBJECTS = [
    "the film", "the movie", "the plot", "the acting", "the ending", "the soundtrack", "the story",
    "the dialogue", "the cast", "the pacing", "the camera work", "the script", "the lead actor",
    "the director's work", "the final scene", "the second half",
]
POSITIVE = [
    "wonderful", "brilliant", "moving", "charming", "gripping", "delightful", "superb", "clever",
    "beautiful", "funny", "touching", "excellent", "lovely", "thrilling", "fresh", "warm",
]
NEGATIVE = [
    "dull", "boring", "clumsy", "awful", "tedious", "messy", "predictable", "bland", "weak",
    "painful", "silly", "flat", "confusing", "lifeless", "forgettable", "cheap",
]
VERBS = ["was", "felt", "seemed", "is"]
OPENERS = ["", "", "", "honestly ", "overall ", "to be fair ", "i think ", "in my view "]
POSITIVE_TAILS = [
    "", "", " and i would watch it again", " and the whole family enjoyed it",
    " and i recommend it", " and i left the cinema smiling",
]
NEGATIVE_TAILS = [
    "", "", " and i want my money back", " and i nearly fell asleep",
    " and i would not recommend it", " and i left before the end",
]
NEUTRAL_TAILS = ["", "", " on a rainy sunday", " with my brother", " at the late show", " last week"]


def clause(rng: random.Random, positive: bool) -> str:
    adjective = rng.choice(POSITIVE if positive else NEGATIVE)
    return f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {adjective}"


def review(rng: random.Random) -> Tuple[str, int]:
    label = rng.randrange(2)
    pattern = rng.random()
    if pattern < 0.70:
        tail = rng.choice(POSITIVE_TAILS if label else NEGATIVE_TAILS)
        text = f"{rng.choice(OPENERS)}{clause(rng, bool(label))}{tail}"
    elif pattern < 0.85:
        subject, verb = rng.choice(SUBJECTS), rng.choice(VERBS)
        adjective = rng.choice(NEGATIVE if label else POSITIVE)  # negated: the opposite word
        text = f"{rng.choice(OPENERS)}{subject} {verb} not {adjective}{rng.choice(NEUTRAL_TAILS)}"
    else:
        text = f"{clause(rng, not label)} but {clause(rng, bool(label))}"
    return f"{text}.", label


def reviews(rng: random.Random, count: int, exclude: set) -> List[Tuple[str, int]]:
    rows: List[Tuple[str, int]] = []
    seen = set(exclude)
    while len(rows) < count:
        text, label = review(rng)
        if text not in seen:  # no duplicates inside a split, and none shared between splits
            seen.add(text)
            rows.append((text, label))
    return rows


def write(path: str, rows: List[Tuple[str, int]]) -> None:
    with open(path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle, lineterminator="\n")
        writer.writerow(["text", "label"])
        writer.writerows(rows)


def main(output_dir: str = os.path.dirname(os.path.abspath(__file__))) -> None:
    """Write both splits into `output_dir` (by default next to this script)."""
    rng = random.Random(SEED)
    train = reviews(rng, NUM_TRAIN, exclude=set())
    validation = reviews(rng, NUM_VALIDATION, exclude={text for text, _ in train})
    write(os.path.join(output_dir, "train.csv"), train)
    write(os.path.join(output_dir, "validation.csv"), validation)


if __name__ == "__main__":
    main()
