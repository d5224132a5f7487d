"""`random_tiny`: a Qwen2.5-VL of a few thousand random weights, with a stand-in tokenizer, built here.

The same model class, processor and code path as the default captioner, so the tests and the CPU demo run what a
user runs, without a download. Its captions are nonsense by construction; everything that shows one says so.
The stand-in tokenizer is a byte-level BPE trained on a few dozen words (`tokenizers`), with Qwen's special tokens
and a chat template of Qwen's shape; `scripts/bench_caption.py` also uses it in front of the full-size model.
"""

from __future__ import annotations

import json
from pathlib import Path

TINY_VERSION = 2  # bump when what is built changes: a folder built by another version is built again
STAMP = "flux-train-random-tiny.json"
SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
           "<|video_pad|>")  # fmt: skip
WORDS = (
    "a photo of woman man child dog cat wearing red blue green white black shirt dress jacket hat standing "
    "sitting walking smiling in park street studio room beach forest soft warm natural light shadow style "
    "portrait painting render close up wide shot the and with on at"
)
# Qwen's chat format: each turn `<|im_start|>role\n...<|im_end|>\n`, an image as vision_start, image_pad, vision_end.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# The text model's and vision tower's shapes, in the layout of Qwen2.5-VL's own config.json.
TINY_CONFIG = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
    "rope_theta": 1000000.0,
    "rope_scaling": {"type": "mrope", "mrope_section": [1, 1, 2]},
    "tie_word_embeddings": True,
    "vision_config": {
        "depth": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 4,
        "out_hidden_size": 32,
        "patch_size": 4,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "window_size": 16,
        "fullatt_block_indexes": [1],
    },
}
# Small patches and a small pixel budget: a 1024x1024 photo becomes 16 image tokens, so the CPU run is quick.
TINY_IMAGES = {"patch_size": 4, "merge_size": 2, "temporal_patch_size": 2, "min_pixels": 16 * 16, "max_pixels": 32 * 32}


def standin_tokenizer():
    """A Qwen2TokenizerFast over a tiny byte-level BPE: encodes any text, knows Qwen's special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import Qwen2TokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=list(SPECIAL),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator([WORDS] * 4, trainer=trainer)
    tokenizer = Qwen2TokenizerFast(
        tokenizer_object=bpe, unk_token=None, bos_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.padding_side = "left"
    return tokenizer


def image_processor(**settings):
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

    return Qwen2VLImageProcessor(**settings)


def qwen_config(values: dict, tokenizer, vocab_size: int | None = None):
    """A Qwen2_5_VLConfig from config.json-style `values`, its special tokens those of `tokenizer`."""
    from transformers import Qwen2_5_VLConfig

    ids = dict(zip(SPECIAL, tokenizer.convert_tokens_to_ids(list(SPECIAL)), strict=True))
    return Qwen2_5_VLConfig(
        **values,
        vocab_size=vocab_size or len(tokenizer),
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
        bos_token_id=None,
    )


def build_random_tiny(folder: Path) -> Path:
    """Write random_tiny into `folder` (seeded: the same weights every time), the stamp last."""
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = standin_tokenizer()
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(qwen_config(TINY_CONFIG, tokenizer))
    model.generation_config.do_sample = False
    # Greedy decoding of random weights repeats one token (here a newline: an empty caption); no token twice
    # gives a different string of word pieces for each image instead.
    model.generation_config.no_repeat_ngram_size = 1
    # Left to itself it may end at once or pick lone bytes that decode to nothing printable: only the word pieces
    # (tokens with a letter in them) may be generated, and a few of them at least, so each caption is visible nonsense.
    vocab = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    model.generation_config.suppress_tokens = [
        i for i, piece in enumerate(vocab)
        if i != eos and not any(c.isalpha() for c in tokenizer.convert_tokens_to_string([piece]))
    ]  # fmt: skip
    model.generation_config.min_new_tokens = 6
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    image_processor(**TINY_IMAGES).save_pretrained(folder)
    (folder / STAMP).write_text(json.dumps({"version": TINY_VERSION}), encoding="utf-8")
    return folder


def ensure_random_tiny(folder: Path) -> Path:
    """random_tiny in `folder`, built once per TINY_VERSION (a second or two)."""
    try:
        if json.loads((folder / STAMP).read_text(encoding="utf-8")).get("version") == TINY_VERSION:
            return folder
    except (OSError, ValueError):
        pass
    return build_random_tiny(folder)
