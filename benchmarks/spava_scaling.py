"""The scaling table of issue P15 §4 from benchmarks/spava_cp.py rows (benchmarks/spava_scaling_gpu.sh).

Per prompt length and method, one line per W: wall time (slowest rank, median of reps), speed-up over the
one-GPU dense prefill of the same launch, parallel efficiency (that speed-up / W), SPAVA's speed-up over the
exact engine of the same W (named), MB sent per rank and the KL vs dense. W = 1 is the dense row.

    python3 benchmarks/spava_scaling.py benchmarks/results/spava_scaling_h200x4.jsonl
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict


def load(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def table(rows: list[dict]) -> str:
    """Markdown: rows grouped by (tokens, method), W ascending; the dense reference is the W=2 launch's (the
    first measured) so that every W is divided by the same one-GPU time."""
    ok = [r for r in rows if "wall_ms" in r]
    dense = {}
    for r in ok:
        if r["method"] == "dense":
            dense.setdefault((r["shape"], r["tokens"]), r["wall_ms"])
    by = defaultdict(dict)
    for r in ok:
        if r["method"] != "dense":
            by[(r["shape"], r["tokens"], r["method"])][r["gpus"]] = r
    out = ["| stack | tokens | method | GPUs | wall ms | speed-up vs 1 GPU dense | parallel efficiency | SPAVA vs exact (same W) | MB sent / rank | KL vs dense |",
           "|---|---:|---|---:|---:|---:|---:|---|---:|---:|"]
    for key in sorted(dense):
        shape, n = key
        out.append(f"| {shape} | {n} | dense | 1 | {dense[key]:.1f} | 1.00× | 1.00 | | – | ref. |")
        for (s, tokens, method), per_w in sorted(by.items()):
            if (s, tokens) != key:
                continue
            for w, r in sorted(per_w.items()):
                speed = dense[key] / r["wall_ms"]
                vs = ", ".join(f"{v:.2f}× vs {k.removeprefix('speedup_vs_')}" for k, v in r.items()
                               if k.startswith("speedup_vs_") and k != "speedup_vs_dense_1gpu")
                sent = max(r.get("bytes_per_rank") or [0]) / 1e6
                label = f"{method} ({r['l_a']} / {r['l_p']})" if method == "spava" else method
                out.append(f"| {shape} | {n} | {label} | {w} | {r['wall_ms']:.1f} | {speed:.2f}× | {speed / w:.2f} | {vs} | {sent:.1f} | {r['kl_vs_dense']:.2e} |")
    return "\n".join(out)


if __name__ == "__main__":
    print(table(load(sys.argv[1])))
