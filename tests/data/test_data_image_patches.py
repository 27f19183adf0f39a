"""The loader's uint8 image path equals the transformers image processor, bit for bit."""

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoImageProcessor

from vlmcore.data.load.batch import Images
from vlmcore.data.media.image import normalize_patches
from vlmcore.data.media.processor import ImagePatcher, write_processor_files

# (width, height, PIL mode): sizes that are and are not multiples of 32, upscaled (below
# min_pixels) and downscaled (above max_pixels), a very wide one, and modes the processor converts.
CASES = [
    (64, 64, "RGB"),
    (100, 70, "RGB"),
    (33, 47, "L"),
    (1000, 30, "RGB"),
    (31, 900, "RGB"),
    (200, 150, "RGBA"),
    (90, 60, "P"),
    (800, 600, "RGB"),
    (16, 16, "LA"),
    (300, 301, "CMYK"),
    (70, 50, "RGB+tRNS"),
]


@pytest.fixture(scope="module")
def image_processor(tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("processor")
    write_processor_files(model_dir, min_pixels=64 * 64, max_pixels=256 * 256)
    return AutoImageProcessor.from_pretrained(model_dir, backend="pil")


def random_image(width: int, height: int, mode: str, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    smooth = np.linspace(0, 255, width, dtype=np.float32)[None, :, None] * np.ones((height, 1, 4), np.float32)
    noisy = np.clip(smooth + rng.normal(0, 40, (height, width, 4)), 0, 255).astype(np.uint8)
    image = Image.fromarray(noisy, "RGBA")
    if mode == "RGB+tRNS":  # an RGB PNG with a transparent colour
        image = Image.fromarray(noisy[..., :3] // 64 * 64)
        image.info["transparency"] = tuple(int(c) for c in np.asarray(image)[0, 0])
        return image
    return image.convert("P", palette=Image.Palette.ADAPTIVE) if mode == "P" else image.convert(mode)


def test_uint8_patches_normalised_equal_the_processor(image_processor):
    patcher = ImagePatcher(image_processor)
    for seed, (width, height, mode) in enumerate(CASES):
        image = random_image(width, height, mode, seed)
        expected = image_processor(images=[image], return_tensors="pt")
        resized = patcher.resized(image)
        t, h, w = patcher.grid(resized)
        assert [[t, h, w]] == expected["image_grid_thw"].tolist(), (width, height, mode)
        patches = torch.empty(t * h * w, patcher.patch_dim, dtype=torch.uint8)
        patcher.write_patches(resized, patches.numpy())
        values = normalize_patches(patches, **patcher.normalize)
        assert values.dtype == torch.float32
        assert torch.equal(values, expected["pixel_values"]), (width, height, mode)


def test_to_device_normalises_loader_pixels(image_processor):
    """A batch's `to(device)` turns a loader batch's uint8 pixels into the processor's values."""
    patcher = ImagePatcher(image_processor)
    images = [random_image(120, 90, "RGB", 0), random_image(45, 200, "RGB", 1)]
    expected = image_processor(images=images, return_tensors="pt")["pixel_values"]
    resized = [patcher.resized(image) for image in images]
    parts = []
    for image in resized:
        _, h, w = patcher.grid(image)
        parts.append(np.empty((h * w, patcher.patch_dim), np.uint8))
        patcher.write_patches(image, parts[-1])
    images = Images(torch.from_numpy(np.concatenate(parts)), torch.tensor([[1, 8, 8], [1, 16, 4]]), patcher.normalize)
    out = images.to(torch.device("cpu"))
    assert out.normalize is None and torch.equal(out.pixel_values, expected)
    # Float pixel values (random data, the memory estimate) pass through unchanged.
    assert torch.equal(Images(expected, [[1, 8, 8]]).to(torch.device("cpu")).pixel_values, expected)


def test_unsupported_processor_settings_are_refused(image_processor):
    image_processor.do_normalize = False
    try:
        with pytest.raises(ValueError, match="do_normalize"):
            ImagePatcher(image_processor)
    finally:
        image_processor.do_normalize = True
