import json

import pytest

from quantize import calib


@pytest.mark.parametrize("offline", ["1", "0"])
def test_bundled_names_are_one_text_everywhere(monkeypatch, offline):
    """A bundled name reads its file whether or not the hub may be used: the same text, the same hash."""
    monkeypatch.setenv("HF_HUB_OFFLINE", offline)
    monkeypatch.setattr(calib, "_from_hub", lambda *a, **k: pytest.fail("a bundled name must not touch the hub"))
    t = calib.load_text("groups-merged")
    assert t.source.endswith("groups-merged.txt") and len(t.documents) > 100
    assert calib.load_text("wikitext2").source.endswith("wikitext2-raw-test.txt")


def test_hub_name_offline_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(calib.CalibrationError, match="not in the local cache.*calibration.dataset: groups-merged"):
        calib.load_text("someone/some-dataset")


@pytest.mark.parametrize("name", ["pileval", "someone/some-dataset"])
def test_unreachable_hub_stops_fast_naming_the_bundled_text(monkeypatch, name):
    """No HF_HUB_OFFLINE, no network: the run stops within the probe's bound, never falls back silently."""
    import time

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(calib, "_from_hub", lambda *a, **k: pytest.fail("the hub was unreachable: no load"))
    monkeypatch.setenv("HF_ENDPOINT", "http://192.0.2.1:9")  # TEST-NET-1: never answers
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", "http://192.0.2.1:9")
    t0 = time.perf_counter()
    with pytest.raises(calib.CalibrationError) as e:
        calib.load_text(name)
    # the probe's bound plus room for a loaded box; a retrying client would take minutes
    assert time.perf_counter() - t0 < calib.HUB_PROBE_S + 5.0
    msg = str(e.value)
    assert "cannot be reached" in msg and "`calibration.dataset: groups-merged`" in msg
    assert ("mit-han-lab/pile-val-backup" if name == "pileval" else name) in msg


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
    from eval.perplexity import EvalInputError, load_eval_text

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    text, src = load_eval_text("wikitext2")
    assert len(text.encode()) == 1_296_370 and src.endswith("wikitext2-raw-test.txt")
    with pytest.raises(EvalInputError, match="c4.*HF_HUB_OFFLINE"):
        load_eval_text("c4")
    (tmp_path / "t.txt").write_text("hello")
    assert load_eval_text(str(tmp_path / "t.txt"))[0] == "hello"
