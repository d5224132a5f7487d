"""Captioning speed and memory of the default captioner (Qwen2.5-VL-3B-Instruct) at full size, without its weights.

The model is built from Qwen2.5-VL-3B-Instruct's config.json values (below) with random bf16 weights, in front of
the stand-in tokenizer (flux_trainer.caption.tiny) and Qwen's image settings (14 px patches, 2x2 merge), so it needs
no network. It captions N generated photos of SIZE² through `Engine.caption`, the code path `flux-train dataset
caption` runs, with a fixed number of new tokens per caption (random weights would stop at a random point): the
time and memory of a real caption of that length. Per batch size: images/s, s/image, peak torch memory (weights
included). Prints a table, writes JSON. docs/captioning.md quotes it. What it cannot say: caption quality, and the
prompt's length under Qwen's own tokenizer (the stand-in's is printed; the image's tokens dominate either way).

    python scripts/bench_caption.py --batch-sizes 1,4,8 --images 16 --json bench_caption.json   # the GPU
    python scripts/bench_caption.py --tiny --images 4 --batch-sizes 1,2                           # a CPU check
"""

from __future__ import annotations

import argparse
import json
import time

# Qwen/Qwen2.5-VL-3B-Instruct's config.json (the shapes; the token ids come from the stand-in tokenizer).
QWEN25_VL_3B = {
    "hidden_size": 2048,
    "intermediate_size": 11008,
    "num_hidden_layers": 36,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128000,
    "max_window_layers": 70,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
    "sliding_window": 32768,
    "use_sliding_window": False,
    "tie_word_embeddings": True,
    "hidden_act": "silu",
    "vision_config": {
        "depth": 32,
        "hidden_act": "silu",
        "hidden_size": 1280,
        "intermediate_size": 3420,
        "num_heads": 16,
        "in_chans": 3,
        "out_hidden_size": 2048,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "spatial_patch_size": 14,
        "window_size": 112,
        "fullatt_block_indexes": [7, 15, 23, 31],
        "tokens_per_second": 2,
        "temporal_patch_size": 2,
    },
}
QWEN_VOCAB = 151936
# Qwen2.5-VL-3B-Instruct's preprocessor_config.json
QWEN_IMAGES = {
    "patch_size": 14,
    "merge_size": 2,
    "temporal_patch_size": 2,
    "min_pixels": 3136,
    "max_pixels": 12845056,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
}


def photos(n: int, size: int) -> list:
    """n different photo-like images: smooth gradients with grain, shifted."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:size, 0:size] / size
    base = np.stack([x, y, (x + y) / 2], axis=-1) * 200 + 25
    base = np.clip(base + rng.normal(0, 6, (size, size, 3)), 0, 255).astype(np.uint8)
    return [Image.fromarray(np.roll(base, 37 * i, axis=1)) for i in range(n)]


def build(tiny: bool, device: str, dtype):
    """The engine: a random-weight Qwen2.5-VL (full size, or random_tiny's shapes) and the stand-in processor."""
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration

    from flux_trainer.caption.engine import Engine, Placement, _qwen_processor_class
    from flux_trainer.caption.models import CAPTIONERS, DEFAULT, RANDOM_TINY
    from flux_trainer.caption.tiny import CHAT_TEMPLATE, TINY_CONFIG, image_processor, qwen_config, standin_tokenizer

    tokenizer = standin_tokenizer()
    # --tiny: random_tiny's depth and widths, with Qwen's patches and window, so the images go through as at full size
    shapes = QWEN25_VL_3B
    if tiny:
        vision = {**TINY_CONFIG["vision_config"], "patch_size": 14, "window_size": 112}
        shapes = {**TINY_CONFIG, "vision_config": vision}
    config = qwen_config(shapes, tokenizer, vocab_size=QWEN_VOCAB)
    processor = _qwen_processor_class()(image_processor(**QWEN_IMAGES), tokenizer, chat_template=CHAT_TEMPLATE)
    torch.manual_seed(0)
    with torch.device(device):  # weights made where they run: 3.75 B random numbers in a second, not a minute
        model = Qwen2_5_VLForConditionalGeneration._from_config(config, torch_dtype=dtype)
    model.generation_config.do_sample = False
    spec = CAPTIONERS[RANDOM_TINY if tiny else DEFAULT]
    return Engine(spec, model.eval(), processor, Placement(device, dtype)), config


def measure(engine, images: list, batch: int, new_tokens: int, prompt: str, device: str) -> dict:
    import torch

    def run_all() -> None:
        for i in range(0, len(images), batch):
            texts = engine.caption(images[i : i + batch], prompt, min_new_tokens=new_tokens, max_new_tokens=new_tokens)
            assert len(texts) == len(images[i : i + batch])

    engine.caption(images[:batch], prompt, min_new_tokens=new_tokens, max_new_tokens=new_tokens)  # warm-up
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    run_all()
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() / 1e9 if device == "cuda" else None
    return {
        "batch_size": batch,
        "images": len(images),
        "seconds": round(seconds, 3),
        "images_per_s": round(len(images) / seconds, 3),
        "s_per_image": round(seconds / len(images), 3),
        "peak_memory_gb": round(peak, 2) if peak is not None else None,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="random_tiny's shapes (a CPU check of the script)")
    ap.add_argument("--images", type=int, default=16)
    ap.add_argument("--size", type=int, default=1024, help="square photos of this side, pixels")
    ap.add_argument("--batch-sizes", default="1,4,8")
    ap.add_argument("--new-tokens", type=int, default=160, help="tokens generated per caption (a long paragraph)")
    ap.add_argument("--json", default="bench_caption.json")
    args = ap.parse_args(argv)

    import torch
    import transformers

    from flux_trainer.caption.engine import PROMPT

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    t0 = time.perf_counter()
    engine, config = build(args.tiny, device, dtype)
    built = time.perf_counter() - t0
    images = photos(args.images, args.size)
    sample = engine.inputs(images[:1], PROMPT)
    visual = int(sample["image_grid_thw"][0].prod()) // engine.processor.image_processor.merge_size**2
    params = sum(p.numel() for p in engine.model.parameters())
    header = {
        "model": "random_tiny shapes" if args.tiny else "Qwen2.5-VL-3B-Instruct shapes, random weights",
        "params_b": round(params / 1e9, 3),
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "dtype": str(dtype).removeprefix("torch."),
        "attention": getattr(config, "_attn_implementation", None),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "image_size": args.size,
        "visual_tokens_per_image": visual,
        "prompt_tokens_standin": int(sample["input_ids"].shape[1]) - visual,
        "new_tokens": args.new_tokens,
        "build_s": round(built, 1),
    }
    print(json.dumps(header))
    rows = []
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        try:
            rows.append(measure(engine, images, batch, args.new_tokens, PROMPT, device))
        except torch.OutOfMemoryError:
            rows.append({"batch_size": batch, "error": "out of memory"})
            torch.cuda.empty_cache()
    print(f"{'batch':>5} {'images/s':>9} {'s/image':>8} {'peak GB':>8}")
    for r in rows:
        if "error" in r:
            print(f"{r['batch_size']:>5} {r['error']}")
        else:
            peak = "-" if r["peak_memory_gb"] is None else f"{r['peak_memory_gb']:.2f}"
            print(f"{r['batch_size']:>5} {r['images_per_s']:>9.3f} {r['s_per_image']:>8.3f} {peak:>8}")
    with open(args.json, "w", encoding="utf-8") as f:
        json.dump({**header, "rows": rows}, f, indent=1)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
