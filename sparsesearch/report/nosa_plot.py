"""PNG of a NOSA sweep, after paper 004 Fig. 9: quality (next-token KL vs dense, attention-mass recall)
and modelled decode throughput against k_q/k, one line per (proxy, block, budget); the recommended
configuration circled. A second panel: KL against host-to-device bytes per token with the Pareto front."""

from __future__ import annotations

from pathlib import Path

from . import save_png


def _series(summaries: list[dict]) -> dict[tuple, list[dict]]:
    lines: dict[tuple, list[dict]] = {}
    for x in summaries:
        lines.setdefault((x["proxy"], x["block"], x["budget"]), []).append(x)
    return {key: sorted(xs, key=lambda x: x["kq_ratio"]) for key, xs in sorted(lines.items())}


def draw_tradeoff(summaries: list[dict], best: dict | None, info, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for (proxy, block, budget), xs in _series(summaries).items():
        label = f"{proxy} b{block} {budget} tok"
        ratios = [x["kq_ratio"] for x in xs]
        line = axes[0].plot(ratios, [x["kl"] for x in xs], marker="o", label=label)[0]
        axes[1].plot(ratios, [x["modelled_tokens_per_s"] for x in xs], marker="s", color=line.get_color(), label=label)
        axes[2].scatter([x["h2d_bytes_per_token"] / 1024 for x in xs], [x["kl"] for x in xs], color=line.get_color(), s=14)
    front = sorted((x for x in summaries if x.get("pareto_bytes")), key=lambda x: x["h2d_bytes_per_token"])
    axes[2].plot([x["h2d_bytes_per_token"] / 1024 for x in front], [x["kl"] for x in front], color="black", linewidth=1, label="Pareto front")
    if best is not None:
        axes[0].scatter([best["kq_ratio"]], [best["kl"]], s=120, facecolors="none", edgecolors="red", label="recommended")
        axes[1].scatter([best["kq_ratio"]], [best["modelled_tokens_per_s"]], s=120, facecolors="none", edgecolors="red")
        axes[2].scatter([best["h2d_bytes_per_token"] / 1024], [best["kl"]], s=120, facecolors="none", edgecolors="red")
    axes[0].set(xlabel="k_q / k", ylabel="next-token KL vs dense", title="quality")
    axes[1].set(xlabel="k_q / k", ylabel="tokens/s (modelled, batch 16)", title="decode throughput (model)")
    axes[2].set(xlabel="H2D KiB per token", ylabel="next-token KL vs dense", title="quality vs transfers")
    axes[0].legend(fontsize=7)
    axes[2].legend(fontsize=7)
    fig.suptitle(f"{info.id}: NOSA k_q/k trade-off (paper 004 Fig. 9)", fontsize=10)
    fig.tight_layout()
    return save_png(fig, path)
