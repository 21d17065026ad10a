"""Draw docs/architecture.png: the three packages and how data flows between them.

    .venv/bin/python scripts/architecture.py [OUT.png]

Blue arrows: tuning (sweep -> worker -> measure -> profile database -> export -> tuned table ->
runtime -> kernels). Orange arrows: the bench (bench decode -> tuner.measure -> database ->
report). Grey dashed: calls and reads. Drawn by hand with matplotlib: the picture names modules,
so update it when a module it names moves.
"""

from __future__ import annotations

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

OUT = Path(__file__).resolve().parent.parent / "docs" / "architecture.png"
TUNE, BENCH, CALL = "#1f5fa8", "#d9731a", "#777777"
BANDS = {  # package: (y0, y1, fill)
    "drafter_attn.bench   (bench/)": (8.0, 10.0, "#fdf0e3"),
    "drafter_attn.tuner   (tuner/)": (4.3, 7.6, "#e6eef8"),
    "drafter_attn.kernels   (kernels/)": (0.2, 3.9, "#eaf5e6"),
}
# name: (x centre, y centre, width, height, label)
BOXES = {
    "decode": (3.0, 9.0, 3.6, 1.1, "bench decode / prefill\nbench.decode, bench.steps"),
    "memory": (8.5, 9.0, 3.0, 1.1, "bench memory\nmodel: kernels.footprint"),
    "report": (14.0, 9.0, 3.4, 1.1, "bench report\nbench.report: plots, report.md"),
    "sweep": (1.75, 6.6, 2.7, 1.1, "tuner sweep\ntuner.spec (TOML),\ntuner.sweep"),
    "worker": (5.0, 6.6, 2.8, 1.1, "worker process per GPU\ntuner.worker\n(crash-isolated)"),
    "measure": (9.0, 6.6, 3.3, 1.1, "measure a step\ntuner.measure, step,\ntiming, syncs"),
    "db": (13.6, 6.6, 3.6, 1.1, "profile database (SQLite)\ntuner.db  ->  profiles/*.db"),
    "export": (13.6, 5.0, 3.6, 1.0, "tuner export / diff / repeat / predict\ntuner.export, repeat, predict"),
    "table": (13.6, 3.1, 3.6, 0.9, "tuned table (JSON)\nprofiles/sm90.json"),
    "dispatch": (13.6, 1.5, 3.6, 1.1, "Dispatcher / Runtime\nkernels.dispatch: tiers, picks"),
    "registry": (9.75, 1.5, 2.7, 1.1, "backend registry\nkernels.registry"),
    "backends": (5.6, 1.9, 3.4, 2.2, "backends\nreference (torch)\ncupy (CUDA C++)\ncutlass (CuTe)\n"
                 "kernels/cuda/*.cu via NVRTC"),
    "contract": (1.75, 2.6, 2.6, 1.0, "contract checks\nkernels.contract"),
    "spec": (1.75, 1.1, 2.6, 1.2, "problem + caches\nkernels.spec, presets,\nkernels.cache"),
}
# (from, to, colour, label, connection style)
ARROWS = [
    ("sweep", "worker", TUNE, "1", "arc3"),
    ("worker", "measure", TUNE, "2", "arc3"),
    ("measure", "db", TUNE, "3", "arc3"),
    ("db", "export", TUNE, "4 winners", "arc3"),
    ("export", "table", TUNE, "5 write", "arc3"),
    ("table", "dispatch", TUNE, "6 load once", "arc3"),
    ("dispatch", "registry", TUNE, "7 pick", "arc3"),
    ("registry", "backends", TUNE, "8 get(name)", "arc3"),
    ("decode", "measure", BENCH, "a  same measurement", "arc3,rad=-0.15"),
    ("db", "report", BENCH, "b  rows", "arc3"),
    ("measure", "registry", CALL, "runs the backends", "arc3,rad=0.15"),
    ("backends", "contract", CALL, "validate", "arc3"),
]
CAPTION = (
    "blue, tuning: 1 candidates go to a worker per GPU, 2 one at a time, 3 a row per result the moment it exists,",
    "4-8 the winners become a tuned table that the runtime loads once and picks from.",
    "orange: bench decode measures and records as the tuner does; bench report reads the rows."
    "   grey dashed: calls",
)


def _edge(box, toward):
    """Point on `box`'s border on the way to `toward` (centres joined by a straight line)."""
    x, y, w, h = box[:4]
    tx, ty = toward[:2]
    dx, dy = tx - x, ty - y
    sx = (w / 2) / abs(dx) if dx else float("inf")
    sy = (h / 2) / abs(dy) if dy else float("inf")
    s = min(sx, sy)
    return x + dx * s, y + dy * s


def draw(out: Path = OUT) -> Path:
    fig, ax = plt.subplots(figsize=(16, 10.4), dpi=100)
    ax.set_xlim(0, 16)
    ax.set_ylim(0, 10.4)
    ax.axis("off")
    for name, (y0, y1, fill) in BANDS.items():
        ax.add_patch(FancyBboxPatch((0.15, y0), 15.7, y1 - y0, boxstyle="round,pad=0.02,rounding_size=0.15",
                                    fc=fill, ec="#999999", lw=1))
        ax.text(0.3, y1 - 0.08, name, ha="left", va="top", fontsize=12, weight="bold", color="#333333")
    for x, y, w, h, label in BOXES.values():
        ax.add_patch(FancyBboxPatch((x - w / 2, y - h / 2), w, h, boxstyle="round,pad=0.02,rounding_size=0.1",
                                    fc="white", ec="#444444", lw=1.2))
        ax.text(x, y, label, ha="center", va="center", fontsize=10.5, linespacing=1.35)
    for a, b, colour, label, style in ARROWS:
        start, end = _edge(BOXES[a], BOXES[b]), _edge(BOXES[b], BOXES[a])
        dashed = colour == CALL
        ax.add_patch(FancyArrowPatch(start, end, arrowstyle="-|>", mutation_scale=16, color=colour,
                                     lw=1.4 if dashed else 2.2, linestyle="--" if dashed else "-",
                                     connectionstyle=style, shrinkA=2, shrinkB=2))
        mx, my = (start[0] + end[0]) / 2, (start[1] + end[1]) / 2
        vertical = abs(end[0] - start[0]) < 0.3
        ax.text(mx + (0.12 if vertical else 0), my + (0 if vertical else 0.1), label, fontsize=9.5,
                color=colour, weight="bold", ha="left" if vertical else "center",
                va="center" if vertical else "bottom", bbox=dict(fc="white", ec="none", alpha=0.8, pad=1))
    ax.text(15.75, 10.3, "imports point one way: bench -> tuner -> kernels", ha="right", va="top",
            fontsize=10, style="italic")
    ax.text(0.3, -0.05, "\n".join(CAPTION), fontsize=10, va="top", linespacing=1.4)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, bbox_inches="tight")
    plt.close(fig)
    return out


if __name__ == "__main__":
    print(draw(Path(sys.argv[1]) if len(sys.argv) > 1 else OUT))
