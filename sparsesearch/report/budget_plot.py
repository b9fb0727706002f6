"""PNG of a quality target's budget curve (manifest ``methods.mminference.target``): along the Lagrangian
path, the measured KL (or, where no KL was measured, the searched heads' mean output error) against the
cost as a fraction of dense and against the mean density; the target line and the chosen point marked."""

from __future__ import annotations

from pathlib import Path

from . import save_png


def draw_budget_curve(target: dict, info, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curve = target["curve"]
    measured = [p for p in curve if "kl" in p]
    chosen = target["calibration"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, x in zip(axes, ("cost_fraction", "mean_density")):
        # Error on its own (linear) axis: it reaches 0 at all-dense, which a log axis cannot show.
        err_ax = ax.twinx()
        err_ax.plot([p[x] for p in curve], [p["mean_output_error"] for p in curve], marker=".", color="tab:gray",
                    label="mean head output error (search)")
        err_ax.set_ylabel("mean head output error", color="tab:gray")
        if measured:
            ax.plot([p[x] for p in measured], [p["kl"] for p in measured], marker="o", color="tab:blue",
                    label="model KL measured (calibration prompts)")
            if all(p["kl"] > 0 for p in measured):
                ax.set_yscale("log")
        if target["kind"] == "target_kl":
            ax.axhline(target["value"], color="tab:red", linestyle="--", linewidth=1, label=f"target KL {target['value']:g}")
        if target["kind"] == "max_output_error":
            err_ax.axhline(target["value"], color="tab:red", linestyle="--", linewidth=1, label=f"max error {target['value']:g}")
        if target["kind"] == "latency_budget" and x == "cost_fraction":
            ax.axvline(target["value"], color="tab:red", linestyle="--", linewidth=1, label=f"budget {target['value']:g} of dense")
        if target["kind"] == "target_kl" and chosen["achieved"] is not None:
            ax.scatter([chosen[x]], [chosen["achieved"]], s=140, facecolors="none", edgecolors="red", label="chosen")
        else:
            err_ax.scatter([chosen[x]], [chosen["mean_output_error"]], s=140, facecolors="none", edgecolors="red", label="chosen")
        ax.set(xlabel="cost / dense cost" if x == "cost_fraction" else "mean density (searched heads)", ylabel="KL vs dense")
    lines = [h for a in (axes[0], axes[0].figure.axes[2]) for h in a.get_legend_handles_labels()[0]]
    axes[0].legend(lines, [h.get_label() for h in lines], fontsize=7)
    held = target.get("held_out") or {}
    note = f"; held-out KL {held['kl']:.3g}" if held.get("kl") is not None else ""
    fig.suptitle(f"{info.id}: budget curve for {target['kind']} {target['value']:g}{note}", fontsize=10)
    fig.tight_layout()
    return save_png(fig, path)
