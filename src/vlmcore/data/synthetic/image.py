"""Synthetic image-text data for the demo: one large coloured shape on a plain background.

Everything a tiny model needs to learn in a few hundred CPU steps: the colour, the kind and the
side of the shape. The generator is deterministic (same seed, byte-identical files), so the
workflow can regenerate it instead of shipping it.

Layout written under `out_dir`:
  images/*.png         train images, then eval images (separate files)
  captions.jsonl       {"id", "image", "caption"}                          alignment data
  conversations.jsonl  {"id", "images", "messages"}   LLaVA style, `<image>` placeholders
  eval.jsonl           {"id", "image", "question", "choices", "answer"}    held-out multiple choice
  preference.jsonl     {"id", "images", "prompt", "chosen", "rejected"}   DPO pairs on the train images
  preference_eval.jsonl  the same on the eval images, one pair per eval question (held out)
  prompts.jsonl        {"id", "kind", "image", "question", "answer", "choices"}  RL prompts on the train images
  prompts_eval.jsonl   the same on the eval images, one per eval question (held out)
  meta.json            counts and chance level per question kind

A preference pair asks one question about one image: the correct answer is chosen, a wrong one
drawn from the other choices rejected. Its draws come from their own random stream, so adding
the pairs left every other file as it was. An RL prompt asks one question about one image, its
reference answer the scene's word (a verifiable reward compares a completion with it); its
kinds come from a stream of their own too.
"""

import itertools
import random
from pathlib import Path

from PIL import Image, ImageDraw
from tqdm import tqdm

from vlmcore.data.synthetic.dataset import write_dataset, write_jsonl
from vlmcore.data.synthetic.shapes import BACKGROUNDS, COLORS, SHAPES, SIDES, draw_shape

QUESTIONS = {
    "color": ("What color is the shape?", list(COLORS)),
    "shape": ("What shape is in the image?", SHAPES),
    "side": ("Is the shape on the left or on the right?", SIDES),
}
CAPTION_TEMPLATES = [
    "A {color} {shape} on a {background} background.",
    "There is a {color} {shape} on the {side}.",
    "The image shows a {color} {shape}.",
    "A {background} picture with a {color} {shape} on the {side} side.",
]
TWO_IMAGE_QUESTION = "What color is the shape in the second image?"


def random_scene(rng: random.Random, min_size: int, max_size: int) -> dict:
    return {
        "width": rng.randint(min_size, max_size),
        "height": rng.randint(min_size, max_size),
        "color": rng.choice(list(COLORS)),
        "shape": rng.choice(SHAPES),
        "side": rng.choice(SIDES),
        "background": rng.choice(list(BACKGROUNDS)),
    }


def draw_scene(scene: dict) -> Image.Image:
    w, h = scene["width"], scene["height"]
    image = Image.new("RGB", (w, h), BACKGROUNDS[scene["background"]])
    draw = ImageDraw.Draw(image)
    # The shape fills most of its half of the image, so it stays visible after resizing.
    x0 = 0 if scene["side"] == "left" else w // 2
    draw_shape(draw, scene["shape"], (x0 + w * 0.04, h * 0.15, x0 + w * 0.46, h * 0.85), COLORS[scene["color"]])
    return image


def caption_for(scene: dict, rng: random.Random) -> str:
    return rng.choice(CAPTION_TEMPLATES).format(**scene)


def conversation_for(scenes: list[dict], rng: random.Random) -> list[dict]:
    if len(scenes) == 2:
        return [
            {"role": "user", "content": f"<image>\n<image>\n{TWO_IMAGE_QUESTION}"},
            {"role": "assistant", "content": scenes[1]["color"]},
        ]
    kinds = rng.sample(list(QUESTIONS), k=rng.randint(1, len(QUESTIONS)))
    messages = []
    for turn, kind in enumerate(kinds):
        question = QUESTIONS[kind][0]
        messages.append({"role": "user", "content": f"<image>\n{question}" if turn == 0 else question})
        messages.append({"role": "assistant", "content": scenes[0][kind]})
    return messages


def corpus_texts(seed: int = 0) -> list[str]:
    """Every kind of text the generator produces, for training the demo tokenizer."""
    rng = random.Random(seed)
    texts = [question for question, _ in QUESTIONS.values()] + [TWO_IMAGE_QUESTION]
    texts += [answer for _, answers in QUESTIONS.values() for answer in answers]
    texts += [caption_for(random_scene(rng, 32, 32), rng) for _ in range(200)]
    texts += [
        template.format(color=color, shape=shape, background=background, side=side)
        for template, color, shape, background, side in itertools.product(
            CAPTION_TEMPLATES, COLORS, SHAPES, BACKGROUNDS, SIDES
        )
    ]
    return texts


def generate(
    out_dir: str | Path, num_train: int, num_eval: int, seed: int = 0, min_size: int = 32, max_size: int = 112
) -> dict:
    """Write the demo dataset (see the module docstring); returns the contents of meta.json."""
    if min_size < 8 or max_size < min_size:
        raise ValueError(f"image sizes must satisfy 8 <= min_size <= max_size, got {min_size}, {max_size}")
    out_dir = Path(out_dir)
    (out_dir / "images").mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)

    def save(scene: dict, name: str) -> str:
        rel = f"images/{name}.png"
        draw_scene(scene).save(out_dir / rel, format="PNG")
        return rel

    train_scenes = []
    captions = []
    for i in tqdm(range(num_train), desc="synth train", unit="img"):
        scene = random_scene(rng, min_size, max_size)
        image = save(scene, f"train_{i:06d}")
        train_scenes.append((scene, image))
        captions.append({"id": f"cap_{i:06d}", "image": image, "caption": caption_for(scene, rng)})
    conversations = conversation_rows(train_scenes, rng)
    eval_rows = []
    eval_scenes = []
    kinds = list(QUESTIONS)
    for i in tqdm(range(num_eval), desc="synth eval", unit="img"):
        scene = random_scene(rng, min_size, max_size)
        kind = kinds[i % len(kinds)]
        question, choices = QUESTIONS[kind]
        image = save(scene, f"eval_{i:06d}")
        eval_scenes.append((scene, image))
        eval_rows.append(
            {
                "id": f"eval_{i:06d}",
                "kind": kind,
                "image": image,
                "question": question,
                "choices": choices,
                "answer": choices.index(scene[kind]),
            }
        )
    preference_rng = random.Random(f"preference-{seed}")
    train_kinds = [preference_rng.choice(kinds) for _ in train_scenes]
    preference = preference_rows(train_scenes, train_kinds, preference_rng, "pref")
    eval_kinds = [row["kind"] for row in eval_rows]
    preference_eval = preference_rows(eval_scenes, eval_kinds, preference_rng, "pref_eval")
    write_jsonl(out_dir / "preference.jsonl", preference)
    write_jsonl(out_dir / "preference_eval.jsonl", preference_eval)
    prompt_rng = random.Random(f"prompts-{seed}")
    prompts = prompt_rows(train_scenes, [prompt_rng.choice(kinds) for _ in train_scenes], "prompt")
    prompts_eval = prompt_rows(eval_scenes, eval_kinds, "prompt_eval")
    write_jsonl(out_dir / "prompts.jsonl", prompts)
    write_jsonl(out_dir / "prompts_eval.jsonl", prompts_eval)

    return write_dataset(
        out_dir,
        captions,
        conversations,
        eval_rows,
        QUESTIONS,
        {
            "seed": seed,
            "num_train_images": num_train,
            "num_eval": num_eval,
            "num_captions": len(captions),
            "num_conversations": len(conversations),
            "num_preference": len(preference),
            "num_preference_eval": len(preference_eval),
            "num_prompts": len(prompts),
            "num_prompts_eval": len(prompts_eval),
            "image_size_range": [min_size, max_size],
        },
    )


def conversation_rows(train_scenes: list[tuple[dict, str]], rng: random.Random) -> list[dict]:
    """One conversation per training image; every fifth pairs its image with another one."""
    conversations = []
    for i, (scene, image) in enumerate(train_scenes):
        scenes = [scene]
        images = [image]
        if i % 5 == 4 and len(train_scenes) > 1:
            other_scene, other_image = train_scenes[rng.randrange(len(train_scenes))]
            scenes.append(other_scene)
            images.append(other_image)
        conversations.append({"id": f"conv_{i:06d}", "images": images, "messages": conversation_for(scenes, rng)})
    return conversations


def preference_rows(scenes: list[tuple[dict, str]], kinds: list[str], rng: random.Random, prefix: str) -> list[dict]:
    """One preference pair per image, asking the question of its kind: the scene's answer chosen,
    one of the other choices rejected."""
    rows = []
    for i, ((scene, image), kind) in enumerate(zip(scenes, kinds, strict=True)):
        question, choices = QUESTIONS[kind]
        wrong = [choice for choice in choices if choice != scene[kind]]
        rows.append(
            {
                "id": f"{prefix}_{i:06d}",
                "kind": kind,
                "images": [image],
                "prompt": f"<image>\n{question}",
                "chosen": scene[kind],
                "rejected": rng.choice(wrong),
            }
        )
    return rows


def prompt_rows(scenes: list[tuple[dict, str]], kinds: list[str], prefix: str) -> list[dict]:
    """One RL prompt per image, asking the question of its kind, the scene's answer its reference
    (the choices kept for a multiple-choice reward)."""
    rows = []
    for i, ((scene, image), kind) in enumerate(zip(scenes, kinds, strict=True)):
        question, choices = QUESTIONS[kind]
        rows.append(
            {
                "id": f"{prefix}_{i:06d}",
                "kind": kind,
                "image": image,
                "question": f"<image>\n{question}",
                "answer": scene[kind],
                "choices": choices,
            }
        )
    return rows
