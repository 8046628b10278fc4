"""The two table forms the tool writes: aligned text for a terminal, Markdown for reports."""

from __future__ import annotations

from collections.abc import Sequence


def text_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Columns padded to their widest cell, a dashed rule under the header, no trailing blanks."""
    cells = [list(header), *[list(row) for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def markdown_row(cells: Sequence[str]) -> str:
    return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """A GitHub Markdown table; a ``|`` inside a cell is escaped."""
    return [markdown_row(header), markdown_row(["---"] * len(header)), *(markdown_row(row) for row in rows)]
