"""The man page and the bash completion, generated from the argument parser (pure).

`render_manpage(parser)` writes roff (man(7)) and `render_bash_completion(parser)` a
bash completion function, both from `supervisor.cli.build_parser()`, so neither can
name a command or option the parser does not have. The shipped copies
(docs/man/placement-supervisor.1, docs/completion/placement-supervisor) are
regenerated with `python -m supervisor.manual man|bash` (a test holds them equal).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator, Sequence

from supervisor import __version__

# Options whose value is a path: the completion offers files there.
PATH_DESTS = ("config", "root", "out")


def _subcommands(
    parser: argparse.ArgumentParser,
) -> Iterator[tuple[str, str, argparse.ArgumentParser]]:
    """(name, one-line help, parser) of each subcommand, in the parser's order."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            for name, sub in action.choices.items():
                yield name, helps.get(name, ""), sub


def _options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings]


def _roff(text: str) -> str:
    """Text as roff prints it: backslashes and hyphens escaped, no line starting a request."""
    out = text.replace("\\", "\\e").replace("-", "\\-")
    return "\n".join(
        ("\\&" + line) if line.startswith((".", "'")) else line for line in out.splitlines()
    )


def _option_head(action: argparse.Action) -> str:
    names = ", ".join(f"\\fB{_roff(s)}\\fR" for s in action.option_strings)
    if action.nargs == 0:
        return names
    metavar = action.metavar or action.dest.upper()
    return f"{names} \\fI{_roff(str(metavar))}\\fR"


def render_manpage(parser: argparse.ArgumentParser) -> str:
    """placement-supervisor(1) in roff."""
    prog = parser.prog
    lines = [
        f'.TH {prog.upper()} 1 "" "{prog} {__version__}" "User Commands"',
        ".ad l",  # left-aligned: usage lines keep single spaces (and stay greppable)
        ".nh",
        ".SH NAME",
        f"{_roff(prog)} \\- {_roff(parser.description or '')}",
        ".SH SYNOPSIS",
        f".B {_roff(prog)}",
        "\\fICOMMAND\\fR [\\fIOPTIONS\\fR]",
        ".br",
        f".B {_roff(prog)}",
        "\\fB\\-\\-version\\fR",
        ".SH COMMANDS",
    ]
    for name, help_text, sub in _subcommands(parser):
        usage = " ".join(sub.format_usage().removeprefix("usage: ").split())
        lines += [f'.SS "{_roff(name)}"', _roff(usage), ".PP", _roff(sub.description or help_text)]
        for action in _options(sub):
            if action.dest == "help":
                continue
            lines += [".TP", _option_head(action), _roff(action.help or "")]
        if sub.epilog:
            lines += [".PP", ".nf", _roff(sub.epilog.rstrip()), ".fi"]
    lines += [
        ".SH EXIT STATUS",
        _roff(
            "0 done; 2 bad arguments or config (one line naming the file, key or value); "
            "3 infeasible plan or unusable topology; run: 1 an internal error; "
            "status and reload: see above."
        ),
        ".SH FILES",
        ".TP",
        "\\fI/etc/placement\\-supervisor/config.toml\\fR",
        "the config the shipped systemd unit runs",
        ".TP",
        "\\fI/run/placement\\-supervisor/\\fR",
        "the instance lock and the API's unix socket",
        ".TP",
        "\\fI/var/lib/placement\\-supervisor/\\fR",
        "each instance's IRQ checkpoint (the affinities it moved)",
        ".SH SEE ALSO",
        "\\fBsystemctl\\fR(1), \\fBnumactl\\fR(8), \\fBtaskset\\fR(1)",
    ]
    return "\n".join(lines) + "\n"


def render_bash_completion(parser: argparse.ArgumentParser) -> str:
    """A bash completion function for the command (bash(1), "Programmable Completion")."""
    prog = parser.prog
    func = "_" + prog.replace("-", "_")
    subs = list(_subcommands(parser))
    top = [name for name, _, _ in subs] + [s for a in _options(parser) for s in a.option_strings]
    path_options = sorted(
        {
            s
            for _, _, sub in subs
            for a in _options(sub)
            if a.dest in PATH_DESTS
            for s in a.option_strings
        }
    )
    cases = []
    for name, _, sub in subs:
        opts = " ".join(s for a in _options(sub) for s in a.option_strings)
        cases.append(f'        {name}) opts="{opts}" ;;')
    return (
        "\n".join(
            [
                f"# bash completion for {prog} (generated: python -m supervisor.manual bash)",
                f"{func}() {{",
                '    local cur=${COMP_WORDS[COMP_CWORD]} prev=${COMP_WORDS[COMP_CWORD-1]} opts=""',
                '    if [ "$COMP_CWORD" -eq 1 ]; then',
                f'        COMPREPLY=($(compgen -W "{" ".join(top)}" -- "$cur"))',
                "        return",
                "    fi",
                '    case "$prev" in',
                f'        {"|".join(path_options)}) COMPREPLY=($(compgen -f -- "$cur")); return ;;',
                "    esac",
                '    case "${COMP_WORDS[1]}" in',
                *cases,
                "    esac",
                '    COMPREPLY=($(compgen -W "$opts" -- "$cur"))',
                "}",
                f"complete -o default -F {func} {prog}",
            ]
        )
        + "\n"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m supervisor.manual man|bash`: print the man page or the completion."""
    from supervisor.cli import build_parser  # noqa: PLC0415 (cli imports nothing of this)

    args = list(sys.argv[1:] if argv is None else argv)
    if args not in (["man"], ["bash"]):
        print("usage: python -m supervisor.manual man|bash", file=sys.stderr)
        return 2
    parser = build_parser()
    sys.stdout.write(render_manpage(parser) if args == ["man"] else render_bash_completion(parser))
    return 0


if __name__ == "__main__":
    sys.exit(main())
