"""DPO on a mixture-of-experts model against TRL's `DPOTrainer` (trl 1.16.0): with the router's
load-balancing loss, which TRL adds as `router_aux_loss_coef * outputs.aux_loss` of the policy's
forward over the chosen and rejected rows (transformers' `load_balancing_loss_func` over their
tokens), and vlmcore's train step adds from the routing of the policy's forward over the same
tokens (`vlmcore.train.step.forward_backward` with the DPO objective, as `vlmcore train` runs it).

Tiny Qwen3-MoE, two text pairs whose four sides have the same length, so that TRL's batch has no
padding (its aux loss leaves padding out; a packed row has none). Compared to 1e-5: each side's
log-probability, the loss with the router's term, the router's term itself; the policy's
gradients to 1e-4 of each parameter's largest entry; unpacked (each side a row) and packed (all
sides one row).
"""

import torch
import transformers
from test_train_dpo_trl import (
    BETA,
    TOLERANCE,
    assistant,
    batch_of,
    rows_of,
    save_pair_of_models,
    trl_inputs,
    trl_trainer,
    user,
)

from vlmcore.data.media.tokenizer import build_demo_tokenizer
from vlmcore.data.synthetic.image import corpus_texts
from vlmcore.models import from_pretrained
from vlmcore.models.moe import RoutingStats, moe_blocks
from vlmcore.train.dpo import DPOObjective, FrozenReference, model_segment_logps
from vlmcore.train.step import MoE, forward_backward

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
