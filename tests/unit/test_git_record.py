"""The manifest's git record: `dirty` only when a tracked file differs from the commit."""

import subprocess

from quantize import runner


def test_dirty_only_when_a_tracked_file_differs(tmp_path, monkeypatch):
    git = lambda *a: subprocess.run(["git", "-C", str(tmp_path), *a], check=True, capture_output=True)  # noqa: E731
    git("init", "-q")
    (tmp_path / "tracked.py").write_text("x = 1\n")
    git("add", "tracked.py")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    monkeypatch.setattr(runner, "PROJECT_DIR", tmp_path)
    (tmp_path / "run.log").write_text("an untracked log\n")
    assert runner.git_commit()["dirty"] is False
    (tmp_path / "tracked.py").write_text("x = 2\n")
    rec = runner.git_commit()
    assert rec["dirty"] is True and len(rec["commit"]) == 40
