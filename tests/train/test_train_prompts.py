"""An RL stage's prompts (vlmcore.train.prompts) from a packed prompt dataset: each prompt encoded
as the training data encodes the same conversation's prompt (tokens and pixels), the stream the
same at any world size and resumable by its position, bad prompts left out and counted, and the
prompts generated from by the native model."""

from collections import Counter

import pytest
from helpers import packed_prompt_dataset

from vlmcore.data import IGNORE_INDEX
from vlmcore.data.media.image import load_image
from vlmcore.data.pack.format import Segment, pack_segments
from vlmcore.generate import SamplingSettings, generate
from vlmcore.models import from_pretrained
from vlmcore.train.prompts import PromptSource


@pytest.fixture(scope="module")
def packed_prompts(tmp_path_factory):
    packed, model = packed_prompt_dataset(tmp_path_factory.mktemp("rl_prompt_source"))
    return packed.parent, model


def test_prompts_are_encoded_as_training_encodes_their_conversation(packed_prompts):
    root, _ = packed_prompts
    source = PromptSource(root / "packed", seed=0)
    assert len(source) == 8
    prompts = source.step_prompts(0, len(source), dp_rank=0, dp_world=1)
    assert {p.answer for p in prompts} == {*map(str, range(6)), "a square", "long"}
    encoder = source.encoder
    for pack_index, segment_index in source.prompts:
        rl_prompt = source.encode(pack_index, segment_index)
        stored = source.packs.read(pack_index)
        segment = Segment.from_json(pack_segments(stored["json"])[segment_index])
        training = encoder.encode_text(segment.sample, segment.image_sizes, segment.videos, segment.max_frames)
        # The training row's prompt: every token up to the first one its labels predict.
        first_label = next(t for t, label in enumerate(training.labels) if label != IGNORE_INDEX)
        assert rl_prompt.prompt.input_ids.tolist() == training.input_ids[: first_label + 1]
        if segment.images:
            pixels, grids = encoder.pixel_values([load_image(stored[name]) for name in segment.images])
            assert (rl_prompt.prompt.pixel_values == pixels).all()
            assert rl_prompt.prompt.image_grid_thw.tolist() == grids.tolist()
        if segment.videos:
            assert rl_prompt.prompt.video_grid_thw is not None and rl_prompt.prompt.pixel_values_videos.shape[0] > 0


def test_the_stream_is_the_same_at_any_world_size_and_resumes_at_its_position(packed_prompts):
    root, _ = packed_prompts
    source = PromptSource(root / "packed", seed=3)
    whole = [p.key for p in source.step_prompts(2, 5, dp_rank=0, dp_world=1)]
    shares = [[p.key for p in source.step_prompts(2, 5, dp_rank=r, dp_world=2)] for r in (0, 1)]
    assert sorted(shares[0] + shares[1]) == sorted(whole) and shares[0] == whole[0::2]
    resumed = PromptSource(root / "packed", seed=3)  # a restarted stage: the position is all it needs
    assert [p.key for p in resumed.step_prompts(2, 5, dp_rank=0, dp_world=1)] == whole
    # Past the end of an epoch: the next epoch's permutation, every prompt once per epoch.
    epoch_two = [p.key for p in source.step_prompts(len(source), len(source), dp_rank=0, dp_world=1)]
    assert sorted(epoch_two) == sorted(p.key for p in source.step_prompts(0, len(source), 0, 1))
    assert PromptSource(root / "packed", seed=4).step_prompts(2, 5, 0, 1) != whole


def test_prompts_over_the_budget_are_left_out_and_counted_and_the_rest_generate(packed_prompts):
    root, model_dir = packed_prompts
    lengths = {
        p.answer: len(p.prompt.input_ids) for p in PromptSource(root / "packed", seed=0).step_prompts(0, 8, 0, 1)
    }
    budget = lengths.pop("long") - 1
    assert max(lengths.values()) <= budget
    source = PromptSource(root / "packed", seed=0, max_prompt_tokens=budget)
    prompts = source.step_prompts(0, len(source), dp_rank=0, dp_world=1)
    assert "long" not in {p.answer for p in prompts} and len(prompts) == 7
    assert source.skipped == Counter({"prompt_over_budget": 1})
    model = from_pretrained(model_dir).eval()
    image_prompts = [p.prompt for p in prompts if p.prompt.pixel_values is not None][:2]
    samples = generate(model, image_prompts, SamplingSettings(max_new_tokens=4, temperature=1.0, n=2, seed=0))
    assert [s.prompt_index for s in samples] == [0, 0, 1, 1]
    assert all(1 <= len(s.tokens) <= 4 and len(s.log_probs) == len(s.tokens) for s in samples)
