"""`vlmcore-vlm`: the lm-eval model for exported vision-language models.

Why not lm-eval's own `hf-multimodal`: in lm-eval 0.4.13 it refuses `loglikelihood` requests
that carry images (NotImplementedError, "not yet tested"), so it cannot score multiple-choice
VQA; its unfinished code path behind that error extends neither Qwen-VL's `mm_token_type_ids`
over the answer tokens nor passes an attention mask for padded rows. This class subclasses it
and implements that one missing piece, checked against a direct transformers forward; generation
with images (MMMU, ChartQA, DocVQA style tasks) and text-only requests (mmlu, arc, hellaswag)
stay lm-eval's code.

Requests with images are always put in the chat form the model was trained on: the context
(with `<image>` placeholders) becomes the user turn of the model's chat template and the answer
is the assistant's turn. A multiple-choice score is the summed log-probability of the answer
tokens. Text-only requests follow lm-eval's `--apply_chat_template` setting as usual.
"""

import dataclasses

import torch
import torch.nn.functional as F
from lm_eval.api.registry import register_model
from lm_eval.models.hf_vlms import DEFAULT_IMAGE_PLACEHOLDER, HFMultimodalLM
from tqdm import tqdm

from vlmcore.data.encoder import to_chat_messages
from vlmcore.data.processor import load_processor


def user_turn(context: str, num_images: int) -> list[dict]:
    """The chat message of a context, built like the training data: images where `<image>`
    stands, or all before the text when the context has no placeholder."""
    if DEFAULT_IMAGE_PLACEHOLDER not in context:
        context = DEFAULT_IMAGE_PLACEHOLDER * num_images + context
    if context.count(DEFAULT_IMAGE_PLACEHOLDER) != num_images:
        raise ValueError(f"context has {context.count(DEFAULT_IMAGE_PLACEHOLDER)} {DEFAULT_IMAGE_PLACEHOLDER} "
                         f"placeholders but the request has {num_images} images: {context!r}")
    return to_chat_messages([{"role": "user", "content": context}])


@register_model("vlmcore-vlm")
class VisionLanguageLM(HFMultimodalLM):
    def _create_tokenizer(self, pretrained, tokenizer, revision="main", trust_remote_code=False, **kwargs):
        # The processor is built without torchvision when it is missing (videos unsupported then).
        self.processor = load_processor(pretrained if isinstance(pretrained, str) else self.model.name_or_path)
        self.tokenizer = self.processor.tokenizer

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        if requests and len(requests[0].args) < 3:
            return super().loglikelihood(requests, disable_tqdm=disable_tqdm)
        rows = [self.encode_row(*request.args) for request in requests]
        # Longest first, so every batch pads to its first row and memory peaks at the start.
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i]["input_ids"]))
        results = [None] * len(rows)
        batch_size = int(self.batch_size)
        for start in tqdm(range(0, len(order), batch_size), disable=disable_tqdm, desc="vlmcore-vlm loglikelihood"):
            batch = [rows[i] for i in order[start:start + batch_size]]
            for i, result in zip(order[start:start + batch_size], self.score_batch(batch)):
                results[i] = result
                self.cache_hook.add_partial("loglikelihood", requests[i].args[:2], result)
        return results

    def chat_prompt(self, context: str, num_images: int) -> str:
        """The context as a chat-templated user turn, unless lm-eval has applied the template already."""
        if self.chat_applied:
            return context
        return self.processor.apply_chat_template(user_turn(context, num_images), add_generation_prompt=True, tokenize=False)

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        templated = []
        for request in requests:
            if len(request.args) == 3:
                context, gen_kwargs, aux = request.args
                request = dataclasses.replace(request, arguments=(self.chat_prompt(context, len(aux.get("visual") or [])), gen_kwargs, aux))
            templated.append(request)
        return super().generate_until(templated, disable_tqdm=disable_tqdm)

    def encode_row(self, context: str, continuation: str, aux: dict) -> dict:
        images = aux.get("visual") or []
        context = self.chat_prompt(context, len(images))
        encoding = self.processor(text=[context], images=images or None, return_tensors="pt")
        continuation_ids = self.tokenizer(continuation, add_special_tokens=False)["input_ids"]
        if not continuation_ids:
            raise ValueError(f"empty continuation after context {context!r}")
        row = {key: value for key, value in encoding.items() if key in ("pixel_values", "image_grid_thw")}
        context_ids = encoding["input_ids"][0].tolist()
        row["input_ids"] = context_ids + continuation_ids
        row["attention_mask"] = [1] * len(row["input_ids"])
        row["continuation_start"] = len(context_ids)
        if "mm_token_type_ids" in encoding:
            row["mm_token_type_ids"] = encoding["mm_token_type_ids"][0].tolist() + [0] * len(continuation_ids)
        return row

    @torch.no_grad()
    def score_batch(self, batch: list[dict]) -> list[tuple[float, bool]]:
        """(sum log p(continuation), greedy?) per row, from one forward of the left-padded batch.

        Left padding puts every continuation at the end, so the LM head runs only on the last
        positions (`logits_to_keep`): a large vocabulary never gets full-sequence logits.
        """
        length = max(len(row["input_ids"]) for row in batch)
        keep = max(len(row["input_ids"]) - row["continuation_start"] for row in batch) + 1

        def left_padded(key, value):
            return torch.tensor([[value] * (length - len(row[key])) + row[key] for row in batch], device=self.device)

        inputs = {"input_ids": left_padded("input_ids", self.tokenizer.pad_token_id),
                  "attention_mask": left_padded("attention_mask", 0)}
        if all("mm_token_type_ids" in row for row in batch):
            inputs["mm_token_type_ids"] = left_padded("mm_token_type_ids", 0)
        for key in ("pixel_values", "image_grid_thw"):
            if any(key in row for row in batch):
                inputs[key] = torch.cat([row[key] for row in batch if key in row]).to(self.device)
        if "pixel_values" in inputs:
            inputs["pixel_values"] = inputs["pixel_values"].to(self.model.dtype)
        logits = self.model(**inputs, logits_to_keep=keep).logits
        results = []
        for b, row in enumerate(batch):
            targets = torch.tensor(row["input_ids"][row["continuation_start"]:], device=self.device)
            log_probs = F.log_softmax(logits[b, keep - 1 - len(targets):keep - 1].float(), dim=-1)
            score = log_probs.gather(-1, targets[:, None]).sum().item()
            greedy = bool((log_probs.argmax(-1) == targets).all())
            results.append((score, greedy))
        return results
