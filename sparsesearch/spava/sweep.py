"""`sweep-spava` outputs: spava.parquet, the artifact's `spava` method section, and a PNG.

The rows come from one launch (run.py). Recommendation per prompt length: among the configurations
whose next-token KL vs exact is at most `kl_tolerance` and which retrieve whenever exact does, the one
with the lowest modelled latency at the launch's W (ties: smaller l_p, then l_a); when none qualifies,
the lowest KL. Writing into an existing artifact keeps its tables and other method sections.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

TABLE = "spava.parquet"


def recommend(rows: list[dict], kl_tolerance: float) -> list[dict]:
    """One {tokens, anchor, passing, kl, qualified} per prompt length."""
    out = []
    for n in sorted({r["tokens"] for r in rows}):
        at = [r for r in rows if r["tokens"] == n]
        ok = [r for r in at if r["kl"] <= kl_tolerance and r.get("retrieved", True) >= r.get("retrieved_exact", False)]
        key = f"modelled_s_w{at[0]['nproc']}" if at[0]["nproc"] in (2, 4, 8) else "seconds"
        best = min(ok, key=lambda r: (r[key], r["passing"], r["anchor"])) if ok else min(at, key=lambda r: r["kl"])
        out.append({"tokens": n, "anchor": best["anchor"], "passing": best["passing"], "kl": round(best["kl"], 6), "qualified": bool(ok)})
    return out


def write_sweep(result: dict, cfg, out: Path, *, kl_tolerance: float, compose: bool) -> tuple[Path, list[dict]]:
    """Write spava.parquet and methods.spava into the artifact at `out` (composed when one is there)."""
    from ..artifacts import load_artifact, write_artifact
    from ..artifacts.manifest import new_manifest
    from ..models.info import ModelInfo

    rows = result["rows"]
    info = ModelInfo(**{k: v for k, v in result["model"].items() if k in ModelInfo.__dataclass_fields__})
    rec = recommend(rows, kl_tolerance)
    section = {
        "table": TABLE, "recommended": rec, "nproc": cfg.nproc, "query": cfg.query, "data": cfg.data,
        "kl_tolerance": kl_tolerance, "exact_engine": result["exact_engine"], "torch_context_parallel": result["torch_cp"],
        "bandwidth_gbs": cfg.bandwidth_gbs, "grid": {"anchor": sorted({r["anchor"] for r in rows}), "passing": sorted({r["passing"] for r in rows}),
                                                      "tokens": sorted({r["tokens"] for r in rows})},
    }
    if compose and (out / "manifest.json").is_file():
        base = load_artifact(out, model_info=info)
        manifest = json.loads(json.dumps(base.manifest))
        manifest["methods"]["spava"] = section
        tables = dict(base.tables)
    else:
        manifest = new_manifest(info, head_index_space="kv", provenance={"kind": "calibrated", "source": "sweep-spava"}, methods={"spava": section})
        tables = {"heads.parquet": []}
    tables[TABLE] = pd.DataFrame(rows)
    manifest.pop("files", None)
    manifest["files"] = {}
    return write_artifact(out, manifest, tables, overwrite=compose), rec


def draw_sweep(rows: list[dict], path: Path) -> Path:
    """KL vs l_p, one panel per prompt length, one line per l_a."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..report import save_png

    df = pd.DataFrame(rows)
    lengths = sorted(df["tokens"].unique())
    fig, axes = plt.subplots(1, len(lengths), figsize=(4.5 * len(lengths), 3.4), squeeze=False)
    for ax, n in zip(axes[0], lengths):
        for la, g in df[df["tokens"] == n].groupby("anchor"):
            g = g.sort_values("passing")
            ax.plot(g["passing"], g["kl"], marker="o", label=f"l_a={la}")
        ax.set_title(f"{n} tokens, W={int(df['nproc'].iloc[0])}")
        ax.set_xlabel("l_p (passing tokens per virtual host)")
        ax.set_ylabel("next-token KL vs exact (query)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    return save_png(fig, path)
