"""A captioner loaded and run: images in, one-paragraph captions out, a batch at a time.

Two families: Qwen2.5-VL (`Qwen2_5_VLForConditionalGeneration`) and LLaVA (`LlavaForConditionalGeneration`,
JoyCaption), both native to transformers 4.54/4.55, so no repository code is ever run (no trust_remote_code).
Qwen's processor is built from its parts: transformers' own `Qwen2_5_VLProcessor` insists on a video processor,
which needs torchvision, which flux-train does not install and a captioner of still images does not use.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flux_trainer.caption.models import RANDOM_TINY, CaptionerSpec

PROMPT = (
    "Write one paragraph of plain prose describing this image, as the caption of a training image for a "
    "text-to-image model. Say what the main subject is, what they wear, their pose and expression, the setting "
    "and background, the lighting, and the style or medium (photograph, painting, 3D render, ...). Be concrete and "
    "factual. Do not begin with 'The image shows', do not use lists or line breaks, and do not guess anyone's name."
)
JOYCAPTION_SYSTEM = "You are a helpful image captioner."
# What random_tiny's caption becomes when its random tokens decode to no printable text: something is always written.
NO_TEXT_MARKER = "(random_tiny: its random tokens decoded to no printable text)"


@dataclass(frozen=True)
class Placement:
    device: str  # "cuda" or "cpu"
    dtype: Any  # torch dtype: bf16 on a GPU that has it, fp16 on an older one, fp32 on the CPU
    gpu_name: str = ""

    @property
    def slow(self) -> bool:
        return self.device == "cpu"


def place() -> Placement:
    """Where the captioner runs, from flux-train's one device question (launch.device)."""
    import torch

    from flux_trainer.launch.device import detect_device

    info = detect_device()
    if not info.is_gpu:
        return Placement("cpu", torch.float32)
    return Placement("cuda", torch.bfloat16 if info.bf16 else torch.float16, info.name)


@functools.cache
def _qwen_processor_class():
    from transformers import Qwen2_5_VLProcessor
    from transformers.processing_utils import ProcessorMixin

    class ImageQwenProcessor(Qwen2_5_VLProcessor):
        """Qwen2.5-VL's processor for still images: an image processor and a tokenizer, no video processor."""

        attributes = ["image_processor", "tokenizer"]

        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            self.image_token = getattr(tokenizer, "image_token", None) or "<|image_pad|>"
            self.video_token = getattr(tokenizer, "video_token", None) or "<|video_pad|>"
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    return ImageQwenProcessor


def chat_template(folder: Path) -> str | None:
    """The repository's chat template file, if it ships one apart from tokenizer_config.json."""
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text(encoding="utf-8")
    if (folder / "chat_template.json").is_file():
        return json.loads((folder / "chat_template.json").read_text(encoding="utf-8"))["chat_template"]
    return None


def qwen_processor(folder: Path):
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.padding_side = "left"  # batched generation: every prompt ends where generation starts
    template = chat_template(folder) or tokenizer.chat_template
    return _qwen_processor_class()(Qwen2VLImageProcessor.from_pretrained(folder), tokenizer, chat_template=template)


class Engine:
    """One loaded captioner. `caption` is the only thing the runner calls."""

    def __init__(self, spec: CaptionerSpec, model, processor, placement: Placement):
        self.spec, self.model, self.processor, self.placement = spec, model, processor, placement

    def inputs(self, images: list, prompt: str):
        if self.spec.family == "qwen2_5_vl":
            messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt}]}]
        else:  # llava (JoyCaption): its chat template puts the image before the user's words
            messages = [{"role": "system", "content": JOYCAPTION_SYSTEM}, {"role": "user", "content": prompt}]
        text = self.processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        batch = self.processor(images=images, text=[text] * len(images), padding=True, return_tensors="pt")
        batch = batch.to(self.placement.device)
        if "pixel_values" in batch:
            batch["pixel_values"] = batch["pixel_values"].to(self.placement.dtype)
        return batch

    def caption(self, images: list, prompt: str, min_new_tokens: int = 0, max_new_tokens: int | None = None):
        """One caption per image, in order: greedy (the same image gives the same caption), bounded length."""
        import torch

        batch = self.inputs(images, prompt)
        limit = max_new_tokens or self.spec.max_new_tokens
        with torch.inference_mode():
            out = self.model.generate(
                **batch,
                max_new_tokens=limit,
                min_new_tokens=min(min_new_tokens, limit),
                do_sample=False,
                temperature=None,
                top_p=None,
                top_k=None,
            )
        new = out[:, batch["input_ids"].shape[1] :]
        texts = [clean(t) for t in self.processor.batch_decode(new, skip_special_tokens=True)]
        if self.spec.name == RANDOM_TINY:
            texts = [t or NO_TEXT_MARKER for t in texts]
        return texts


def clean(text: str) -> str:
    """One paragraph on one line: control characters and undecodable bytes dropped, whitespace collapsed."""
    kept = "".join(ch if ch.isprintable() and ch != "\ufffd" else " " for ch in text)
    return " ".join(kept.split())


def load(spec: CaptionerSpec, folder: Path, placement: Placement) -> Engine:
    """The model in eval mode on its device, in its dtype, with its processor."""
    if spec.family == "qwen2_5_vl":
        from transformers import Qwen2_5_VLForConditionalGeneration as model_class

        processor = qwen_processor(folder)
    else:
        from transformers import AutoProcessor
        from transformers import LlavaForConditionalGeneration as model_class

        processor = AutoProcessor.from_pretrained(folder)
        processor.tokenizer.padding_side = "left"
        if processor.tokenizer.pad_token is None:
            processor.tokenizer.pad_token = processor.tokenizer.eos_token
    model = model_class.from_pretrained(folder, torch_dtype=placement.dtype)
    return Engine(spec, model.to(placement.device).eval(), processor, placement)
