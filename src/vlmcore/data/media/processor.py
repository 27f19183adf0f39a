"""Processor files of a Qwen3-VL-style snapshot, and loading the processor without torchvision.

`write_processor_files` writes the image, video and processor configs with the values Qwen3-VL
publishes (patch 16, merge 2, mean/std 0.5), naming the PIL image processor.

`ImagePatcher` is the training loader's image path: the image processor's RGB conversion, smart
resize (PIL, the processor's resample) and patch order, with the patches kept as uint8, one frame
(an image's patches are the same for every temporal slot), and written straight into the row's
buffer; `normalize_patches` (image.py, so that the training loader imports no processor code) does the rest on the device. Together they give exactly the
processor's float32 `pixel_values` from an eighth of the bytes, without its float copies on the CPU.

transformers 5.x cannot build any `Qwen3VLProcessor` without torchvision: the processor always
loads a video processor, and video processors need torchvision. `load_processor` therefore uses
`AutoProcessor` when torchvision is there and otherwise builds the same transformers class with
no video processor (images and text behave identically; videos are unsupported).
"""

import json
from pathlib import Path

import numpy as np
from PIL import Image
from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer, BaseImageProcessor, ProcessorMixin
from transformers.image_transforms import convert_to_rgb
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
from transformers.utils import is_torchvision_available

IMAGE_MEAN = [0.5, 0.5, 0.5]
IMAGE_STD = [0.5, 0.5, 0.5]


def write_processor_files(
    out_dir: str | Path,
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
    shared = {
        "do_convert_rgb": True,
        "do_resize": True,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": IMAGE_MEAN,
        "image_std": IMAGE_STD,
        "resample": 3,
    }
    patches = {"patch_size": patch_size, "temporal_patch_size": temporal_patch_size, "merge_size": merge_size}
    image_config = {
        "image_processor_type": "Qwen2VLImageProcessorPil",
        "processor_class": "Qwen3VLProcessor",
        **shared,
        "size": {"shortest_edge": min_pixels, "longest_edge": max_pixels},
        **patches,
    }
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "preprocessor_config.json").write_text(json.dumps(image_config, indent=2) + "\n")
    video_config = {
        **shared,
        "video_processor_type": "Qwen3VLVideoProcessor",
        "processor_class": "Qwen3VLProcessor",
        "size": {"shortest_edge": min_pixels, "longest_edge": max_pixels * temporal_patch_size},
        **patches,
        "fps": 2,
    }
    (out_dir / "video_preprocessor_config.json").write_text(json.dumps(video_config, indent=2) + "\n")
    (out_dir / "processor_config.json").write_text(json.dumps({"processor_class": "Qwen3VLProcessor"}, indent=2) + "\n")


class ImageOnlyQwen3VLProcessor(Qwen3VLProcessor):
    """transformers' Qwen3VLProcessor with `video_processor=None` allowed (no torchvision)."""

    def check_argument_for_proper_class(self, argument_name: str, argument: object) -> type | tuple | None:
        if argument_name == "video_processor" and argument is None:
            return None
        return super().check_argument_for_proper_class(argument_name, argument)


def load_processor(model_dir: str | Path) -> ProcessorMixin:
    """The snapshot's transformers processor; image-only when torchvision is missing."""
    if is_torchvision_available():
        return AutoProcessor.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    image_processor = AutoImageProcessor.from_pretrained(model_dir, backend="pil")
    return ImageOnlyQwen3VLProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=None,
        chat_template=tokenizer.chat_template,
    )


class ImagePatcher:
    """uint8 patches of images, in the order and at the size of the snapshot's image processor."""

    def __init__(self, image_processor: BaseImageProcessor) -> None:
        for key in ("do_convert_rgb", "do_resize", "do_rescale", "do_normalize"):
            if not getattr(image_processor, key):
                raise ValueError(f"preprocessor_config.json: {key}=false is not supported by the training loader")
        self.patch_size = image_processor.patch_size
        self.merge_size = image_processor.merge_size
        self.temporal_patch_size = image_processor.temporal_patch_size
        self.min_pixels = image_processor.size["shortest_edge"]
        self.max_pixels = image_processor.size["longest_edge"]
        self.resample = int(image_processor.resample)
        self.patch_dim = 3 * self.patch_size**2  # uint8 values per patch: one frame of (C, P, P)
        # What the device needs to finish the processor's work (`normalize_patches`).
        self.normalize = {
            "rescale_factor": float(image_processor.rescale_factor),
            "mean": [float(m) for m in image_processor.image_mean],
            "std": [float(s) for s in image_processor.image_std],
            "temporal_patch_size": self.temporal_patch_size,
        }

    def resized(self, image: Image.Image) -> Image.Image:
        """RGB (transparency on white) at the smart-resize size, as the processor resizes it."""
        if image.mode == "RGB" and image.info.get("transparency") is None:
            rgb = image  # convert_to_rgb would return a copy of it
        else:
            rgb = Image.fromarray(convert_to_rgb(image, return_numpy=True))
        height, width = smart_resize(
            rgb.height,
            rgb.width,
            factor=self.patch_size * self.merge_size,
            min_pixels=self.min_pixels,
            max_pixels=self.max_pixels,
        )
        return rgb.resize((width, height), resample=self.resample)

    def grid(self, image: Image.Image) -> tuple[int, int, int]:
        return 1, image.height // self.patch_size, image.width // self.patch_size

    def write_patches(self, image: Image.Image, out: np.ndarray) -> None:
        """The patches of a `resized` image into `out` (num_patches, patch_dim) uint8, in one copy:
        merge groups in row-major order, inside them patches row-major, each patch (C, P, P)."""
        p, m = self.patch_size, self.merge_size
        pixels = np.asarray(image)  # (H, W, C)
        gh, gw = image.height // (p * m), image.width // (p * m)
        src = pixels.reshape(gh, m, p, gw, m, p, 3).transpose(0, 3, 1, 4, 6, 2, 5)  # (gh, gw, mh, mw, C, ph, pw)
        out.reshape(gh, gw, m, m, 3, p, p)[...] = src
