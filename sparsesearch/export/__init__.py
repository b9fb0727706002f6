"""Exporters: one module per target format, each writing exactly one file at the path given.

* ``minference``: MInference / Qwen2.5-1M per-head JSON (``export_minference``, ``import_minference``)
* ``flex``: FlexAttention BlockMask per layer (``flex_block_mask``, ``flex_tensors``, ``write_flex``)
* ``duo``: DuoAttention-style TSV of full (1) vs streaming (0) KV heads (``export_duo``)
* ``json_dump``: plain JSON of manifest + rows for people and pipes (``export_json``)
* ``qwen1m``: Qwen2.5-1M ``sparse_attention_config.json`` under the dual-chunk engines' rules (``export_qwen1m``)
* ``flashprefill``: FlashPrefill's dense-prefix flag line from the TriangleMix start layer (``flag_line``)
* ``flashinfer``: FlashInfer BSR plans per layer and KV head for static patterns (``export_flashinfer``)
* ``modelopt``: NVIDIA ModelOpt ``sparse_attention_config`` block (``export_modelopt``)
* ``check``: a file of the engine formats checked against a model's config and the engine's rules (``check_file``)
"""

from .duo import duo_tsv, export_duo, write_duo
from .flex import block_mask_from_tensors, flex_block_mask, flex_tensors, load_flex, write_flex
from .json_dump import export_json, write_json
from .minference import export_minference, import_minference, minference_json, write_minference

FORMATS = ("minference", "flex", "duo", "json", "qwen-1m", "flashprefill", "flashinfer", "modelopt")

__all__ = [
    "FORMATS", "duo_tsv", "export_duo", "write_duo", "block_mask_from_tensors", "flex_block_mask", "flex_tensors",
    "load_flex", "write_flex", "export_json", "write_json", "export_minference", "import_minference",
    "minference_json", "write_minference",
]
