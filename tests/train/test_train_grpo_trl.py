"""vlmcore's GRPO objective against TRL's `GRPOTrainer` (trl 1.16.0) on the same tiny Qwen3 and the
same rollout: two prompts, two completions each, the old log-probabilities and the advantages.

TRL's trainer is built for real (a `GRPOConfig` per variant, offline: the policy and the
reference are local snapshots) and computes with its own methods the per-token log-probabilities
at the sampling temperature (`_get_per_token_logps_and_entropies`, through the fused head that its
`__init__` adds to the policy; the reference gets TRL's `add_fused_lm_head` the same way) and the
loss (`_compute_loss`) and its gradients. The rollout's old log-probabilities are TRL's policy's,
perturbed, so that the ratios are not 1 and clip; the reference is a second model (other random
weights), so that the KL term has a value and a gradient. vlmcore's native models, loaded from the
same snapshots, get the same tokens as TRL's rows (each completion a row, right padded) and
packed (all four completions one row), through the train step's `forward_backward` with
`GRPOObjective` and the normaliser of its global count.

Every variant TRL has of vlmcore's `grpo.loss`: grpo, dapo (and TRL's bnpo, which is dapo once its
normaliser is the global one, as here with one process and one micro-batch), dr_grpo, gspo (TRL's
loss_type grpo with importance_sampling_level sequence); with beta > 0 and 0; the dual clip
(`delta`), truncated importance sampling (`tis_cap`) and the KL estimate without the ratio's
weight (`kl_ratio_weighted` false; TRL's use_bias_correction_kl) once each. Compared to 1e-5: the policy's
and the reference's token log-probabilities, the loss, the clip fractions and the KL metric (the
token-level ones, which TRL averages as vlmcore does), and every parameter's gradient relative to
its largest entry.
"""

import pytest
import torch
import transformers
import trl
from datasets import Dataset

from vlmcore.data import IGNORE_INDEX
from vlmcore.data.load.batch import Batch, Rollout
from vlmcore.data.media.tokenizer import build_demo_tokenizer
from vlmcore.data.synthetic.image import corpus_texts
from vlmcore.models import from_pretrained
from vlmcore.tiny import TOKENIZER_TEXT
from vlmcore.train.dpo import FrozenReference
from vlmcore.train.grpo import GRPOObjective
from vlmcore.train.metrics_log import completions
from vlmcore.train.step import forward_backward

TOLERANCE = dict(rtol=1e-5, atol=1e-5)
TEMPERATURE = 0.7
MAX_NEW_TOKENS = 12
EPSILON_LOW = 0.2
EPSILON_HIGH = 0.28
BETA = 0.1
# Prompts of one token length: TRL left-pads prompts and its model then numbers a padded prompt's
# positions from the padding; without padding they are the same as a packed segment's.
PROMPTS = ["Name a shape.", "Name a color."]
COMPLETIONS = ["A red circle.", "Blue.", "A blue square, I think.", "Green."]  # two a prompt
ADVANTAGES = [1.0, -1.0, 0.7, -0.7]


@pytest.fixture(scope="module")
def snapshots(tmp_path_factory):
    """(policy, reference) snapshot directories (different random weights) with the tokenizer."""
    root = tmp_path_factory.mktemp("grpo_trl")
    tokenizer = build_demo_tokenizer(root / "source", corpus_texts(0), vocab_size=512)
    config = transformers.Qwen3Config(**TOKENIZER_TEXT, tie_word_embeddings=False)
    dirs = []
    for seed, name in [(0, "policy"), (1, "reference")]:
        torch.manual_seed(seed)
        transformers.Qwen3ForCausalLM(config).save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
        dirs.append(root / name)
    return tuple(dirs), tokenizer, root


def trl_trainer(snapshots, loss_type: str, beta: float, **args) -> trl.GRPOTrainer:
    (policy_dir, _), tokenizer, root = snapshots
    config = trl.GRPOConfig(
        output_dir=str(root / "trl"),
        report_to="none",
        use_cpu=True,
        bf16=False,  # the comparison is in fp32
        loss_type=loss_type,
        beta=beta,
        epsilon=EPSILON_LOW,
        epsilon_high=EPSILON_HIGH,
        temperature=TEMPERATURE,
        max_completion_length=MAX_NEW_TOKENS,
        num_generations=2,
        per_device_train_batch_size=4,
        **args,
    )
    trainer = trl.GRPOTrainer(
        model=transformers.AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32),
        reward_funcs=lambda completions, **kwargs: [0.0] * len(completions),  # rewards are not compared here
        args=config,
        train_dataset=Dataset.from_list([{"prompt": prompt} for prompt in PROMPTS]),
        processing_class=tokenizer,
    )
    # Evaluation mode: from_pretrained's, and what the comparison wants (no dropout, and TRL's
    # gradient-accumulation normaliser is 1 without reading the training loop's state).
    assert not trainer.model.training
    return trainer


def trl_rollout(trainer: trl.GRPOTrainer, snapshots) -> dict:
    """TRL's inputs of `_compute_loss` for the four completions: the tokens, the advantages, the old
    log-probabilities (TRL's policy's, perturbed) and the reference's (TRL's, of the second model)."""
    (_, reference_dir), tokenizer, _ = snapshots
    prompts = [tokenizer(PROMPTS[i // 2])["input_ids"] for i in range(len(COMPLETIONS))]
    answers = [tokenizer(text)["input_ids"] for text in COMPLETIONS]
    assert len({len(p) for p in prompts}) == 1, "the prompts must have one token length: no padding"
    width = max(len(a) for a in answers)
    completion_ids = torch.tensor([a + [tokenizer.pad_token_id] * (width - len(a)) for a in answers])
    completion_mask = torch.tensor([[1] * len(a) + [0] * (width - len(a)) for a in answers])
    inputs = {
        "prompt_ids": torch.tensor(prompts),
        "prompt_mask": torch.ones(len(prompts), len(prompts[0]), dtype=torch.long),
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": torch.tensor(ADVANTAGES),
        "num_items_in_batch": completion_mask.sum(),
    }
    input_ids = torch.cat([inputs["prompt_ids"], completion_ids], dim=1)
    attention_mask = torch.cat([inputs["prompt_mask"], completion_mask], dim=1)
    reference = transformers.AutoModelForCausalLM.from_pretrained(reference_dir, dtype=torch.float32)
    trl.trainer.utils.add_fused_lm_head(reference, temperature=TEMPERATURE)
    with torch.no_grad():
        policy_logps, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, input_ids, attention_mask, width)
        reference_logps, _, _ = trainer._get_per_token_logps_and_entropies(reference, input_ids, attention_mask, width)
    noise = torch.randn(policy_logps.shape, generator=torch.Generator().manual_seed(0))
    inputs["policy_logps"] = policy_logps
    inputs["old_per_token_logps"] = policy_logps + 0.3 * noise
    inputs["ref_per_token_logps"] = reference_logps
    return inputs


def vlmcore_batch(inputs: dict, packed: bool) -> Batch:
    """The completions as vlmcore's batch: each its prompt and completion, one segment, the labels on
    the completion; the rollout's values at the labels' places. Packed: one row; else TRL's rows."""
    segments = []
    for i in range(len(COMPLETIONS)):
        length = int(inputs["completion_mask"][i].sum())
        prompt = inputs["prompt_ids"][i]
        ids = torch.cat([prompt, inputs["completion_ids"][i][:length]])
        labels = torch.full_like(ids, IGNORE_INDEX)
        labels[len(prompt) - 1 : -1] = inputs["completion_ids"][i][:length]
        old_logps = torch.zeros(len(ids))
        old_logps[len(prompt) - 1 : -1] = inputs["old_per_token_logps"][i][:length]
        advantages = torch.zeros(len(ids))
        advantages[len(prompt) - 1 : -1] = inputs["advantages"][i]
        segments.append((ids, labels, old_logps, advantages))
    if packed:
        rows = [[torch.cat([segment[k] for segment in segments])] for k in range(4)]
        lengths = [len(segment[0]) for segment in segments]
    else:
        width = max(len(segment[0]) for segment in segments)
        pad_values = (0, IGNORE_INDEX, 0.0, 0.0)
        rows = [
            [
                torch.nn.functional.pad(segment[k], (0, width - len(segment[k])), value=pad_values[k])
                for segment in segments
            ]
            for k in range(4)
        ]
        lengths = [width] * len(segments)
    input_ids, labels, old_logps, advantages = (torch.stack(row) for row in rows)
    cu_seqlens = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    return Batch(input_ids, labels, cu_seqlens, rollout=Rollout(old_logps, advantages)).to(torch.device("cpu"))


def at_labels(batch: Batch, token_values: torch.Tensor) -> torch.Tensor:
    """vlmcore's per-token values (flattened rows) at the label tokens, in TRL's order."""
    return token_values[batch.labels.reshape(-1) != IGNORE_INDEX]


def trl_at_mask(inputs: dict, values: torch.Tensor) -> torch.Tensor:
    return values[inputs["completion_mask"].bool()]


def vlmcore_step(snapshots, batch: Batch, beta: float, loss_type: str, **options) -> tuple:
    """The train step's forward and backward of the batch with the GRPO objective: (its normalised
    loss, its metrics, the policy's gradients)."""
    (policy_dir, reference_dir), _, _ = snapshots
    policy = from_pretrained(policy_dir).eval()
    reference = FrozenReference(from_pretrained(reference_dir)) if beta > 0 else None
    objective = GRPOObjective(
        loss_type,
        EPSILON_LOW,
        EPSILON_HIGH,
        TEMPERATURE,
        MAX_NEW_TOKENS,
        beta,
        reference,
        chunk_tokens=16,
        **options,
    )
    counts = {"label_tokens": batch.label_tokens, "completions": completions(batch)}
    sums, _, _ = forward_backward(policy, [batch], counts[objective.count], None, objective=objective)
    metrics = objective.metrics(sums.tolist(), counts)
    gradients = {name: p.grad for name, p in policy.named_parameters()}
    return metrics, gradients


def check_step(snapshots, inputs: dict, trainer: trl.GRPOTrainer, loss_type: str, beta: float, **options) -> dict:
    """TRL's loss and gradients against vlmcore's, unpacked and packed; returns vlmcore's metrics."""
    trl_loss = trainer._compute_loss(trainer.model, inputs)
    trl_loss.backward()
    trl_gradients = {name: p.grad for name, p in trainer.model.named_parameters()}
    trl_metrics = {key: values[-1] for key, values in trainer._metrics["eval"].items()}
    for packed in (False, True):
        batch = vlmcore_batch(inputs, packed)
        metrics, gradients = vlmcore_step(snapshots, batch, beta, loss_type, **options)
        case = (loss_type, beta, options, packed)
        torch.testing.assert_close(
            metrics["loss"], trl_loss.item(), **TOLERANCE, msg=lambda m, case=case: f"{case}: {m}"
        )
        if trainer.importance_sampling_level == "token":
            torch.testing.assert_close(metrics["grpo_clip_low"], trl_metrics["clip_ratio/low_mean"], **TOLERANCE)
            torch.testing.assert_close(metrics["grpo_clip_high"], trl_metrics["clip_ratio/high_mean"], **TOLERANCE)
        if beta > 0:
            torch.testing.assert_close(metrics["grpo_kl"], trl_metrics["kl"], **TOLERANCE)
        assert gradients.keys() == trl_gradients.keys()
        for name, gradient in gradients.items():
            scale = trl_gradients[name].abs().max() + 1e-6
            assert (gradient - trl_gradients[name]).abs().max() / scale < 1e-5, (case, name)
    return metrics


def test_token_logps_at_the_temperature_equal_trl(snapshots):
    """The policy's and the reference's log-probabilities of the completion tokens at the sampling
    temperature (the hidden states divided by it), packed and not, equal TRL's (its fused head)."""
    trainer = trl_trainer(snapshots, "grpo", BETA)
    inputs = trl_rollout(trainer, snapshots)
    (policy_dir, reference_dir), _, _ = snapshots
    policy = FrozenReference(from_pretrained(policy_dir), chunk_tokens=16)
    reference = FrozenReference(from_pretrained(reference_dir), chunk_tokens=16)
    for packed in (False, True):
        batch = vlmcore_batch(inputs, packed)
        for model, expected in ((policy, inputs["policy_logps"]), (reference, inputs["ref_per_token_logps"])):
            logps = model.token_logps(batch, temperature=TEMPERATURE)
            torch.testing.assert_close(at_labels(batch, logps), trl_at_mask(inputs, expected), **TOLERANCE)
        rollout = batch.rollout
        torch.testing.assert_close(
            at_labels(batch, rollout.old_logps.reshape(-1)), trl_at_mask(inputs, inputs["old_per_token_logps"])
        )


# (TRL's loss_type, its importance_sampling_level, vlmcore's grpo.loss)
VARIANTS = [
    ("grpo", "token", "grpo"),
    ("dapo", "token", "dapo"),
    ("bnpo", "token", "dapo"),
    ("dr_grpo", "token", "dr_grpo"),
    ("grpo", "sequence", "gspo"),
]


@pytest.mark.parametrize("beta", [BETA, 0.0])
@pytest.mark.parametrize("trl_loss, level, loss_type", VARIANTS)
def test_loss_and_gradients_equal_trl(snapshots, trl_loss, level, loss_type, beta):
    trainer = trl_trainer(snapshots, trl_loss, beta, importance_sampling_level=level)
    inputs = trl_rollout(trainer, snapshots)
    metrics = check_step(snapshots, inputs, trainer, loss_type, beta)
    if level == "token":  # the perturbed old log-probabilities clip on both sides
        assert metrics["grpo_clip_low"] > 0 and metrics["grpo_clip_high"] > 0
    assert metrics["grpo_ratio"] != pytest.approx(1.0, abs=1e-3)
    # |old - policy| is the perturbation: 0.3 x |standard normal| on average, about 0.24
    assert 0.1 < metrics["grpo_logp_gap"] < 0.5
    # KL(sampler || trainer) of that perturbation, exp(d) - d - 1 a token: about d^2 / 2
    assert 0.005 < metrics["grpo_rollout_kl"] < metrics["grpo_logp_gap"]


def test_dual_clip_equals_trl(snapshots):
    """`delta` caps the unclipped ratio (TRL's `delta`, two-sided GRPO): a negative advantage's
    term is bounded. A cap of 1.5 (above 1 + epsilon_high) binds on some perturbed ratios."""
    delta = 1.5
    trainer = trl_trainer(snapshots, "dapo", BETA, delta=delta)
    inputs = trl_rollout(trainer, snapshots)
    inputs["old_per_token_logps"] -= 0.5  # the policy has moved up on every token: ratios about 1.65
    ratios = torch.exp(inputs["policy_logps"] - inputs["old_per_token_logps"])
    negative = (inputs["advantages"] < 0)[:, None] & inputs["completion_mask"].bool()
    assert bool((ratios[negative] > delta).any()), "the cap must bind"
    check_step(snapshots, inputs, trainer, "dapo", BETA, delta=delta)


def test_kl_without_the_ratio_weight_equals_trl(snapshots):
    """`kl_ratio_weighted` false: the plain k3 estimate per token (TRL's use_bias_correction_kl false)."""
    trainer = trl_trainer(snapshots, "grpo", BETA, use_bias_correction_kl=False)
    inputs = trl_rollout(trainer, snapshots)
    check_step(snapshots, inputs, trainer, "grpo", BETA, kl_ratio_weighted=False)


def test_truncated_importance_sampling_equals_trl(snapshots):
    """`tis_cap`: the ratio against the trainer's own log-probabilities, each token's loss weighed
    by min(exp(trainer - sampler), cap). TRL applies it with vLLM (`use_vllm`, which needs vLLM
    installed, as this machine has not: the flag its __init__ sets from `use_vllm=True` is set on
    the built trainer instead), from the sampler's log-probabilities through its token_truncate
    mode, computed here as TRL's `_generate_and_score_completions` does; the ratio is then against
    its own log-probabilities (no `old_per_token_logps` given: the policy's, detached)."""
    cap = 1.2
    trainer = trl_trainer(snapshots, "grpo", BETA, vllm_importance_sampling_mode="token_truncate")
    inputs = trl_rollout(trainer, snapshots)
    sampler_logps = inputs.pop("old_per_token_logps")
    trainer.use_vllm = True
    assert trainer.vllm_importance_sampling_correction
    inputs["importance_sampling_ratio"] = torch.exp(inputs["policy_logps"] - sampler_logps).clamp(max=cap)
    assert bool((inputs["importance_sampling_ratio"] == cap).any()), "the cap must bind"
    # vlmcore's batch holds the sampler's log-probabilities as the rollout's.
    vlmcore_inputs = {**inputs, "old_per_token_logps": sampler_logps}
    trl_loss = trainer._compute_loss(trainer.model, inputs)
    trl_loss.backward()
    trl_gradients = {name: p.grad for name, p in trainer.model.named_parameters()}
    for packed in (False, True):
        metrics, gradients = vlmcore_step(snapshots, vlmcore_batch(vlmcore_inputs, packed), BETA, "grpo", tis_cap=cap)
        torch.testing.assert_close(metrics["loss"], trl_loss.item(), **TOLERANCE)
        assert metrics["grpo_ratio"] == pytest.approx(1.0)  # against the trainer's own log-probabilities
        for name, gradient in gradients.items():
            scale = trl_gradients[name].abs().max() + 1e-6
            assert (gradient - trl_gradients[name]).abs().max() / scale < 1e-5, (packed, name)


@pytest.mark.parametrize(
    "grpo, lora, holds_a_copy",
    [
        ({"loss": "dapo", "beta": BETA, "reference": "frozen"}, {}, True),
        ({"loss": "grpo", "beta": 0.0}, {}, False),
        ({"loss": "dapo", "beta": BETA, "reference": "adapters_off"}, {"rank": 4, "alpha": 8}, False),
    ],
)
def test_the_train_step_built_from_the_config_gives_trls_loss(
    snapshots, one_process_group, tmp_path, grpo, lora, holds_a_copy
):
    """`objective: grpo` through `use_objective` (vlmcore.train.build) and the train step of a run
    built from the config give TRL's loss, and a reference copy is held beside the policy only
    when one weighs (beta > 0) and is not the policy with its LoRA adapters off. The frozen copy
    is given the second snapshot's weights (it starts as the policy's); adapters off, before any
    step, the reference is the policy's starting weights, as TRL's reference is then."""
    from helpers import write_config

    from vlmcore.config import load_config
    from vlmcore.models import load_hf_config, load_hf_weights
    from vlmcore.parallel.checks import check_run
    from vlmcore.train.build import build_meta_run, use_objective

    (policy_dir, reference_dir), _, _ = snapshots
    settings = {
        "temperature": TEMPERATURE,
        "max_new_tokens": MAX_NEW_TOKENS,
        "epsilon_low": EPSILON_LOW,
        "epsilon_high": EPSILON_HIGH,
        "rewards": [{"name": "exact_match", "weight": 1.0}],
        **grpo,
    }
    config = write_config(
        tmp_path / "stage.yaml", policy_dir, tmp_path / "out", objective="grpo", grpo=settings, lora=lora
    )
    cfg = load_config(config)
    run = build_meta_run(cfg, check_run(cfg, 1, load_hf_config(cfg.model_path)), torch.device("cpu"), 0)
    run.materialize(load=True)
    run.make_step()
    held = use_objective(run)
    objective = run.step.objective
    assert isinstance(objective, GRPOObjective) and objective.loss_type == grpo["loss"]
    assert len(held) == (1 if holds_a_copy else 0)
    assert (objective.reference is None) == (grpo["beta"] == 0)
    if holds_a_copy:
        load_hf_weights(held[0], reference_dir)

    trainer = trl_trainer(snapshots, grpo["loss"], grpo["beta"])
    inputs = trl_rollout(trainer, snapshots)
    if lora:  # TRL's reference logps of the policy's own snapshot
        reference = transformers.AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32)
        trl.trainer.utils.add_fused_lm_head(reference, temperature=TEMPERATURE)
        width = inputs["completion_ids"].shape[1]
        input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        with torch.no_grad():
            inputs["ref_per_token_logps"], _, _ = trainer._get_per_token_logps_and_entropies(
                reference, input_ids, attention_mask, width
            )
    with torch.no_grad():
        trl_loss = trainer._compute_loss(trainer.model, inputs)
    batch = vlmcore_batch(inputs, packed=True)
    counts = {"label_tokens": batch.label_tokens, "completions": completions(batch)}
    run.model.eval()
    result = run.step([batch], counts[objective.count], lambda optimizer: None)
    assert result.applied and result.grad_norm > 0
    torch.testing.assert_close(objective.metrics(result.sums, counts)["loss"], trl_loss.item(), **TOLERANCE)
