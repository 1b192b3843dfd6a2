"""Fixed-width tables, the benchmarks' printed results."""

from __future__ import annotations

from collections.abc import Sequence


def format_table(header: Sequence[str], rows: Sequence[Sequence[object]], gap: int = 2) -> str:
    """Columns as wide as their widest cell: the first left-aligned, the others right."""
    cells = [[str(c) for c in header], *[[str(c) for c in r] for r in rows]]
    widths = [max(len(r[i]) for r in cells if i < len(r)) for i in range(len(cells[0]))]

    def line(row: list[str]) -> str:
        parts = [c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))]
        return (" " * gap).join(parts).rstrip()

    return "\n".join(line(r) for r in cells)


def print_table(header: Sequence[str], rows: Sequence[Sequence[object]], gap: int = 2) -> None:
    print(format_table(header, rows, gap), flush=True)
