"""The plain-text table that ``advisory_locks`` and ``job_runs`` print."""

from __future__ import annotations

from collections.abc import Sequence


def format_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> list[str]:
    """Lines of a table: columns padded to their widest cell, two spaces apart; None and ""
    print as empty cells."""
    cells = [list(header), *[["" if cell is None else str(cell) for cell in row] for row in rows]]
    widths = [max(len(row[column]) for row in cells) for column in range(len(header))]
    return [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in cells
    ]
