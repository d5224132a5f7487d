"""Build the stand-in Qwen3 tokenizer shipped in flux_trainer/standin_tokenizers/Qwen_Qwen3-4B/.

musubi-tuner's FLUX.2 [klein] text encoder loads `Qwen2Tokenizer.from_pretrained("Qwen/Qwen3-4B")` (or -8B) from
the hub, which no test, demo or benchmark here can reach. This writes a tiny byte-level BPE with the same file set
and interface (vocab.json + merges.txt for the slow `Qwen2Tokenizer` musubi-tuner calls, tokenizer.json for the
fast class, a chat template honouring `enable_thinking=False`, `<|endoftext|>` as pad), trained on a few made-up
captions. It is NOT Qwen's vocabulary: it only drives random-weight models. Its ids stay below 512, so a tiny
random Qwen3 (vocab 512) and the full-size one (151,936) both accept them.

Run from the repository root: python scripts/build_standin_qwen3_tokenizer.py
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

OUT = Path(__file__).resolve().parents[1] / "flux_trainer" / "standin_tokenizers" / "Qwen_Qwen3-4B"
VOCAB_SIZE = 500  # byte alphabet (256) + merges; the special tokens come after
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
THINK = ["<think>", "</think>"]  # plain added tokens (not special), as the chat template writes them
# Our own minimal template: the turn markers Qwen3 uses and, with enable_thinking=False, the empty think block
# its template adds before the answer. transformers renders it with trim_blocks/lstrip_blocks, hence no newlines
# next to block tags.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
CORPUS = [
    "a photo of a cat sitting on a wooden table next to a window",
    "a painting of a mountain lake at sunset, oil on canvas",
    "portrait of a woman with red hair, studio lighting, 85mm",
    "a red sports car parked in front of a modern glass building",
    "an illustration of a dragon flying over a medieval castle",
    "close-up of a flower with water drops, macro photography",
    "a bowl of ramen with egg and green onions, top view",
    "the same scene in winter, covered with snow; make it night",
    "change the background to a beach. Keep the person unchanged!",
    "sks dog, ohwx person, 1girl, anime style, high quality, 4k",
    'Text: "HELLO WORLD" written in neon letters (blue, pink) 0123456789',
]


def build(out: Path = OUT) -> None:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in SPECIAL])
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in THINK])
    out.mkdir(parents=True, exist_ok=True)
    tok.model.save(str(out))  # vocab.json + merges.txt: what the slow Qwen2Tokenizer reads
    tok.save(str(out / "tokenizer.json"))
    added = {
        str(tok.token_to_id(t)): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": t in SPECIAL,
        }
        for t in SPECIAL + THINK
    }
    config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "extra_special_tokens": {},
        "model_max_length": 131072,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    special_map = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    (out / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n")
    print(f"wrote {out} ({tok.get_vocab_size()} tokens)")


if __name__ == "__main__":
    build()
