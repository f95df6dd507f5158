"""Every entry point speaks one language: a user's mistake is one `error:` line on stderr, exit code 2, no
traceback; every option has help text; `make help` lists every target. Run as a user runs them: subprocesses."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline import cli

ROOT = Path(__file__).resolve().parents[2]


def _run(*argv: str, cwd: Path = ROOT, timeout: int = 180) -> subprocess.CompletedProcess:
    env = {"PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin",
           "MLFLOW_TRACKING_URI": f"sqlite:///{cwd / 'registry' / 'mlflow.db'}"}  # none there: nothing may create it
    return subprocess.run([sys.executable, *argv], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)


def _bad_recipe(tmp_path: Path) -> Path:
    path = tmp_path / "typo.yaml"
    path.write_text("name: typo\nbase: smollm2-awq-g64\nq_grup_size: 32\n")
    return path


def _user_errors(tmp_path: Path) -> list[tuple[list[str], str]]:
    """(argv after `python`, a phrase the error line must hold), one or more per entry point."""
    missing = str(tmp_path / "no-such-artifact")
    return [
        (["-m", "pipeline", "run", "smollm2-awq-g46"], "did you mean `smollm2-awq-g64`?"),
        (["-m", "pipeline", "validate", "smollm2-awq-g64", str(_bad_recipe(tmp_path))],
         "`q_grup_size`: unknown key; did you mean `q_group_size`?"),
        (["-m", "pipeline", "eval", "--artifact", missing], "is not an artifact directory"),
        (["-m", "pipeline", "compare", "smollm2-awq-g64", "nope-g64"], "no recipe named 'nope-g64'"),
        (["-m", "pipeline", "register", "--artifact", missing], "does not exist"),
        (["-m", "pipeline", "register", "smollm2-awq-g64", "--variant", "x"], "--variant names the version"),
        (["-m", "pipeline", "serve", "models:/only-a-name"], "is not a registered version"),
        (["-m", "pipeline", "serve", "models:/some-model@champion"], "no model registry at"),
        (["-m", "pipeline", "serve", missing + ".yaml"], "recipe file"),
        (["-m", "pipeline", "preflight", "smollm2-awq-g46"], "did you mean"),
        (["-m", "eval.serve", missing], "is not a model directory (no config.json)"),
        (["-m", "eval.bench_serve", missing], "is not an artifact directory"),
    ]


def test_every_entry_points_user_errors_exit_2_with_one_error_line(tmp_path):
    work = tmp_path / "cwd"
    work.mkdir()
    for argv, phrase in _user_errors(tmp_path):
        p = _run(*argv, cwd=work)
        shown = f"python {' '.join(argv)} -> {p.returncode}\n{p.stdout[-800:]}\n{p.stderr[-2000:]}"
        assert p.returncode == 2, shown
        errors = [ln for ln in p.stderr.splitlines() if ln.startswith("error: ")]
        assert errors and phrase in p.stderr, shown
        assert "Traceback" not in p.stderr, shown
    assert not list(tmp_path.glob("*.lock")) and not list(tmp_path.glob(".*"))  # nothing left behind
    assert list(work.iterdir()) == []  # not even an empty artifacts/ or registry/


def test_validate_lists_every_recipe_and_exits_2_for_an_invalid_one(tmp_path):
    p = _run("-m", "pipeline", "validate", "smollm2-awq-g64", str(_bad_recipe(tmp_path)), "smollm2-gptq-g64")
    assert p.returncode == 2
    assert p.stdout.split() == ["ok", "smollm2-awq-g64", "ok", "smollm2-gptq-g64"]
    assert p.stderr.startswith(f"error: {tmp_path / 'typo.yaml'}: recipe is invalid:")
    assert _run("-m", "pipeline", "validate").returncode == 0  # the shipped recipes


def _options(parser: argparse.ArgumentParser, path: str = ""):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _options(sub, f"{path} {name}")
        elif not isinstance(action, argparse._HelpAction):
            yield f"{path} {'/'.join(action.option_strings) or action.dest}", action.help


def test_every_option_has_help_text():
    from eval import bench_serve, serve

    found = dict(_options(cli._parser()))
    assert len(found) > 40
    assert [name for name, text in found.items() if not text] == []
    for module in (serve, bench_serve):  # their parsers are built inside main(): read them from --help
        out = _run("-m", module.__name__, "--help").stdout
        assert out.startswith(f"usage: python -m {module.__name__}")
        for line in re.findall(r"^  (-[-\w]+|\w+)\s*$", out, re.M):  # an option alone on its line, no help
            pytest.fail(f"{module.__name__}: {line} has no help text")
    tail = _run("-m", "eval.bench_serve", "--help").stdout
    assert "exit codes: 0 done; 2 a user error" in tail and "-> artifacts/<name>-bench-serve.{json,md,png}" in tail


def test_usage_names_how_the_command_was_started():
    assert _run("-m", "pipeline", "--help").stdout.startswith("usage: python -m pipeline ")
    probe = "import sys; sys.argv[0] = '/x/bin/quantize'; from pipeline.cli import main; main(['--help'])"
    assert _run("-c", probe).stdout.startswith("usage: quantize ")


def test_make_help_lists_every_target_once():
    make = (ROOT / "Makefile").read_text()
    phony = set(re.search(r"^\.PHONY: (.+?)(?<!\\)$", make, re.M | re.S).group(1).replace("\\\n", " ").split())
    p = subprocess.run(["make", "-s", "help"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    listed = [ln.split()[1] for ln in p.stdout.splitlines()]
    assert p.returncode == 0 and sorted(listed) == sorted(phony - {"help"}), p.stdout
    assert all(len(ln.split(maxsplit=2)) == 3 for ln in p.stdout.splitlines())  # each with its description


def test_make_targets_take_a_recipe_path_and_registry_versions():
    venv = Path(sys.prefix)

    def dry(*args: str) -> str:  # make -n: the commands it would run; the venv taken as installed
        p = subprocess.run(["make", "-n", f"VENV={venv}", "-o", str(venv / ".installed"), *args], cwd=ROOT,
                           capture_output=True, text=True, timeout=60)
        assert p.returncode == 0, p.stderr
        return p.stdout

    assert "-m eval.bench_serve artifacts/x-awq-g64 " in dry("bench-serve", "RECIPE=some/dir/x-awq-g64.yaml")
    assert "-m pipeline serve some/dir/x.yaml --host 0.0.0.0 --port 8000" in dry("serve", "RECIPE=some/dir/x.yaml",
                                                                               "HOST=0.0.0.0")
    assert "-m pipeline serve models:/x@champion --host 127.0.0.1" in dry("serve", "MODEL=models:/x@champion")
    assert "-m pipeline register --comparison cmp --alias champion --variant cmp-g64" in " ".join(
        dry("register", "COMPARISON=cmp", "ALIAS=champion", "VARIANT=cmp-g64").replace("\\\n", " ").split())
    for target in ("quantize", "eval", "register", "preflight"):
        assert " some/dir/x.yaml" in dry(target, "RECIPE=some/dir/x.yaml"), target
