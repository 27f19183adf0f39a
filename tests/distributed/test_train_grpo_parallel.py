"""GRPO's objective under context and tensor parallelism, on 2 gloo processes (this file launches
itself under torchrun).

Context parallelism: each rank holds a contiguous half of the rows (`Batch.context_chunk`) and
their hidden states, completions cross the chunks' edge. For every `grpo.loss`, with and without
the KL term (and the dual clip and truncated importance sampling once each), the ranks' loss sums
and metric sums add up to one process's on the whole rows, the LM head's gradients too, and each
rank's hidden-state gradient is the whole rows' at its chunk: a completion's token count (grpo's
mean) and GSPO's sequence log-ratio are the whole completion's, summed over the cp group (GSPO's
with its gradient summed back, a differentiable all-reduce).

Tensor parallelism: the LM head (the policy's and the reference's) sharded on the vocabulary, the
rows the same on both ranks: the metrics (each rank's sums divided by tp) and the gradients are
one process's."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vlmcore.data import IGNORE_INDEX

HIDDEN = 8
VOCAB = 32
TEMPERATURE = 0.7
# Two rows of 16 tokens (chunks of 8): (prompt, completion) lengths of each row's segments; a
# row's rest is a padding segment without labels.
ROWS = [[(3, 7), (2, 3)], [(2, 4), (4, 5)]]
# (grpo.loss, beta, options): every loss with and without the KL term; the dual clip and
# truncated importance sampling (per-token weights on GSPO's sequence term) once each.
CASES = [(loss, beta, {}) for loss in ("grpo", "dapo", "dr_grpo", "gspo") for beta in (0.0, 0.1)]
CASES += [("dapo", 0.1, {"delta": 1.3}), ("gspo", 0.1, {"tis_cap": 1.1})]


def rollout_batch():
    """The rows as a rollout's batch (labels on the completions, old log-probabilities and
    advantages there), on the host, seeded."""
    from vlmcore.data.load.batch import Batch, Rollout

    generator = torch.Generator().manual_seed(0)
    length = 16
    input_ids = torch.randint(0, VOCAB, (len(ROWS), length), generator=generator)
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    old_logps = torch.zeros(len(ROWS), length)
    advantages = torch.zeros(len(ROWS), length)
    lengths = []
    for row, segments in enumerate(ROWS):
        start = 0
        for prompt, completion in segments:
            first = start + prompt - 1
            labels[row, first : first + completion] = input_ids[row, first + 1 : first + completion + 1]
            old_logps[row, first : first + completion] = -3.5 + torch.randn(completion, generator=generator)
            advantages[row, first : first + completion] = torch.randn((), generator=generator)
            lengths.append(prompt + completion)
            start += prompt + completion
        lengths.append(length - start)
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return Batch(input_ids, labels, cu_seqlens, rollout=Rollout(old_logps, advantages))


class HeadReference:
    """A reference policy as a fixed LM head over fixed hidden states: what `FrozenReference.
    token_logps` computes from a model's final hidden states (under context parallelism, its
    chunk's), without the model."""

    def __init__(self, hidden: torch.Tensor, weight: torch.Tensor, chunk: tuple[int, int] | None = None) -> None:
        from vlmcore.data.load.batch import row_chunk

        self.hidden = hidden if chunk is None else row_chunk(hidden, *chunk)
        self.weight = weight

    def token_logps(self, batch, embeds=None, temperature: float = 1.0) -> torch.Tensor:
        from vlmcore.train.loss import chunked_token_logps

        with torch.no_grad():
            return chunked_token_logps(self.hidden / temperature, self.weight, batch.labels, chunk_tokens=5)


def worker(report_path: Path) -> None:
    import torch.distributed as dist

    from vlmcore.data.load.batch import row_chunk
    from vlmcore.parallel.mesh import init_distributed
    from vlmcore.train.dpo import Context
    from vlmcore.train.grpo import GRPOObjective
    from vlmcore.train.metrics_log import completions

    init_distributed(torch.device("cpu"))
    rank, cp = dist.get_rank(), dist.get_world_size()
    context = Context(rank, cp, dist.group.WORLD)
    host = rollout_batch()
    counts = {"label_tokens": host.label_tokens, "completions": completions(host)}
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(len(ROWS), 16, HIDDEN, generator=generator)
    weight = torch.randn(VOCAB, HIDDEN, generator=generator)
    reference_hidden = hidden + 0.3 * torch.randn(hidden.shape, generator=generator)
    report = {}
    for loss_type, beta, options in CASES:
        results = []
        for chunked in (False, True):
            batch = host.context_chunk(rank, cp) if chunked else host
            reference = None
            if beta > 0:
                reference = HeadReference(reference_hidden, weight, (rank, cp) if chunked else None)
            objective = GRPOObjective(
                loss_type,
                0.2,
                0.28,
                TEMPERATURE,
                max_new_tokens=8,
                beta=beta,
                reference=reference,
                chunk_tokens=5,
                context=context if chunked else None,
                **options,
            )
            leaf = (row_chunk(hidden, rank, cp) if chunked else hidden).clone().requires_grad_()
            head = weight.clone().requires_grad_()
            prepared = objective.prepare(batch, None)
            loss_sum, sums = objective.loss(leaf, head, batch, prepared)
            (loss_sum / counts[objective.count]).backward()
            if chunked:  # the ranks' parts added up
                dist.all_reduce(sums)
                dist.all_reduce(head.grad)
            results.append((sums, head.grad, leaf.grad))
        (whole_sums, whole_head, whole_hidden), (sums, head_grad, hidden_grad) = results
        report[f"{loss_type} beta {beta} {options}"] = {
            # relative: the sums are of float32 terms (|old_logp - logp| adds up to about 100)
            "sums": ((sums - whole_sums).abs() / whole_sums.abs().clamp(min=1)).max().item(),
            "head": (head_grad - whole_head).abs().max().item(),
            "hidden": (hidden_grad - row_chunk(whole_hidden, rank, cp)).abs().max().item(),
            "hidden_scale": whole_hidden.abs().max().item(),
        }
    report.update(tensor_parallel_cases(host, counts, hidden, weight, reference_hidden))
    reports = [None] * cp
    dist.all_gather_object(reports, report)
    if rank == 0:
        report_path.write_text(json.dumps(reports))
    dist.destroy_process_group()


def tensor_parallel_cases(host, counts, hidden, weight, reference_hidden) -> dict:
    """The same ranks as 2 tensor-parallel ones: the LM head sharded on the vocabulary (each rank
    its half, the log-softmax's statistics all-reduced), the rows the same on both. Each rank's
    sums are the whole ones (the metrics divide by tp), its head gradient the whole one's half."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from vlmcore.train.grpo import GRPOObjective

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    rank = dist.get_rank()
    report = {}
    for loss_type, beta in (("dapo", 0.1), ("gspo", 0.1)):
        results = []
        for sharded in (False, True):
            head = weight.clone()
            if sharded:
                head = distribute_tensor(head, mesh, [Shard(0)])
            head.requires_grad_()
            reference = HeadReference(reference_hidden, head.detach())
            objective = GRPOObjective(
                loss_type, 0.2, 0.28, TEMPERATURE, 8, beta, reference, chunk_tokens=5, tp=2 if sharded else 1
            )
            leaf = hidden.clone().requires_grad_()
            loss_sum, sums = objective.loss(leaf, head, host, objective.prepare(host, None))
            (loss_sum / counts[objective.count]).backward()
            if sharded:
                dist.all_reduce(sums)
            metrics = objective.metrics(sums.tolist(), counts)
            grad = head.grad.to_local() if sharded else head.grad.chunk(2)[rank]
            results.append((metrics, grad, leaf.grad))
        (whole_metrics, whole_head, whole_hidden), (metrics, head_grad, hidden_grad) = results
        report[f"tp {loss_type} beta {beta}"] = {
            "sums": max(abs(metrics[k] - whole_metrics[k]) for k in whole_metrics),
            "head": (head_grad - whole_head).abs().max().item(),
            "hidden": (hidden_grad - whole_hidden).abs().max().item(),
            "hidden_scale": whole_hidden.abs().max().item(),
        }
    return report


def test_cp2_and_tp2_losses_and_gradients_equal_one_process(tmp_path):
    from helpers import env

    out = tmp_path / "report.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__, str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env())
    assert proc.returncode == 0, proc.stderr[-6000:]
    reports = json.loads(out.read_text())
    for rank, report in enumerate(reports):
        assert len(report) == len(CASES) + 2
        for case, diffs in report.items():
            assert diffs["hidden_scale"] > 1e-3, (rank, case)  # the gradients are not all 0
            for name in ("sums", "head", "hidden"):
                assert diffs[name] < 1e-6, (rank, case, name, diffs)


GRPO_METRICS = ("loss", "grpo_ratio", "grpo_clip_low", "grpo_clip_high", "grpo_logp_gap", "grpo_kl", "grad_norm")


@pytest.mark.slow
def test_fsdp2_on_2_ranks_trains_as_one_process(tmp_path):
    """`vlmcore train` of a GRPO stage on random rollouts (each segment a completion, of its own
    length: the ranks' completions and completion tokens differ), per-completion (grpo) and
    per-token (dapo) normalisers: 2 FSDP2 ranks, one micro-batch each, against one process with
    two micro-batches, the same global batch. Each step's metrics and the final weights."""
    from helpers import load_dcp, read_metrics, train_cases, write_config

    from vlmcore.tiny import tiny_snapshot

    snapshot = tiny_snapshot("qwen3_vl", tmp_path / "model")

    def config(name: str, loss: str, grad_accum_steps: int) -> Path:
        return write_config(
            tmp_path / f"{name}.yaml",
            snapshot,
            tmp_path / name,
            steps=4,
            grad_accum_steps=grad_accum_steps,
            objective="grpo",
            grpo={"loss": loss, "beta": 0.04, "rewards": [{"name": "exact_match", "weight": 1.0}]},
            optimizer={"lr": 1.0e-2, "weight_decay": 0.0, "eps": 1.0e-6},
            data={"kind": "random", "seq_len": 48, "segments": 3, "image_fraction": 0.5},
            checkpoint={"enabled": False},
        )

    losses = ("grpo", "dapo")
    train_cases(1, [config(f"one-{loss}", loss, 2) for loss in losses])
    train_cases(2, [config(f"fsdp2-{loss}", loss, 1) for loss in losses])
    for loss in losses:
        expected = read_metrics(tmp_path / f"one-{loss}")
        got = read_metrics(tmp_path / f"fsdp2-{loss}")
        assert [m["step"] for m in got] == [m["step"] for m in expected] == [1, 2, 3, 4]
        for e, g in zip(expected, got):
            for key in GRPO_METRICS:
                assert g[key] == pytest.approx(e[key], rel=1e-4, abs=1e-6), (loss, e["step"], key)
        weights = load_dcp(tmp_path / f"fsdp2-{loss}" / "final")
        for key, value in load_dcp(tmp_path / f"one-{loss}" / "final").items():
            torch.testing.assert_close(weights[key], value, rtol=1e-4, atol=1e-5, msg=f"{loss} {key}")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the helpers in tests/
    worker(Path(sys.argv[1]))
