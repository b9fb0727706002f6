"""A model split over the GPUs of one host by accelerate (``device_map``, ``max_memory``), checked before loading.

``calibrate --device-map`` places the model for the capture forward (a model one GPU cannot hold); the
per-layer searches go to worker processes on ``--gpus`` GPUs (``search/spread.py``). Everything here reads
configs only: the module names and weight sizes come from the model built on the meta device, so a bad
split is refused in one line before any weights are read.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")  # accelerate's device_map names
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KB|MB|GB|TB|KiB|MiB|GiB|TiB)\s*$", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check_gpus(gpus: int) -> None:
    """--gpus N: a positive count no larger than the GPUs this host has (1 on a CPU host: the search in-process)."""
    if gpus < 1:
        raise ValueError(f"--gpus must be >= 1, got {gpus}")
    have = gpu_count()
    if gpus > 1 and gpus > have:
        raise ValueError(f"--gpus {gpus}: this host has {have} GPU{'s' if have != 1 else ''}")


def parse_max_memory(text: str | None) -> dict | None:
    """'0=20GiB,1=20GiB,cpu=64GiB' -> {0: '20GiB', 1: '20GiB', 'cpu': '64GiB'}; one line on anything else."""
    if not text:
        return None
    out: dict = {}
    for part in text.split(","):
        key, sep, size = part.partition("=")
        key = key.strip()
        if not sep or not _SIZE.match(size) or not (key.isdigit() or key == "cpu"):
            raise ValueError(f"--max-memory takes GPU=SIZE pairs such as '0=20GiB,1=20GiB' (or cpu=SIZE), got {part.strip()!r}")
        out[int(key) if key.isdigit() else key] = size.strip()
    return out


def size_bytes(size: str) -> int:
    number, unit = _SIZE.match(size).groups()
    return int(float(number) * _UNITS[unit.lower()])


def read_device_map(value: str | None) -> str | dict | None:
    """--device-map: an accelerate strategy name, or a JSON file {module name: GPU index | "cpu"}."""
    if value is None:
        return None
    if value in STRATEGIES:
        return value
    path = Path(value)
    if not path.is_file():
        raise ValueError(f"--device-map must be one of {', '.join(STRATEGIES)} or a JSON file of {{module: device}}, got {value!r}")
    try:
        mapping = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"--device-map {value}: not a JSON object ({exc.__class__.__name__})") from None
    if not isinstance(mapping, dict) or not mapping:
        raise ValueError(f"--device-map {value}: expected a non-empty JSON object of {{module: device}}")
    return mapping


def meta_model(resolved):
    """The model built on the meta device from its config: module names and parameter sizes, no weights."""
    import transformers
    from accelerate import init_empty_weights

    with init_empty_weights():
        return getattr(transformers, resolved.info.architecture)._from_config(resolved.config)


def check_device_map(mapping: dict, model, gpus: int) -> None:
    """Every name a module of the model, every device a GPU index this host has (or cpu), every parameter placed."""
    modules = dict(model.named_modules())
    unknown = [name for name in mapping if name not in modules]
    if unknown:
        raise ValueError(f"--device-map names modules the model does not have: {', '.join(unknown[:4])}"
                         f"{' …' if len(unknown) > 4 else ''} (top-level modules: {', '.join(n for n, _ in model.named_children())})")
    for name, device in mapping.items():
        if not (device == "cpu" or (isinstance(device, int) and 0 <= device < gpus)):
            raise ValueError(f"--device-map places {name} on {device!r}; devices are GPU indices 0..{gpus - 1} here, or 'cpu'")
    placed = lambda p: any(p == m or p.startswith(m + ".") or m == "" for m in mapping)
    loose = [p for p, _ in model.named_parameters() if not placed(p)]
    if loose:
        raise ValueError(f"--device-map leaves {len(loose)} parameters unplaced, e.g. {loose[0]}")


def check_split(resolved, device_map: str | dict | None, max_memory: dict | None, dtype: torch.dtype) -> None:
    """Refuse a split that cannot be made as asked: no GPUs, a GPU index this host lacks, a JSON map that
    names missing modules, or --max-memory too small for the weights or for the largest decoder layer."""
    if device_map is None:
        if max_memory is not None:
            raise ValueError("--max-memory needs --device-map (the split it bounds)")
        return
    have = gpu_count()
    if have == 0:
        raise ValueError("--device-map splits the model over GPUs; torch sees none here")
    for key in max_memory or {}:
        if key != "cpu" and key >= have:
            raise ValueError(f"--max-memory names GPU {key}; this host has GPUs 0..{have - 1}")
    model = meta_model(resolved)
    if isinstance(device_map, dict):
        check_device_map(device_map, model, have)
    if not max_memory:
        return
    elt = torch.empty((), dtype=dtype).element_size()
    weights = sum(p.numel() for p in model.parameters()) * elt
    gpu_budget = {k: size_bytes(v) for k, v in max_memory.items() if k != "cpu"}
    room = sum(gpu_budget.values()) + (size_bytes(max_memory["cpu"]) if "cpu" in max_memory else 0)
    if room < weights:
        raise ValueError(f"the weights need {weights / 2**30:.1f} GiB in {str(dtype).removeprefix('torch.')}; "
                         f"--max-memory gives {room / 2**30:.1f} GiB in all")
    layer = max((sum(p.numel() for p in m.parameters()) * elt for n, m in model.named_modules()
                 if re.search(r"\.layers\.\d+$", n)), default=0)
    if gpu_budget and layer > max(gpu_budget.values()):
        raise ValueError(f"one decoder layer needs {layer / 2**30:.2f} GiB; no --max-memory GPU entry holds it "
                         f"(largest {max(gpu_budget.values()) / 2**30:.2f} GiB)")
