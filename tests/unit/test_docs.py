"""The docs say what the code does: docs/cli.md is made from the command's own parsers, and the repository
speaks of the product only.

    python -m tests.unit.test_docs --write        # from the repository root: write docs/cli.md again

The tests fail when an option of any command (nested ones included, `eval run`, `keys new`, ...) is
missing from its section of docs/cli.md, or when a tracked file other than CHANGELOG.md carries work
history: issue numbers or numbered sessions. Options hidden from --help are left out of both.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest


def repository_root() -> Path:
    """The checkout this file is in: the nearest folder above it that holds pyproject.toml."""
    here = Path(__file__).resolve()
    return next(folder for folder in here.parents if (folder / "pyproject.toml").is_file())


CLI_MD = repository_root() / "docs" / "cli.md"
REGENERATE = "run `python -m tests.unit.test_docs --write` from the repository root to write docs/cli.md again"
# Every command has these; docs/cli.md describes them once, at the top.
COMMON_OPTIONS = ("-h", "--help", "-v", "--verbose")
# Work history in a tracked file: issue numbers, sessions counted by an ordinal (spelled out or in
# digits), and references to a task's own instructions. Pytest, tmux and database sessions are not counted.
HISTORY = r"issue [0-9]+|(first|second|third|[a-z]+th|[0-9]+(st|nd|rd|th)) session|the[ ]brief"
HISTORY_ALLOWED_IN = ("CHANGELOG.md",)


@dataclass(frozen=True)
class Command:
    """One command of the `layerbus` console script, as docs/cli.md documents it."""

    # "layerbus eval run"
    name: str
    # its line in its parent's --help
    summary: str
    parser: argparse.ArgumentParser


def _subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, str, argparse.ArgumentParser]]:
    """(name, help line, parser) of each subcommand `parser` has, in the order --help lists them."""
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            summaries = {choice.dest: choice.help or "" for choice in action._choices_actions}
            found += [(name, summaries.get(name, ""), sub) for name, sub in action.choices.items()]
    return found


def _with_own_options(name: str, parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The parser whose options `layerbus NAME` takes. `layerbus stage` adds its options only when it runs
    (they import torch); cli/stage.py builds the full parser for its --help."""
    if name == "layerbus stage":
        from layerbus.cli.stage import stage_parser

        return stage_parser()
    return parser


def commands() -> list[Command]:
    """Every command that takes arguments of its own or has no subcommands, parents before children."""
    from layerbus.cli.main import build_parser

    found: list[Command] = []

    def visit(prefix: str, parser: argparse.ArgumentParser) -> None:
        for name, summary, sub in _subcommands(parser):
            full = f"{prefix} {name}"
            sub = _with_own_options(full, sub)
            children = _subcommands(sub)
            if not children or visible_actions(sub):
                found.append(Command(full, summary.replace("%%", "%"), sub))
            visit(full, sub)

    visit("layerbus", build_parser())
    return found


def visible_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The options and arguments --help shows, less the common ones and the subcommand list."""
    return [action for action in parser._actions
            if action.help is not argparse.SUPPRESS
            and not isinstance(action, argparse._SubParsersAction)
            and not set(action.option_strings) & set(COMMON_OPTIONS)]


def option_strings(parser: argparse.ArgumentParser) -> list[str]:
    return [option for action in visible_actions(parser) for option in action.option_strings]


def _markdown(text: str) -> str:
    # A '<' before a letter would start an HTML tag in Markdown.
    return re.sub(r"<(?=[A-Za-z/])", "&lt;", " ".join(text.split()))


def _help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    return _markdown(parser._get_formatter()._expand_help(action)) if action.help else ""


def _invocation(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """`--stages N`, `-o FILE`, `--once`: each option string with its arguments."""
    formatter = parser._get_formatter()
    if not action.option_strings:
        return f"`{formatter._format_args(action, formatter._get_default_metavar_for_positional(action))}`"
    args = formatter._format_args(action, formatter._get_default_metavar_for_optional(action)) if action.nargs != 0 else ""
    return ", ".join(f"`{option} {args}`" if args else f"`{option}`" for option in action.option_strings)


def _anchor(name: str) -> str:
    return re.sub(r"[^a-z0-9 -]", "", name.lower()).replace(" ", "-")


def render() -> str:
    """docs/cli.md, from the parsers."""
    from layerbus.cli.main import build_parser

    top = build_parser()
    listed = commands()
    lines = [
        "# The `layerbus` command line",
        "",
        "This page is generated from the command's own parsers by `python -m tests.unit.test_docs --write` (from the",
        "repository root), and `tests/unit/test_docs.py` fails when an option is missing from it: edit the help texts",
        "in `cli/` (and `stages/__main__.py` for `layerbus stage`), then write it again.",
        "",
        "One console script, `layerbus`, one section per command below: what it does, then its arguments and",
        "options with their help text. The topic pages say how the pieces fit: [jobs](jobs.md),",
        "[placement](placement.md), [faults](faults.md), [weights and wire](weights-and-wire.md),",
        "[operations](operations.md), [evals](evals.md), [the store](store.md).",
        "",
        "Every command takes `-h`/`--help`, and `-v`/`--verbose` (INFO logs on stderr; `-vv` for DEBUG), before",
        "or after the command's name. The default store is one SQLite file, `$LAYERBUS_HOME/layerbus.db`",
        "(`LAYERBUS_HOME` defaults to `~/.local/share/layerbus`), so `submit` and `status` from two shells see",
        "the same jobs; `--db` takes any SQLAlchemy URL (`sqlite:///path.db`,",
        "`postgresql+psycopg://user:pass@host/db`). Results land in `$LAYERBUS_HOME/results/<job>.parquet`.",
        "",
        f"{_markdown(top.epilog or '')} `layerbus broker` and `layerbus stage` exit 143 when stopped by SIGTERM,",
        "after stopping cleanly.",
        "",
        "| command | what it does |",
        "|---|---|",
    ]
    lines += [f"| [`{command.name}`](#{_anchor(command.name)}) | {_markdown(command.summary)} |" for command in listed]
    for command in listed:
        summary = _markdown(command.summary).rstrip(".")
        lines += ["", f"## `{command.name}`", "", summary[:1].upper() + summary[1:] + "."]
        description = (command.parser.description or "").replace("%%", "%")
        if description and " ".join(description.split()) != " ".join(command.summary.split()):
            lines += ["", _markdown(description)]
        actions = visible_actions(command.parser)
        positionals = [action for action in actions if not action.option_strings]
        optionals = [action for action in actions if action.option_strings]
        if positionals:
            lines += ["", "Arguments:", ""]
            lines += [f"- {_invocation(command.parser, action)}: {_help(command.parser, action)}"
                      for action in positionals]
        if optionals:
            lines += ["", "Options:", ""]
            lines += [f"- {_invocation(command.parser, action)}: {_help(command.parser, action)}".rstrip(": ")
                      for action in optionals]
    return "\n".join(lines) + "\n"


def sections(text: str) -> dict[str, str]:
    """docs/cli.md's text under each `## \\`layerbus ...\\`` heading, by command name."""
    found: dict[str, str] = {}
    name = None
    for line in text.splitlines():
        heading = re.fullmatch(r"## `(layerbus[^`]*)`", line)
        if heading:
            name = heading.group(1)
            found[name] = ""
        elif name is not None:
            found[name] += line + "\n"
    return found


def documents(section: str, option: str) -> bool:
    return re.search(r"`" + re.escape(option) + r"[ `]", section) is not None


def test_every_command_and_option_is_in_cli_md() -> None:
    assert CLI_MD.is_file(), f"{CLI_MD} is missing: {REGENERATE}"
    written = sections(CLI_MD.read_text())
    missing = []
    for command in commands():
        section = written.get(command.name)
        if section is None:
            missing.append(f"{command.name} (no section)")
            continue
        missing += [f"{command.name} {option}" for option in option_strings(command.parser)
                    if not documents(section, option)]
    assert not missing, f"docs/cli.md does not document: {', '.join(missing)}; {REGENERATE}"


def test_cli_md_documents_no_command_that_is_gone() -> None:
    names = {command.name for command in commands()}
    stale = sorted(set(sections(CLI_MD.read_text())) - names)
    assert not stale, f"docs/cli.md documents commands that no longer exist: {', '.join(stale)}; {REGENERATE}"


def test_hidden_options_stay_out_of_cli_md() -> None:
    from layerbus.cli.main import build_parser

    hidden = []

    def visit(parser: argparse.ArgumentParser) -> None:
        for action in parser._actions:
            if action.help is argparse.SUPPRESS and action.option_strings:
                hidden.extend(action.option_strings)
        for _, _, sub in _subcommands(parser):
            visit(sub)

    visit(build_parser())
    text = CLI_MD.read_text()
    shown = [option for option in hidden if option not in COMMON_OPTIONS and documents(text, option)]
    assert not shown, f"docs/cli.md shows options hidden from --help: {', '.join(shown)}; {REGENERATE}"


def test_no_work_history_in_tracked_files() -> None:
    root = repository_root()
    if shutil.which("git") is None or not (root / ".git").exists():
        pytest.skip("not a git checkout: the tracked files are not known")
    excluded = [f":(exclude){path}" for path in HISTORY_ALLOWED_IN]
    found = subprocess.run(["git", "grep", "-n", "-i", "-I", "-E", HISTORY, "--", ".", *excluded],
                           cwd=root, capture_output=True, text=True)
    if found.returncode not in (0, 1):
        pytest.skip(f"git grep failed: {found.stderr.strip()}")
    hits = found.stdout.splitlines()
    shown = "\n".join(line[:200] for line in hits[:40])
    assert not hits, (f"{len(hits)} line(s) carry work history (issue numbers, numbered sessions); say what the "
                      f"code does and why instead, and keep history to git and CHANGELOG.md:\n{shown}")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description="Check docs/cli.md against the parsers, or write it again.")
    parser.add_argument("--write", action="store_true", help="write docs/cli.md from the parsers")
    args = parser.parse_args(argv)
    text = render()
    if args.write:
        CLI_MD.parent.mkdir(exist_ok=True)
        CLI_MD.write_text(text)
        print(f"wrote {CLI_MD}")
        return 0
    current = CLI_MD.is_file() and CLI_MD.read_text() == text
    print(f"{CLI_MD} is {'what the parsers give' if current else 'not what the parsers give: add --write'}")
    return 0 if current else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
