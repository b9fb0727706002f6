"""`sweep-spava` outputs: spava.parquet, the artifact's `spava` method section, and a PNG.

The rows come from one launch (run.py). Recommendation per prompt length: among the configurations
whose next-token KL vs exact is at most `kl_tolerance` and which retrieve whenever exact does, the one
with the lowest modelled latency at the launch's W (ties: smaller l_p, then l_a); when none qualifies,
the lowest KL. Writing into an existing artifact keeps its tables and other method sections.

Resume: the launch's ranks save each configuration's row to ``OUT.sweep-spava.partial/`` (sparsesearch.workdir)
as it is measured; ``open_work(..., resume=True)`` keeps the rows of a run with the same settings, which the
next launch reads instead of measuring again. A killed sweep loses at most the configuration in progress; the
resumed rows keep the timings measured when they ran, the other values are the ones an uninterrupted run
gives. The caller removes the directory once the artifact and plot are written.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd

TABLE = "spava.parquet"
COMMAND = "sweep-spava"


def open_work(cfg, target: Path, *, resume: bool):
    """Check ``cfg`` (launch.preflight: bad input stays one line with nothing written), open the work directory
    beside ``target`` for it and point the ranks at it (``cfg.workdir``). -> the WorkDir."""
    from ..workdir import WorkDir
    from .launch import preflight

    preflight(cfg)
    work = WorkDir.open(target, COMMAND, work_settings(cfg), resume=resume)
    cfg.workdir = str(work.path)
    return work


def work_settings(cfg) -> dict:
    """What a configuration's row depends on (the work directory's fingerprint): the launch's settings, the
    model's revision and a data file's contents. Not the collective timeout or the directory itself, and not
    the grid (lengths, prompts, l_a, l_p): those name the unit (run.unit_name), so a resumed sweep over a wider
    grid reuses the configurations it shares with the killed one."""
    from dataclasses import asdict

    from .. import preflight as check
    from ..models.resolve import file_sha256

    unit_free = ("timeout_s", "workdir", "tokens", "samples", "anchors", "passings")
    settings = {k: v for k, v in asdict(cfg).items() if k not in unit_free}
    settings["model_revision"] = check.model_info(cfg.model).revision
    if Path(cfg.data).is_file():
        settings["data_sha256"] = file_sha256(cfg.data)
    return settings


def configurations(rows: list[dict]) -> list[dict]:
    """Rows of one (tokens, anchor, passing) over the launch's prompts (``sample``) folded into one: mean KL
    and latencies, and retrieval as counts — SPAVA's and exact's over the prompts, and how many prompts
    exact retrieved but SPAVA did not (``lost``)."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["tokens"], r["anchor"], r["passing"]), []).append(r)
    out = []
    for (n, la, lp), rs in groups.items():
        def mean(k: str) -> float | None:  # None where the model has no value (2W hosts that do not fit)
            vals = [r[k] for r in rs]
            return None if any(v is None for v in vals) else sum(vals) / len(vals)

        conf = {"tokens": n, "anchor": la, "passing": lp, "nproc": rs[0]["nproc"], "prompts": len(rs), "kl": mean("kl"),
                **{k: mean(k) for k in rs[0] if k == "seconds" or k.startswith("modelled_s_w")}}
        if "retrieved" in rs[0]:
            conf.update(retrieved=sum(bool(r["retrieved"]) for r in rs), retrieved_exact=sum(bool(r["retrieved_exact"]) for r in rs),
                        lost=sum(bool(r["retrieved_exact"]) and not r["retrieved"] for r in rs))
        out.append(conf)
    return out


def recommend(rows: list[dict], kl_tolerance: float) -> list[dict]:
    """One {tokens, anchor, passing, kl, qualified[, retrieved, retrieved_exact, prompts]} per prompt length:
    KL is the mean over the prompts, and a configuration qualifies only if it retrieves every prompt exact
    retrieves."""
    out = []
    confs = configurations(rows)
    for n in sorted({c["tokens"] for c in confs}):
        at = [c for c in confs if c["tokens"] == n]
        ok = [c for c in at if c["kl"] <= kl_tolerance and not c.get("lost", 0)]
        key = f"modelled_s_w{at[0]['nproc']}" if at[0]["nproc"] in (2, 4, 8) else "seconds"
        fastest = lambda c: (math.inf if c[key] is None else c[key], c["passing"], c["anchor"])  # noqa: E731
        best = min(ok, key=fastest) if ok else min(at, key=lambda c: c["kl"])
        rec = {"tokens": n, "anchor": best["anchor"], "passing": best["passing"], "kl": round(best["kl"], 6), "qualified": bool(ok),
               "prompts": best["prompts"]}
        if "retrieved" in best:
            rec.update(retrieved=best["retrieved"], retrieved_exact=best["retrieved_exact"])
        out.append(rec)
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
            g = g.groupby("passing", as_index=False)["kl"].mean()  # mean over the prompts
            ax.plot(g["passing"], g["kl"], marker="o", label=f"l_a={la}")
        ax.set_title(f"{n} tokens, W={int(df['nproc'].iloc[0])}")
        ax.set_xlabel("l_p (passing tokens per virtual host)")
        ax.set_ylabel("next-token KL vs exact (query)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    return save_png(fig, path)


# ------------------------------------------------------------- W = 2/4/8 latency from measured rank times

RANK_FIELDS = {"tokens": int, "heads": int, "kv_heads": int, "dim": int, "W": int, "rank": int, "method": str,
               "ms": float, "bytes_sent": int, "sdpa_ms": float}
SPAVA_FIELDS = {"l_a": int, "l_p": int, "bytes_passing": int, "overlap_ms": float}
METHODS = ("spava", "zigzag-ring")


def _check_row(row, where: str) -> dict:
    """One benchmark row (benchmarks/spava_rank.py --simulate-world), checked field by field."""
    if not isinstance(row, dict):
        raise ValueError(f"{where}: a row must be a JSON object, got {type(row).__name__}")
    fields = dict(RANK_FIELDS, **(SPAVA_FIELDS if row.get("method") == "spava" else {}))
    for name, kind in fields.items():
        value = row.get(name)
        ok = isinstance(value, str) if kind is str else isinstance(value, (int, float)) and not isinstance(value, bool)
        if not ok or (kind is int and value != int(value)):
            raise ValueError(f"{where}: field {name!r} must be {kind.__name__}, got {value!r}")
    if row["method"] not in METHODS:
        raise ValueError(f"{where}: method must be one of {METHODS}, got {row['method']!r}")
    if row["ms"] <= 0 or row["sdpa_ms"] <= 0 or row["bytes_sent"] < 0 or not 0 <= row["rank"] < row["W"]:
        raise ValueError(f"{where}: needs ms > 0, sdpa_ms > 0, bytes_sent >= 0 and 0 <= rank < W, got {row}")
    return row


def _config(row: dict) -> tuple:
    return (row["tokens"], row["heads"], row["kv_heads"], row["dim"], row["W"], row["method"], row.get("l_a"), row.get("l_p"))


def load_rank_times(path) -> list[dict]:
    """Rows of benchmarks/spava_rank.py --simulate-world (JSON lines), checked: every configuration has each
    of its W ranks exactly once (the slowest rank is the per-rank time, so none may be missing)."""
    from pathlib import Path

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--rank-times {path}: no such file")
    rows = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{i}: not JSON ({exc.msg})") from None
        rows.append(_check_row(row, f"{path}:{i}"))
    if not rows:
        raise ValueError(f"{path}: no rows")
    ranks: dict[tuple, list[int]] = {}
    for r in rows:
        ranks.setdefault(_config(r), []).append(r["rank"])
    for cfg, got in ranks.items():
        if sorted(got) != list(range(cfg[4])):
            raise ValueError(f"{path}: {cfg[5]} at {cfg[0]} tokens, W={cfg[4]}, l_a={cfg[6]}, l_p={cfg[7]} has ranks {sorted(got)}, needs each of 0..{cfg[4] - 1} once")
    return rows


def exposed_ms(row: dict, bandwidth_gbs: float) -> tuple[float, float]:
    """(communication ms, the part no compute hides) of one rank's row at a link of bandwidth_gbs GB/s.

    SPAVA: the passing all-gather hides behind the compute between sending the selections and needing the
    peers' (query partial + anchor rows: the row's overlap_ms); the query partials' all-gather behind the
    rest (the context rows). Ring: each of the W - 1 hops hides behind one step's attention, and the zigzag
    layout gives every step the same work (ms / W).
    """
    per_ms = 1e3 / (bandwidth_gbs * 1e9)
    comm = row["bytes_sent"] * per_ms
    if row["method"] == "spava":
        passing, partials = row["bytes_passing"] * per_ms, (row["bytes_sent"] - row["bytes_passing"]) * per_ms
        hidden_by = row["overlap_ms"]
        return comm, max(0.0, passing - hidden_by) + max(0.0, partials - max(0.0, row["ms"] - hidden_by))
    hops = row["W"] - 1
    if hops == 0:
        return comm, 0.0
    return comm, hops * max(0.0, comm / hops - row["ms"] / row["W"])


def rank_time_model(rows: list[dict], bandwidth_gbs: float) -> list[dict]:
    """Modelled latency per configuration: max over ranks of (measured compute + exposed communication).

    rows: load_rank_times. Returns one dict per (shape, tokens, W, method, l_a, l_p) with compute_ms (the
    slowest rank), comm_ms and exposed_ms (of the rank that sets the latency), latency_ms, sdpa_ms, and
    the speed-ups over single-GPU SDPA and over the exact ring at the same W.
    """
    if bandwidth_gbs <= 0:
        raise ValueError(f"bandwidth must be > 0 GB/s, got {bandwidth_gbs}")
    out = []
    for cfg in dict.fromkeys(_config(r) for r in rows):
        at = [r for r in rows if _config(r) == cfg]
        per_rank = [(r["ms"] + exposed_ms(r, bandwidth_gbs)[1], r) for r in at]
        latency, worst = max(per_rank, key=lambda t: t[0])
        comm, exposed = exposed_ms(worst, bandwidth_gbs)
        out.append({"tokens": cfg[0], "heads": cfg[1], "kv_heads": cfg[2], "dim": cfg[3], "W": cfg[4], "method": cfg[5],
                    "l_a": cfg[6], "l_p": cfg[7], "compute_ms": max(r["ms"] for r in at), "comm_ms": comm, "exposed_ms": exposed,
                    "latency_ms": latency, "sdpa_ms": at[0]["sdpa_ms"], "bandwidth_gbs": bandwidth_gbs})
    for row in out:
        row["speedup_vs_sdpa"] = row["sdpa_ms"] / row["latency_ms"]
        ring = [r for r in out if r["method"] == "zigzag-ring" and _config(r)[:5] == _config(row)[:5]]
        row["speedup_vs_ring"] = ring[0]["latency_ms"] / row["latency_ms"] if ring else None
    return out
