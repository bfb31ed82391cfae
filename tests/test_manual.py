"""The man page and bash completion: generated from the argument parser, shipped
as generated, read by the real man(1) and bash(1)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from supervisor.cli import build_parser
from supervisor.manual import render_bash_completion, render_manpage

REPO = Path(__file__).resolve().parent.parent
MAN = REPO / "docs/man/placement-supervisor.1"
COMPLETION = REPO / "docs/completion/placement-supervisor"
COMMANDS = (
    "topology",
    "plan",
    "check",
    "containers",
    "agent",
    "snapshot",
    "run",
    "status",
    "reload",
)


def test_the_shipped_files_are_what_the_parser_generates() -> None:
    parser = build_parser()
    regenerate = f"{sys.executable} -m supervisor.manual man|bash"
    assert MAN.read_text() == render_manpage(parser), f"stale: {MAN} ({regenerate})"
    assert COMPLETION.read_text() == render_bash_completion(parser), f"stale ({regenerate})"


def test_man_renders_every_command_and_option_without_a_warning() -> None:
    if shutil.which("man") is None:
        pytest.skip("man is not installed")
    done = subprocess.run(
        ["man", "--warnings", "-l", str(MAN)],
        env=dict(os.environ, MANWIDTH="100", MANPAGER="cat", PAGER="cat"),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0 and done.stderr == "", done.stderr
    text = done.stdout
    assert "PLACEMENT-SUPERVISOR(1)" in text
    for name in COMMANDS:
        assert f"placement-supervisor {name} " in text, name
    for option in ("--no-checks", "--pid PID", "--timeout TIMEOUT", "--example NAME"):
        assert option in text, option
    assert "5  refused: the file is valid but needs a restart" in text  # reload's epilog


def _complete(*words: str, cwd: Path = REPO) -> list[str]:
    """COMPREPLY of the shipped completion in a real bash, for a command line whose
    last word is being completed."""
    script = (
        f'source {COMPLETION}; COMP_WORDS=("$@"); COMP_CWORD=$(($# - 1)); '
        "_placement_supervisor; printf '%s\\n' \"${COMPREPLY[@]}\""
    )
    done = subprocess.run(
        ["bash", "-c", script, "bash", "placement-supervisor", *words],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    return [line for line in done.stdout.splitlines() if line]


def test_bash_completes_commands_options_and_paths(tmp_path: Path) -> None:
    if shutil.which("bash") is None:
        pytest.skip("bash is not installed")
    assert _complete("re") == ["reload"]
    assert sorted(_complete("")) == sorted([*COMMANDS, "-h", "--help", "--version"])
    assert _complete("reload", "--p") == ["--pid"]
    assert _complete("plan", "--no") == ["--no-checks"]
    (tmp_path / "gpu.toml").write_text("")
    assert _complete("plan", "--config", "gp", cwd=tmp_path) == ["gpu.toml"]
