#!/usr/bin/env python
"""Write the option and exit-code reference of docs/cli.md from cmatmul_pass/cli.py's parser.

``python tools/gen_cli_doc.py`` (or ``make cli-doc``) replaces what lies between the two markers
in docs/cli.md with one row per option of every command (an option several commands share is one
row naming them all; its text is the option's ``--help`` line) and one row per
:data:`cmatmul_pass.cli.EXIT_CODES` entry; nothing outside the markers changes. ``--check`` writes
nothing and exits 1 when the file differs. tests/test_docs.py compares the file with
:func:`updated`, so ``--help`` and the page cannot disagree.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cmatmul_pass import cli  # noqa: E402
from tools.doc_markers import between, cell, run  # noqa: E402

DOC = ROOT / "docs" / "cli.md"
BEGIN = "<!-- BEGIN option table: written by `make cli-doc` from cmatmul_pass/cli.py; edit that, not this -->"
END = "<!-- END option table -->"


def commands(parser: argparse.ArgumentParser | None = None) -> dict[str, argparse.ArgumentParser]:
    """Each command's parser, by name, in the order ``--help`` lists them."""
    parser = parser or cli.build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def options(parser: argparse.ArgumentParser | None = None) -> dict[tuple[str, str], list[str]]:
    """(how ``--help`` writes the option, its help text) -> the commands that take it; the main
    parser's own options under ``(all)``."""
    parser = parser or cli.build_parser()
    found: dict[tuple[str, str], list[str]] = {}
    for name, p in [("(all)", parser), *commands(parser).items()]:
        formatter = p._get_formatter()
        for action in p._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            shown = formatter._format_action_invocation(action)
            text = formatter._expand_help(action) if action.help else ""
            default = action.default
            unset = default is None or default is False or default is True or default == argparse.SUPPRESS
            if action.option_strings and not unset and "(default" not in text:
                text += f" (default: {default})"
            found.setdefault((shown, text), []).append(name)
    return found


def table() -> str:
    rows = ["| option | commands | what it does |", "|---|---|---|"]
    for (shown, text), names in options().items():
        rows.append(f"| `{cell(shown)}` | {', '.join(names)} | {cell(text)} |")
    rows += ["", "| exit code | meaning |", "|---|---|"]
    rows += [f"| `{code}` | {cell(meaning)} |" for code, meaning in cli.EXIT_CODES.items()]
    return "\n".join(rows) + "\n"


def updated(text: str) -> str:
    """``text`` (docs/cli.md) with the tables between the markers written afresh."""
    return between(text, BEGIN, END, table(), str(DOC.relative_to(ROOT)))


if __name__ == "__main__":
    sys.exit(run(DOC, updated, "cli-doc", sys.argv[1:]))
