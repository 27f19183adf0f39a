"""The demo tokenizer: a small byte-level BPE with Qwen's special tokens and chat template.

The real Qwen tokenizers cannot be downloaded here, so the demo model gets a tokenizer trained
on the synthetic corpus. It keeps Qwen's layout (special tokens after the BPE vocabulary, the
same names) and a Qwen3-VL-style chat template, so the same encoding code serves both.
"""

from collections.abc import Iterable
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

# Qwen2.5 / Qwen3 / Qwen3-VL special tokens, in their id order after the base vocabulary.
QWEN_SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
# Tokens that are special in Qwen's vocabulary but rendered as plain text (not skipped on decode).
QWEN_TEXT_TOKENS = [
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
]

# Qwen3-VL instruct layout: `<|im_start|>role\n...<|im_end|>\n`, images as
# `<|vision_start|><|image_pad|><|vision_end|>`; the processor expands each `<|image_pad|>`.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}"
    "{{- message['content'] }}"
    "{%- else %}"
    "{%- for item in message['content'] %}"
    "{%- if item['type'] == 'image' or 'image' in item %}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif item['type'] == 'video' or 'video' in item %}"
    "{{- '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{%- elif 'text' in item %}"
    "{{- item['text'] }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)


def build_demo_tokenizer(out_dir: str | Path, texts: Iterable[str], vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on `texts` and save it with Qwen's special tokens into `out_dir`.

    `vocab_size` counts the special tokens too; the model's vocabulary must be at least
    `len(tokenizer)`. Use `special_token_ids(tokenizer)` for the ids the model config needs.
    """
    num_added = len(QWEN_SPECIAL_TOKENS) + len(QWEN_TEXT_TOKENS)
    if vocab_size <= 256 + num_added:
        raise ValueError(f"vocab_size={vocab_size} leaves no room for merges: need more than {256 + num_added}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - num_added, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    # The chat-template scaffolding is part of every training text, so let BPE see it too.
    tok.train_from_iterator(list(texts) + ["user\n", "assistant\n", "system\n"], trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN_SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in QWEN_TEXT_TOKENS])

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=131072,
        clean_up_tokenization_spaces=False,
        chat_template=CHAT_TEMPLATE,
    )
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out_dir)
    return tokenizer


def special_token_ids(tokenizer: PreTrainedTokenizerBase) -> dict:
    """The ids a Qwen3-VL / Qwen3.5 config must agree with, read from the tokenizer."""
    ids = {
        "image_token_id": "<|image_pad|>",
        "video_token_id": "<|video_pad|>",
        "vision_start_token_id": "<|vision_start|>",
        "vision_end_token_id": "<|vision_end|>",
        "bos_token_id": "<|endoftext|>",
        "pad_token_id": "<|endoftext|>",
        "eos_token_id": "<|im_end|>",
    }
    out = {}
    for key, token in ids.items():
        token_id = tokenizer.convert_tokens_to_ids(token)
        if token_id is None or token_id == tokenizer.unk_token_id:
            raise ValueError(f"tokenizer has no {token} token (needed for {key})")
        out[key] = token_id
    return out
