"""`vlmcore-vlm`: the lm-eval model for exported vision-language models.

Why not lm-eval's own `hf-multimodal`: in lm-eval 0.4.13 it refuses `loglikelihood` requests
that carry images (NotImplementedError, "not yet tested"), so it cannot score multiple-choice
VQA; its unfinished code path behind that error extends neither Qwen-VL's `mm_token_type_ids`
over the answer tokens nor passes an attention mask for padded rows. This class subclasses it
and implements that missing piece, checked against a direct transformers forward. Generation with
images or videos (MMMU, ChartQA, DocVQA, MMBench, Video-MME, MVBench) is ours too: lm-eval's
multimodal generation takes no videos, and runs a full `gc.collect()` after every batch (about
1.4 s each in an evaluation process on a CPU, more than the tiny model's decoding of the batch:
benchmarks/eval_throughput.py). Rows are encoded one by one and decoded in batches of the batch
size by vlmcore's native decoder (`vlmcore.generate`, KV cache) on the native model loaded from
the same snapshot, loaded on the first generation request: the task's `until` list (with the
tokenizer's end-of-text) becomes the stop strings, `max_gen_toks` the token budget, greedy unless
the task asks for sampling (`native_settings`; a generation setting the decoder has not is
refused by name). The model argument `generator=transformers` decodes with transformers'
`generate` on the exported model instead, left-padded batches with lm-eval's stopping criteria,
the image and video placeholder tokens suppressed as the native decoder blocks them: the reference
the native answers are tested equal to. Either way each answer is decoded without
special tokens and cut at the stop sequences as lm-eval cuts them. Text-only requests (mmlu, arc,
hellaswag) stay lm-eval's code.

Requests with images are always put in the chat form the model was trained on: the context
(with `<image>` placeholders) becomes the user turn of the model's chat template and the answer
is the assistant's turn. A multiple-choice score is the summed log-probability of the answer
tokens. Text-only requests follow lm-eval's `--apply_chat_template` setting as usual.

Videos: a task's `doc_to_image` may return `VideoClip`s among its visuals (`<video>` marks their
place). transformers' video processor needs torchvision, which the project does not, so clips are
sampled, resized and laid out by vlmcore's own video code (vlmcore.data.media.video, tested equal to
the processor) and the row is encoded as the training data is (`SampleEncoder`), for scoring and
for generation alike. A row's tokens need only each clip's plan (from its container headers); the
pixels are decoded per batch, by `video_workers` processes ahead of the model when set
(vlmcore/eval/video_decode.py), the batches being the same either way.

A video that does not decode (not a video, cut short, no video stream: vlmcore.data.media.video's
BadSample reasons) does not stop the evaluation: the question is recorded in `UNDECODABLE_VIDEOS`
(the runner reports them by task and reason) and answered as by a model that gives no answer. A
generated answer is empty, and the benchmark's own rule for an empty answer scores it: wrong in
Video-MME (the question stays in the denominator), left out of both counts in MVBench (as
lmms-eval's MVBench scoring leaves out an empty answer). lmms-eval's video models that catch a clip
that cannot load (llava_vid, oryx) do the same in spirit: they answer a fixed "can not load" text
that the task then scores. A multiple-choice question gets log-probability -inf for every choice,
and lm-eval then takes the first choice.
"""

import copy
import functools
import json
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from lm_eval.api.instance import Instance
from lm_eval.api.registry import register_model
from lm_eval.models.hf_vlms import DEFAULT_IMAGE_PLACEHOLDER, HFMultimodalLM
from lm_eval.models.utils import handle_stop_sequences
from tqdm import tqdm
from transformers import PreTrainedModel, ProcessorMixin

from vlmcore.data.media.encoder import VIDEO_PLACEHOLDER, SampleEncoder, to_chat_messages
from vlmcore.data.media.processor import load_processor
from vlmcore.data.media.video import probe
from vlmcore.data.quality import BadSample
from vlmcore.eval.video_decode import ClipJob, ClipPixels, VideoClip
from vlmcore.generate import Prompt, SamplingSettings, generate

# How `vlmcore eval` generates free-form answers: vlmcore's decoder on the native model, or
# transformers' `generate` on the exported model (the reference).
GENERATORS = ("vlmcore", "transformers")
# The generation settings of an lm-eval task (`generation_kwargs`) the native decoder takes,
# beside `until` and `max_gen_toks`.
NATIVE_GEN_KWARGS = ("do_sample", "temperature", "top_p", "top_k")


def user_turn(context: str, num_images: int, num_videos: int = 0) -> list[dict]:
    """The chat message of a context, built like the training data: images and videos where
    `<image>` and `<video>` stand, or all before the text when the context has no placeholder."""
    for tag, count in ((VIDEO_PLACEHOLDER, num_videos), (DEFAULT_IMAGE_PLACEHOLDER, num_images)):
        if tag not in context:
            context = tag * count + context
        if context.count(tag) != count:
            raise ValueError(
                f"context has {context.count(tag)} {tag} placeholders but the request has "
                f"{count} {'videos' if tag == VIDEO_PLACEHOLDER else 'images'}: {context!r}"
            )
    return to_chat_messages([{"role": "user", "content": context}])


VISUAL_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")
# An encoded row keeps its visual inputs and its videos' decoding jobs (their pixels join per batch).
ROW_VISUAL_KEYS = (*VISUAL_KEYS, "videos")

# The questions whose video did not decode in this process: (task, doc_id) -> {task, doc_id, video,
# reason, detail}. lm-eval builds the model object itself, so the runner reads them here (it
# empties this before a run).
UNDECODABLE_VIDEOS: dict[tuple[str, int], dict] = {}


def split_visuals(aux: dict) -> tuple[list, list[VideoClip]]:
    """A request's images and its videos."""
    visuals = aux.get("visual") or []
    images = [v for v in visuals if not isinstance(v, VideoClip)]
    videos = [v for v in visuals if isinstance(v, VideoClip)]
    return images, videos


def record_undecodable(request: Instance, videos: list[VideoClip], error: BadSample) -> None:
    """Notes a question whose video did not decode (once per question: its choices ask again)."""
    UNDECODABLE_VIDEOS[(request.task_name, request.doc_id)] = {
        "task": request.task_name,
        "doc_id": request.doc_id,
        "video": ", ".join(video.member or video.path for video in videos),
        "reason": error.reason,
        "detail": error.detail,
    }


@register_model("vlmcore-vlm")
class VisionLanguageLM(HFMultimodalLM):
    def __init__(
        self, pretrained: str | PreTrainedModel, video_workers: int = 0, generator: str = "vlmcore", **kwargs: Any
    ) -> None:
        # Processes that decode the video clips ahead of the model (0: this process decodes them).
        self.video_workers = int(video_workers)
        if self.video_workers < 0:
            raise ValueError(f"video_workers: {video_workers}; must be 0 (decode in this process) or more")
        if generator not in GENERATORS:
            raise ValueError(f"generator: {generator!r}; must be one of {', '.join(GENERATORS)}")
        self.generator = generator
        # A clip's metadata and plan, probed once (a multiple-choice question asks once per choice).
        self.clip_jobs: dict[VideoClip, ClipJob] = {}
        super().__init__(pretrained, **kwargs)

    def _create_tokenizer(
        self,
        pretrained: str | PreTrainedModel,
        tokenizer: str | ProcessorMixin | None,
        revision: str | None = "main",
        trust_remote_code: bool | None = False,
        **kwargs: Any,
    ) -> None:
        # The processor is built without torchvision when it is missing (videos unsupported then).
        self.processor = load_processor(pretrained if isinstance(pretrained, str) else self.model.name_or_path)
        self.tokenizer = self.processor.tokenizer

    def loglikelihood(self, requests: list[Instance], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        if requests and len(requests[0].args) < 3:
            return super().loglikelihood(requests, disable_tqdm=disable_tqdm)
        rows = [self.encode_row_or_none(request) for request in requests]
        # A question whose video does not decode keeps this: no choice is likelier than another.
        results = [(float("-inf"), False)] * len(rows)
        # Longest first, so every batch pads to its first row and memory peaks at the start.
        encoded = [i for i, row in enumerate(rows) if row is not None]
        order = sorted(encoded, key=lambda i: -len(rows[i]["input_ids"]))
        progress = tqdm(total=len(order), disable=disable_tqdm, desc="vlmcore-vlm loglikelihood")
        with self.clip_decoder(rows, order) as pixels:
            for batch in self.batches_with_pixels(requests, rows, order, pixels):
                indices = [i for i, _ in batch]
                for i, result in zip(indices, self.score_batch([row for _, row in batch])):
                    results[i] = result
                    self.cache_hook.add_partial("loglikelihood", requests[i].args[:2], result)
                progress.update(len(batch))
        progress.close()
        return results

    def clip_decoder(self, rows: list[dict | None], order: list[int]) -> ClipPixels:
        """The decoder of the rows' videos, in the order the batches of `order` will ask for them."""
        jobs = [job for i in order for job in rows[i].get("videos", ())]
        settings = self.sample_encoder.video if jobs else None
        # Two batches ahead: the workers decode the next batch's clips while the model runs this one.
        ahead = 2 * max(int(self.batch_size), self.video_workers)
        return ClipPixels(jobs, settings, self.video_workers, ahead)

    def batches_with_pixels(
        self, requests: list[Instance], rows: list[dict | None], order: list[int], pixels: ClipPixels
    ) -> Iterator[list[tuple[int, dict]]]:
        """(index, row) batches of the batch size, the rows at `order` taken in turn with their
        videos' pixels. A row whose video does not decode is recorded and left out, so the batches
        are those of the rows that decode, as if it had never been encoded."""
        batch_size = int(self.batch_size)
        batch = []
        for i in order:
            try:
                batch.append((i, self.with_pixels(rows[i], pixels)))
            except BadSample as error:
                record_undecodable(requests[i], [job.clip for job in rows[i]["videos"]], error)
                continue
            if len(batch) == batch_size:
                yield batch
                batch = []
        if batch:
            yield batch

    @staticmethod
    def with_pixels(row: dict, pixels: ClipPixels) -> dict:
        """The row with its videos' pixel_values_videos; raises the BadSample of a clip that does not decode."""
        if not row.get("videos"):
            return row
        decoded = []
        failure = None
        for job in row["videos"]:
            try:
                decoded.append(pixels.take(job))
            except BadSample as error:  # the other clips are still taken: each is kept until its last use
                failure = failure or error
        if failure is not None:
            raise failure
        return {**row, "pixel_values_videos": torch.cat(decoded)}

    def encode_row_or_none(self, request: Instance) -> dict | None:
        """`encode_row` of a request; None (recorded) when its video does not decode."""
        try:
            return self.encode_row(*request.args)
        except BadSample as error:
            _, videos = split_visuals(request.args[2])
            if not videos:
                raise
            record_undecodable(request, videos, error)
            return None

    def chat_prompt(self, context: str, num_images: int, num_videos: int = 0) -> str:
        """The context as a chat-templated user turn, unless lm-eval has applied the template already."""
        if self.chat_applied:
            return context
        return self.processor.apply_chat_template(
            user_turn(context, num_images, num_videos), add_generation_prompt=True, tokenize=False
        )

    def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
        """Answers of requests with images or videos, in batches of the model's batch size: longest
        prompt first within each set of generation settings (lm-eval's order), each batch decoded by
        `generate_batch`. Text-only requests are lm-eval's."""
        if requests and len(requests[0].args) < 3:
            return super().generate_until(requests, disable_tqdm=disable_tqdm)
        rows = [self.generation_row_or_none(request) for request in requests]
        answers = [""] * len(requests)  # a question whose video did not decode answers nothing
        groups = {}
        for index, row in enumerate(rows):
            if row is not None:
                settings = json.dumps(requests[index].args[1], sort_keys=True, default=str)
                groups.setdefault(settings, []).append(index)
        for indices in groups.values():
            indices.sort(key=lambda i: -len(rows[i]["input_ids"]))
        order = [i for indices in groups.values() for i in indices]
        if self.generator == "vlmcore":  # a setting the native decoder has not is refused before any work
            for indices in groups.values():
                native_settings(*self.split_gen_kwargs(requests[indices[0]].args[1]))
        progress = tqdm(total=len(requests), disable=disable_tqdm, desc="vlmcore-vlm generate")
        progress.update(rows.count(None))
        with self.clip_decoder(rows, order) as pixels:
            for indices in groups.values():
                for batch in self.batches_with_pixels(requests, rows, indices, pixels):
                    gen_kwargs = requests[batch[0][0]].args[1]
                    texts = self.generate_batch([row for _, row in batch], gen_kwargs)
                    for (i, _), text in zip(batch, texts):
                        answers[i] = text
                        self.cache_hook.add_partial("generate_until", (rows[i]["prompt"], gen_kwargs), text)
                    progress.update(len(batch))
        progress.close()
        return answers

    def generation_row_or_none(self, request: Instance) -> dict | None:
        """The encoded chat prompt of a generation request; None (recorded) when its video does not decode."""
        context, _, aux = request.args
        images, videos = split_visuals(aux)
        prompt = self.chat_prompt(context, len(images), len(videos))
        try:
            encoding = self.encode_prompt(prompt, images, videos)
        except BadSample as error:
            if not videos:
                raise
            record_undecodable(request, videos, error)
            return None
        input_ids = encoding["input_ids"][0].tolist()
        row = {key: value for key, value in encoding.items() if key in ROW_VISUAL_KEYS}
        row.update(prompt=prompt, input_ids=input_ids, attention_mask=[1] * len(input_ids))
        if "mm_token_type_ids" in encoding:
            row["mm_token_type_ids"] = encoding["mm_token_type_ids"][0].tolist()
        return row

    def generate_batch(self, rows: list[dict], gen_kwargs: dict) -> list[str]:
        """The answers of a batch of encoded prompts, by the `generator` of the model arguments,
        each decoded without special tokens and cut at the stop sequences as lm-eval cuts them."""
        kwargs, until, max_gen_toks = self.split_gen_kwargs(gen_kwargs)
        if self.generator == "vlmcore":
            settings = native_settings(kwargs, until, max_gen_toks)
            if not settings.greedy:  # each batch its own draws, from the generator lm-eval seeds
                settings.seed = int(torch.randint(0, 2**31 - 1, ()))
            answers = self.native_generate(rows, settings)
        else:
            answers = self.transformers_generate(rows, kwargs, until, max_gen_toks)
        return [cut_at_stops(self.tok_decode(tokens), until) for tokens in answers]

    def split_gen_kwargs(self, gen_kwargs: dict) -> tuple[dict, list[str], int]:
        """A task's generation settings -> (the others, its stop sequences with the tokenizer's
        end-of-text, its token budget), as lm-eval reads them."""
        kwargs = copy.deepcopy(gen_kwargs)
        until = handle_stop_sequences(
            kwargs.pop("until", None), eos=self.tok_decode(self.eot_token_id, skip_special_tokens=False)
        )
        return kwargs, until, kwargs.pop("max_gen_toks", self.max_gen_toks)

    @torch.no_grad()
    def native_generate(self, rows: list[dict], settings: SamplingSettings) -> list[list[int]]:
        """The generated tokens of each row, by vlmcore.generate on the native model: the rows'
        prompts packed into one prefill, each row leaving the batch at its stop."""
        dtype = self.native_model.lm_head.weight.dtype
        prompts = []
        for row in rows:
            media = {key: row[key] for key in VISUAL_KEYS if key in row}
            for key in ("pixel_values", "pixel_values_videos"):
                if key in media:
                    media[key] = media[key].to(dtype)
            prompts.append(Prompt(torch.tensor(row["input_ids"]), **media))
        samples = generate(self.native_model, prompts, settings, tokenizer=self.tokenizer)
        return [sample.tokens for sample in samples]

    @torch.no_grad()
    def transformers_generate(
        self, rows: list[dict], kwargs: dict, until: list[str], max_gen_toks: int
    ) -> list[list[int]]:
        """The generated tokens of each row, by transformers' `generate` on the exported model: the
        rows left-padded into one batch, with lm-eval's stopping criteria."""
        inputs = self.left_padded_inputs(rows)
        context_length = inputs["input_ids"].shape[1]
        # The image and video placeholders are never generated, as by the native decoder (which
        # would take a generated one for a picture's place): a placeholder is no answer.
        config = self.model.config
        placeholders = [getattr(config, name, None) for name in ("image_token_id", "video_token_id")]
        kwargs.setdefault("suppress_tokens", [token for token in placeholders if token is not None])
        output = self._model_multimodal_generate(inputs, max_length=context_length + max_gen_toks, stop=until, **kwargs)
        return output[:, context_length:].tolist()

    @functools.cached_property
    def native_model(self) -> torch.nn.Module:
        """vlmcore's model of the snapshot the exported model was loaded from, in its dtype and on its
        device, with its generation config (so the same end-of-text tokens stop both generators)."""
        from vlmcore.models import from_pretrained

        model = from_pretrained(self.model.name_or_path, dtype=self.model.dtype, device=self.device)
        model.generation_config = self.model.generation_config
        return model.eval()

    @functools.cached_property
    def sample_encoder(self) -> SampleEncoder:
        return SampleEncoder(self.model.name_or_path)

    def encode_prompt(self, prompt: str, images: list, videos: list[VideoClip]) -> dict:
        """The processor's outputs for one templated prompt (videos encoded as the training data is,
        their pixels left to the batches: `videos` holds their decoding jobs)."""
        if videos:
            return self.encode_with_videos(prompt, images, videos)
        return self.processor(text=[prompt], images=images or None, return_tensors="pt")

    def encode_row(self, context: str, continuation: str, aux: dict) -> dict:
        images, videos = split_visuals(aux)
        context = self.chat_prompt(context, len(images), len(videos))
        encoding = self.encode_prompt(context, images, videos)
        continuation_ids = self.tokenizer(continuation, add_special_tokens=False)["input_ids"]
        if not continuation_ids:
            raise ValueError(f"empty continuation after context {context!r}")
        context_ids = encoding["input_ids"][0].tolist()
        row = {key: value for key, value in encoding.items() if key in ROW_VISUAL_KEYS}
        row.update(
            input_ids=context_ids + continuation_ids,
            attention_mask=[1] * (len(context_ids) + len(continuation_ids)),
            continuation_start=len(context_ids),
        )
        if "mm_token_type_ids" in encoding:
            row["mm_token_type_ids"] = encoding["mm_token_type_ids"][0].tolist() + [0] * len(continuation_ids)
        return row

    def encode_with_videos(self, prompt: str, images: list, videos: list[VideoClip]) -> dict:
        """The processor's outputs for a templated prompt with videos, made as the training data is,
        but for the videos' pixels: `videos` holds the clips' decoding jobs (ClipPixels decodes them)."""
        encoder = self.sample_encoder
        out = {}
        grids = []
        if images:
            out = dict(self.processor.image_processor(images, return_tensors="pt"))
            grids = [tuple(g) for g in out["image_grid_thw"].tolist()]
        jobs = [self.clip_job(clip) for clip in videos]
        plans = [job.plan for job in jobs]
        input_ids = self.tokenizer(encoder.expand_visual_tokens(prompt, grids, plans))["input_ids"]
        return {
            **out,
            "input_ids": torch.tensor([input_ids]),
            "videos": jobs,
            "video_grid_thw": torch.tensor([plan.grid for plan in plans]),
            "mm_token_type_ids": torch.tensor(self.processor.create_mm_token_type_ids([input_ids])),
        }

    def clip_job(self, clip: VideoClip) -> ClipJob:
        """The clip with its metadata and plan, from its container headers (a clip that does not
        probe raises its BadSample); its frames are decoded later, by ClipPixels."""
        if clip not in self.clip_jobs:
            meta = {"kind": "file", **probe(clip.read_bytes()).as_dict()}
            self.clip_jobs[clip] = ClipJob(clip, meta, self.sample_encoder.video_plan(meta, clip.max_frames))
        return self.clip_jobs[clip]

    def left_padded_inputs(self, batch: list[dict]) -> dict[str, torch.Tensor]:
        """The model's inputs for encoded rows: token lists left-padded to the longest, the rows'
        visual tensors concatenated (in row order, as the processor lays out a batch)."""
        length = max(len(row["input_ids"]) for row in batch)

        def left_padded(key: str, value: int) -> torch.Tensor:
            return torch.tensor([[value] * (length - len(row[key])) + row[key] for row in batch], device=self.device)

        inputs = {
            "input_ids": left_padded("input_ids", self.tokenizer.pad_token_id),
            "attention_mask": left_padded("attention_mask", 0),
        }
        if all("mm_token_type_ids" in row for row in batch):
            inputs["mm_token_type_ids"] = left_padded("mm_token_type_ids", 0)
        for key in VISUAL_KEYS:
            if any(key in row for row in batch):
                dtype = self.model.dtype if key.startswith("pixel_values") else None  # the grids stay integers
                inputs[key] = torch.cat([row[key] for row in batch if key in row]).to(self.device, dtype)
        return inputs

    @torch.no_grad()
    def score_batch(self, batch: list[dict]) -> list[tuple[float, bool]]:
        """(sum log p(continuation), greedy?) per row, from one forward of the left-padded batch.

        Left padding puts every continuation at the end, so the LM head runs only on the last
        positions (`logits_to_keep`): a large vocabulary never gets full-sequence logits.
        """
        keep = max(len(row["input_ids"]) - row["continuation_start"] for row in batch) + 1
        logits = self.model(**self.left_padded_inputs(batch), logits_to_keep=keep).logits
        results = []
        for b, row in enumerate(batch):
            targets = torch.tensor(row["input_ids"][row["continuation_start"] :], device=self.device)
            log_probs = F.log_softmax(logits[b, keep - 1 - len(targets) : keep - 1].float(), dim=-1)
            score = log_probs.gather(-1, targets[:, None]).sum().item()
            greedy = bool((log_probs.argmax(-1) == targets).all())
            results.append((score, greedy))
        return results


def native_settings(gen_kwargs: dict, until: list[str], max_gen_toks: int) -> SamplingSettings:
    """The native decoder's settings of an lm-eval request: `until` as the stop strings,
    `max_gen_toks` as max_new_tokens, greedy unless the task asks for sampling (`do_sample: true`,
    or a temperature above 0 without `do_sample`), then its temperature (default 1), top_p and
    top_k. A setting the native decoder has not (num_beams, repetition_penalty, ...) is refused by
    name: it would be ignored, and the answers would not be the task's."""
    unknown = sorted(set(gen_kwargs) - set(NATIVE_GEN_KWARGS))
    if unknown:
        raise ValueError(
            f"generation_kwargs {', '.join(unknown)}: not supported by vlmcore's decoder (it takes until, "
            f"max_gen_toks, {', '.join(NATIVE_GEN_KWARGS)}); run with generator=transformers "
            "(`vlmcore eval --generator transformers`)"
        )
    temperature = float(gen_kwargs.get("temperature") or 0.0)
    do_sample = gen_kwargs.get("do_sample")
    sampling = bool(do_sample) if do_sample is not None else temperature > 0
    settings = SamplingSettings(max_new_tokens=int(max_gen_toks), stop_strings=[stop for stop in until if stop])
    if sampling:
        settings.temperature = temperature or 1.0
        settings.top_p = float(gen_kwargs.get("top_p") or 1.0)
        settings.top_k = int(gen_kwargs.get("top_k") or 0)
    return settings


def cut_at_stops(text: str, until: list[str]) -> str:
    """The answer before the first of lm-eval's stop sequences, cut one after another as lm-eval cuts."""
    for stop in until:
        if stop:
            text = text.split(stop)[0]
    return text
