"""The documents of the shipped lm-eval task `hellaswag_local`: HellaSwag's 10,042 validation tasks, from the
bundled text file (data/README.md says where it comes from), in lm-eval's own `hellaswag` shape (query, choices,
gold), so lm-eval scores them as its standard HellaSwag task does (acc, acc_norm).

The file holds six lines a task: `activity_label: ctx`, the label, four endings, with the WikiHow bracket tags
([header], [step], [substeps], [title]) already replaced. lm-eval builds its query from ctx_a and ctx_b, with
ctx_b capitalised; the file joined them, so the last fragment of ctx that follows a sentence end and starts in
lower case is taken as ctx_b. What remains of lm-eval's `preprocess` (other bracketed text, double spaces) is
applied by lm-eval's own function.
"""

from __future__ import annotations

import bz2
import re
from pathlib import Path

DATA = Path(__file__).resolve().parents[2] / "data" / "hellaswag-val-full.txt.bz2"
N_TASKS = 10042
LINES_PER_TASK = 6
N_CHOICES = 4
# ctx_b: a lower-case fragment after the last sentence end (". he" -> "He", lm-eval's ctx_b.capitalize())
CTX_B = re.compile(r"^(.*[.!?\"] )([a-z][^.!?]*)$")


def parse(text: str) -> list[dict]:
    """The file's text -> tasks {label_ctx ("activity_label: ctx"), label (0-3), endings [4]}, in file order."""
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    if len(lines) % LINES_PER_TASK:
        raise ValueError(f"{len(lines)} lines is not a whole number of {LINES_PER_TASK}-line HellaSwag tasks")
    out = []
    for i in range(0, len(lines), LINES_PER_TASK):
        label = int(lines[i + 1])
        if not 0 <= label < N_CHOICES:
            raise ValueError(f"task {i // LINES_PER_TASK}: label {label} is not 0-{N_CHOICES - 1}")
        out.append({"label_ctx": lines[i], "label": label, "endings": lines[i + 2:i + LINES_PER_TASK]})
    return out


def recapitalise(label_ctx: str) -> str:
    """`activity_label: ctx_a ctx_b` -> the same with ctx_b capitalised as lm-eval does (str.capitalize)."""
    m = CTX_B.match(label_ctx)
    return m.group(1) + m.group(2).capitalize() if m else label_ctx


def to_lm_eval(task: dict) -> dict:
    """One parsed task -> lm-eval's hellaswag document {query, choices, gold}, through lm-eval's `preprocess`."""
    from lm_eval.tasks.hellaswag.utils import preprocess

    return {"query": preprocess(recapitalise(task["label_ctx"])),
            "choices": [preprocess(e) for e in task["endings"]], "gold": task["label"]}


def read(path: Path = DATA) -> list[dict]:
    """The bundled file -> lm-eval documents, in file order (document i is the file's task i)."""
    return [to_lm_eval(t) for t in parse(bz2.decompress(path.read_bytes()).decode("utf-8"))]


def docs(**_kwargs):
    """lm-eval's `custom_dataset` hook -> {"validation": datasets.Dataset}."""
    import datasets

    return datasets.DatasetDict({"validation": datasets.Dataset.from_list(read())})
