"""Bad input: checks and repairs for images, text and conversations, and the counts of both.

A bad sample never crashes a stage and is never silent: it is skipped (or repaired where that is
safe), counted under a short reason, and logged (the first few of each reason). When the skipped
fraction exceeds `max_bad_fraction` the stage fails with the counts.
"""

import io
import json
import logging
import warnings
from collections import Counter
from pathlib import PurePosixPath

import numpy as np
from PIL import Image

logger = logging.getLogger(__name__)

# The text must not smuggle in tokens the encoder inserts itself.
RESERVED_MARKERS = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")
ROLE_NAMES = {"user": "user", "human": "user", "assistant": "assistant", "gpt": "assistant", "system": "system"}
LOGGED_PER_REASON = 5


class BadSample(Exception):
    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


class DataError(RuntimeError):
    """Input a stage cannot read at all (a truncated shard, a missing dataset); names the file."""


class TooMuchBadData(DataError):
    pass


class BadDataLog:
    """Counts of samples seen, skipped and repaired, by reason."""

    def __init__(self, stage: str, max_bad_fraction: float):
        self.stage = stage
        self.max_bad_fraction = max_bad_fraction
        self.seen = 0
        self.skipped = Counter()
        self.repaired = Counter()

    def skip(self, reason: str, where: str, detail: str = "") -> None:
        self.skipped[reason] += 1
        if self.skipped[reason] <= LOGGED_PER_REASON:
            logger.warning("%s: skipping %s (%s) %s", self.stage, where, reason, detail)

    def repair(self, reason: str, where: str) -> None:
        self.repaired[reason] += 1
        if self.repaired[reason] <= LOGGED_PER_REASON:
            logger.info("%s: repaired %s (%s)", self.stage, where, reason)

    @property
    def bad_fraction(self) -> float:
        return sum(self.skipped.values()) / max(self.seen, 1)

    def as_dict(self) -> dict:
        return {
            "seen": self.seen,
            "skipped": sum(self.skipped.values()),
            "skipped_by_reason": dict(sorted(self.skipped.items())),
            "repaired_by_reason": dict(sorted(self.repaired.items())),
            "bad_fraction": self.bad_fraction,
            "max_bad_fraction": self.max_bad_fraction,
        }

    def check(self) -> None:
        if self.bad_fraction > self.max_bad_fraction:
            reasons = ", ".join(f"{r}={n}" for r, n in self.skipped.most_common())
            raise TooMuchBadData(
                f"{self.stage}: {sum(self.skipped.values())} of {self.seen} samples were bad "
                f"({self.bad_fraction:.1%} > max_bad_fraction {self.max_bad_fraction:.1%}): {reasons}"
            )


def run_stage(stage, out, stage_logger: logging.Logger) -> dict | None:
    """The stats `stage()` returns, or None once the DataError it raised is logged (the CLI's exit 1)."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        return stage()
    except TooMuchBadData as e:
        stage_logger.error("%s (details in %s/stats.json)", e, out)
    except DataError as e:
        stage_logger.error("%s", e)
    return None


def safe_relative_path(name: str) -> str:
    """`name` normalised, or BadSample if it is absolute or climbs out of its directory."""
    path = PurePosixPath(name.replace("\\", "/"))
    if not name or path.is_absolute() or ".." in path.parts:
        raise BadSample("unsafe_path", repr(name))
    return str(path)


def decode_utf8(raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadSample("non_utf8_text", str(e)) from e


def load_json(raw: bytes):
    try:
        return json.loads(decode_utf8(raw))
    except json.JSONDecodeError as e:
        raise BadSample("malformed_json", str(e)) from e


def load_image(data: bytes) -> Image.Image:
    """The fully decoded image, or BadSample("corrupt_image") (a header alone can look valid)."""
    try:
        image = Image.open(io.BytesIO(data))
        image.load()
        return image
    except Exception as e:  # PIL raises many types for broken files
        raise BadSample("corrupt_image", f"{type(e).__name__}: {e}") from e


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
                image.load()
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


def normalise_messages(messages, num_images: int, num_videos: int = 0) -> tuple[list[dict], list[str]]:
    """LLaVA/OpenAI-style turns -> [{"role", "content"}] with one `<image>` tag per image and one
    `<video>` tag per video, and the repairs made.

    Samples whose images (videos) carry no tag at all get the tags prepended to the first user
    turn (the LLaVA convention); any other count mismatch is an error.
    """
    if not isinstance(messages, list) or not messages:
        raise BadSample("empty_conversation")
    out = []
    for turn in messages:
        if not isinstance(turn, dict):
            raise BadSample("malformed_conversation", f"turn is {type(turn).__name__}")
        role = ROLE_NAMES.get(turn.get("role", turn.get("from")))
        content = turn.get("content", turn.get("value"))
        if role is None or not isinstance(content, str):
            raise BadSample("malformed_conversation", f"turn {turn!r:.80}")
        if any(marker in content for marker in RESERVED_MARKERS):
            raise BadSample("special_token_in_text")
        out.append({"role": role, "content": content})
    if not any(m["role"] == "assistant" and m["content"].strip() for m in out):
        raise BadSample("no_assistant_turn")
    if not any(m["role"] == "user" for m in out):
        raise BadSample("malformed_conversation", "no user turn")

    repairs = []
    for kind, count in (("video", num_videos), ("image", num_images)):  # prepended: images first, then videos
        num_tags = sum(m["content"].count(f"<{kind}>") for m in out)
        if num_tags == count:
            continue
        if num_tags:
            raise BadSample(f"{kind}_tag_mismatch", f"{num_tags} <{kind}> tags, {count} {kind}s")
        first_user = next(m for m in out if m["role"] == "user")
        first_user["content"] = f"<{kind}>\n" * count + first_user["content"]
        repairs.append(f"added_{kind}_tags")
    return out, repairs
