"""bench/peers/autoround_quant.py: the folder AutoRound saved into is moved up into the artifact, and nothing
outside the artifact is ever moved."""

from __future__ import annotations

import pytest

from bench.peers.autoround_quant import move_up


def _saved(out):
    folder = out / "model-w4g64"
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"w")
    (folder / "config.json").write_text("{}")
    return folder


@pytest.mark.parametrize("as_list", [False, True])
def test_the_saved_folder_moves_up_into_the_artifact(tmp_path, as_list):
    out = tmp_path / "art"
    folder = _saved(out)
    move_up([str(folder)] if as_list else str(folder), out)  # one format: AutoRound returns the str itself
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]


@pytest.mark.parametrize("where", ["/", "..", "elsewhere"])
def test_a_folder_not_directly_inside_the_artifact_is_refused_and_nothing_moves(tmp_path, where):
    out = tmp_path / "art"
    _saved(out)
    other = tmp_path / "elsewhere"
    other.mkdir()
    (other / "keep.txt").write_text("x")
    folder = {"/": "/", "..": str(tmp_path), "elsewhere": str(other)}[where]
    with pytest.raises(SystemExit, match="not a folder inside"):
        move_up(folder, out)
    assert (other / "keep.txt").is_file() and (out / "model-w4g64" / "config.json").is_file()
