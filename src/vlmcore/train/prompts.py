"""The prompts of an online-RL stage: a packed dataset of RL prompt samples
(vlmcore.data.prepare.prompts, then `vlmcore pack`) -> each step's prompts, encoded for generation.

Global prompt j is a fixed function of the dataset, the seed and j (an epoch is a seeded
permutation of all the prompts, `RowOrder` over them), so the stream is the same at any world
size and its position is one number: step k takes global prompts [k * P, (k + 1) * P) of P
prompts a step, and data-parallel rank r the ones whose offset in the step is r modulo the ranks.
A resumed stage continues the stream exactly.

Each prompt is encoded as generation takes it (vlmcore.generate.prompt: the chat template with
the generation prompt, the pack's images and clips through the model's processor settings). A
prompt that cannot be used (its media missing or not decoding, or over `max_prompt_tokens`) is
left out of its step and counted by reason (`prompt_over_budget`, `missing_image`, ...); the
step goes on with the others.
"""

import logging
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

from vlmcore.data.load.loader import packed_dataset_files
from vlmcore.data.load.order import RowOrder
from vlmcore.data.media.encoder import EncodingError, SampleEncoder
from vlmcore.data.media.image import load_image
from vlmcore.data.pack.format import Segment, pack_segments
from vlmcore.data.prepare.prompts import prompt_of
from vlmcore.data.quality import BadSample, DataError
from vlmcore.data.shards import IndexedShards, video_part_names
from vlmcore.generate.decode import Prompt
from vlmcore.generate.prompt import encode_turns

logger = logging.getLogger(__name__)


@dataclass
class RLPrompt:
    """One prompt of a step: what generation takes, and what the rewards compare its completions with."""

    key: str  # the prompt's sample key in the prepared dataset
    prompt: Prompt
    answer: str  # the reference answer
    reward_fields: dict  # the row's other fields (choices, a solution, a box...)
    position: int = 0  # its place in the stage's stream of prompts (`step_prompts`' j): its samples' seeds


class PromptSource:
    """Global prompt j of a packed prompt dataset -> an `RLPrompt` (module docstring)."""

    def __init__(self, packed_dir: str | Path, seed: int, max_prompt_tokens: int | None = None) -> None:
        model_dir, _ = packed_dataset_files(packed_dir)
        self.packed_dir = Path(packed_dir)
        self.encoder = SampleEncoder(model_dir)
        self.max_prompt_tokens = max_prompt_tokens
        self.packs = IndexedShards(packed_dir)
        # (pack, segment) of every prompt: each pack's json read once here
        self.prompts = []
        for pack in range(len(self.packs)):
            segments = pack_segments(self.packs.read(pack)["json"])
            for i, segment in enumerate(segments):
                if "answer" not in segment.get("sample", {}):
                    raise DataError(
                        f"{self.packed_dir}: pack {pack} segment {i} is not an RL prompt (no reference answer); "
                        f"prepare the stage's data as `--source prompts:PATH`"
                    )
                self.prompts.append((pack, i))
        if not self.prompts:
            raise DataError(f"{self.packed_dir}: no prompts")
        self.order = RowOrder([len(self.prompts)], seed)
        self.skipped = Counter()  # prompts left out, by reason, since the source was made

    def __len__(self) -> int:
        return len(self.prompts)

    def step_prompts(self, start: int, count: int, dp_rank: int, dp_world: int) -> list[RLPrompt]:
        """This rank's share of global prompts [start, start + count), the bad ones left out and counted."""
        out = []
        for j in range(start + dp_rank, start + count, dp_world):
            _, index = self.order[j]
            try:
                out.append(replace(self.encode(*self.prompts[index]), position=j))
            except (BadSample, EncodingError) as e:
                self.skipped[e.reason] += 1
                logger.warning("prompt %d (%s): left out, %s: %s", j, self.prompts[index], e.reason, e)
        return out

    def encode(self, pack: int, segment_index: int) -> RLPrompt:
        stored = self.packs.read(pack)
        try:
            segment = Segment.from_json(pack_segments(stored["json"])[segment_index])
            turns, answer, reward_fields = prompt_of(segment.sample)
        except (KeyError, TypeError) as e:
            raise BadSample("malformed_segment", f"{type(e).__name__}: {e}") from e
        missing = [name for name in segment.images if name not in stored]
        if missing:
            raise BadSample("missing_image", f"parts {missing}")
        images = [load_image(stored[name]) for name in segment.images]
        clips = []
        for video in segment.videos:
            names = video_part_names(video)
            if any(name not in stored for name in names):
                raise BadSample("missing_video", f"parts {[n for n in names if n not in stored][:3]}")
            clips.append((video, [stored[name] for name in names]))
        prompt = encode_turns(self.encoder, turns, images, clips, segment.max_frames)
        if self.max_prompt_tokens is not None and len(prompt.input_ids) > self.max_prompt_tokens:
            raise BadSample(
                "prompt_over_budget", f"{len(prompt.input_ids)} tokens > max_prompt_tokens {self.max_prompt_tokens}"
            )
        return RLPrompt(segment.key, prompt, answer, reward_fields)
