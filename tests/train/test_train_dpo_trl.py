"""vlmcore's DPO against TRL's `DPOTrainer` (trl 1.16.0) on the same tiny transformers models and pairs.

TRL builds its batch (its own collator and tokenization: chosen rows then rejected rows, right
padded) and computes, with its own methods, each pair's log-probabilities
(`compute_ref_log_probs` on a given model) and the DPO loss (`_compute_loss`, the policy against
its reference model, and the loss's gradients). vlmcore's native models, loaded from the same snapshots, get the same
tokens and pixels twice: as TRL's rows (unpacked, each side a row) and packed, all pairs' sides
in one row (block-diagonal attention per segment, positions restarting per segment).

TRL 1.16's `sigmoid` loss has no label smoothing; the smoothed (conservative) sigmoid loss is its
`aot` loss with one pair a batch (sorting one pair's log-ratios changes nothing), which the
smoothed case is compared with, pair by pair.
"""

import numpy as np
import torch
import transformers
import trl
from datasets import Dataset
from helpers import make_demo_model_dir
from PIL import Image

from vlmcore.data import IGNORE_INDEX
from vlmcore.data.load.batch import Batch, Images
from vlmcore.data.media.processor import load_processor
from vlmcore.data.media.tokenizer import build_demo_tokenizer
from vlmcore.data.synthetic.image import corpus_texts
from vlmcore.models import from_pretrained
from vlmcore.models.moe import RoutingStats, moe_blocks
from vlmcore.tiny import TOKENIZER_TEXT
from vlmcore.train.dpo import DPOObjective, FrozenReference, model_segment_logps, pair_losses
from vlmcore.train.step import MoE, forward_backward

BETA = 0.3
TOLERANCE = dict(rtol=1e-5, atol=1e-5)


def image(seed: int, size: tuple[int, int]) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def user(text: str, with_image: bool) -> list[dict]:
    content = [{"type": "image"}] if with_image else []
    return [{"role": "user", "content": content + [{"type": "text", "text": text}]}]


def assistant(text: str) -> list[dict]:
    return [{"role": "assistant", "content": [{"type": "text", "text": text}]}]


def vision_pairs() -> list[dict]:
    return [
        {
            "images": [image(0, (64, 64))],
            "prompt": user("What shape is this?", True),
            "chosen": assistant("A red circle."),
            "rejected": assistant("A blue square, I think."),
        },
        {
            "images": [image(1, (96, 64))],
            "prompt": user("What color is the shape in the middle?", True),
            "chosen": assistant("Green."),
            "rejected": assistant("It is a yellow one."),
        },
    ]


def text_pairs() -> list[dict]:
    return [
        {"prompt": user("Name a shape.", False), "chosen": assistant("A circle."), "rejected": assistant("Blue.")},
        {
            "prompt": user("What color is the sky?", False),
            "chosen": assistant("Blue, on a clear day."),
            "rejected": assistant("A square."),
        },
    ]


def save_pair_of_models(model_class: type, config: transformers.PretrainedConfig, tmp_path, source_dir) -> tuple:
    """Policy and reference snapshots (different random weights) with the tokenizer and processor files."""
    dirs = []
    for seed, name in [(0, "policy"), (1, "reference")]:
        torch.manual_seed(seed)
        path = tmp_path / name
        model_class(config).save_pretrained(path)
        for file in source_dir.iterdir():
            if file.is_file() and not (path / file.name).exists():
                (path / file.name).write_bytes(file.read_bytes())
        dirs.append(path)
    return tuple(dirs)


def trl_trainer(policy_dir, reference_dir, processing_class, examples, tmp_path, **args) -> trl.DPOTrainer:
    policy = transformers.AutoModelForImageTextToText if "images" in examples[0] else transformers.AutoModelForCausalLM
    config = trl.DPOConfig(
        output_dir=str(tmp_path / "trl"),
        beta=BETA,
        report_to="none",
        use_cpu=True,
        bf16=False,  # TRL autocasts to bf16 by default; the comparison is in fp32
        **args,
    )
    return trl.DPOTrainer(
        model=policy.from_pretrained(policy_dir, dtype=torch.float32),
        ref_model=policy.from_pretrained(reference_dir, dtype=torch.float32),
        args=config,
        train_dataset=Dataset.from_list(examples),
        processing_class=processing_class,
    )


def trl_inputs(trainer: trl.DPOTrainer, examples: list[dict]) -> dict:
    """TRL's batch of the pairs, made by its collator (for text, from its own tokenized dataset)."""
    if "images" in examples[0]:
        return trainer.data_collator([dict(e) for e in examples])
    return trainer.data_collator([trainer.train_dataset[i] for i in range(len(examples))])


def rows_of(inputs: dict) -> list[dict]:
    """TRL's rows (chosen rows, then rejected rows), each as its real tokens, shifted labels and patches."""
    grids = inputs.get("image_grid_thw")
    patches = inputs["pixel_values"].split(grids.prod(-1).tolist()) if grids is not None else None
    rows = []
    for i, ids in enumerate(inputs["input_ids"]):
        length = int(inputs["attention_mask"][i].sum())
        ids = ids[:length]
        completion = inputs["completion_mask"][i][:length].bool()
        labels = torch.full_like(ids, IGNORE_INDEX)
        labels[:-1] = ids[1:].masked_fill(~completion[1:], IGNORE_INDEX)
        row = {"ids": ids, "labels": labels, "pixels": None, "grid": None}
        if patches is not None:
            row["pixels"] = patches[i]
            row["grid"] = grids[i : i + 1]
        rows.append(row)
    return rows


def batch_of(rows: list[dict], pairs: list[list[int]], packed: bool) -> Batch:
    """One row of all `rows` as segments (packed) or one row each, padded to the longest (unpacked)."""
    lengths = [len(row["ids"]) for row in rows]
    if packed:
        input_ids = torch.cat([row["ids"] for row in rows])[None]
        labels = torch.cat([row["labels"] for row in rows])[None]
    else:
        width = max(lengths)
        input_ids = torch.stack([torch.nn.functional.pad(row["ids"], (0, width - len(row["ids"]))) for row in rows])
        labels = torch.stack(
            [torch.nn.functional.pad(row["labels"], (0, width - len(row["ids"])), value=IGNORE_INDEX) for row in rows]
        )
        lengths = [width] * len(rows)
    images = None
    if rows[0]["pixels"] is not None:
        images = Images(torch.cat([row["pixels"] for row in rows]), torch.cat([row["grid"] for row in rows]))
    cu_seqlens = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    return Batch(input_ids, labels, cu_seqlens, images=images, pairs=torch.tensor(pairs)).to(torch.device("cpu"))


def vlmcore_results(policy_dir, reference_dir, rows: list[dict], label_smoothing: float, packed: bool) -> tuple:
    """(policy chosen, policy rejected) log-probabilities and the pairs' DPO losses, from vlmcore's models."""
    pairs_count = len(rows) // 2
    if packed:  # each pair's chosen and rejected side next to each other
        order = [i for pair in range(pairs_count) for i in (pair, pair + pairs_count)]
        rows = [rows[i] for i in order]
        pairs = [[2 * pair, 2 * pair + 1] for pair in range(pairs_count)]
    else:  # TRL's rows: chosen ones, then rejected ones
        pairs = [[pair, pair + pairs_count] for pair in range(pairs_count)]
    batch = batch_of(rows, pairs, packed)
    policy = from_pretrained(policy_dir).eval()
    reference = FrozenReference(from_pretrained(reference_dir))
    policy_logps = model_segment_logps(policy, batch, chunk_tokens=16)
    pairs = pair_losses(policy_logps, reference.logps(batch), batch.pairs, BETA, label_smoothing)
    pairs.losses.mean().backward()
    gradients = {name: p.grad for name, p in policy.named_parameters()}
    return policy_logps[batch.pairs[:, 0]], policy_logps[batch.pairs[:, 1]], pairs, gradients


def check_against_trl(policy_dir, reference_dir, processing_class, examples, tmp_path, gradient_floor=1e-6) -> None:
    """Log-probabilities and losses to TOLERANCE; each parameter's gradient to 1e-4 of its largest
    entry, or of `gradient_floor` where that entry is smaller (float32 noise of a differently
    ordered sum is absolute, so a parameter whose gradient is all near zero compares to the floor)."""
    trainer = trl_trainer(policy_dir, reference_dir, processing_class, examples, tmp_path)
    inputs = trl_inputs(trainer, examples)
    trl_chosen, trl_rejected = trainer.compute_ref_log_probs(trainer.model, inputs)
    trl_loss = trainer._compute_loss(trainer.model, inputs, return_outputs=False)
    trl_loss.backward()
    trl_gradients = {name: p.grad for name, p in trainer.model.named_parameters()}
    rows = rows_of(inputs)
    for packed in (False, True):
        chosen, rejected, pairs, gradients = vlmcore_results(policy_dir, reference_dir, rows, 0.0, packed)
        torch.testing.assert_close(chosen.detach(), trl_chosen, **TOLERANCE)
        torch.testing.assert_close(rejected.detach(), trl_rejected, **TOLERANCE)
        torch.testing.assert_close(pairs.losses.mean().detach(), trl_loss.detach(), **TOLERANCE)
        assert gradients.keys() == trl_gradients.keys()
        for name, gradient in gradients.items():
            scale = trl_gradients[name].abs().max() + gradient_floor
            assert (gradient - trl_gradients[name]).abs().max() / scale < 1e-4, name
    # Label smoothing: TRL's `aot` loss with one pair a batch is the smoothed sigmoid loss.
    smoothed = trl_trainer(
        policy_dir, reference_dir, processing_class, examples, tmp_path, loss_type=["aot"], label_smoothing=0.2
    )
    with torch.no_grad():
        trl_losses = torch.stack(
            [smoothed._compute_loss(smoothed.model, trl_inputs_one(smoothed, examples, i), False) for i in range(2)]
        )
    for packed in (False, True):
        _, _, pairs, _ = vlmcore_results(policy_dir, reference_dir, rows, 0.2, packed)
        torch.testing.assert_close(pairs.losses.detach(), trl_losses, **TOLERANCE)


def trl_inputs_one(trainer: trl.DPOTrainer, examples: list[dict], index: int) -> dict:
    if "images" in examples[0]:
        return trainer.data_collator([dict(examples[index])])
    return trainer.data_collator([trainer.train_dataset[index]])


def test_qwen3_vl_pair_logps_and_loss_equal_trl(tmp_path):
    source = make_demo_model_dir(tmp_path / "source")
    config = transformers.AutoConfig.from_pretrained(source)
    policy_dir, reference_dir = save_pair_of_models(
        transformers.Qwen3VLForConditionalGeneration, config, tmp_path, source
    )
    check_against_trl(policy_dir, reference_dir, load_processor(source), vision_pairs(), tmp_path)


def test_qwen3_text_pair_logps_and_loss_equal_trl(tmp_path):
    source = tmp_path / "source"
    tokenizer = build_demo_tokenizer(source, corpus_texts(0), vocab_size=512)
    config = transformers.Qwen3Config(**TOKENIZER_TEXT, tie_word_embeddings=False)
    policy_dir, reference_dir = save_pair_of_models(transformers.Qwen3ForCausalLM, config, tmp_path, source)
    check_against_trl(policy_dir, reference_dir, tokenizer, text_pairs(), tmp_path)


def test_qwen3_5_text_pair_logps_and_loss_equal_trl(tmp_path):
    """Qwen3.5's hybrid stack (Gated DeltaNet mixers beside attention): packed, each segment's
    recurrent state starts afresh, as in TRL's one side a row."""
    from vlmcore.tiny import qwen3_5_text_dict

    source = tmp_path / "source"
    tokenizer = build_demo_tokenizer(source, corpus_texts(0), vocab_size=512)
    config = transformers.Qwen3_5TextConfig(**{**qwen3_5_text_dict(layers=4), "vocab_size": 512})
    policy_dir, reference_dir = save_pair_of_models(transformers.Qwen3_5ForCausalLM, config, tmp_path, source)
    # The decay parameters of the second mixer (A_log, dt_bias) get gradients of 1e-6 (the largest
    # gradient is 0.36), which the two chunked recurrences sum in another order: they differ by 2e-9,
    # float32 noise. A floor of 1e-4 still holds every gradient to 1e-8 absolute.
    check_against_trl(policy_dir, reference_dir, tokenizer, text_pairs(), tmp_path, gradient_floor=1e-4)


# DPO on a mixture-of-experts model against TRL's `DPOTrainer` (trl 1.16.0): with the router's
# load-balancing loss, which TRL adds as `router_aux_loss_coef * outputs.aux_loss` of the policy's
# forward over the chosen and rejected rows (transformers' `load_balancing_loss_func` over their
# tokens), and vlmcore's train step adds from the routing of the policy's forward over the same
# tokens (`vlmcore.train.step.forward_backward` with the DPO objective, as `vlmcore train` runs it).
#
# Tiny Qwen3-MoE, two text pairs whose four sides have the same length, so that TRL's batch has no
# padding (its aux loss leaves padding out; a packed row has none). Compared to 1e-5: each side's
# log-probability, the loss with the router's term, the router's term itself; the policy's
# gradients to 1e-4 of each parameter's largest entry; unpacked (each side a row) and packed (all
# sides one row).


COEF = 0.05


def equal_length_pairs() -> list[dict]:
    """Every side 7 prompt tokens and 3 answer tokens under the demo tokenizer."""
    return [
        {"prompt": user("Name a shape.", False), "chosen": assistant("A circle."), "rejected": assistant("A square.")},
        {
            "prompt": user("Name a color.", False),
            "chosen": assistant("A triangle."),
            "rejected": assistant("A circle."),
        },
    ]


def vlmcore_step(policy_dir, reference_dir, rows: list[dict], packed: bool) -> tuple:
    """The train step's forward and backward of the pairs: (chosen, rejected) log-probabilities,
    the loss the step backpropagates, the router's loss and the policy's gradients."""
    pairs_count = len(rows) // 2
    if packed:
        rows = [rows[i] for pair in range(pairs_count) for i in (pair, pair + pairs_count)]
        pairs = [[2 * pair, 2 * pair + 1] for pair in range(pairs_count)]
    else:
        pairs = [[pair, pair + pairs_count] for pair in range(pairs_count)]
    batch = batch_of(rows, pairs, packed)
    policy = from_pretrained(policy_dir).eval()
    objective = DPOObjective(FrozenReference(from_pretrained(reference_dir)), BETA, 0.0, chunk_tokens=16)
    moe = MoE(RoutingStats(moe_blocks(policy)), COEF, dp_size=1)
    sums, aux_sum, _ = forward_backward(policy, [batch], pairs_count, None, moe=moe, objective=objective)
    gradients = {name: p.grad for name, p in policy.named_parameters()}
    with torch.no_grad():
        logps = model_segment_logps(policy, batch, chunk_tokens=16)
    loss = sums[0] / pairs_count + COEF * aux_sum
    return logps[batch.pairs[:, 0]], logps[batch.pairs[:, 1]], loss, aux_sum, gradients


def test_qwen3_moe_pair_losses_with_the_router_loss_equal_trl(tmp_path):
    source = tmp_path / "source"
    tokenizer = build_demo_tokenizer(source, corpus_texts(0), vocab_size=512)
    config = transformers.Qwen3MoeConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=48,
        norm_topk_prob=True,
        router_aux_loss_coef=COEF,
        tie_word_embeddings=False,
    )
    policy_dir, reference_dir = save_pair_of_models(transformers.Qwen3MoeForCausalLM, config, tmp_path, source)
    examples = equal_length_pairs()
    trainer = trl_trainer(policy_dir, reference_dir, tokenizer, examples, tmp_path)
    assert trainer.aux_loss_enabled and trainer.router_aux_loss_coef == COEF
    inputs = trl_inputs(trainer, examples)
    assert bool(inputs["attention_mask"].all()), "the pairs' sides must have one length: no padding"
    trl_chosen, trl_rejected = trainer.compute_ref_log_probs(trainer.model, inputs)
    trl_loss = trainer._compute_loss(trainer.model, inputs, return_outputs=False)
    trl_loss.backward()
    trl_aux = next(metrics["aux_loss"][-1] for metrics in trainer._metrics.values() if metrics.get("aux_loss"))
    trl_gradients = {name: p.grad for name, p in trainer.model.named_parameters()}
    rows = rows_of(inputs)
    for packed in (False, True):
        chosen, rejected, loss, aux, gradients = vlmcore_step(policy_dir, reference_dir, rows, packed)
        torch.testing.assert_close(chosen, trl_chosen, **TOLERANCE)
        torch.testing.assert_close(rejected, trl_rejected, **TOLERANCE)
        assert aux.item() > 0
        torch.testing.assert_close(aux.item(), trl_aux, **TOLERANCE)
        torch.testing.assert_close(loss.float(), trl_loss.detach(), **TOLERANCE)
        assert gradients.keys() == trl_gradients.keys()
        for name, gradient in gradients.items():
            scale = trl_gradients[name].abs().max() + 1e-6
            assert (gradient - trl_gradients[name]).abs().max() / scale < 1e-4, (packed, name)
