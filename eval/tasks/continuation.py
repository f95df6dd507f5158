"""The documents of the shipped lm-eval task `wikitext_continuation`, built from the bundled WikiText-2 test text.

Each document is a paragraph's first two sentences (context) and four candidate third sentences: its own, and
three drawn (seeded) from other paragraphs; the model is scored by lm-eval's multiple-choice loglikelihoods
(acc, acc_norm). No network: the text ships with the project (data/README.md says where it comes from).
"""

from __future__ import annotations

import random
import re
from pathlib import Path

TEXT = Path(__file__).resolve().parents[2] / "data" / "wikitext2-raw-test.txt"
SEED = 1234
N_CHOICES = 4
DETOK = ((" @-@ ", "-"), (" @,@ ", ","), (" @.@ ", "."), (" , ", ", "), (" ; ", "; "), (" : ", ": "),
         (" 's", "'s"), ("( ", "("), (" )", ")"))


def _detok(s: str) -> str:
    for a, b in DETOK:
        s = s.replace(a, b)
    return s.strip()


def _sentences(paragraph: str) -> list[str]:
    """WikiText's tokenized paragraph -> its sentences (split at " . "), detokenized, each ending in "."."""
    parts = [p.strip() for p in re.split(r" \. ", paragraph.strip() + " ") if p.strip()]
    return [_detok(p if p.endswith(".") else p + ".") for p in parts]


def build(text: str, seed: int = SEED) -> list[dict]:
    """text -> documents {context, choices [4 sentences], label (index of the true one)}, in text order."""
    paragraphs = [p for p in text.split("\n") if p.strip() and not p.strip().startswith("=")]
    triples = []
    for p in paragraphs:
        s = _sentences(p)
        if len(s) >= 3 and all(4 <= len(x.split()) <= 40 for x in s[:3]):
            triples.append((f"{s[0]} {s[1]}", s[2]))
    rng = random.Random(seed)
    docs = []
    for i, (context, true) in enumerate(triples):
        others = [j + (j >= i) for j in rng.sample(range(len(triples) - 1), N_CHOICES - 1)]  # never i itself
        choices = [triples[j][1] for j in others]
        label = rng.randrange(N_CHOICES)
        choices.insert(label, true)
        docs.append({"context": context, "choices": choices, "label": label})
    return docs


def docs(**_kwargs):
    """lm-eval's `custom_dataset` hook -> {"test": datasets.Dataset}."""
    import datasets

    return datasets.DatasetDict({"test": datasets.Dataset.from_list(build(TEXT.read_text(encoding="utf-8")))})
