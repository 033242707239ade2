"""Every command the guides show parses: README.md first, then the files it links to.

Extracted from each ``bash`` / ``sh`` / ``shell`` / ``console`` fence (other fences hold YAML, diagrams and
directory trees): every line, ``\\`` continuations joined, ``# comments`` and a console's ``$ `` prompt
removed, leading ``VAR=value`` assignments and the wrappers ``nice -n N``, ``bash``, ``python``,
``.venv/bin/python`` skipped. What is checked, by what the command starts with:

- ``srpo SUB ...`` (or ``tools/dev srpo SUB ...``): the CLI's own parser (``srpo_megatron.cli.build_parser``)
  parses the whole argument list in-process, so an unknown flag, a missing required flag or a bad choice
  fails; ``SUB --help`` must render too. Nothing runs: parsing is what ``--help`` / ``--dryrun`` would check
  of the arguments, without starting a job.
- ``tools/NAME.py ...`` and ``examples/.../NAME.py ...``: the script runs in-process with its real
  ``argparse`` parser, which parses those arguments and is stopped right after (``_Parsed``), before the
  script does any work.
- ``tools/dev SUB ...``: SUB is one of the commands of ``tools/dev``'s ``case``; ``demo`` arguments are
  ``KEY=VALUE`` overrides; ``gate`` arguments go through the gate's parser; ``test`` arguments are pytest's
  and are not checked.
- ``tools/NAME.sh``, ``cluster/...`` scripts: the file exists.

Placeholders such as ``RECIPE`` or ``/runs/x`` are positional values: parsing accepts any string there,
so nothing is skipped. A line that is none of the above (``cd``, ``export``, a ``pytest`` call) is not a
command of this project's and is ignored; README.md must yield at least ten commands, so a broken
extractor cannot pass.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import runpy
import shlex
import sys
from pathlib import Path

import pytest

from srpo_megatron.cli import COMMANDS, build_parser

REPO = Path(__file__).resolve().parents[2]
GUIDES = [
    "README.md",
    "cluster/README.md",
    "tests/README.md",
    "tools/MEASURED.md",
    "examples/cpu_compare/README.md",
    "srpo_megatron/ARCHITECTURE.md",
]
SHELL_FENCES = {"bash", "sh", "shell", "console"}
WRAPPERS = {"bash", "python", "python3", ".venv/bin/python", "exec"}


class _Parsed(Exception):
    """Raised by the patched ``ArgumentParser.parse_args`` once a script's arguments parsed."""


def fenced_commands(text: str) -> list[tuple[int, str]]:
    """(line number, command) of every line inside a shell fence, continuations joined."""
    out: list[tuple[int, str]] = []
    fence: str | None = None
    pending, start = "", 0
    for i, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith("```"):
            fence = None if fence is not None else (stripped[3:].strip() or "plain")
            continue
        if fence not in SHELL_FENCES:
            continue
        if fence == "console" and stripped.startswith("$ "):
            stripped = stripped[2:]
        if not pending:
            start = i
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        command = (pending + stripped).strip()
        pending = ""
        if command and not command.startswith("#"):
            out.append((start, command))
    return out


def _words(command: str) -> list[str]:
    """The command's words with leading assignments and wrappers removed."""
    words = shlex.split(command, comments=True)
    while words:
        if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]) or words[0] in WRAPPERS:
            words = words[1:]
        elif words[0] == "nice":
            words = words[3:] if len(words) > 2 and words[1] == "-n" else words[1:]
        elif words[:2] == ["-m", "srpo_megatron.cli"]:
            words = ["srpo", *words[2:]]
        else:
            break
    return words


def _dev_commands() -> set[str]:
    text = (REPO / "tools" / "dev").read_text()
    block = text[text.index('case "$cmd" in') :]
    return set(re.findall(r"^  ([a-z][a-z-]*)\)$", block, re.M))


@contextlib.contextmanager
def _stop_after_parse():
    """``ArgumentParser.parse_args`` parses as usual (bad arguments: SystemExit 2), then raises _Parsed."""
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        original(self, args, namespace)
        raise _Parsed

    argparse.ArgumentParser.parse_args = parse_then_stop  # type: ignore[method-assign]
    try:
        yield
    finally:
        argparse.ArgumentParser.parse_args = original  # type: ignore[method-assign]


def _argparse_problem(run) -> str | None:
    """None when ``run()`` reached its parser and the arguments parsed; else argparse's complaint."""
    err = io.StringIO()
    try:
        with _stop_after_parse(), contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            run()
    except _Parsed:
        return None
    except SystemExit as e:
        return f"exit {e.code}: {' '.join(err.getvalue().split())[-300:]}"
    return "the script ended without parsing its arguments"


def _check_srpo(args: list[str]) -> str | None:
    if not args or args[0] not in COMMANDS:
        return f"{args[:1]} is not an srpo command; have {sorted(COMMANDS)}"
    problem = _argparse_problem(lambda: build_parser(args).parse_args(args))
    if problem:
        return problem
    help_out = io.StringIO()
    try:
        with contextlib.redirect_stdout(help_out):
            build_parser([args[0], "--help"]).parse_args([args[0], "--help"])
    except SystemExit as e:
        if e.code != 0 or not help_out.getvalue():
            return f"srpo {args[0]} --help exited {e.code}"
    return None


def _check_script(path: Path, args: list[str]) -> str | None:
    if not path.is_file():
        return f"{path.relative_to(REPO)} does not exist"
    old_argv, old_path = sys.argv, list(sys.path)
    sys.argv = [str(path), *args]
    sys.path.insert(0, str(path.parent))
    try:
        return _argparse_problem(lambda: runpy.run_path(str(path), run_name="__main__"))
    finally:
        sys.argv, sys.path[:] = old_argv, old_path


def _check_dev(args: list[str]) -> str | None:
    commands = _dev_commands()
    if not args or args[0] not in commands:
        return f"tools/dev {args[:1]}: not a tools/dev command; have {sorted(commands)}"
    sub, rest = args[0], args[1:]
    if sub == "srpo":
        return _check_srpo(rest)
    if sub == "demo":
        bad = [a for a in rest if "=" not in a or a.startswith("-")]
        return f"tools/dev demo takes KEY=VALUE overrides, not {bad}" if bad else None
    if sub == "gate":
        from srpo_megatron.testing.gate import main as gate_main

        return _argparse_problem(lambda: gate_main(rest))
    if sub in ("setup", "lint", "bench") and rest:
        return f"tools/dev {sub} takes no arguments, got {rest}"
    return None


def check_command(command: str) -> str | None:
    """None when the command parses, else why not; raises ValueError for a line that is not ours."""
    words = _words(command)
    if not words:
        raise ValueError(command)
    head, args = words[0], words[1:]
    if head == "srpo":
        return _check_srpo(args)
    if head == "tools/dev":
        return _check_dev(args)
    if head.endswith(".py") and head.startswith(("tools/", "examples/")):
        return _check_script(REPO / head, args)
    if head.endswith(".sh") and head.startswith(("tools/", "cluster/")):
        return None if (REPO / head).is_file() else f"{head} does not exist"
    raise ValueError(command)


def problems(md: Path) -> tuple[int, list[str]]:
    """(commands checked, 'file:line: command: why' for each that does not parse)."""
    checked, out = 0, []
    for line, command in fenced_commands(md.read_text()):
        try:
            why = check_command(command)
        except ValueError:
            continue
        checked += 1
        if why:
            out.append(f"{md.name}:{line}: {command}: {why}")
    return checked, out


@pytest.mark.parametrize("guide", GUIDES)
def test_every_fenced_command_parses(guide):
    checked, bad = problems(REPO / guide)
    assert not bad, "\n".join(bad)
    if guide == "README.md":
        assert checked >= 10, f"only {checked} commands found in README.md: is the extractor broken?"


def test_readme_links_point_at_files():
    text = (REPO / "README.md").read_text()
    targets = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text)
    assert len(targets) >= 5
    missing = [t for t in targets if not t.startswith("http") and not (REPO / t).exists()]
    assert not missing, missing


def test_readme_is_a_short_guide_with_the_two_setup_commands_first():
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 400
    first_fence = text.split("```")[1]
    commands = [_words(c) for _, c in fenced_commands("```" + first_fence + "```")]
    assert commands == [["tools/dev", "demo"], ["tools/dev", "test"]]
    assert not re.search(r"\b[Ii]ssues? \d+", text)


def test_the_architecture_layer_table_is_the_import_rules_table():
    import subprocess

    rules = [sys.executable, "-m", "tests.unit.test_import_rules"]
    table = subprocess.run(rules, cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()
    assert table in (REPO / "srpo_megatron" / "ARCHITECTURE.md").read_text(), (
        "srpo_megatron/ARCHITECTURE.md's layer table is stale: paste the output of "
        "`python -m tests.unit.test_import_rules` between its <!-- layers --> markers"
    )


@pytest.mark.parametrize(
    ("good", "bad"),
    [
        ("srpo plan examples/qwen3_8b_srpo.yaml --cluster", "srpo plan examples/x.yaml --clusterr"),
        ("--out-dir /models/qwen3_8b_srpo_hf --dtype bf16", "--out-dir /models/x --dtype bf17"),
        ("srpo jobs logs --tail 100", "srpo jobs log --tail 100"),
        (
            "srpo doctor examples/qwen3_8b_srpo.yaml --cluster cluster/h100.yaml\n",
            "srpo doctor x --verbose\n",
        ),
        ("tools/dev demo run.seed=2", "tools/dev demoo run.seed=2"),
    ],
)
def test_a_planted_bad_command_in_a_readme_copy_fails(tmp_path, good, bad):
    text = (REPO / "README.md").read_text()
    assert good in text
    copy = tmp_path / "README.md"
    copy.write_text(text.replace(good, bad, 1))
    _, found = problems(copy)
    assert len(found) == 1 and found[0].startswith("README.md:"), found
    _, clean = problems(REPO / "README.md")
    assert not clean
