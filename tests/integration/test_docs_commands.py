"""The commands README.md and docs/*.md show run as written: every shell block is read, the light commands
(`--help`, `list`, `validate`, `preflight`, `make help|recipes|validate|preflight`) are run as a user types
them, and every shipped recipe a block names exists."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from quantize.recipe import list_recipes

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```(?:bash|sh|shell|console)?\n(.*?)^```", re.M | re.S)
LIGHT_PIPELINE = {"--help", "list", "validate", "preflight"}
LIGHT_MAKE = {"help", "recipes", "validate", "preflight"}


def shell_lines(path: Path) -> list[str]:
    """Every command line of the file's shell blocks: continuations joined, comments dropped."""
    out = []
    for block in BLOCK.findall(path.read_text()):
        for line in block.replace("\\\n", " ").splitlines():
            try:
                words = shlex.split(line, comments=True)
            except ValueError:  # a YAML or prose block, not shell
                continue
            if words:
                out.append(shlex.join(words))
    return out


def _light(words: list[str]) -> bool:
    files = [w.split("=", 1)[-1] for w in words if w.endswith((".yaml", ".yml"))]
    if any(not (ROOT / f).is_file() for f in files):  # the user's own recipe (docs/YOUR_MODEL.md's mine/...)
        return False
    if words[0] == "make":
        return len(words) > 1 and words[1] in LIGHT_MAKE
    return words[0].endswith("python") and words[1:3] == ["-m", "pipeline"] and len(words) > 3 \
        and words[3] in LIGHT_PIPELINE


def light_commands() -> list[tuple[str, str]]:
    return [(p.relative_to(ROOT).as_posix(), line) for p in DOCS for line in shell_lines(p)
            if _light(shlex.split(line))]


def test_the_docs_show_the_light_commands():
    shown = {line for _, line in light_commands()}
    for needle in (".venv/bin/python -m pipeline --help", ".venv/bin/python -m pipeline validate",
                   ".venv/bin/python -m pipeline preflight smollm2-gptq-g64"):
        assert needle in shown, sorted(shown)


@pytest.mark.parametrize("where,line", light_commands())
def test_a_light_command_from_the_docs_runs_as_written(where, line, tmp_path):
    words = shlex.split(line)
    venv = Path(sys.prefix)
    if words[0] == "make":  # the project's venv, taken as installed (-o: never rebuilt here)
        words = ["make", "-s", f"VENV={venv}", "-o", str(venv / ".installed"), *words[1:]]
    else:
        words = [sys.executable, *words[1:]]
    if "preflight" in words:  # its plan's JSON goes beside the artifacts: keep it out of the checkout
        words += ["--out", str(tmp_path)] if words[0] != "make" else []
    p = subprocess.run(words, cwd=ROOT, capture_output=True, text=True, timeout=900,
                       env={"PATH": f"{venv}/bin:/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "HOME": str(Path.home())})
    assert p.returncode == 0 and "Traceback" not in p.stderr, f"{where}: {line}\n{p.stdout[-1500:]}\n{p.stderr[-3000:]}"


def test_every_recipe_the_docs_name_exists():
    shipped, missing = set(list_recipes()), []
    for path in DOCS:
        for line in shell_lines(path):
            words = shlex.split(line)
            names = [w.split("=", 1)[1] for w in words if w.startswith(("RECIPE=", "RECIPES="))]
            if "pipeline" in words:
                i = words.index("pipeline")
                if words[i + 1:i + 2] and words[i + 1] in ("run", "eval", "preflight", "compare", "register"):
                    names += [w for w in words[i + 2:] if not w.startswith("-")][:1]
            for name in (n for value in names for n in value.split()):
                placeholder = name.isupper() or "<" in name or name.endswith(("...", ".yaml", ".yml"))
                if not placeholder and name not in shipped:
                    missing.append(f"{path.name}: {line}")
    assert missing == []


CODE_PATH = re.compile(r"(?<![\w/.])((?:quantize|eval|pipeline|bench|tests|recipes|docs)/[\w/.-]*\w\.(?:py|sh|md|yaml))")
CODE_DOCS = ["README.md", "docs/METHODS.md", "docs/ARCHITECTURES.md", "docs/YOUR_MODEL.md"]


def test_every_file_the_guides_name_exists():
    """README and the guides to methods, architectures and your own model name only files the tree holds."""
    missing = [f"{doc}: {path}" for doc in CODE_DOCS for path in CODE_PATH.findall((ROOT / doc).read_text())
               if not (ROOT / path).exists() and not path.startswith("mine/")]
    assert missing == []


def test_the_methods_tree_lists_every_module_of_the_package():
    """docs/METHODS.md's file tree of quantize/methods/ names each of its modules, and no other."""
    text = (ROOT / "docs" / "METHODS.md").read_text()
    tree = next(b for b in BLOCK.findall(text) if b.startswith("quantize/methods/"))
    listed = {w for line in tree.splitlines()[1:] for w in line.split() if w.endswith(".py")}
    assert listed == {p.name for p in (ROOT / "quantize" / "methods").glob("*.py")}
