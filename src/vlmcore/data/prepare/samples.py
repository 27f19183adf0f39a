"""One source row -> the sample a shard stores: the conversation normalised (roles, `<image>` and
`<video>` tags), its images checked (and repaired to RGB where safe), its videos probed; or a
plain text document. A row that cannot be used raises BadSample with the reason."""

from collections.abc import Callable

from vlmcore.data.media.image import check_image
from vlmcore.data.media.video import MIN_VIDEO_FRAMES, check_video
from vlmcore.data.prepare.sources import ImageFiles, image_bytes
from vlmcore.data.quality import BadDataLog, BadSample

DEFAULT_MAX_VIDEO_SECONDS = 3 * 3600
# The text must not smuggle in tokens the encoder inserts itself.
RESERVED_MARKERS = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")
ROLE_NAMES = {"user": "user", "human": "user", "assistant": "assistant", "gpt": "assistant", "system": "system"}


def normalise_messages(messages: object, num_images: int, num_videos: int = 0) -> tuple[list[dict], list[str]]:
    """LLaVA/OpenAI-style turns -> [{"role", "content"}] with one `<image>` tag per image and one
    `<video>` tag per video, and the repairs made.

    Samples whose images (videos) carry no tag at all get the tags prepended to the first user
    turn (the LLaVA convention); any other count mismatch is an error.
    """
    if not isinstance(messages, list) or not messages:
        raise BadSample("empty_conversation")
    out = [normalise_turn(turn) for turn in messages]
    if not any(m["role"] == "assistant" and m["content"].strip() for m in out):
        raise BadSample("no_assistant_turn")
    if not any(m["role"] == "user" for m in out):
        raise BadSample("malformed_conversation", "no user turn")
    repairs = []
    # Prepended one kind after the other: the images' tags end up first, then the videos'.
    for kind, count in (("video", num_videos), ("image", num_images)):
        if add_missing_tags(out, kind, count):
            repairs.append(f"added_{kind}_tags")
    return out, repairs


def normalise_turn(turn: object) -> dict:
    """One turn -> {"role", "content"} with the role's canonical name."""
    if not isinstance(turn, dict):
        raise BadSample("malformed_conversation", f"turn is {type(turn).__name__}")
    role = ROLE_NAMES.get(turn.get("role", turn.get("from")))
    content = turn.get("content", turn.get("value"))
    if role is None or not isinstance(content, str):
        raise BadSample("malformed_conversation", f"turn {turn!r:.80}")
    if any(marker in content for marker in RESERVED_MARKERS):
        raise BadSample("special_token_in_text")
    return {"role": role, "content": content}


def add_missing_tags(messages: list[dict], kind: str, count: int) -> bool:
    """Prepend `count` `<kind>` tags to the first user turn when the text has none; whether it did.
    Any other number of tags than `count` is a BadSample."""
    num_tags = sum(m["content"].count(f"<{kind}>") for m in messages)
    if num_tags == count:
        return False
    if num_tags:
        raise BadSample(f"{kind}_tag_mismatch", f"{num_tags} <{kind}> tags, {count} {kind}s")
    first_user = next(m for m in messages if m["role"] == "user")
    first_user["content"] = f"<{kind}>\n" * count + first_user["content"]
    return True


def row_refs(row: dict, kind: str, empty: tuple = (None,)) -> list:
    """The row's image (video) references: `images` (a list, or one), or `image` (one; a list
    there is one video clip's frames); values in `empty` left out."""
    refs = row.get(f"{kind}s")
    if refs is None:
        refs = [row[kind]] if row.get(kind) not in empty else []
    if not isinstance(refs, list):
        refs = [refs]
    return [ref for ref in refs if ref not in empty]


def video_entry(ref: object, row: dict, files: ImageFiles, max_pixels: int, max_seconds: float) -> tuple[list, dict]:
    """One video of a row -> ([(bytes, ext)], metadata): the file as it is, or a clip given as frames."""
    if not isinstance(ref, list):
        data = image_bytes(ref, files, "video")
        info = check_video(data, max_pixels, max_seconds)
        return [(data, info.container)], {"kind": "file", **info.as_dict()}
    frames = []
    for frame in ref:
        try:
            data, ext, size, _ = check_image(image_bytes(frame, files), max_pixels)
        except BadSample as e:
            raise BadSample("bad_video_frame", f"{e.reason}: {e.detail}") from e
        frames.append((data, ext, size))
    if len(frames) < MIN_VIDEO_FRAMES:
        raise BadSample("too_few_video_frames", f"{len(frames)} frames, a frame group takes {MIN_VIDEO_FRAMES}")
    sizes = {size for _, _, size in frames}
    if len(sizes) > 1:
        raise BadSample("bad_video_frame", f"frames of different sizes {sorted(sizes)}")
    fps = row.get("video_fps")
    if fps is not None and (not isinstance(fps, (int, float)) or fps <= 0):
        raise BadSample("malformed_row", f"video_fps {fps!r}")
    (width, height) = frames[0][2]
    meta = {"kind": "frames", "frames": len(frames), "fps": fps, "width": width, "height": height}
    if fps and len(frames) / fps > max_seconds:
        raise BadSample("video_too_long", f"{len(frames) / fps:.1f} s > {max_seconds} s")
    return [(data, ext) for data, ext, _ in frames], meta


def row_messages(row: dict, num_images: int, num_videos: int) -> list | None:
    """The row's turns as the source gives them (normalised later), or None for a text document."""
    if "messages" in row or "conversations" in row:
        return row.get("messages", row.get("conversations"))
    if "texts" in row:
        return finevision_turns(row["texts"])
    if "caption" in row:
        return caption_turns(row["caption"], num_images, num_videos)
    if "text" in row:
        return None
    raise BadSample("malformed_row", f"no text/caption/messages/conversations/texts field in keys {sorted(row)}")


def finevision_turns(texts: object) -> list[dict]:
    """FineVision's [{"user", "assistant"}] -> turns."""
    if not isinstance(texts, list):
        raise BadSample("malformed_conversation", "texts is not a list")
    messages = []
    for turn in texts:
        if not isinstance(turn, dict):
            raise BadSample("malformed_conversation", f"turn is {type(turn).__name__}")
        messages.append({"role": "user", "content": turn.get("user")})
        messages.append({"role": "assistant", "content": turn.get("assistant")})
    return messages


def caption_turns(caption: object, num_images: int, num_videos: int) -> list[dict]:
    """An image (video) caption as a conversation: the media tags, then the caption as the answer."""
    if not isinstance(caption, str) or not caption.strip():
        raise BadSample("empty_text", "empty caption")
    if not num_images and not num_videos:  # trained on, it would teach describing an image that is not there
        raise BadSample("missing_image", "a caption row needs an image or a video")
    return [
        {"role": "user", "content": "<video>" * num_videos + "<image>" * num_images},
        {"role": "assistant", "content": caption},
    ]


def text_document(row: dict, num_images: int, num_videos: int) -> dict:
    """A plain text document's sample; it carries no images or videos."""
    text = row["text"]
    if not isinstance(text, str) or not text.strip():
        raise BadSample("empty_text")
    if any(marker in text for marker in RESERVED_MARKERS):
        raise BadSample("special_token_in_text")
    if num_images:
        raise BadSample("image_tag_mismatch", "a text document cannot carry images")
    if num_videos:
        raise BadSample("video_tag_mismatch", "a text document cannot carry videos")
    return {"text": text}


def row_to_sample(
    row: object,
    files: ImageFiles,
    max_image_pixels: int,
    log: BadDataLog,
    where: str,
    max_video_seconds: float = DEFAULT_MAX_VIDEO_SECONDS,
) -> tuple[dict, list, list]:
    """One source row -> (sample json, [(image bytes, ext)], [([(video bytes, ext)], metadata)]); raises BadSample."""
    if not isinstance(row, dict):
        raise BadSample("malformed_row", f"row is {type(row).__name__}")
    refs = row_refs(row, "image")
    video_refs = video_refs_of(row)
    messages = row_messages(row, len(refs), len(video_refs))
    if messages is None:
        return text_document(row, len(refs), len(video_refs)), [], []

    def conversation(row: dict, num_images: int, num_videos: int) -> tuple[dict, list[str]]:
        normalised, repairs = normalise_messages(messages, num_images, num_videos)
        return {"messages": normalised}, repairs

    return sample_with_media(conversation, row, files, max_image_pixels, log, where, max_video_seconds)


# A row's stored sample, from the row and its counts of images and videos: (sample json, repairs made).
SampleOf = Callable[[dict, int, int], tuple[dict, list[str]]]


def sample_with_media(
    sample_of: SampleOf,
    row: dict,
    files: ImageFiles,
    max_image_pixels: int,
    log: BadDataLog,
    where: str,
    max_video_seconds: float = DEFAULT_MAX_VIDEO_SECONDS,
) -> tuple[dict, list, list]:
    """One row -> (sample json, [(image bytes, ext)], [([(video bytes, ext)], metadata)]): the sample
    `sample_of` makes of it (a conversation, a preference pair, an RL prompt), its images and videos
    checked (`row_media`), the repairs logged; raises BadSample."""
    sample, repairs = sample_of(row, len(row_refs(row, "image")), len(video_refs_of(row)))
    images, videos = row_media(row, files, max_image_pixels, log, where, max_video_seconds)
    for repair in repairs:
        log.repair(repair, where)
    return sample, images, videos


def row_media(
    row: dict, files: ImageFiles, max_image_pixels: int, log: BadDataLog, where: str, max_video_seconds: float
) -> tuple[list, list]:
    """The row's images ([(bytes, ext)], checked, repaired where safe) and videos ([([(bytes, ext)],
    metadata)]); raises BadSample."""
    videos = [video_entry(ref, row, files, max_image_pixels, max_video_seconds) for ref in video_refs_of(row)]
    images = []
    for ref in row_refs(row, "image"):
        data, ext, _, image_repair = check_image(image_bytes(ref, files), max_image_pixels)
        if image_repair:
            log.repair(image_repair, where)
        images.append((data, ext))
    return images, videos


def video_refs_of(row: dict) -> list:
    """The row's video references (an empty string or list is no video)."""
    return row_refs(row, "video", (None, "", []))
