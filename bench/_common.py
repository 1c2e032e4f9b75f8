"""What the benchmark scripts share: how busy the machine is, and how a result table is printed.

Imported by the scripts in this folder as ``bench._common`` once they have put the repository
root on ``sys.path``; imports nothing of kvroute.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence


def busy_cores(seconds: float = 1.0) -> float | None:
    """CPU cores busy on this machine over ``seconds`` (Linux /proc/stat), None elsewhere."""

    def read() -> tuple[int, int]:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return sum(v), v[3] + v[4]  # total, idle + iowait

    try:
        t0, i0 = read()
        time.sleep(seconds)
        t1, i1 = read()
    except OSError:
        return None
    return (1 - (i1 - i0) / max(t1 - t0, 1)) * (os.cpu_count() or 1)


def print_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    """Print ``rows`` under ``header`` in left-aligned columns as wide as their widest cell, with a
    dashed rule under the header; trailing blanks are stripped."""
    cells = [[str(c) for c in row] for row in (header, *rows)]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    cells.insert(1, ["-" * w for w in widths])
    for row in cells:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
