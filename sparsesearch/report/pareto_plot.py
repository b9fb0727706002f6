"""PNG of a Pareto report (sparsesearch/pareto): teacher-forced KL vs attention cost (fraction of dense),
one line per family through its budgets, the searched artifacts as one line of their own (their frontier
with the dense anchor), each point labelled. KL on a log axis: families span orders of magnitude. A point that
loses a passkey key dense holds (its row's keys_lost > 0: the key check of pareto/run.py) is drawn hollow: its
KL alone would hide that it drops the needle."""

from __future__ import annotations

from pathlib import Path

from . import save_png

STYLE = {  # family -> (colour, marker)
    "searched": ("tab:red", "*"), "streaming": ("tab:blue", "o"), "minference": ("tab:green", "s"),
    "topk": ("tab:orange", "D"), "trianglemix": ("tab:purple", "^"), "duo": ("tab:brown", "v"), "dense": ("black", "X"),
}
KL_FLOOR = 1e-6  # dense's KL 0 drawn here on the log axis


def loses_keys(row: dict) -> bool:
    """Whether the row's key check ran and it lost a key dense holds (reports before the check have no column)."""
    return (row.get("keys_lost") or 0) > 0


def _hollow(ax, rows: list[dict], marker: str, colour: str, size: float) -> None:
    """White-faced markers over ``rows``' filled ones: the points that lose a passkey key."""
    lost = [r for r in rows if loses_keys(r)]
    if lost:
        ax.scatter([r["cost_fraction"] for r in lost], [max(KL_FLOOR, r["kl"]) for r in lost], marker=marker, s=size,
                   facecolors="white", edgecolors=colour, linewidths=1.4, zorder=4)


def draw_pareto(report: dict, info, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5))
    rows = [r for r in report["rows"] if r["kl"] is not None]
    for family in [f for f in STYLE if any(r["family"] == f for r in rows)]:
        mine = sorted((r for r in rows if r["family"] == family), key=lambda r: r["cost_fraction"])
        colour, marker = STYLE[family]
        xs, ys = [r["cost_fraction"] for r in mine], [max(KL_FLOOR, r["kl"]) for r in mine]
        if family == "searched":  # separate artifacts: their frontier (the verdicts' curve) is the line
            ax.scatter(xs, ys, marker=marker, color=colour, s=110, zorder=3, label="searched artifacts")
            curve = report.get("searched_frontier") or []  # pareto/dominance.py; absent from reports before it
            ax.plot([c for c, _ in curve], [max(KL_FLOOR, k) for _, k in curve], color=colour, linewidth=2.2, label="searched frontier")
        else:
            ax.plot(xs, ys, marker=marker, color=colour, linewidth=1.2, markersize=6, label=family)
        _hollow(ax, mine, marker, colour, 110 if family == "searched" else 36)
        for r, x, y in zip(mine, xs, ys):
            ax.annotate(r["label"], (x, y), fontsize=6, xytext=(3, 3), textcoords="offset points", color=colour)
    if any(loses_keys(r) for r in rows):  # the legend's key to the hollow markers
        ax.scatter([], [], marker="o", s=36, facecolors="white", edgecolors="dimgray", linewidths=1.4, label="loses a passkey key")
    ax.set_yscale("log")
    ax.set(xlabel=f"attention cost / dense ({report.get('cost_model')}, index builds included)",
           ylabel="teacher-forced KL(dense || sparse), every position")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    # a model given as a path titles by its file name: a long path pushed the title off the figure
    ax.set_title(f"{Path(info.id).name}, {report['samples']} x {report['tokens']} tokens of {report['data']} on {report['device']}:\n"
                 f"{report.get('summary', '')}", fontsize=9)
    fig.tight_layout()
    return save_png(fig, path)
