"""bench/record_imports.py: the list of what a command imports, merged into an existing list."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_scripts_imports_are_recorded_relative_to_their_root_and_merged(tmp_path):
    lib = tmp_path / "lib"
    (lib / "pkg_rec").mkdir(parents=True)
    (lib / "pkg_rec" / "__init__.py").write_text("")
    (lib / "pkg_rec" / "leaf.py").write_text("import xml.dom.minidom\n")
    script = tmp_path / "job.py"
    script.write_text(f"import sys; sys.path.insert(0, {str(lib)!r})\nimport pkg_rec.leaf\nimport bench.versions\n")
    merged = tmp_path / "imports.txt"
    merged.write_text("kept/from_before.py\n")
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "record_imports.py"), "--merge", str(merged),
                        "--script", str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    names = merged.read_text().split()
    assert names == sorted(names)
    for want in ("kept/from_before.py", "pkg_rec/__init__.py", "pkg_rec/leaf.py", "xml/dom/minidom.py"):
        assert want in names
    assert not [n for n in names if n.startswith("bench/")], "the repository's bench scripts are not recorded"
