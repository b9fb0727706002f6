"""`torchrun --nproc_per_node N -m sparsesearch.spava [options]`: one SPAVA launch (run.py) on every rank.

The `sparsesearch spava run` / `sweep-spava` commands start this through torch.distributed.run after
checking their input; started by hand it takes the same options (or a whole config as JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from .orphan import watch_from_env
from .run import SpavaConfig, rank_main


def _ints(text: str) -> list[int | None]:
    return [None if t == "default" else int(t) for t in text.split(",")]


def parse(argv=None) -> tuple[SpavaConfig, str | None]:
    ap = argparse.ArgumentParser(prog="python -m sparsesearch.spava")
    ap.add_argument("--config", help="the whole SpavaConfig as JSON (the launcher passes this)")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", default="2048", help="comma-separated prompt lengths")
    ap.add_argument("--anchor", default="default", help="comma-separated l_a values ('default' = n/64 rounded up to 128)")
    ap.add_argument("--passing", default="default", help="comma-separated l_p values ('default' = n/128 rounded up to 128)")
    ap.add_argument("--query", type=int, default=64)
    ap.add_argument("--samples", type=int, default=1, help="prompts per length (seeds 0, 1, ...)")
    ap.add_argument("--data", default="text")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--generate", type=int, default=0, help="greedy tokens decoded after each SPAVA prefill")
    ap.add_argument("--decode", default="distributed", choices=("distributed", "gather"),
                    help="distributed: each rank attends its own K/V per token (the paper's); gather: the cache on rank 0")
    ap.add_argument("--result", help="rank 0 writes the rows here (JSON)")
    a = ap.parse_args(argv)
    if a.config:
        return SpavaConfig(**json.loads(a.config)), a.result
    cfg = SpavaConfig(model=a.model, nproc=int(os.environ.get("WORLD_SIZE", "1")), tokens=[int(t) for t in a.tokens.split(",")],
                      anchors=_ints(a.anchor), passings=_ints(a.passing), query=a.query, data=a.data, backend=a.backend,
                      timeout_s=a.timeout, generate=a.generate, decode=a.decode, samples=a.samples)
    return cfg, a.result


def main(argv=None) -> None:
    cfg, result = parse(argv)
    watch_from_env(result)  # a launcher killed outright leaves no rank running (orphan.py)
    rows = rank_main(cfg, result)
    if int(os.environ.get("RANK", "0")) == 0 and not result:
        print(json.dumps(rows, indent=1, default=str))


if __name__ == "__main__":
    main()
    # rank_main destroyed the group and rank 0's rows are written: leave without interpreter finalization, where gloo
    # async work freed late aborts a finished rank (SIGABRT; spava.group._entry, pytorch/pytorch#179291).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
