"""The README's "## Results" table, read as data: {first cell: (figure cell, machine cell)},
and the figures of one cell pulled out by a row's pattern. scripts/reproduce_results.py
prints these beside what it measures now, so the README's text is the one source of the
figures it compares against (tests/test_reproduce_results.py keeps the two in step).
"""
from __future__ import annotations

import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(REPO, "README.md")


def results_table(path: str = README) -> dict[str, tuple[str, str]]:
    """{what: (figure, machine)} of every row of the table under "## Results", in order."""
    with open(path) as f:
        text = f.read()
    start = text.index("\n## Results\n")
    end = text.find("\n## ", start + 1)
    section = text[start:end if end >= 0 else len(text)]
    rows: dict[str, tuple[str, str]] = {}
    for line in section.splitlines():
        if not line.startswith("|"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or cells[0] == "what" or set(cells[0]) <= set("-: "):
            continue
        rows[cells[0]] = (cells[1], cells[2])
    return rows


def figures(pattern: str, cell: str) -> list[float]:
    """The numbers `pattern`'s groups capture in `cell` (ValueError when it does not match:
    the README's row changed its wording, and the row's pattern must follow)."""
    m = re.search(pattern, cell)
    if m is None:
        raise ValueError(f"README figure {cell!r} does not match {pattern!r}")
    return [float(g.replace(",", "")) for g in m.groups()]
