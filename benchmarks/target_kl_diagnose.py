"""Why a --target-kl allocation's calibration KL does not predict its held-out KL (issue 13, P8 §3).

Reads the per-head search scores a calibrate run left in ``OUT.partial/`` (kill the run after the search,
or use ``--resume`` state) and measures, with the real runtime on the real model:

- ``points``: path points of the Lagrangian allocation (search/targets.py) near the given mean densities,
  teacher-forced KL per tuning window (calibration part) and per held-out window: is KL monotone along the
  path, and how much does it vary window to window?
- ``layers``: per-layer attribution at one path point: only layer l sparse (its heads as at that point),
  every other layer dense; KL on the tuning windows (and held-out ones, for comparison only). The sum over
  layers against the joint KL says whether per-layer KL adds up.
- ``heads``: per-head output error of the chosen candidates on calibration sample 0 vs sample 1 (needs a
  run with --samples 2): does one 4K sample predict another?

Every dense run is made once per window (fidelity.dense_reference). Rows go to one JSON file.

    python -m benchmarks.target_kl_diagnose --partial /tmp/kl/s2.partial --samples 2 --out benchmarks/results/target_kl_diagnose_cpu.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch


def _point_rows(path, curves, scored, space, i):
    from sparsesearch.search.allocate import allocation_rows

    return allocation_rows(path[i], curves, scored, space)


def _only_layer(rows: list[dict], layer: int) -> list[dict]:
    """rows with every layer but ``layer`` made dense (density 1, error 0)."""
    dense = lambda r: {**r, "pattern": "dense", "density": 1.0, "output_error": 0.0, "recall": 1.0}
    return [r if r["layer"] == layer else dense(r) for r in rows]


def _kl(model, tok, manifest, rows, refs) -> list[float]:
    from sparsesearch.tuning import fidelity_kl
    from sparsesearch.fidelity import evaluate_against

    return [fidelity_kl(evaluate_against(model, tok, manifest, rows, ref, min_tokens=1))[1] for ref in refs]


def _mean(xs):
    return sum(xs) / len(xs)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--partial", type=Path, required=True)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--data", default="text:shakespeare")
    ap.add_argument("--max-tokens", type=int, default=4096)
    ap.add_argument("--samples", type=int, default=1, help="calibration samples the search ran on")
    ap.add_argument("--tune-samples", type=int, default=2)
    ap.add_argument("--held-out-samples", type=int, default=2)
    ap.add_argument("--densities", default="0.25,0.3,0.35,0.4,0.5", help="path points nearest these mean densities")
    ap.add_argument("--layer-density", type=float, default=0.3, help="path point of the per-layer attribution ('' to skip)")
    ap.add_argument("--layers-held-out", action="store_true", help="also measure each layer on held-out windows")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)

    from sparsesearch.artifacts.manifest import new_manifest
    from sparsesearch.calibrate import CalibrateConfig
    from sparsesearch.search.allocate import curve_point, layer_curves
    from sparsesearch.tuning import tuning_samples
    from sparsesearch.data import held_out
    from sparsesearch.fidelity import dense_reference
    from sparsesearch.models import load_model
    from sparsesearch.search.space import load_space
    from sparsesearch.search.targets import lagrangian_path

    started = time.perf_counter()
    model, tok, info = load_model(args.model, dtype="float32", device="cpu")
    space = load_space(None)
    scored, curves = {}, []
    for layer in info.global_layers:
        scored[layer], cs = layer_curves(args.partial, layer, args.samples)
        curves.extend(cs)
    path = lagrangian_path(curves)
    manifest = new_manifest(info, head_index_space="kv", provenance={"kind": "calibrated", "source": args.data},
                            methods={"mminference": {"table": "heads.parquet"}})
    cfg = CalibrateConfig(model=args.model, data=args.data, max_tokens=args.max_tokens, samples=args.samples, tune_samples=args.tune_samples)
    tune = [dense_reference(model, tok, [s], data="tuning") for s in tuning_samples(cfg, tok)]
    held = [dense_reference(model, tok, [held_out(args.data, tok, max_tokens=args.max_tokens, seed=i)], data="held-out")
            for i in range(args.held_out_samples)]
    out = {"command": " ".join(sys.argv), "device": f"cpu ({platform.machine()}, {torch.get_num_threads()} threads)",
           "model": args.model, "data": args.data, "tokens": args.max_tokens, "searched_samples": args.samples,
           "path_points": len(path), "points": [], "layers": None, "heads": None}

    def save():
        out["seconds"] = round(time.perf_counter() - started, 1)
        args.out.write_text(json.dumps(out, indent=1))

    densities = [curve_point(a, curves, _point_rows(path, curves, scored, space, i))["mean_density"] for i, a in enumerate(path)]
    wanted = sorted({min(range(len(path) - 1), key=lambda i: abs(densities[i] - float(d))) for d in args.densities.split(",") if d})
    for i in wanted:
        rows = _point_rows(path, curves, scored, space, i)
        t = time.perf_counter()
        row = {"index": i, **curve_point(path[i], curves, rows), "kl_tuning": _kl(model, tok, manifest, rows, tune),
               "kl_held_out": _kl(model, tok, manifest, rows, held)}
        row["seconds"] = round(time.perf_counter() - t, 1)
        out["points"].append(row)
        print(json.dumps(row), flush=True)
        save()

    if args.layer_density:
        i = min(range(len(path) - 1), key=lambda i: abs(densities[i] - args.layer_density))
        rows = _point_rows(path, curves, scored, space, i)
        layers = []
        for layer in info.global_layers:
            mine = [r for r in rows if r["layer"] == layer]
            entry = {"layer": layer, "sparse_heads": sum(r["pattern"] != "dense" for r in mine),
                     "mean_error": round(_mean([r["output_error"] for r in mine]), 6),
                     "sum_sq_error": round(sum(r["output_error"] ** 2 for r in mine), 6)}
            if entry["sparse_heads"]:
                entry["kl_tuning"] = _kl(model, tok, manifest, _only_layer(rows, layer), tune)
                if args.layers_held_out:
                    entry["kl_held_out"] = _kl(model, tok, manifest, _only_layer(rows, layer), held)
            layers.append(entry)
            print(json.dumps(entry), flush=True)
            out["layers"] = {"point": i, "mean_density": densities[i], "rows": layers}
            save()

    if args.samples >= 2:
        from sparsesearch.search.workfiles import GLOBAL, scope_path, scores_from_json

        per = []
        for layer in info.global_layers:
            s0, _, _ = scores_from_json(json.loads(scope_path(args.partial, 0, layer, GLOBAL).read_text()))
            s1, _, _ = scores_from_json(json.loads(scope_path(args.partial, 1, layer, GLOBAL).read_text()))
            for c0, c1 in zip(s0, s1):
                per.extend(zip(c0.error.tolist(), c1.error.tolist()))
        e0, e1 = torch.tensor(per).T
        keep = torch.isfinite(e0) & torch.isfinite(e1)
        e0, e1 = e0[keep], e1[keep]
        out["heads"] = {"pairs": int(keep.sum()), "pearson": round(float(torch.corrcoef(torch.stack([e0, e1]))[0, 1]), 4),
                        "mean_abs_rel_diff": round(float(((e0 - e1).abs() / (0.5 * (e0 + e1)).clamp_min(1e-9)).mean()), 4)}
        print(json.dumps(out["heads"]), flush=True)
    save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
