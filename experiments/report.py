"""Writes a benchmark's Markdown table into a docs page, between named markers.

The figures in ``docs/`` come from the result files this way, never typed by hand. A script
renders its table from the dict it saves as ``results/<name>.json``; with ``--report``
(:func:`add_report_flag`) it re-renders the table from that file (:func:`load_results`)
without running the benchmark.
"""

from __future__ import annotations

import json
import pathlib

DOCS = pathlib.Path(__file__).parent.parent / "docs"
RESULTS = pathlib.Path(__file__).parent / "results"


def write_between_markers(path: pathlib.Path, name: str, text: str) -> None:
    """Replaces the text between ``<!-- name:begin -->`` and ``<!-- name:end -->`` in ``path``
    (appending the markers when the page has none yet)."""
    doc = path.read_text()
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    if doc.count(begin) > 1 or doc.count(end) > 1:
        raise ValueError(f"{path}: the markers of {name!r} appear more than once")
    if begin not in doc:
        doc += f"\n{begin}\n{end}\n"
    head, rest = doc.split(begin, 1)
    tail = rest.split(end, 1)[1]
    path.write_text(f"{head}{begin}\n{text}\n{end}{tail}")


def add_report_flag(parser) -> None:
    """Adds ``--report`` to an ``argparse`` parser: re-render the docs table, run nothing."""
    parser.add_argument("--report", action="store_true",
                        help="only rewrite the table in docs/ from the saved results/*.json, "
                             "without running the benchmark")


def load_results(name: str) -> dict:
    """The result dict a script saved as ``results/<name>.json``."""
    return json.loads((RESULTS / f"{name}.json").read_text())


def markdown_table(header, rows) -> str:
    """A Markdown table.

    Args:
      header: the column titles.
      rows: one sequence of cells per row, each cell already formatted (``str()`` is applied).

    Returns:
      The table's lines, joined by newlines.
    """
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)
