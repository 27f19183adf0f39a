"""A conversation's turns and media -> the `Prompt` generation takes: the chat template with the
generation prompt, the media tokens laid out by the model's processor settings, the images'
normalised patches and the videos' sampled frames, all as the training data is encoded
(vlmcore.data.media), so that a prompt's tokens are those of a training segment's prompt."""

import torch
from PIL import Image

from vlmcore.data.media.encoder import SampleEncoder
from vlmcore.data.media.video import clip_patches, normalize_video_patches

from .decode import Prompt


def encode_turns(
    encoder: SampleEncoder,
    turns: list[dict],
    images: list[Image.Image],
    clips: list[tuple[dict, list[bytes]]],
    max_frames: int | None = None,
) -> Prompt:
    """`turns` ({"role", "content"} with `<image>` / `<video>` tags, the last a user turn) and their
    `images` and `clips` ((metadata as `vlmcore prepare` records it, the clip's parts' bytes)), in
    tag order, as one prompt; each clip sampled at most `max_frames` frames (None: the processor's)."""
    rendered = encoder.render([turns], add_generation_prompt=True)[0]
    prompt = Prompt(input_ids=torch.empty(0, dtype=torch.long))
    grids, plans = [], []
    if images:
        prompt.pixel_values, prompt.image_grid_thw = encoder.pixel_values(images)
        grids = [tuple(g) for g in prompt.image_grid_thw.tolist()]
    video_patches, video_grids = [], []
    for meta, parts in clips:
        plan = encoder.video_plan(meta, max_frames)
        patches, grid = clip_patches(meta, parts, plan, encoder.video)
        video_patches.append(normalize_video_patches(patches, encoder.video.image_mean, encoder.video.image_std))
        video_grids.append(grid)
        plans.append(plan)
    if clips:
        prompt.pixel_values_videos = torch.cat(video_patches)
        prompt.video_grid_thw = torch.tensor(video_grids)
    ids = encoder.tokenizer(encoder.expand_visual_tokens(rendered, grids, plans), add_special_tokens=False)["input_ids"]
    prompt.input_ids = torch.tensor(ids, dtype=torch.long)
    return prompt
