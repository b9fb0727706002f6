"""The prompts a ``--target-kl`` search is held on, and what it measures there.

- the KL: teacher-forced KL(dense || sparse) over every position of ``tune_samples`` calibration prompts
  after the searched ones (``tuning_kl``), the value the Lagrangian path is bisected on;
- the retrieval guard: passkey prompts at the calibration length, read until the dense model retrieves
  ``retrieval_guard`` keys (at most keycheck.DRAWS x that many prompts), a point passing when none of those keys
  is lost with the sparse runtime (``retrieval_guard``).
  Average KL cannot see a lost needle: on Gemma 3 270M at 8K (H200, RESULTS Run 33) the wide-space
  ``--target-kl 0.02`` artifact held teacher-forced KL 0.0048 on the passkey prompts while answering 14 of
  the 17 that dense answered (streaming heads in the global layers drop the middle of the context); the
  answer token is one position of thousands. The guard moves the KL target's choice up the path to the
  cheapest point that loses no key.

  The guard reads the key's digits teacher-forced (``fidelity.answer_probs``), not greedy answers: a greedy
  answer is decided by its first token, which is a choice of *format* (" 17412" or " the pass key is ..."),
  near a coin toss for small models. SmolLM2-135M at 8K starts its answer with " " at p 0.30 against " a"
  (" a magical key ...") at 0.32 and then writes every digit at p >= 0.98 (CPU, RESULTS Run 38); Gemma 3 270M
  starts with " " at 0.31-0.38 against " the" at 0.24-0.27. Held to greedy answers, SmolLM2's guard saw one
  answered prompt flip format under any sparse point and pushed all 11 targets of a sweep (0.4 .. 0.005) to one
  near-dense point (H200 Run 38). A key is held when every digit is dense's most likely token there (Gemma's
  weakest guard digit is 0.37 against 0.18 for the runner-up: retrieved, if not surely); it is lost when a digit
  falls below GUARD_KEEPS of its dense probability. The check itself (sparsesearch/keycheck.py) is shared
  with ``sparsesearch pareto`` and ``evaluate``, which read keys by the same rule.

Everything is measured through the sparse runtime with ``VERIFY_MIN_TOKENS`` (the patterns' quality at every
length, not the dense cut-off's); dense runs are made once per search and reused, and a ``--target-kl`` sweep's
targets share the dense run and every KL measured (``TuningMemo``).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from .keycheck import KEEPS as GUARD_KEEPS, dense_keys_until, read_keys
from .search.targets import KeyCheck

if TYPE_CHECKING:
    from .calibrate import CalibrateConfig

VERIFY_MIN_TOKENS = 1  # quality is measured with the sparse path on at every length: the patterns' KL, not the cut-off's
GUARD_DATA = "synthetic:passkey"  # one needle at a seeded depth in filler text: the retrieval a streaming head loses


def fidelity_kl(fidelity: dict) -> tuple[str, float]:
    """(key, value) of the KL a target is held against in an ``evaluate_fidelity`` result: the teacher-forced
    KL averaged over every position of the prompts (``teacher_forced.kl_mean``) when the report has it — one
    next-token KL per prompt is a single sampled position, too noisy to bisect on — else the first key
    naming a KL with a number (reports written before teacher forcing: ``next_token_kl``)."""
    tf = fidelity.get("teacher_forced")
    if isinstance(tf, dict) and isinstance(tf.get("kl_mean"), (int, float)):
        return "teacher_forced.kl_mean", float(tf["kl_mean"])
    for key, value in fidelity.items():
        if "kl" in key.split("_") and isinstance(value, (int, float)):
            return key, float(value)
    raise ValueError(f"fidelity result has no KL to hold a --target-kl against (keys: {sorted(fidelity)})")


def tuning_samples(cfg: "CalibrateConfig", tokenizer) -> list:
    """The prompts a --target-kl is tuned on: calibration samples ``cfg.samples .. cfg.samples + tune_samples - 1``
    of the calibration stream (``load_calibration`` with the run's seed) — the calibration part of the data
    (never ``held_out``'s part: held-out data only verifies), and not the samples the heads were searched on
    (their errors were fitted there, so a KL measured on them would flatter the allocation)."""
    from .data import load_calibration

    stream = load_calibration(cfg.data, tokenizer, max_tokens=cfg.max_tokens, samples=cfg.samples + cfg.tune_samples, seed=cfg.seed)
    found = stream[cfg.samples:]
    if not found:
        raise ValueError(f"--data {cfg.data}: no calibration sample is left for tuning --target-kl after the {cfg.samples} searched")
    return found


def tuning_reference(cfg: "CalibrateConfig", model, tokenizer):
    """The dense run over ``tuning_samples`` (fidelity.Reference), computed once per target search."""
    from .fidelity import dense_reference

    return dense_reference(model, tokenizer, tuning_samples(cfg, tokenizer), data=f"{cfg.data} (tuning)")


@dataclass
class TuningMemo:
    """What the targets of one ``calibrate --target-kl X --target-kl Y ...`` share: the dense run over the tuning
    prompts and each KL measured, by the allocation's rows. Every target probes the same per-layer KL model
    (one layer sparse at a time: 30 model runs for SmolLM2, ~6 minutes at 2K on two CPU cores) and often
    measures the same path points; a second target measured them all again. The retrieval guard's dense run and readings are kept the same way:
    the path move and the layer protection of one target, and the targets of a sweep, read many of the same points."""

    reference: object | None = None
    kl: dict[str, float] = field(default_factory=dict)
    guard: tuple | None = None  # the retrieval guard's dense side: (keycheck.DenseKeys, the manifest's record)
    keys: dict[str, KeyCheck] = field(default_factory=dict)  # each guard reading, by the allocation's rows


def _rows_key(rows: list[dict]) -> str:
    """A stable name for what an allocation runs (its rows as plain data)."""
    return hashlib.sha256(json.dumps(rows, sort_keys=True, default=str).encode()).hexdigest()


def tuning_kl(cfg: "CalibrateConfig", model, tokenizer, manifest: dict, fixed_rows: list[dict],
              progress=None, memo: TuningMemo | None = None) -> Callable[[list[dict]], float]:
    """kl_of for ``allocate_target``: rows of the searched layers -> the teacher-forced KL(dense || sparse) of
    the model with ``fixed_rows`` + those rows, on the tuning prompts (``fidelity_kl``). The dense run over
    the prompts is made on the first call and reused by every later one: only the sparse side changes
    between the points of a target search. ``memo`` (a sweep's) keeps both across targets."""
    from .fidelity import evaluate_against

    memo = memo if memo is not None else TuningMemo()

    def kl_of(rows: list[dict]) -> float:
        key = _rows_key(fixed_rows + rows)
        if key in memo.kl:
            return memo.kl[key]
        density = sum(r["density"] for r in rows) / len(rows)
        if progress is not None:
            progress.stage(f"target KL: runtime on tuning prompts, allocation at mean density {density:.1%}")
        if memo.reference is None:
            memo.reference = tuning_reference(cfg, model, tokenizer)
        fid = evaluate_against(model, tokenizer, manifest, fixed_rows + rows, memo.reference, min_tokens=VERIFY_MIN_TOKENS)
        memo.kl[key] = fidelity_kl(fid)[1]
        return memo.kl[key]

    kl_of.known = lambda rows: memo.kl.get(_rows_key(fixed_rows + rows))  # a reading without a run (search_target's known)
    return kl_of


def tuning_record(cfg: "CalibrateConfig") -> dict:
    """The manifest's account of the tuning prompts."""
    return {"data": cfg.data, "part": "calibration", "samples": cfg.tune_samples, "seed": cfg.seed,
            "stream_indices": [cfg.samples, cfg.samples + cfg.tune_samples - 1],
            "why": "calibration-stream samples after the searched ones: disjoint from the search's samples and from held-out data"}


def guard_prompt(cfg: "CalibrateConfig", tokenizer, j: int):
    """Guard prompt j, a passkey prompt at the calibration length: the synthetic stream's seed ``cfg.seed + j``
    (the j-th of ``load_calibration(..., seed=cfg.seed)``), disjoint from the held-out prompts (seeded from
    10_000 on, data.calibration.held_out)."""
    from .data import load_calibration

    return load_calibration(GUARD_DATA, tokenizer, max_tokens=cfg.max_tokens, samples=1, seed=cfg.seed + j)[0]


def retrieval_guard(cfg: "CalibrateConfig", model, tokenizer, manifest: dict, fixed_rows: list[dict],
                    progress=None, memo: TuningMemo | None = None) -> tuple[Callable[[list[dict]], KeyCheck] | None, dict]:
    """check_of for ``allocate_target``: rows of the searched layers -> KeyCheck: how many guard prompts whose
    key dense retrieves (every digit its most likely token, teacher-forced) the model with ``fixed_rows`` + those
    rows loses (a digit below GUARD_KEEPS of its dense probability), and the lowest sparse / dense ratio of a held
    digit. Returns (check_of, the manifest's record); check_of is None when dense retrieves no key (nothing to
    hold). One forward per held prompt, no generation, no KL; ``memo`` (a sweep's) keeps the dense side and
    every reading across calls."""
    from .fidelity import as_artifact

    memo = memo if memo is not None else TuningMemo()
    if memo.guard is None:
        memo.guard = _guard_dense(cfg, model, tokenizer)
    keys, record = memo.guard
    if not keys.held:
        return None, {**record, "held": None, "why": f"dense retrieves none of the {len(keys.samples)} guard keys: nothing to hold"}

    def check_of(rows: list[dict]) -> KeyCheck:
        key = _rows_key(fixed_rows + rows)
        if key in memo.keys:
            return memo.keys[key]
        if progress is not None:
            progress.stage(f"retrieval guard: the {len(keys.held)} keys dense retrieves, through the runtime")
        memo.keys[key] = read_keys(model, keys, as_artifact(manifest, fixed_rows + rows))
        return memo.keys[key]

    return check_of, record


def _guard_dense(cfg: "CalibrateConfig", model, tokenizer) -> tuple:
    """The guard's dense side: (keycheck.DenseKeys of its prompts, the manifest's record). Prompts are read until
    dense retrieves ``cfg.retrieval_guard`` keys (at most keycheck.DRAWS x that many): with a fixed count, Gemma 3 at
    16K held one key of four, and that one prompt decided every target's layers (RESULTS Run 40)."""
    keys = dense_keys_until(model, tokenizer, lambda j: guard_prompt(cfg, tokenizer, j), cfg.retrieval_guard)
    record = {"data": GUARD_DATA, "wanted": cfg.retrieval_guard, "prompts": len(keys.samples), "seed": cfg.seed,
              "tokens": max(len(s.input_ids) for s in keys.samples), "dense_retrieves": len(keys.held),
              "rule": f"held: every digit dense's most likely token; lost: a digit below {GUARD_KEEPS} x its dense p (teacher-forced)",
              "dense_min_p": [round(float(p.min()), 4) if p.numel() else None for p in keys.dense]}
    return keys, record
