"""The shipped HellaSwag task: the bundled file is the whole validation set, its documents are what lm-eval's own
`hellaswag` preprocessing makes of the original records, subsets are fixed, and the paired stderr of a Δ is the
spread of per-document differences."""

from __future__ import annotations

import bz2
import hashlib
import re

import pytest

from eval import lmeval
from eval.tasks import hellaswag
from quantize.recipe import RecipeError, load_recipe
from tests.unit.test_recipe import BASE, write_recipe


def test_the_file_is_hellaswag_validation_whole():
    raw = hellaswag.DATA.read_bytes()
    sha = hashlib.sha256(raw).hexdigest()
    assert sha in (hellaswag.DATA.parent / "README.md").read_text()  # the provenance names the bytes shipped
    tasks = hellaswag.parse(bz2.decompress(raw).decode("utf-8"))
    assert len(tasks) == hellaswag.N_TASKS == 10042
    assert {t["label"] for t in tasks} == {0, 1, 2, 3} and all(len(t["endings"]) == 4 for t in tasks)
    assert tasks[0]["label_ctx"] == "Roof shingle removal: A man is sitting on a roof. he" and tasks[0]["label"] == 3


def test_a_torn_file_is_refused():
    with pytest.raises(ValueError, match="whole number"):
        hellaswag.parse("a: b\n1\nx\ny\nz\n")
    with pytest.raises(ValueError, match="label 4"):
        hellaswag.parse("a: b\n4\nw\nx\ny\nz\n")


def _file_side(text: str) -> str:
    """What the file's producer (extract_hellaswag.cpp's preprocess_data) wrote for one field of a record."""
    for a, b in (("[header]", ""), ("[step]", ""), ("[substeps]", ""), (" [title]", ". "), ("[title] ", ""),
                 ("[title].", ""), ("  ", " ")):
        text = text.replace(a, b)
    return text[1:] if text.startswith(" ") else text


# Original records (rowanz/hellaswag's fields): the first three of the validation set as published, and a
# WikiHow-shaped one with its bracket tags, a bracketed aside and an empty ctx_b.
RECORDS = [
    {"activity_label": "Roof shingle removal", "ctx_a": "A man is sitting on a roof.", "ctx_b": "he", "label": 3,
     "endings": ["is using wrap to wrap a pair of skis.", "is ripping level tiles off.",
                 "is holding a rubik's cube.", "starts pulling up roofing on a roof."]},
    {"activity_label": "Clean and jerk", "ctx_a": "A lady walks to a barbell. She bends down and grabs the pole.",
     "ctx_b": "the lady", "label": 3,
     "endings": ["swings and lands in her arms.", "pulls the barbell forward.",
                 "pulls a rope attached to the barbell.", "stands and lifts the weight over her head."]},
    {"activity_label": "Canoeing", "ctx_a": "Two women in a child are shown in a canoe while a man pulls the canoe "
     "while standing in the water, with other individuals visible in the background.",
     "ctx_b": "the child and a different man", "label": 2,
     "endings": ["are then shown paddling down a river in a boat while a woman talks.",
                 "are driving the canoe, they go down the river flowing side to side.",
                 "sit in a canoe while the man paddles.",
                 "walking go down the rapids, while the man in his helicopter almost falls and goes out of "
                 "canoehood."]},
    {"activity_label": "Family Life", "ctx_a": "[header] How to entertain a toddler [title] Ask the toddler what "
     "to do. [step] Visit a site like [www.kiddio.org] to find  games.", "ctx_b": "", "label": 1,
     "endings": ["Play outside. [substeps] Bring a ball.", "Read a book together.", "Sing a song.",
                 "Go to sleep [title] Early."]},
]


@pytest.mark.parametrize("rec", RECORDS, ids=lambda r: r["activity_label"])
def test_documents_match_lm_evals_own_hellaswag_preprocessing(rec):
    from lm_eval.tasks.hellaswag.utils import process_docs
    import datasets

    want = process_docs(datasets.Dataset.from_list([rec]))[0]
    ctx = (rec["ctx_a"] + " " + rec["ctx_b"]) if rec["ctx_b"] else rec["ctx_a"]  # the record's `ctx` field
    line = f"{_file_side(rec['activity_label'])}: {_file_side(ctx)}"
    got = hellaswag.to_lm_eval({"label_ctx": line, "label": rec["label"],
                                "endings": [_file_side(e) for e in rec["endings"]]})
    assert got == {"query": want["query"], "choices": want["choices"], "gold": want["gold"]}


def test_a_subset_is_fixed_spread_and_refused_when_too_large():
    idx = lmeval.subset_indices(10042, 1200)
    assert idx == lmeval.subset_indices(10042, 1200) and len(set(idx)) == 1200 and idx == sorted(idx)
    assert idx[0] == 0 and idx[-1] >= 10042 - 10042 // 1200 - 1  # reaches the end: both halves of the set

    class Task:
        eval_docs = list(range(10))

    assert lmeval.subset_samples({"t": Task()}, 4) == {"t": [0, 2, 5, 7]}
    assert lmeval.subset_samples({"t": Task()}, None) is None
    with pytest.raises(RecipeError, match="subset 11 is more than the 10 documents of task t; use at most 10"):
        lmeval.subset_samples({"t": Task()}, 11)


def test_recipe_subset_and_limit_are_one_or_the_other(tmp_path):
    p = write_recipe(tmp_path / "r.yaml", **BASE, eval={"lm_eval": {"tasks": ["hellaswag_local"], "subset": 5,
                                                                    "limit": 5}})
    with pytest.raises(RecipeError, match=re.escape("both limit (5) and subset (5); keep one")):
        load_recipe(p)
    p = write_recipe(tmp_path / "r.yaml", **BASE, eval={"lm_eval": {"tasks": ["hellaswag_local"], "subset": 0}})
    with pytest.raises(RecipeError, match="eval.lm_eval.subset"):
        load_recipe(p)


def test_paired_stderr_is_the_spread_of_per_document_differences():
    # d = [0, +1, -1, 0, 0]: mean 0, sample sd sqrt(2 / 4), stderr sd / sqrt(5)
    p = lmeval.paired_difference([1, 0, 1, 1, 0], [1, 1, 0, 1, 0])
    assert p["delta"] == 0 and p["n"] == 5 and p["stderr"] == pytest.approx(0.5 ** 0.5 / 5 ** 0.5)
    assert p["distinguishable"] is False
    # d = [1, 1, 1, 0]: mean 0.75, sd 0.5, stderr 0.25; 0.75 > 1.96 * 0.25
    p = lmeval.paired_difference([0, 0, 0, 0], [1, 1, 1, 0])
    assert (p["delta"], p["stderr"], p["distinguishable"]) == (0.75, pytest.approx(0.25), True)


def test_paired_pairs_the_same_documents_only():
    ref = {"outcomes": {"t": {"doc_id": [0, 5], "acc_norm": [1, 0]}}}
    q = {"outcomes": {"t": {"doc_id": [0, 5], "acc_norm": [1, 1]}}}
    assert lmeval.paired(ref, q)["t"]["acc_norm"]["delta"] == 0.5
    assert lmeval.paired(ref, {"outcomes": {"t": {"doc_id": [0, 6], "acc_norm": [1, 1]}}}) == {}
