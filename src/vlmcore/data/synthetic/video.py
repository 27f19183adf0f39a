"""Synthetic video-text data for the video demo: coloured shapes that move, change colour or jump.

Every question needs more than one frame and the frames' order: the way a shape moves, which of
two colours comes first, how many times a shape jumps between two corners. The clips are real
MPEG-4 (part 2) mp4 files, made by FFmpeg's own encoder (the same seed gives the same bytes;
libx264 varies run to run on these tiny frames), 16 frames at 4 fps (4 s), so a video processor
sampling 2 frames a second takes 8 frames: 4 frame groups, each from one quarter of the clip.
Within a quarter nothing changes but a moving shape's place, or a jumping shape's corner at the
quarter's middle frame, between the group's two sampled frames (frames 0 2 | 4 6 | 9 11 | 13 15).

Layout written under `out_dir` (the image demo's, with videos):
  videos/*.mp4         train clips, then eval clips (separate files)
  captions.jsonl       {"id", "video", "caption"}                                  alignment data
  conversations.jsonl  {"id", "video", "messages"}          LLaVA style, `<video>` placeholders
  eval.jsonl           {"id", "kind", "video", "question", "choices", "answer"}    held-out multiple choice
  meta.json            counts and chance level per question kind
"""

import random
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw
from tqdm import tqdm

from vlmcore.data.media.video import encode_clip
from vlmcore.data.synthetic.dataset import write_dataset
from vlmcore.data.synthetic.shapes import BACKGROUNDS, COLORS, SHAPES, draw_shape

FRAMES, FPS, QUARTER = 16, 4, 4  # frames of a clip, its frame rate, frames of a quarter
DIRECTIONS = ["left", "right", "up", "down"]
COUNTS = ["one", "two", "three"]
TIMES = ["once", "twice", "three times"]
QUESTIONS = {
    "direction": ("Which way does the shape move?", DIRECTIONS),
    "order": ("Which color comes first?", list(COLORS)),
    "count": ("How many times does the shape jump?", COUNTS),
}
# The frame of a quarter at which a jumping shape lands in its other corner: the quarter's middle,
# so the sampled frame before it and the one after it fall in the same frame group (the model's
# temporal patch sees each jump). A jump between two groups would need the model to compare them,
# which the tiny demo model did not learn in the demo's steps (docs/video.md).
JUMP_FRAME = 2


def random_clip(rng: random.Random, kind: str, size: int) -> dict:
    """A clip's description: what the frames show and the answer to its question."""
    colors = rng.sample(list(COLORS), 3)
    shapes = [rng.choice(SHAPES) for _ in range(3)]
    clip = {"kind": kind, "size": size, "background": rng.choice(list(BACKGROUNDS))}
    if kind == "direction":
        clip.update(direction=rng.choice(DIRECTIONS), color=colors[0], shape=shapes[0])
    elif kind == "order":
        clip.update(colors=colors[:2], shape=shapes[0])  # one shape kind, two colours, one after the other
    else:
        # One shape jumps back and forth between two corners, once a quarter from the clip's start,
        # `count` times, then stays: where the jumping stops tells the count. Jumps in any `count` of
        # the quarters (the count a sum over the whole clip) were not learned in the demo's steps.
        count = rng.randint(1, 3)
        clip.update(
            count=COUNTS[count - 1],
            color=colors[0],
            shape=shapes[0],
            corners=rng.sample(range(4), 2),
            jump_quarters=list(range(count)),
        )
    return clip


def answer_of(clip: dict) -> str:
    return clip["colors"][0] if clip["kind"] == "order" else clip[clip["kind"]]  # the direction, or the count


def shapes_in_frame(clip: dict, frame: int) -> list[tuple[str, tuple, str]]:
    """(shape, box, colour) of what frame `frame` shows."""
    s = clip["size"]
    quarter = frame // QUARTER
    side = s * 0.4
    if clip["kind"] == "direction":
        # From one edge to the other, the shape's centre in a straight line at constant speed.
        travel = (s - side) * frame / (FRAMES - 1)
        along = {"right": travel, "left": s - side - travel, "down": travel, "up": s - side - travel}[clip["direction"]]
        middle = (s - side) / 2
        x, y = (along, middle) if clip["direction"] in ("left", "right") else (middle, along)
        return [(clip["shape"], (x, y, x + side, y + side), clip["color"])]
    if clip["kind"] == "order":
        x = (s - side) / 2
        return [(clip["shape"], (x, x, x + side, x + side), clip["colors"][quarter // 2])]
    jumps_so_far = sum(1 for q in clip["jump_quarters"] if frame >= q * QUARTER + JUMP_FRAME)
    corner = clip["corners"][jumps_so_far % 2]
    x = (corner % 2) * s / 2 + s * 0.05
    y = (corner // 2) * s / 2 + s * 0.05
    return [(clip["shape"], (x, y, x + side, y + side), clip["color"])]


def render_clip(clip: dict) -> bytes:
    """The clip as an mp4 file."""
    frames = []
    for frame in range(FRAMES):
        image = Image.new("RGB", (clip["size"], clip["size"]), BACKGROUNDS[clip["background"]])
        draw = ImageDraw.Draw(image)
        for shape, box, color in shapes_in_frame(clip, frame):
            draw_shape(draw, shape, box, COLORS[color])
        frames.append(np.asarray(image))
    return encode_clip(frames, FPS, codec="mpeg4")


def a(word: str) -> str:
    return f"{'an' if word[0] in 'aeiou' else 'a'} {word}"


def caption_for(clip: dict) -> str:
    if clip["kind"] == "direction":
        return f"{a(clip['color']).capitalize()} {clip['shape']} moves {clip['direction']}."
    if clip["kind"] == "order":
        return f"{a(clip['colors'][0]).capitalize()} {clip['shape']}, then {a(clip['colors'][1])} {clip['shape']}."
    times = TIMES[COUNTS.index(clip["count"])]
    return f"{a(clip['color']).capitalize()} {clip['shape']} jumps {times} between two corners."


def generate(
    out_dir: str | Path, num_train: int, num_eval: int, seed: int = 0, min_size: int = 64, max_size: int = 64
) -> dict:
    """Write the video demo dataset (see the module docstring); returns the contents of meta.json.
    Frames are square, of a side between min_size and max_size in steps of 32 (the demo model's
    merged patch)."""
    sizes = list(range(-(-min_size // 32) * 32, max_size + 1, 32))
    if not sizes:
        raise ValueError(
            f"no multiple of 32 between min_size {min_size} and max_size {max_size}: "
            f"video frames are sized in merged patches of 32 pixels"
        )
    out_dir = Path(out_dir)
    (out_dir / "videos").mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    kinds = list(QUESTIONS)

    def save(clip: dict, name: str) -> str:
        rel = f"videos/{name}.mp4"
        (out_dir / rel).write_bytes(render_clip(clip))
        return rel

    captions = []
    conversations = []
    for i in tqdm(range(num_train), desc="synth train", unit="clip"):
        clip = random_clip(rng, kinds[i % len(kinds)], rng.choice(sizes))
        video = save(clip, f"train_{i:06d}")
        captions.append({"id": f"cap_{i:06d}", "video": video, "caption": caption_for(clip)})
        question = QUESTIONS[clip["kind"]][0]
        conversations.append(
            {
                "id": f"conv_{i:06d}",
                "video": video,
                "messages": [
                    {"role": "user", "content": f"<video>\n{question}"},
                    {"role": "assistant", "content": answer_of(clip)},
                ],
            }
        )

    eval_rows = []
    for i in tqdm(range(num_eval), desc="synth eval", unit="clip"):
        clip = random_clip(rng, kinds[i % len(kinds)], rng.choice(sizes))
        question, choices = QUESTIONS[clip["kind"]]
        eval_rows.append(
            {
                "id": f"eval_{i:06d}",
                "kind": clip["kind"],
                "video": save(clip, f"eval_{i:06d}"),
                "question": question,
                "choices": choices,
                "answer": choices.index(answer_of(clip)),
            }
        )

    return write_dataset(
        out_dir,
        captions,
        conversations,
        eval_rows,
        QUESTIONS,
        {
            "seed": seed,
            "kind": "video",
            "num_train_videos": num_train,
            "num_eval": num_eval,
            "num_captions": len(captions),
            "num_conversations": len(conversations),
            "frame_sizes": sizes,
            "frames": FRAMES,
            "fps": FPS,
        },
    )
