"""Printing and saving benchmark results."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def print_table(rows: list[dict[str, object]], title: str | None = None) -> None:
    columns = list(dict.fromkeys(k for row in rows for k in row))
    if not columns:  # nothing to compare (a ratio table with one policy, say)
        return
    cells = [[str(row.get(c, "")) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    if title:
        print(f"\n{title}")
    print("| " + " | ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in cells:
        print("| " + " | ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)) + " |")


def save_json(path: str | None, data: dict[str, object]) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(data, indent=2) + "\n")
        print(f"saved {path}")


def pyplot() -> Any:
    """matplotlib's pyplot, drawing off-screen; None (and a note) when it is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install 'kvserve[bench]'); no plot written")
        return None
    return plt
