"""ModelInfo: the facts about a model that artifacts record and validate against. Plain data."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

SLIDING = "sliding_attention"  # transformers' config.layer_types names
FULL = "full_attention"
LAYER_TYPES = (SLIDING, FULL)


@dataclass(frozen=True)
class ModelInfo:
    """What an artifact must agree with to be applied to a model.

    id: the name the user gave (alias, hub id or path); revision: hub commit or a content hash of the
    weights file(s); architecture: transformers class name of the model (e.g. "LlamaForCausalLM"; VLMs below);
    rope: "default", "llama3", "mrope", ... as in the config's rope_scaling / rope_type.

    For VLMs ``architecture`` is the top-level class transformers loads (e.g.
    "Qwen2_5_VLForConditionalGeneration") and ``text_architecture`` the class of the text decoder inside
    it (e.g. "Qwen2_5_VLTextModel", or "Qwen2ForCausalLM" for LLaVA-OneVision); for LLMs both are the
    same (e.g. "LlamaForCausalLM"). None when unknown (artifacts written before the field existed).

    Hybrid models (Gemma 3: sliding-window layers with a few global ones) carry ``layer_types``, one of
    "sliding_attention" / "full_attention" per layer, and ``sliding_window`` (a sliding layer's query at
    position p sees keys j with p - j < sliding_window). A model whose every layer is full attention has
    both None (the uniform case, and every artifact written before the fields existed). A uniform window
    (Mistral v0.1: ``sliding_window`` set, no layer_types) is recorded as every layer sliding.
    """

    id: str
    revision: str
    architecture: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    rope: str = "default"
    max_position_embeddings: int | None = None
    modality_token_ids: dict[str, list[int]] = field(default_factory=dict)
    text_architecture: str | None = None
    layer_types: tuple[str, ...] | None = None
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if self.layer_types is None:
            return
        types = tuple(self.layer_types)  # a JSON list from a manifest becomes the tuple the dataclass promises
        object.__setattr__(self, "layer_types", types)
        bad = sorted({t for t in types if t not in LAYER_TYPES})
        if bad:
            raise ValueError(f"layer_types {bad} unsupported (known: {', '.join(LAYER_TYPES)})")
        if len(types) != self.num_layers:
            raise ValueError(f"layer_types has {len(types)} entries for {self.num_layers} layers")
        if SLIDING in types and not (isinstance(self.sliding_window, int) and self.sliding_window >= 1):
            raise ValueError(f"sliding layers need sliding_window >= 1, got {self.sliding_window!r}")

    def to_dict(self) -> dict:
        out = asdict(self)
        if self.layer_types is None:  # uniform models keep the manifest bytes they had before hybrids existed
            del out["layer_types"], out["sliding_window"]
        else:
            out["layer_types"] = list(self.layer_types)
        return out

    @classmethod
    def from_dict(cls, data: dict) -> "ModelInfo":
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in data.items() if k in known})

    @property
    def sliding_layers(self) -> tuple[int, ...]:
        """Layers that run the model's own sliding window (never searched, never triangle)."""
        return tuple(i for i, t in enumerate(self.layer_types or ()) if t == SLIDING)

    @property
    def global_layers(self) -> tuple[int, ...]:
        """Full-attention layers: the ones the search, the probe's start rule and TriangleMix act on."""
        sliding = set(self.sliding_layers)
        return tuple(i for i in range(self.num_layers) if i not in sliding)

    def window_of(self, layer: int) -> int | None:
        """The sliding window of ``layer``, or None for a full-attention layer."""
        return self.sliding_window if self.layer_types is not None and self.layer_types[layer] == SLIDING else None

    @property
    def group(self) -> int:
        return self.num_heads // self.num_kv_heads
