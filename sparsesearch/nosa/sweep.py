"""`sweep-nosa`: measure the k_q/k trade-off of NOSA selection on any model (stock models through
training-free query-agnostic proxies) and record a recommended configuration in the artifact.

One held-out sample of ``context + decode_steps + 1`` tokens: a dense prefill of the first ``context``
tokens (kept as a cache; the proxies' prompt statistics are captured on the way), then per configuration
one teacher-forced forward of the ``decode_steps`` continuation tokens over a copy of that cache, with an
attention function (registered through transformers' AttentionInterface) that runs every global layer's
decode rows as NOSA would: selection from the row's own query, attention over the selected blocks plus
the tail block. Sliding-window layers of hybrid models (Gemma 3) keep their own window and are not
selected. The dense forward of the same tokens gives the reference logits (perplexity, next-token KL).

Results are written per configuration into ``.<out>.nosa-partial/`` as they finish; a rerun with the
same settings skips the finished ones (resume after a kill). The artifact gets ``nosa.parquet`` (one row
per configuration, layer, KV head and step), ``methods.nosa`` (recommended configuration, rule, Pareto
fronts, per-configuration summaries) and composes with whatever the artifact already holds.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import shutil
import time
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pandas as pd
import torch

from ..files import atomic_path, write_json_atomic
from ..models.forward import cache_kwarg, returned_cache
from ..runtime.nosa_config import KERNEL, STRIDE, NosaConfig
from ..runtime.nosa_proxies import eviction_weights, h2o_column_sums
from .config import make_config
from .simulate import LayerInputs, simulate_layer
from .throughput import DeviceModel, tokens_per_second

SWEEP_ATTENTION = "sparsesearch_nosa_sweep"
_HANDLER: ContextVar[Callable | None] = ContextVar("sparsesearch_nosa_handler", default=None)


@dataclass
class SweepSettings:
    model: str = "smollm2-135m"
    budgets: tuple[int, ...] = (1024, 2048, 4096)
    kq_ratios: tuple[float, ...] = (0.0, 0.125, 0.25, 0.375, 0.5)
    blocks: tuple[int, ...] = (64,)
    proxies: tuple[str, ...] = ("snapkv",)
    context: int = 4096
    decode_steps: int = 256
    data: str = "synthetic:passkey"
    seed: int = 0
    kl_tolerance: float = 0.02
    bytes_per_elem: int = 2  # the offloaded cache in bf16, as on a GPU host
    out: Path | None = None
    into: Path | None = None
    device: str = "auto"
    dtype: str = "auto"
    trust_remote_code: bool = False
    created: str | None = None
    device_model: DeviceModel = field(default_factory=DeviceModel)

    @property
    def target(self) -> Path:
        if self.into is not None:
            return self.into
        return self.out if self.out is not None else Path(f"artifacts/{Path(self.model).name}-nosa")


@dataclass
class SweepOutcome:
    path: Path
    summaries: list[dict]
    recommended: dict | None
    plot: Path | None
    seconds: float
    resumed: int
    context: int
    model_load_seconds: float
    notes: list[str] = field(default_factory=list)


def configs_of(s: SweepSettings) -> list[tuple[float, NosaConfig]]:
    """(kq ratio, configuration) over the grid, ValueError naming the first bad value. Ratios that round
    to the same k_q give one configuration (the first ratio names it)."""
    grid, seen = [], set()
    for proxy in s.proxies:
        for block in s.blocks:
            for budget in s.budgets:
                for ratio in s.kq_ratios:
                    cfg = make_config(budget, ratio, block, proxy)
                    if cfg not in seen:
                        seen.add(cfg)
                        grid.append((ratio, cfg))
    return grid


def preflight(s: SweepSettings):
    """Bad input before the model loads: the grid, steps, the context vs the model's, the data spec, and
    --into (an artifact of this model). Returns (ModelInfo, configs, the artifact to compose with or None)."""
    from .. import preflight as check

    if s.decode_steps <= 0:
        raise ValueError(f"--decode-steps must be > 0, got {s.decode_steps}")
    if s.context <= 0:
        raise ValueError(f"--context must be > 0, got {s.context}")
    if s.kl_tolerance < 0:
        raise ValueError(f"--kl-tolerance must be >= 0, got {s.kl_tolerance}")
    if s.into is not None and s.out is not None and s.into != s.out:
        raise ValueError(f"--into {s.into} and --out {s.out} disagree; --into writes into that artifact")
    if s.into is not None and not (s.into / "manifest.json").is_file():
        raise ValueError(f"--into {s.into} is not an artifact (no manifest.json)")
    configs = configs_of(s)
    if not configs:
        raise ValueError("the grid is empty: give at least one --budget, --kq-ratio, --block-size and --proxy")
    check.data("--data", s.data)
    info = check.model_info(s.model, trust_remote_code=s.trust_remote_code, dtype=s.dtype, device=s.device)
    check.context_fits(f"--context {s.context} + --decode-steps {s.decode_steps} + 1 =", s.context + s.decode_steps + 1, info)
    if s.target.exists() and not s.target.is_dir():
        raise ValueError(f"--out {s.target} exists and is not a directory")
    return info, configs, existing_artifact(s.target, info, "--into" if s.into is not None else "--out")


def existing_artifact(path: Path, info, option: str):
    """The artifact at ``path`` validated against the model (one line naming it otherwise), or None."""
    if not (path / "manifest.json").is_file():
        return None
    from ..artifacts import load_artifact

    try:
        return load_artifact(path, model_info=info)
    except ValueError as exc:
        raise ValueError(f"{option} {path}: {' '.join(str(exc).split())}") from None


# ------------------------------------------------------------------------------------ attention routing


def _sweep_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None, **kwargs):
    """AttentionInterface function: the active handler's output for layers it takes, else SDPA."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    handler = _HANDLER.get()
    out = handler(module, query, key, value, scaling) if handler is not None else None
    if out is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    return out, None


@contextmanager
def nosa_attention(model, handler: Callable):
    """Within the block, the text decoder's attention calls ``handler(module, q, k, v, scaling)``, which
    returns [B, N, Hq, D] or None (then SDPA runs). The previous implementation is restored on exit."""
    from ..models.attention import register, routed

    register(SWEEP_ATTENTION, _sweep_attention)
    with routed(model, SWEEP_ATTENTION, _HANDLER, handler):
        yield


# ------------------------------------------------------------------------------------------ the passes


@dataclass
class Prompt:
    """What every configuration reuses: the dense prefill's cache and per-layer prompt statistics."""

    cache: object
    hist_q: dict[int, torch.Tensor]  # layer -> [Hkv, G, H, D] last H prompt queries
    colsum: dict[int, torch.Tensor]  # layer -> [Hkv, T - H] h2o column sums of the earlier prompt rows
    eviction: dict[int, tuple]  # layer -> (w, a) of a trained eviction head
    dense_logits: torch.Tensor  # [S, V] float32, the dense teacher-forced logits of the continuation
    first_logits: torch.Tensor  # [V] the prompt's last logits (predicts the first continuation token)


def prefill(model, ids: torch.Tensor, context: int, hist: int, layers: list[int], want_h2o: bool) -> Prompt:
    """Dense prefill of ids[:, :context] with a cache, capturing what the proxies need, then the dense
    teacher-forced forward of the continuation (reference logits) on a copy of the cache."""
    from ..models.capture import attention_capture

    hist_q, colsum, eviction = {}, {}, {}
    wanted = set(layers)

    def sink(module, query, key, value, attention_mask, output, scaling):
        layer = int(module.layer_idx)
        if layer not in wanted:
            return
        q = grouped(query, key.shape[1])
        hist_q[layer] = q[..., -hist:, :].detach().clone()
        if want_h2o:
            colsum[layer] = h2o_column_sums(q[..., :-hist, :], key[0], scaling)
        head = eviction_weights(module)
        if head is not None:
            eviction[layer] = head

    with torch.no_grad(), attention_capture(model, sink):
        out = model(ids[:, :context], use_cache=True)
    cache = returned_cache(out)
    with torch.no_grad():
        dense = model(ids[:, context:-1], **cache_kwarg(model, copy.deepcopy(cache)), use_cache=True)
    return Prompt(cache, hist_q, colsum, eviction, dense.logits[0].float(), out.logits[0, -1].float())


def grouped(query: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[1, Hq, N, D] -> [Hkv, G, N, D] (query head h uses KV head h // G)."""
    q = query[0]
    return q.reshape(kv_heads, q.shape[0] // kv_heads, *q.shape[1:])


def run_config(model, ids: torch.Tensor, context: int, prompt: Prompt, cfg: NosaConfig, layers: list[int], s: SweepSettings):
    """One configuration's teacher-forced sparse forward. Returns (per-layer metrics, logits [S, V])."""
    metrics: dict[int, dict] = {}
    wanted = set(layers)

    def handler(module, query, key, value, scaling):
        layer = int(module.layer_idx)
        if layer not in wanted:
            return None
        kv = key.shape[1]
        colsum = None
        if layer in prompt.colsum:
            colsum = torch.zeros(kv, key.shape[2], dtype=torch.float32, device=key.device)
            colsum[:, : prompt.colsum[layer].shape[-1]] = prompt.colsum[layer]
        x = LayerInputs(grouped(query, kv), key[0], value[0], prompt.hist_q[layer], float(scaling),
                        colsum=colsum, eviction=prompt.eviction.get(layer))
        out, metrics[layer] = simulate_layer(x, cfg, bytes_per_elem=s.bytes_per_elem, seed=s.seed)
        heads, steps = query.shape[1], query.shape[2]
        return out.reshape(heads, steps, -1).transpose(0, 1)[None].to(query.dtype)

    with torch.no_grad(), nosa_attention(model, handler):
        out = model(ids[:, context:-1], **cache_kwarg(model, copy.deepcopy(prompt.cache)), use_cache=True)
    return metrics, out.logits[0].float()


def token_quality(logits: torch.Tensor, dense: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per step: nll of the target under the sparse and dense logits, and KL(dense || sparse).

    logits, dense: [S, V]; targets: long [S]."""
    from ..quality import log_probs, token_kl, token_nll

    lp, ld = log_probs(logits), log_probs(dense)
    return {"nll": token_nll(lp, targets), "nll_dense": token_nll(ld, targets), "kl": token_kl(ld, lp)}


def config_rows(cfg: NosaConfig, metrics: dict[int, dict], quality: dict[str, torch.Tensor], kq_ratio: float) -> pd.DataFrame:
    """One row per (layer, KV head, step) with the configuration's columns."""
    frames = []
    for layer, m in sorted(metrics.items()):
        heads, steps = next(iter(m.values())).shape
        cols = {name: t.detach().float().reshape(-1).cpu().numpy() for name, t in m.items()}
        frame = pd.DataFrame(cols)
        frame.insert(0, "step", torch.arange(steps).repeat(heads).numpy())
        frame.insert(0, "kv_head", torch.arange(heads).repeat_interleave(steps).numpy())
        frame.insert(0, "layer", layer)
        for name, t in quality.items():
            frame[name] = t.cpu().numpy()[frame["step"].to_numpy()]
        frames.append(frame)
    rows = pd.concat(frames, ignore_index=True)
    for col in ("stable", "cold", "tail_completed"):
        rows[col] = rows[col].astype(bool)
    for col in ("selected", "miss", "query_aware", "layer_union_blocks", "proxy_version", "violation"):
        rows[col] = rows[col].astype("int64")
    for name, value in (("proxy", cfg.proxy), ("block", cfg.block), ("budget", cfg.budget), ("k", cfg.k), ("k_q", cfg.k_q),
                        ("k_e", cfg.k_e), ("kq_ratio", kq_ratio), ("n_init", cfg.n_init), ("n_win", cfg.n_win), ("config", cfg.name)):
        rows.insert(0, name, value)
    return rows


def summarise(cfg: NosaConfig, kq_ratio: float, rows: pd.DataFrame, head_dim: int, kv_heads: int, s: SweepSettings, seconds: float) -> dict:
    """Per-configuration numbers for the manifest, the Pareto fronts and the table."""
    steady = rows[~rows["cold"]]
    per_step = rows.groupby("step").first()
    stable = steady[steady["stable"]]
    unstable = steady[~steady["stable"]]
    h2d_layer = steady.groupby(["layer", "step"])["h2d_bytes"].sum().groupby("layer").mean()
    d2h_layer = steady.groupby(["layer", "step"])["d2h_bytes"].sum().groupby("layer").mean()
    resident = (cfg.k + 1) * cfg.block * head_dim * 2 * s.bytes_per_elem * kv_heads
    tps = tokens_per_second(list(h2d_layer.values), [resident] * len(h2d_layer), s.device_model)
    return {
        "config": cfg.name, "proxy": cfg.proxy, "block": cfg.block, "budget": cfg.budget, "k": cfg.k, "k_q": cfg.k_q,
        "k_e": cfg.k_e, "kq_ratio": kq_ratio, "n_init": cfg.n_init, "n_win": cfg.n_win, "bound": cfg.bound,
        "ppl": math.exp(float(per_step["nll"].mean())), "ppl_dense": math.exp(float(per_step["nll_dense"].mean())),
        "kl": float(per_step["kl"].mean()), "kl_max": float(per_step["kl"].max()),
        "recall": float(rows["recall"].mean()), "out_rel_err": float(rows["out_rel_err"].mean()),
        "gamma_mean": float(steady["gamma_raw"].mean()), "gamma_res_mean": float(steady["gamma_res"].mean()),
        "gamma_min_stable": float(stable["gamma_raw"].min()) if len(stable) else None,
        "gamma_min_unstable": float(unstable["gamma_raw"].min()) if len(unstable) else None,
        "gamma_res_min_unstable": float(unstable["gamma_res"].min()) if len(unstable) else None,
        "stable_rows": int(len(stable)), "unstable_rows": int(len(unstable)), "violations": int(steady["violation"].sum()),
        "unstable_below_bound": int((unstable["bound_holds"] == 0).sum()),
        "hit_rate": float(steady["hit_rate"].mean()),
        "h2d_bytes_per_token": float(h2d_layer.sum()), "d2h_bytes_per_token": float(d2h_layer.sum()),
        "modelled_tokens_per_s": tps, "measured_tokens_per_s": None, "seconds": round(seconds, 2),
    }


def pareto(points: list[tuple[float, float]]) -> list[bool]:
    """Non-dominated flags for points to minimise in both coordinates."""
    flags = []
    for i, (a, b) in enumerate(points):
        flags.append(not any((c <= a and d <= b) and (c < a or d < b) for j, (c, d) in enumerate(points) if j != i))
    return flags


def recommend(summaries: list[dict], kl_tolerance: float) -> tuple[dict, str]:
    """The highest modelled throughput among configurations with KL <= tolerance (ties: fewer bytes, then
    name); without one, the lowest KL."""
    ok = [x for x in summaries if x["kl"] <= kl_tolerance]
    if ok:
        best = max(ok, key=lambda x: (x["modelled_tokens_per_s"], -x["h2d_bytes_per_token"], x["config"]))
        return best, f"highest modelled tokens/s among configurations with next-token KL <= {kl_tolerance}"
    best = min(summaries, key=lambda x: (x["kl"], x["config"]))
    return best, f"no configuration reached KL <= {kl_tolerance}; lowest KL"


# ------------------------------------------------------------------------------------------ resume


def fingerprint(s: SweepSettings, info, ids: torch.Tensor, context: int) -> str:
    facts = {"model": info.to_dict(), "ids": hashlib.sha256(ids.cpu().numpy().tobytes()).hexdigest(), "context": context,
             "seed": s.seed, "bytes_per_elem": s.bytes_per_elem, "dtype": s.dtype}
    return hashlib.sha256(json.dumps(facts, sort_keys=True, default=str).encode()).hexdigest()


def partial_dir(target: Path) -> Path:
    return target.parent / f".{target.name}.nosa-partial"


def open_partial(target: Path, key: str) -> Path:
    """The partial-results directory of this sweep; one left by other settings is cleared."""
    path = partial_dir(target)
    stamp = path / "settings.json"
    if path.is_dir() and (not stamp.is_file() or json.loads(stamp.read_text()).get("fingerprint") != key):
        shutil.rmtree(path)
    path.mkdir(parents=True, exist_ok=True)
    write_json_atomic(stamp, {"fingerprint": key})  # whole: a torn stamp would not parse on the next run
    return path


def save_partial(path: Path, name: str, rows: pd.DataFrame, summary: dict) -> None:
    """Rows then summary, each whole or not at all (``sparsesearch.files``): a kill leaves either a whole result
    (``load_partial`` needs both files) or none."""
    with atomic_path(path / f"{name}.parquet") as tmp:
        rows.to_parquet(tmp, index=False)
    write_json_atomic(path / f"{name}.json", summary)


def load_partial(path: Path, name: str):
    rows, summary = path / f"{name}.parquet", path / f"{name}.json"
    if rows.is_file() and summary.is_file():
        return pd.read_parquet(rows), json.loads(summary.read_text())
    return None


# --------------------------------------------------------------------------------------------- main


def run_sweep(s: SweepSettings, stage: Callable[[str], None] = lambda x: None, tick: Callable[[int, int], None] = lambda i, n: None) -> SweepOutcome:
    from ..data import held_out
    from ..models import load_model

    started = time.perf_counter()
    info, configs, base = preflight(s)
    stage("loading model")
    model, tokenizer, info = load_model(s.model, dtype=s.dtype, device=s.device, trust_remote_code=s.trust_remote_code)
    loaded = time.perf_counter() - started
    if tokenizer is None:
        raise ValueError(f"model {s.model!r} has no tokenizer files; the held-out text needs one")
    stage("building the held-out text")
    sample = held_out(s.data, tokenizer, max_tokens=s.context + s.decode_steps + 1, seed=s.seed)
    context = len(sample) - s.decode_steps - 1
    notes = [shortened_note(s, context, len(sample))] if context < s.context else []
    hist = max(64, *(c.block for _, c in configs))
    if context < hist + 1:
        raise ValueError(f"--data {s.data}: the held-out text has {len(sample)} tokens, too few for --decode-steps {s.decode_steps} after a {hist}-token prompt")
    device = next(model.parameters()).device
    ids = sample.input_ids[None].to(device)
    layers = list(info.global_layers)
    stage("dense prefill and reference decode")
    prompt = prefill(model, ids, context, hist, layers, want_h2o=any(c.proxy == "h2o" for _, c in configs))
    if any(c.proxy == "trained" for _, c in configs) and not prompt.eviction:
        raise ValueError("--proxy trained needs a NOSA checkpoint with an eviction head; this model has none")
    targets = ids[0, context + 1 :]
    partial = open_partial(s.target, fingerprint(s, info, ids, context))
    frames, summaries, resumed = [], [], 0
    stage("sweeping configurations")
    for i, (ratio, cfg) in enumerate(configs):
        got = load_partial(partial, cfg.name)
        if got is None:
            t0 = time.perf_counter()
            metrics, logits = run_config(model, ids, context, prompt, cfg, layers, s)
            rows = config_rows(cfg, metrics, token_quality(logits, prompt.dense_logits, targets), ratio)
            summary = summarise(cfg, ratio, rows, info.head_dim, info.num_kv_heads, s, time.perf_counter() - t0)
            save_partial(partial, cfg.name, rows, summary)
        else:
            rows, summary = got
            resumed += 1
        frames.append(rows)
        summaries.append(summary)
        tick(i + 1, len(configs))
    for flag, key in (("pareto_bytes", "h2d_bytes_per_token"), ("pareto_throughput", "modelled_tokens_per_s")):
        sign = -1 if key == "modelled_tokens_per_s" else 1
        for x, on in zip(summaries, pareto([(x["kl"], sign * x[key]) for x in summaries])):
            x[flag] = on
    best, rule = recommend(summaries, s.kl_tolerance)
    stage("writing artifact")
    section = nosa_section(s, best, rule, summaries, context, layers, info)
    path = write(s, info, base, pd.concat(frames, ignore_index=True), section)
    plot = None
    try:
        from ..report.nosa_plot import draw_tradeoff

        plot = draw_tradeoff(summaries, best, info, path.with_name(path.name + ".png"))
    except ImportError:
        plot = None
    shutil.rmtree(partial, ignore_errors=True)
    return SweepOutcome(path, summaries, best, plot, time.perf_counter() - started, resumed, context, loaded, notes)


def shortened_note(s: SweepSettings, context: int, got: int) -> str:
    """Why the measured context is shorter than --context: the held-out text gave fewer tokens than asked
    (a data set's prompt is built to about the length, not to the token)."""
    return (f"context shortened: --context {s.context} asked, {context} used; --data {s.data} gave {got} tokens, "
            f"{s.decode_steps + 1} of which are the continuation the {s.decode_steps} decode steps are scored on")


RECOMMENDED_KEYS = ("proxy", "block", "budget", "k", "k_q", "k_e", "kq_ratio", "n_init", "n_win")


def nosa_section(s: SweepSettings, best: dict, rule: str, summaries: list[dict], context: int, layers: list[int], info) -> dict:
    rec = {key: best[key] for key in RECOMMENDED_KEYS} | {"kernel": KERNEL, "stride": STRIDE}
    return {
        "table": "nosa.parquet",
        "recommended": rec,
        "rule": rule,
        "kl_tolerance": s.kl_tolerance,
        "layers": layers,
        "sweep": {"budgets": list(s.budgets), "kq_ratios": list(s.kq_ratios), "blocks": list(s.blocks), "proxies": list(s.proxies),
                  "context": context, "decode_steps": s.decode_steps, "data": s.data, "seed": s.seed,
                  "bytes_per_elem": s.bytes_per_elem, "throughput_model": s.device_model.to_dict()},
        "configs": [{k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in x.items()} for x in summaries],
    }


def write(s: SweepSettings, info, base, table: pd.DataFrame, section: dict) -> Path:
    from ..artifacts import write_artifact
    from ..artifacts.manifest import new_manifest

    if base is not None:
        manifest = json.loads(json.dumps(base.manifest))
        manifest["methods"]["nosa"] = section
        tables = dict(base.tables)
    else:
        manifest = new_manifest(info, head_index_space="kv", provenance={"kind": "calibrated", "source": "sweep-nosa"}, methods={"nosa": section})
        tables = {"heads.parquet": []}  # no per-head patterns: every head runs dense prefill
    if s.created:
        manifest["created"] = s.created
    tables["nosa.parquet"] = table
    manifest["files"] = {}
    return write_artifact(s.target, manifest, tables, overwrite=base is not None)
