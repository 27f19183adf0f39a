"""The palette of the synthetic demos, and drawing one shape: what the image and the video demo share."""

from PIL import ImageDraw

COLORS = {
    "red": (220, 30, 30),
    "green": (30, 170, 40),
    "blue": (30, 60, 220),
    "yellow": (235, 215, 20),
    "purple": (140, 40, 180),
    "orange": (245, 130, 20),
}
SHAPES = ["circle", "square", "triangle"]
SIDES = ["left", "right"]
BACKGROUNDS = {"white": (245, 245, 245), "gray": (128, 128, 128), "black": (15, 15, 15)}


def draw_shape(draw: ImageDraw.ImageDraw, shape: str, box: tuple, fill: tuple) -> None:
    if shape == "circle":
        draw.ellipse(box, fill=fill)
    elif shape == "square":
        draw.rectangle(box, fill=fill)
    else:
        draw.polygon([((box[0] + box[2]) / 2, box[1]), (box[2], box[3]), (box[0], box[3])], fill=fill)
