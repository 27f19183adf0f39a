"""The `iou` reward: the intersection over union of the box a completion names and the
reference box, in Qwen3-VL's grounding convention.

The convention: a box is `[x1, y1, x2, y2]`, the top-left and the bottom-right corners, with x
and y relative to the image on a 0..1000 scale whatever its size (x = 1000 * x_pixel / width),
as Qwen3-VL (and Qwen3.5) print them, usually as JSON: `[{"bbox_2d": [x1, y1, x2, y2], "label":
"cat"}]`. (Qwen2.5-VL printed absolute pixels of its resized input image instead: its boxes would
have to be rescaled first, which this reward does not do.)

The reference box is in the same 0..1000 frame, unless the sample gives `image_size: [width,
height]`: then it is in pixels of that image and is rescaled to 0..1000. IoU itself does not
depend on the frame as long as both boxes are in the same one.
"""

import re

from vlmcore.rewards.text import answer_span

GRID = 1000.0  # Qwen3-VL's coordinates run over 0..1000 on both axes
NUMBER = r"\s*(-?\d+(?:\.\d+)?)\s*"
FOUR_NUMBERS = r"\[" + ",".join([NUMBER] * 4) + r"\]"
BBOX_2D = re.compile(r'"bbox_2d"\s*:\s*' + FOUR_NUMBERS)
ANY_BOX = re.compile(FOUR_NUMBERS)

Box = tuple[float, float, float, float]


def parse_box(text: str) -> Box | None:
    """The last box of the text: the last `"bbox_2d": [...]` of a JSON answer if there is one,
    else the last list of four numbers `[x1, y1, x2, y2]`. None when there is none, or when it
    has no area (x2 <= x1 or y2 <= y1)."""
    found = BBOX_2D.findall(text) or ANY_BOX.findall(text)
    if not found:
        return None
    x1, y1, x2, y2 = (float(value) for value in found[-1])
    if x2 <= x1 or y2 <= y1:
        return None
    return x1, y1, x2, y2


def box_iou(a: Box, b: Box) -> float:
    """Intersection over union of two boxes with area, in one frame."""
    width = min(a[2], b[2]) - max(a[0], b[0])
    height = min(a[3], b[3]) - max(a[1], b[1])
    intersection = max(width, 0.0) * max(height, 0.0)
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - intersection
    return intersection / union


def reference_box(answer: str, sample: dict) -> Box | None:
    """The reference box in the 0..1000 frame (rescaled from pixels when the sample gives its
    image's `image_size`)."""
    box = parse_box(answer)
    size = sample.get("image_size")
    if box is None or size is None:
        return box
    width, height = (float(value) for value in size)
    return box[0] * GRID / width, box[1] * GRID / height, box[2] * GRID / width, box[3] * GRID / height


def iou(completion: str, answer: str, sample: dict) -> float:
    """The IoU (0..1) of the answer span's last box with the reference box; 0 when the span holds
    no box with area."""
    predicted = parse_box(answer_span(completion))
    expected = reference_box(answer, sample)
    if predicted is None or expected is None:
        return 0.0
    return box_iou(predicted, expected)
