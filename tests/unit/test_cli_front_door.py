"""The command line's contract: a `UserError`, and only it, becomes one `error:` line and exit 2; the light
commands (`--help`, `list`, `validate`) import neither torch nor transformers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pipeline import cli
from quantize.errors import UserError

ROOT = Path(__file__).resolve().parents[2]


def _user_error_classes() -> list[type]:
    """Every exception class the project defines for its users, from the modules that raise them."""
    from eval import perplexity, serve, vllm_run
    from pipeline import registry
    from quantize import calib, files, lock, manifest, paths, recipe
    from quantize import source as stage
    from quantize.source import arch, gguf, load as source
    from quantize.capture import loop as capture, device, distributed
    from quantize.export import write as export
    from quantize.methods import kernels
    from quantize.preflight import checks as preflight

    mods = (arch, calib, capture, device, distributed, export, files, gguf, kernels, lock, manifest, paths, preflight,
            recipe, source, stage, perplexity, serve, vllm_run, registry)
    return [c for m in mods for c in vars(m).values()
            if isinstance(c, type) and issubclass(c, Exception) and c.__module__ == m.__name__
            and not c.__name__.startswith("_")]  # private control flow, never shown


def test_every_project_error_class_is_a_user_error():
    found = _user_error_classes()
    assert len(found) >= 16  # the modules above define at least these many
    assert [c.__name__ for c in found if not issubclass(c, UserError)] == []


def test_a_user_error_is_one_line_and_exit_2_and_anything_else_keeps_its_traceback(monkeypatch, capsys):
    class Mistake(UserError):
        pass

    def raises(exc):
        def command(args):
            raise exc
        return command

    monkeypatch.setattr(cli, "_command", raises(Mistake("recipe key `x` is wrong; set it to 1")))
    assert cli.main(["list"]) == 2
    assert capsys.readouterr().err == "error: recipe key `x` is wrong; set it to 1\n"
    monkeypatch.setattr(cli, "_command", raises(ValueError("a bug")))
    with pytest.raises(ValueError, match="a bug"):  # a ValueError that is no UserError is a bug, not a message
        cli.main(["list"])
    monkeypatch.setattr(cli, "_command", raises(Mistake("with its traceback")))
    with pytest.raises(Mistake):
        cli.main(["list", "--debug"])


@pytest.mark.parametrize("argv", [["--help"], ["list"], ["validate"], ["validate", "smollm2-awq-g64"]])
def test_the_light_commands_import_no_torch(argv):
    # the command's own function: `python -m pipeline` runs it, then ends the process (tests/unit/test_exit.py)
    probe = ("import sys\n"
             f"sys.argv = ['quantize', *{argv!r}]\n"
             "from pipeline.__main__ import main\n"
             "try:\n    code = main()\n"
             "except SystemExit as e:\n    code = e.code\n"
             "heavy = sorted(m for m in ('torch', 'transformers', 'vllm', 'mlflow') if m in sys.modules)\n"
             "print('HEAVY', heavy, 'CODE', code, file=sys.stderr)\n")
    p = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert "HEAVY [] CODE 0" in p.stderr, p.stderr[-2000:]


def test_a_malformed_registry_name_is_refused_before_the_output_is_looked_at(tmp_path, capsys):
    """The name is checked first: nothing about the output directory (here its parent is missing) is asked or made
    before the user hears what a registered version looks like."""
    from pipeline.cli import main

    out = tmp_path / "no" / "such" / "artifacts"
    assert main(["serve", "models:/only-a-name", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not a registered version: write models:/<name>@<alias>" in err[0], err
    assert not (tmp_path / "no").exists()
