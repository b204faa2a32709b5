"""A block of a document written by a generator: the text between a BEGIN and an END marker line.

The generators (``tools/gen_reasons_doc.py``, ``tools/gen_cli_doc.py``, ``tools/gen_bench_doc.py``)
replace only what lies between their two markers; tests/test_docs.py checks each page is what its
generator writes.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent


def between(text: str, begin: str, end: str, body: str, doc: str = "the document") -> str:
    """``text`` with the lines between the ``begin`` and ``end`` marker lines replaced by ``body``
    (which ends with a newline)."""
    if text.count(begin) != 1 or text.count(end) != 1 or text.index(begin) > text.index(end):
        raise ValueError(f"{doc}: needs one {begin!r} line and one {end!r} line after it")
    head, rest = text.split(begin + "\n", 1)
    _, tail = rest.split(end, 1)
    return f"{head}{begin}\n{body}{end}{tail}"


def cell(text: str) -> str:
    """``text`` for a markdown table's cell."""
    return text.replace("|", "\\|").replace("\n", " ")


def run(doc: Path, updated: Callable[[str], str], make_target: str, argv: list[str]) -> int:
    """A generator's command line: write ``doc`` afresh, or with ``--check`` write nothing and
    exit 1 where it differs from what would be written."""
    text = doc.read_text()
    new = updated(text)
    name = doc.relative_to(ROOT)
    if "--check" in argv:
        if new != text:
            print(f"{name} is stale: run `make {make_target}`", file=sys.stderr)
            return 1
        return 0
    if new != text:
        doc.write_text(new)
        print(f"wrote {name}")
    return 0
