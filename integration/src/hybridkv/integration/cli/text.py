"""Plain-text rendering shared by the CLI's commands: sizes and aligned tables."""

from __future__ import annotations

from collections.abc import Sequence


def human_bytes(count: int) -> str:
    """`count` bytes as people read them (binary units)."""
    if count < 1024:
        return f"{count} B"
    size = float(count)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        size /= 1024
        if size < 1024 or unit == "TiB":
            break
    return f"{size:.1f} {unit}"


def table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Columns padded to their widest cell; columns of numbers (or blanks) right-aligned."""
    cells = [[str(cell) for cell in row] for row in [header, *rows]]
    widths = [max(len(row[column]) for row in cells) for column in range(len(header))]
    numeric = [
        any(isinstance(row[column], int) for row in rows)
        and all(isinstance(row[column], int) or row[column] == "" for row in rows)
        for column in range(len(header))
    ]
    return "\n".join(
        "  ".join(
            cell.rjust(width) if right else cell.ljust(width)
            for cell, width, right in zip(row, widths, numeric, strict=True)
        ).rstrip()
        for row in cells
    )
