"""PNG of a TriangleMix probe, after paper 002 Fig. 2/4: per layer, Grad (signed, ± standard error) and
mean |∂y/∂θ| per section, summed over heads; the chosen and the validated start layers marked."""

from __future__ import annotations

from pathlib import Path

from . import save_png


def draw_probe(result, start: int, validated: int | None, info, path: Path, sections: tuple[str, ...]) -> Path:
    """``sections``: the names of the result's last axis, in its order (the probe's SECTIONS; passed in, as
    the report sits below the probe)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = list(range(result.grad_mean.shape[0]))
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    colors = {"stream": "#1f77b4", "middle": "#d62728", "last": "#2ca02c"}
    panels = (("signed Grad (sum over heads)", result.grad_mean, result.grad_se),
              ("mean |dy/dθ| (sum over heads)", result.abs_mean, result.abs_se),
              ("Att: mean probability (sum over heads)", result.att_mean, result.att_se))
    for ax, (title, mean, se) in zip(axes, panels):
        for i, sec in enumerate(sections):
            m = mean[:, :, i].sum(1).numpy()
            e = se[:, :, i].pow(2).sum(1).sqrt().numpy()  # heads summed: their errors add in quadrature
            ax.errorbar(layers, m, yerr=e, label=sec, color=colors[sec], marker="o", markersize=2.5, linewidth=1, capsize=1.5)
        ax.axvline(start, color="black", linestyle="--", linewidth=1, label=f"probe start {start}")
        if validated is not None:
            ax.axvline(validated, color="grey", linestyle=":", linewidth=1.2, label=f"validated start {validated}")
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("layer")
        ax.axhline(0, color="#999", linewidth=0.5)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"{info.id}: TriangleMix probe ({result.samples} samples, {max(result.tokens)} tokens)", fontsize=10)
    fig.tight_layout()
    return save_png(fig, path)
