"""Images as the stages check them: decoded in full or by header, refused with a reason when they
are unusable (empty, corrupt, too large, too small, too narrow), repaired to 8-bit RGB when that is safe."""

import contextlib
import io
import warnings
from collections.abc import Iterator

import numpy as np
import torch
from PIL import Image, ImageFile

from vlmcore.data.quality import BadSample


def load_image(data: bytes) -> Image.Image:
    """The fully decoded image, or BadSample("corrupt_image") (a header alone can look valid)."""
    try:
        image = Image.open(io.BytesIO(data))
        load_every_pixel(image)
        return image
    except Exception as e:  # PIL raises many types for broken files
        raise BadSample("corrupt_image", f"{type(e).__name__}: {e}") from e


@contextlib.contextmanager
def _truncated_images_refused() -> Iterator[None]:
    """PIL's `ImageFile.LOAD_TRUNCATED_IMAGES` off while inside: it is a process-wide switch that
    other libraries turn on at import (lmms-eval's `api/task.py` does), after which a file cut short
    decodes with grey pixels instead of failing, and would be trained on as a good image."""
    before = ImageFile.LOAD_TRUNCATED_IMAGES
    ImageFile.LOAD_TRUNCATED_IMAGES = False
    try:
        yield
    finally:
        ImageFile.LOAD_TRUNCATED_IMAGES = before


def load_every_pixel(image: Image.Image) -> None:
    """Decodes all of `image`; a file cut short raises, whatever PIL's process-wide switch says."""
    with _truncated_images_refused():
        image.load()


def open_image(data: bytes, max_pixels: int, min_side: int = 2, decode: bool = True) -> Image.Image:
    """The image of encoded bytes, every pixel decoded unless `decode` is False (then its header
    alone is read: a file cut after it is not seen); BadSample with the reason if it is unusable."""
    if not data:
        raise BadSample("empty_image_file")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            width, height = image.size
            if width * height > max_pixels:
                raise BadSample("image_too_large", f"{width}x{height} > {max_pixels} pixels")
            if decode:
                load_every_pixel(image)
    except BadSample:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise BadSample("image_too_large", str(e)) from e
    except Exception as e:  # PIL raises many types for broken files
        raise BadSample("corrupt_image", f"{type(e).__name__}: {e}") from e
    if min(width, height) < min_side:
        raise BadSample("image_too_small", f"{width}x{height}")
    if max(width, height) / min(width, height) > 200:
        raise BadSample("bad_aspect_ratio", f"{width}x{height}")
    return image


def check_image(data: bytes, max_pixels: int, min_side: int = 2) -> tuple[bytes, str, tuple[int, int], str | None]:
    """Validate encoded image bytes; returns (bytes, extension, (width, height), repair reason or None).

    RGB JPEG/PNG files are kept as they are. CMYK, 16-bit, alpha, palette and grayscale images are
    converted to 8-bit RGB (alpha composited on white) and stored as PNG.
    """
    image = open_image(data, max_pixels, min_side)
    width, height = image.size

    if image.mode == "RGB" and image.format in ("JPEG", "PNG"):
        return data, "jpg" if image.format == "JPEG" else "png", (width, height), None
    rgb, reason = to_rgb(image)
    out = io.BytesIO()
    rgb.save(out, format="PNG")
    return out.getvalue(), "png", (width, height), reason


def to_rgb(image: Image.Image) -> tuple[Image.Image, str]:
    mode = image.mode
    if mode.startswith("I"):  # 16-bit files open as I;16* or I: scale, do not clip at 255
        array = np.asarray(image, dtype=np.float64)
        gray = Image.fromarray(np.clip(array / 65535.0 * 255.0 + 0.5, 0, 255).astype(np.uint8), mode="L")
        return gray.convert("RGB"), "16bit_to_8bit"
    if mode == "CMYK":
        return image.convert("RGB"), "cmyk_to_rgb"
    if mode == "P":
        has_alpha = "transparency" in image.info
        image = image.convert("RGBA" if has_alpha else "RGB")
        if not has_alpha:
            return image, "palette_to_rgb"
        mode = "RGBA"
    if mode in ("RGBA", "LA", "PA", "La", "RGBa"):
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB"), "alpha_on_white"
    return image.convert("RGB"), f"{mode.lower()}_to_rgb"


def normalize_patches(
    patches: torch.Tensor, rescale_factor: float, mean: list[float], std: list[float], temporal_patch_size: int
) -> torch.Tensor:
    """uint8 patches (N, C*P*P) -> the image processor's float32 `pixel_values` (N, C*T*P*P), bit for
    bit: its rescale (float64, then float32) is a 256-entry table, its normalisation the same float32
    ops, and each patch is repeated over the T temporal slots as the processor repeats an image."""
    table = (torch.arange(256, dtype=torch.float64) * rescale_factor).float().to(patches.device)
    n = patches.shape[0]
    channels = len(mean)
    values = table[patches.int()].view(n, channels, 1, -1)
    mean = torch.tensor(mean, dtype=torch.float32, device=patches.device).view(1, channels, 1, 1)
    std = torch.tensor(std, dtype=torch.float32, device=patches.device).view(1, channels, 1, 1)
    values = (values - mean) / std
    return values.expand(n, channels, temporal_patch_size, values.shape[-1]).reshape(n, -1)
