"""ModelInfo: the facts about a model that artifacts record and validate against. Plain data."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


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

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "ModelInfo":
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in data.items() if k in known})

    @property
    def group(self) -> int:
        return self.num_heads // self.num_kv_heads
