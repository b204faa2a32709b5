#!/usr/bin/env python
"""Write the reason-code table of docs/reasons.md from cmatmul_pass/reasons.py.

``python tools/gen_reasons_doc.py`` (or ``make reasons-doc``) replaces what lies between the two
markers in docs/reasons.md with one row per :data:`cmatmul_pass.reasons.REASONS` entry, in its
order; nothing outside the markers changes. ``--check`` writes nothing and exits 1 when the file
differs from what it would write. tests/test_docs.py compares the file with :func:`updated`.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cmatmul_pass import reasons  # noqa: E402
from tools.doc_markers import between, cell, run  # noqa: E402

DOC = ROOT / "docs" / "reasons.md"
BEGIN = "<!-- BEGIN reason table: written by `make reasons-doc` from cmatmul_pass/reasons.py; edit that, not this -->"
END = "<!-- END reason table -->"
HEADER = ["| code | what the pass found | example | what you can change |", "|---|---|---|---|"]


def row(reason: reasons.Reason) -> str:
    example = f"`explain {' '.join(reason.example)}`" if reason.example else "—"
    return f"| `{reason.code}` | {cell(reason.meaning)} | {cell(example)} | {cell(reason.hint)} |"


def table(table_reasons=None) -> str:
    """The markdown table, header included, one row per reason code."""
    rows = [row(r) for r in (table_reasons or reasons.REASONS).values()]
    return "\n".join([*HEADER, *rows]) + "\n"


def updated(text: str) -> str:
    """``text`` (docs/reasons.md) with the table between the markers written afresh."""
    return between(text, BEGIN, END, table(), str(DOC.relative_to(ROOT)))


if __name__ == "__main__":
    sys.exit(run(DOC, updated, "reasons-doc", sys.argv[1:]))
