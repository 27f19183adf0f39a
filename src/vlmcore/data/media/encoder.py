"""One sample -> model inputs, exactly as the snapshot's transformers processor does it.

A sample is the dict `vlmcore prepare` stores in each shard's `json` part: either a conversation
`{"messages": [{"role", "content"}, ...]}` (with `answer_from`, a preference pair's side: its
assistant turns from that index on are its answer, the only ones trained on) whose contents hold `<image>` and `<video>`
placeholders (one per image or video, in order), or a plain document `{"text": ...}`.

Conversations go through the snapshot's chat template (items rendered by the template, images as
`<|vision_start|><|image_pad|><|vision_end|>`, videos with `<|video_pad|>` inside the same
wrapper), each `<|image_pad|>` is expanded to the image's merged-patch count and each
`<|video_pad|>` to the clip's frame groups (`<t.t seconds>`, vision start, the group's video
tokens, vision end; the template's wrapper stays around them, as transformers' processor leaves
it), and the text is tokenized: the same steps and the same code as the transformers processor.
A video needs only its metadata here (`vlmcore.data.media.video.plan_video`). Labels cover the
assistant turns only. Their character spans come from the template itself: the text rendered up
to turn i with the generation prompt, and the text rendered through turn i, differ by exactly
that assistant turn.

Documents are tokenized as they are, followed by `<|endoftext|>`, and fully supervised.
"""

import dataclasses
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from PIL import Image
from transformers import AutoTokenizer
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

from vlmcore.data import IGNORE_INDEX
from vlmcore.data.media.processor import load_processor
from vlmcore.data.media.video import VideoPlan, VideoSettings, plan_video, video_prompt, with_video_settings

IMAGE_PLACEHOLDER = "<image>"
VIDEO_PLACEHOLDER = "<video>"


class EncodingError(ValueError):
    """A sample that cannot be encoded; `reason` is the short name it is counted under."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass
class TextEncoding:
    input_ids: list[int]
    labels: list[int]  # already shifted: labels[t] is the target of position t
    image_grid_thw: list[tuple[int, int, int]]
    video_grid_thw: list[tuple[int, int, int]] = field(default_factory=list)
    video_spans: list[tuple[int, int]] = field(default_factory=list)  # each video's tokens, its wrapper included

    @property
    def num_patches(self) -> int:
        return sum(t * h * w for t, h, w in self.image_grid_thw + self.video_grid_thw)


def to_chat_messages(messages: list[dict]) -> list[dict]:
    """LLaVA-style `<image>` and `<video>` placeholders -> transformers' structured content items."""
    out = []
    for message in messages:
        parts = re.split(f"({IMAGE_PLACEHOLDER}|{VIDEO_PLACEHOLDER})", message["content"])
        items = [{"type": "text", "text": parts[0]}] if parts[0] else []
        for tag, text in zip(parts[1::2], parts[2::2]):
            items.append({"type": "image" if tag == IMAGE_PLACEHOLDER else "video"})
            if text:
                items.append({"type": "text", "text": text})
        out.append({"role": message["role"], "content": items})
    return out


class SampleEncoder:
    """Encodes samples for the model snapshot in `model_dir`; text-only snapshots (no
    preprocessor_config.json) encode documents and image-free conversations."""

    def __init__(self, model_dir: str | Path, video: dict | None = None) -> None:
        """`video`: sampling settings that replace the snapshot's video processor's (`VIDEO_KEYS`)."""
        model_dir = Path(model_dir)
        self.processor = load_processor(model_dir) if (model_dir / "preprocessor_config.json").is_file() else None
        self.tokenizer = self.processor.tokenizer if self.processor else AutoTokenizer.from_pretrained(model_dir)
        if self.processor:
            image_processor = self.processor.image_processor
            self.patch_size = image_processor.patch_size
            self.merge_size = image_processor.merge_size
            self.min_pixels = image_processor.size["shortest_edge"]
            self.max_pixels = image_processor.size["longest_edge"]
            video_config = model_dir / "video_preprocessor_config.json"
            self.video = VideoSettings.from_processor_config(
                with_video_settings(json.loads(video_config.read_text()) if video_config.is_file() else {}, video or {})
            )
        self.image_token = self.processor.image_token if self.processor else "<|image_pad|>"
        self.vision_start_id = self.tokenizer.convert_tokens_to_ids("<|vision_start|>")
        self.vision_end_id = self.tokenizer.convert_tokens_to_ids("<|vision_end|>")
        self.end_of_text_id = self.tokenizer.convert_tokens_to_ids("<|endoftext|>")
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.end_of_text_id

    def image_grid(self, width: int, height: int) -> tuple[int, int, int]:
        """(t, h, w) in patches after the processor's smart resize; t is 1 for an image."""
        if self.processor is None:
            raise EncodingError("image_for_text_model", "the model has no image processor")
        factor = self.patch_size * self.merge_size
        try:
            h, w = smart_resize(height, width, factor=factor, min_pixels=self.min_pixels, max_pixels=self.max_pixels)
        except ValueError as e:
            raise EncodingError("bad_aspect_ratio", f"image {width}x{height}: {e}") from e
        return 1, h // self.patch_size, w // self.patch_size

    def render(self, conversations: list[list[dict]], add_generation_prompt: bool = False) -> list[str]:
        """The chat template applied to a batch of conversations in one call."""
        if not conversations:
            return []
        if self.processor is None:  # text templates expect string contents
            return self.tokenizer.apply_chat_template(
                conversations, tokenize=False, add_generation_prompt=add_generation_prompt
            )
        return self.processor.apply_chat_template(
            [to_chat_messages(m) for m in conversations], tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def video_plan(self, meta: dict, max_frames: int | None = None) -> VideoPlan:
        """What the video processor makes of a clip with metadata `meta` (at most `max_frames` frames)."""
        if self.processor is None:
            raise EncodingError("video_for_text_model", "the model has no video processor")
        if meta["frames"] < self.video.temporal_patch_size:
            raise EncodingError(
                "too_few_video_frames",
                f"{meta['frames']} frames, a frame group of this video processor takes {self.video.temporal_patch_size}",
            )
        settings = self.video if max_frames is None else dataclasses.replace(self.video, max_frames=max_frames)
        try:
            return plan_video(meta, settings)
        except ValueError as e:
            raise EncodingError("bad_aspect_ratio", f"video {meta['width']}x{meta['height']}: {e}") from e

    def expand_visual_tokens(self, text: str, grids: list[tuple[int, int, int]], videos: list[VideoPlan] = ()) -> str:
        """Each image token as the image's merged patches, each video token as the clip's frame groups."""
        merge = self.merge_size**2 if self.processor else 1
        tokens = {"video": "<|video_pad|>", "vision_start": "<|vision_start|>", "vision_end": "<|vision_end|>"}
        for token, items, expand, what in (
            (self.image_token, grids, lambda g: self.image_token * (g[0] * g[1] * g[2] // merge), "image"),
            (tokens["video"], videos, lambda v: video_prompt(v.grid, v.timestamps, self.merge_size, tokens), "video"),
        ):
            pieces = text.split(token)
            if len(pieces) - 1 > len(items):
                raise EncodingError(f"{what}_tag_mismatch", f"{len(pieces) - 1} {what} tokens but {len(items)} {what}s")
            text = pieces[0] + "".join(expand(item) + piece for item, piece in zip(items, pieces[1:]))
        return text

    def encode_text(
        self, sample: dict, image_sizes: list[tuple[int, int]], videos: list[dict] = (), max_frames: int | None = None
    ) -> TextEncoding:
        """Token ids and labels; images are only needed by size, (width, height) each, and videos
        by their metadata (`vlmcore prepare` keeps it in the sample's `videos`), each sampled at
        most `max_frames` frames if given."""
        grids = [self.image_grid(w, h) for w, h in image_sizes]
        plans = [self.video_plan(meta, max_frames) for meta in videos]
        if "text" in sample:
            if plans:
                raise EncodingError("video_tag_mismatch", "a text document cannot carry videos")
            if grids:
                raise EncodingError("image_tag_mismatch", "a text document cannot carry images")
            ids = self.tokenizer(sample["text"], add_special_tokens=False)["input_ids"] + [self.end_of_text_id]
            return TextEncoding(ids, ids[1:] + [IGNORE_INDEX], [])

        messages = sample["messages"]
        for what, placeholder, items in (("image", IMAGE_PLACEHOLDER, grids), ("video", VIDEO_PLACEHOLDER, plans)):
            num_tags = sum(m["content"].count(placeholder) for m in messages)
            if num_tags != len(items):
                raise EncodingError(f"{what}_tag_mismatch", f"{num_tags} <{what}> tags but {len(items)} {what}s")
        # Two template calls per sample: the whole conversation with the prefixes through each
        # assistant turn (the last one is the whole conversation when it ends it), and the
        # prefixes before each assistant turn with the generation prompt.
        # `answer_from` (a preference side): only the answer after the shared prompt is trained on.
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant" and i >= sample.get("answer_from", 0)]
        full, *throughs = self.render([messages] + [messages[: i + 1] for i in turns if i + 1 < len(messages)])
        throughs += [full] * (len(turns) - len(throughs))
        spans = []
        for before, through in zip(self.render([messages[:i] for i in turns], add_generation_prompt=True), throughs):
            if not (full.startswith(through) and through.startswith(before)):
                raise EncodingError(
                    "template_not_prefix_stable",
                    "the chat template renders earlier turns differently once later turns follow; "
                    "assistant tokens cannot be located from it",
                )
            # Train on the answer and its end-of-turn token, not the newline the template adds after it.
            start = len(self.expand_visual_tokens(before, grids, plans))
            end = len(self.expand_visual_tokens(through, grids, plans).rstrip())
            spans.append((start, end))
        if not spans:
            raise EncodingError("no_assistant_turn", "conversation has no assistant turn to train on")

        text = self.expand_visual_tokens(full, grids, plans)
        encoded = self.tokenizer(text, return_offsets_mapping=True)
        ids, offsets = encoded["input_ids"], encoded["offset_mapping"]
        supervised = [any(s <= start < e for s, e in spans) for start, _ in offsets]
        labels = [ids[t + 1] if supervised[t + 1] else IGNORE_INDEX for t in range(len(ids) - 1)] + [IGNORE_INDEX]
        return TextEncoding(ids, labels, grids, [p.grid for p in plans], self.video_spans(ids) if plans else [])

    def video_spans(self, ids: list[int]) -> list[tuple[int, int]]:
        """[start, end) of each video's tokens, its wrapper included: the template's vision start
        whose next token is not a vision token (a timestamp follows) up to the vision end after
        its last frame group."""
        spans = []
        start = None  # the current video's first token
        depth = 0  # vision wrappers open at this token
        for t, token in enumerate(ids):
            if token == self.vision_start_id:
                depth += 1
                if (
                    depth == 1
                    and t + 1 < len(ids)
                    and ids[t + 1] != self.vision_start_id
                    and self.tokenizer.convert_ids_to_tokens(ids[t + 1]) not in ("<|image_pad|>", "<|video_pad|>")
                ):
                    start = t
            elif token == self.vision_end_id:
                depth -= 1
                if depth == 0 and start is not None:
                    spans.append((start, t + 1))
                    start = None
        return spans

    def truncation_point(self, input_ids: list[int], max_len: int, video_spans: list[tuple[int, int]] = ()) -> int:
        """Largest cut <= max_len that does not split an image's tokens or a video's."""
        if len(input_ids) <= max_len:
            return len(input_ids)
        cut = max_len
        for t in range(max_len - 1, -1, -1):
            if input_ids[t] == self.vision_end_id:
                break
            if input_ids[t] == self.vision_start_id:
                cut = t
                break
        for start, end in video_spans:
            if start < cut < end:
                cut = start
        return cut

    def truncate(self, enc: TextEncoding, cut: int) -> TextEncoding:
        if cut >= len(enc.input_ids):
            return enc
        image_pad = self.tokenizer.convert_tokens_to_ids(self.image_token)
        kept_images = sum(1 for t in range(1, cut) if enc.input_ids[t] == image_pad != enc.input_ids[t - 1])
        kept_videos = sum(1 for _, end in enc.video_spans if end <= cut)
        labels = enc.labels[:cut]
        labels[-1] = IGNORE_INDEX  # its target was cut off
        return TextEncoding(
            enc.input_ids[:cut],
            labels,
            enc.image_grid_thw[:kept_images],
            enc.video_grid_thw[:kept_videos],
            enc.video_spans[:kept_videos],
        )

    def pixel_values(self, images: list[Image.Image]) -> tuple[torch.Tensor, torch.Tensor]:
        """The image processor's own pixel_values and grids of `images` (the reference the loader's patches equal)."""
        out = self.processor.image_processor(images=images, return_tensors="pt")
        return out["pixel_values"], out["image_grid_thw"]
