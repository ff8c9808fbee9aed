"""Writes a benchmark's Markdown table into a docs page, between named markers.

The figures in ``docs/`` come from the result files this way, never typed by hand.
"""

from __future__ import annotations

import pathlib

DOCS = pathlib.Path(__file__).parent.parent / "docs"


def write_between_markers(path: pathlib.Path, name: str, text: str) -> None:
    """Replaces the text between ``<!-- name:begin -->`` and ``<!-- name:end -->`` in ``path``
    (appending the markers when the page has none yet)."""
    doc = path.read_text()
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    if begin not in doc:
        doc += f"\n{begin}\n{end}\n"
    head, rest = doc.split(begin, 1)
    tail = rest.split(end, 1)[1]
    path.write_text(f"{head}{begin}\n{text}\n{end}{tail}")
