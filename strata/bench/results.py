"""Where benchmarks put what they measured: JSON under bench/results/ and, with matplotlib, a PNG."""

from __future__ import annotations

import json
import os
from typing import Any, Callable


def save(info: dict, out: str, draw: Callable[[Any, dict], None]) -> None:
    """Writes `info` to `out` (JSON) and, when matplotlib is installed, `draw(plt, info)` beside it."""
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump(info, f, indent=1)
    print(f"wrote {out}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    draw(plt, info)
    png = out.replace(".json", ".png")
    plt.gcf().tight_layout()
    plt.savefig(png, dpi=120)
    plt.close("all")
    print(f"wrote {png}")
