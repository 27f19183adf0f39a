"""Processor files of a Qwen3-VL-style snapshot, and loading the processor without torchvision.

`write_processor_files` writes the image, video and processor configs with the values Qwen3-VL
publishes (patch 16, merge 2, mean/std 0.5), naming the PIL image processor.

transformers 5.x cannot build any `Qwen3VLProcessor` without torchvision: the processor always
loads a video processor, and video processors need torchvision. `load_processor` therefore uses
`AutoProcessor` when torchvision is there and otherwise builds the same transformers class with
no video processor (images and text behave identically; videos are unsupported).
"""

import json
from pathlib import Path

from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
from transformers.utils import is_torchvision_available

IMAGE_MEAN = [0.5, 0.5, 0.5]
IMAGE_STD = [0.5, 0.5, 0.5]


def write_processor_files(
    out_dir,
    patch_size: int = 16,
    temporal_patch_size: int = 2,
    merge_size: int = 2,
    min_pixels: int = 32 * 32,
    max_pixels: int = 128 * 128,
) -> None:
    factor = patch_size * merge_size
    if min_pixels < factor * factor or max_pixels < min_pixels:
        raise ValueError(
            f"need {factor * factor} <= min_pixels <= max_pixels (patch_size*merge_size = {factor}), "
            f"got min_pixels={min_pixels}, max_pixels={max_pixels}"
        )
    image_config = {
        "image_processor_type": "Qwen2VLImageProcessorPil",
        "processor_class": "Qwen3VLProcessor",
        "do_convert_rgb": True,
        "do_resize": True,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": IMAGE_MEAN,
        "image_std": IMAGE_STD,
        "resample": 3,
        "size": {"shortest_edge": min_pixels, "longest_edge": max_pixels},
        "patch_size": patch_size,
        "temporal_patch_size": temporal_patch_size,
        "merge_size": merge_size,
    }
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "preprocessor_config.json").write_text(json.dumps(image_config, indent=2) + "\n")
    video_config = {
        key: image_config[key]
        for key in ("do_convert_rgb", "do_resize", "do_rescale", "rescale_factor", "do_normalize", "image_mean", "image_std", "resample")
    }
    video_config.update(
        video_processor_type="Qwen3VLVideoProcessor",
        processor_class="Qwen3VLProcessor",
        size={"shortest_edge": min_pixels, "longest_edge": max_pixels * temporal_patch_size},
        patch_size=patch_size,
        temporal_patch_size=temporal_patch_size,
        merge_size=merge_size,
        fps=2,
    )
    (out_dir / "video_preprocessor_config.json").write_text(json.dumps(video_config, indent=2) + "\n")
    (out_dir / "processor_config.json").write_text(json.dumps({"processor_class": "Qwen3VLProcessor"}, indent=2) + "\n")


class ImageOnlyQwen3VLProcessor(Qwen3VLProcessor):
    """transformers' Qwen3VLProcessor with `video_processor=None` allowed (no torchvision)."""

    def check_argument_for_proper_class(self, argument_name, argument):
        if argument_name == "video_processor" and argument is None:
            return None
        return super().check_argument_for_proper_class(argument_name, argument)


def load_processor(model_dir):
    """The snapshot's transformers processor; image-only when torchvision is missing."""
    if is_torchvision_available():
        return AutoProcessor.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    image_processor = AutoImageProcessor.from_pretrained(model_dir, backend="pil")
    return ImageOnlyQwen3VLProcessor(
        image_processor=image_processor, tokenizer=tokenizer, video_processor=None, chat_template=tokenizer.chat_template
    )
