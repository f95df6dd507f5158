import json

import pytest

from quantize import calib


def test_bundled_texts_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    t = calib.load_text("pileval")
    assert t.source.endswith("calib-pile-mix.txt") and len(t.documents) > 100 and len(t.sha256) == 64
    assert calib.load_text("wikitext2").source.endswith("wikitext2-raw-test.txt")


def test_hub_name_offline_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(calib.CalibrationError, match="HF_HUB_OFFLINE=1"):
        calib.load_text("someone/some-dataset")


def test_local_jsonl_and_parquet(tmp_path):
    rows = [{"text": f"document number {i} " * 5, "other": i} for i in range(20)]
    (tmp_path / "c.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    t = calib.load_text(str(tmp_path / "c.jsonl"))
    assert t.documents[3] == rows[3]["text"]
    import datasets

    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "c.parquet"))
    assert calib.load_text(str(tmp_path / "c.parquet")).documents == t.documents
    with pytest.raises(calib.CalibrationError, match="text_column 'body'"):
        calib.load_text(str(tmp_path / "c.jsonl"), column="body")


class _Tok:
    eos_token_id = 0

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) % 50 + 1 for c in text]}


def test_samples_seeded_and_too_short():
    docs = [f"paragraph {i} with some words" for i in range(200)]
    a = calib.make_samples(docs, _Tok(), 4, 32, seed=1)
    assert a.shape == (4, 32) and (a == calib.make_samples(docs, _Tok(), 4, 32, seed=1)).all()
    assert not (a == calib.make_samples(docs, _Tok(), 4, 32, seed=2)).all()
    with pytest.raises(calib.CalibrationError, match="lower calibration.n_samples"):
        calib.make_samples(docs[:2], _Tok(), 4, 32, seed=1)


def test_eval_text_sources(monkeypatch, tmp_path):
    from eval.perplexity import load_eval_text

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    text, src = load_eval_text("wikitext2")
    assert len(text.encode()) == 1_296_370 and src.endswith("wikitext2-raw-test.txt")
    with pytest.raises(FileNotFoundError, match="c4.*HF_HUB_OFFLINE"):
        load_eval_text("c4")
    (tmp_path / "t.txt").write_text("hello")
    assert load_eval_text(str(tmp_path / "t.txt"))[0] == "hello"
