"""Each benchmark owns one section of docs/benchmarks.md between HTML markers."""

from __future__ import annotations

from pathlib import Path


def replace_section(path: Path, name: str, text: str) -> None:
    """Write `text` between `<!-- name:start -->` and `<!-- name:end -->`, or append it."""
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    block = f"{start}\n{text.strip()}\n\n{end}"
    current = path.read_text() if path.exists() else "# Benchmarks\n"
    if start in current and end in current:
        head, _, rest = current.partition(start)
        _, _, tail = rest.partition(end)
        updated = head + block + tail
    else:
        updated = current.rstrip("\n") + "\n\n" + block + "\n"
    path.write_text(updated)
