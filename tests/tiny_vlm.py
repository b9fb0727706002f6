"""A tiny LLaVA (CLIP tower + Llama text model, random weights) saved with a real LlavaProcessor — a
word-level tokenizer, CLIP's PIL image processor and a chat template — so image rows go through the same
``processor.apply_chat_template`` path as a real VLM, offline. Plus a jsonl of chat rows with PNG images."""

from __future__ import annotations

import json
from pathlib import Path

import torch

IMAGE_SIZE, PATCH = 16, 4  # 16 image tokens per image
TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} : {% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for c in m['content'] %}{% if c['type'] == 'image' %}<image>{% else %} {{ c['text'] }} {% endif %}{% endfor %}"
    "{% endif %} </s> {% endfor %}"
)


def make_tiny_llava(path: Path) -> str:
    import transformers as tf
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["[PAD]", "[UNK]", "<s>", "</s>", "user", "assistant", ":"] + [f"w{i}" for i in range(100)]
    vocab = {w: i for i, w in enumerate(words + ["<image>"])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = tf.PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]", pad_token="[PAD]", bos_token="<s>",
                                     eos_token="</s>", additional_special_tokens=["<image>"])
    image_processor = tf.CLIPImageProcessorPil(size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    processor = tf.LlavaProcessor(image_processor=image_processor, tokenizer=tok, patch_size=PATCH, num_additional_image_tokens=1,
                                  vision_feature_select_strategy="default", chat_template=TEMPLATE)
    text = tf.LlamaConfig(vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                          bos_token_id=2, eos_token_id=3, pad_token_id=0, head_dim=64)
    vision = tf.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                 image_size=IMAGE_SIZE, patch_size=PATCH)
    config = tf.LlavaConfig(vision_config=vision, text_config=text, image_token_index=vocab["<image>"],
                            vision_feature_select_strategy="default", vision_feature_layer=-1)
    torch.manual_seed(0)
    tf.LlavaForConditionalGeneration(config).save_pretrained(path)
    processor.save_pretrained(path)
    return str(path)


def write_image_rows(folder: Path, rows: int = 2, images: int = 6, words: int = 40) -> Path:
    """rows chat rows, each: text, an image, text, ... (``images`` images of 16 tokens): a multi-span input."""
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    lines = []
    for r in range(rows):
        content = []
        for i in range(images):
            pixels = (torch.rand(IMAGE_SIZE, IMAGE_SIZE, 3, generator=gen) * 255).to(torch.uint8).numpy()
            name = f"r{r}_i{i}.png"
            Image.fromarray(pixels).save(folder / name)
            said = " ".join(f"w{int(x)}" for x in torch.randint(0, 100, (words,), generator=gen))
            content += [{"type": "text", "text": said}, {"type": "image", "image": name}]
        content.append({"type": "text", "text": "w1 w2 w3"})
        lines.append(json.dumps({"messages": [{"role": "user", "content": content}]}))
    path = folder / "rows.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path
