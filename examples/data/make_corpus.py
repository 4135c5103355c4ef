"""Generate the synthetic English corpus shipped in this folder (written for hf_zero; no third-party text).

    python examples/data/make_corpus.py      # rewrites synthetic_train.txt and synthetic_heldout.txt

Sentences come from a small grammar with agreement, arithmetic facts, simple narratives and lists, so a tiny
language model has real structure to learn (spelling, word order, number agreement, sums) and a held-out split
has a meaningful perplexity. Deterministic: same seed, same bytes.
"""

from __future__ import annotations

import random
from pathlib import Path

NAMES = ["Ada", "Bram", "Cleo", "Dev", "Esme", "Faro", "Gus", "Hana", "Ivo", "Juno", "Kai", "Lena", "Milo", "Nia",
         "Otto", "Pia", "Quin", "Rosa", "Sami", "Tove"]
ANIMALS = ["cat", "dog", "fox", "owl", "hen", "goat", "mole", "crow", "seal", "frog", "bee", "horse"]
THINGS = ["lamp", "kettle", "map", "coat", "basket", "drum", "kite", "ladder", "boat", "bell", "book", "candle"]
PLACES = ["the market", "the river", "the old mill", "the garden", "the harbor", "the hill", "the library",
          "the bakery", "the station", "the forest"]
ADJ = ["small", "red", "quiet", "heavy", "bright", "old", "warm", "green", "tall", "round", "clever", "sleepy"]
TIMES = ["in the morning", "at noon", "after dinner", "before dawn", "on Sunday", "in the spring", "at night"]
VERBS = [("find", "finds", "found"), ("carry", "carries", "carried"), ("paint", "paints", "painted"),
         ("fix", "fixes", "fixed"), ("sell", "sells", "sold"), ("watch", "watches", "watched"),
         ("follow", "follows", "followed"), ("clean", "cleans", "cleaned")]
NUM = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve",
       "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen"]


def plural(noun: str) -> str:
    return noun + ("es" if noun.endswith(("x", "s", "sh", "ch")) else "s")


def np(r: random.Random) -> tuple[str, bool]:
    """A noun phrase and whether it is plural."""
    kind = r.random()
    if kind < 0.3:
        return r.choice(NAMES), False
    noun = r.choice(ANIMALS + THINGS)
    if r.random() < 0.35:
        n = r.randint(2, 9)
        return f"{NUM[n]} {r.choice(ADJ)} {plural(noun)}", True
    return f"the {r.choice(ADJ)} {noun}" if r.random() < 0.6 else f"the {noun}", False


def sentence(r: random.Random) -> str:
    k = r.random()
    if k < 0.2:
        a, b = r.randint(0, 9), r.randint(0, 9)
        return f"{NUM[a].capitalize()} plus {NUM[b]} is {NUM[a + b]}."
    if k < 0.3:
        a = r.randint(2, 9)
        b = r.randint(0, a)
        return f"{NUM[a].capitalize()} minus {NUM[b]} is {NUM[a - b]}."
    subj, many = np(r)
    verb = r.choice(VERBS)
    obj, _ = np(r)
    if k < 0.65:
        v = verb[0] if many else verb[1]
        return f"{subj[0].upper() + subj[1:]} {v} {obj} at {r.choice(PLACES)}."
    if k < 0.85:
        t = r.choice(TIMES)
        return f"{t[0].upper() + t[1:]}, {subj} {verb[2]} {obj} near {r.choice(PLACES)}."
    be = "are" if many else "is"
    return f"{subj[0].upper() + subj[1:]} {be} {r.choice(ADJ)} and {r.choice(ADJ)}."


def story(r: random.Random) -> str:
    hero = r.choice(NAMES)
    pet = r.choice(ANIMALS)
    thing = r.choice(THINGS)
    place = r.choice(PLACES)
    lines = [f"{hero} had a {r.choice(ADJ)} {pet}.",
             f"One day {hero} and the {pet} went to {place}.",
             f"There they found a {r.choice(ADJ)} {thing}.",
             f"The {pet} {r.choice(VERBS)[2]} the {thing}, and {hero} laughed.",
             f"Then {hero} took the {thing} home {r.choice(TIMES)}."]
    return " ".join(lines)


def paragraph(r: random.Random) -> str:
    if r.random() < 0.3:
        return story(r)
    return " ".join(sentence(r) for _ in range(r.randint(3, 7)))


def write(path: Path, seed: int, nbytes: int) -> None:
    r = random.Random(seed)
    parts, size = [], 0
    while size < nbytes:
        p = paragraph(r)
        parts.append(p)
        size += len(p) + 1
    path.write_text("\n".join(parts) + "\n", encoding="ascii")


if __name__ == "__main__":
    here = Path(__file__).parent
    write(here / "synthetic_train.txt", seed=1, nbytes=240_000)
    write(here / "synthetic_heldout.txt", seed=2, nbytes=30_000)
