"""The GPU-only checks of issue 31 (item 3), one command on a lent GPU machine:

    PYTHONPATH=src python benchmarks/gpu_checks.py --out $OUT

1. expert mesh: the NCCL process groups of the experts' unflattened mesh (`dp_shard_mod_ep x ep`,
   built as vlmcore.parallel.mesh.Meshes builds it) are created and reduce; a tiny MoE model with
   `apply_ep` over the 1-rank `ep` group (the real all-to-all dispatch on NCCL) gives the same
   logits and gradients as without it;
2. a 1-GPU `vlmcore train` run of a tiny Qwen3-VL-MoE in bf16 steps, with finite losses;
3. resume: a bf16 run with fused AdamW interrupted by SIGUSR1 and resumed ends bit-identical
   (losses, grad norms, final weights) to the uninterrupted run, eager and compiled;
4. the experts' grouped GEMMs at Qwen3-VL-30B-A3B's layer shape (issue 43 item 5,
   benchmarks/grouped_mm_alignment.py): vlmcore's padded groups match the fp32 per-expert loop,
   and whether the installed torch's kernel also takes groups that are not multiples of 8 rows
   (eager and compiled: runs, error, time), which would let the padding go.

Each check prints PASS or FAIL with its figures and the script goes on to the next; all of it
is written to gpu_checks.json in --out. Exit status 1 if any check failed.
"""

import argparse
import copy
import json
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
from common import read_metrics, src_env, train_command, write_results, write_run_config

from vlmcore.export import load_final_state_dict
from vlmcore.tiny import tiny_snapshot

RESUME_STEPS = 24


def train(config: Path, check: bool = True, timeout: int = 300) -> subprocess.CompletedProcess:
    """`vlmcore train CONFIG` in a process of its own, on the GPU."""
    proc = subprocess.run(
        train_command(1, config), capture_output=True, text=True, timeout=timeout, env=src_env(cpu=False)
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"vlmcore train failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


def start_train(config: Path) -> subprocess.Popen:
    return subprocess.Popen(
        train_command(1, config), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=src_env(cpu=False)
    )


def check_expert_mesh(tmp: Path) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from vlmcore.models import from_pretrained
    from vlmcore.parallel.expert_parallel import apply_ep
    from vlmcore.parallel.mesh import device_for_rank, init_distributed

    device = device_for_rank()
    init_distributed(device)
    try:
        mesh = init_device_mesh(device.type, (1, 1, 1), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
        experts = mesh._unflatten(1, (1, 1), ("dp_shard_mod_ep", "ep"))
        backends = {}
        for name in ("dp_shard_mod_ep", "ep"):
            group = experts[name].get_group()
            value = torch.full((1,), 3.0, device=device)
            dist.all_reduce(value, group=group)
            assert value.item() == 3.0, (name, value)
            backends[name] = str(dist.get_backend(group))
        assert device.type != "cuda" or "nccl" in backends["ep"], backends

        torch.manual_seed(0)
        snapshot = tiny_snapshot("qwen3_moe", tmp / "qwen3_moe")
        reference = from_pretrained(snapshot, dtype=torch.bfloat16, device=device)
        model = copy.deepcopy(reference)
        apply_ep(model, experts["ep"])
        ids = torch.randint(0, 256, (1, 256), device=device)
        logits = {}
        for name, m in (("reference", reference), ("ep", model)):
            out = m(ids).logits.float()
            out.square().mean().backward()
            logits[name] = out
        max_logit_diff = (logits["ep"] - logits["reference"]).abs().max().item()
        grad_diffs = {}
        for (name, p), (_, q) in zip(reference.named_parameters(), model.named_parameters()):
            g = q.grad.full_tensor() if hasattr(q.grad, "full_tensor") else q.grad
            grad_diffs[name] = (g.float() - p.grad.float()).abs().max().item()
        worst = max(grad_diffs, key=grad_diffs.get)
        ok = max_logit_diff == 0.0 and grad_diffs[worst] == 0.0
        return dict(
            ok=ok, backends=backends, max_logit_diff=max_logit_diff, worst_grad=worst, worst_grad_diff=grad_diffs[worst]
        )
    finally:
        dist.destroy_process_group()


def check_moe_run(tmp: Path) -> dict:
    snapshot = tiny_snapshot("qwen3_vl_moe", tmp / "qwen3_vl_moe")
    cfg = write_run_config(tmp / "moe.yaml", snapshot, tmp / "moe_run", steps=6, precision={"param_dtype": "bfloat16"})
    proc = train(cfg, check=False)
    metrics = read_metrics(tmp / "moe_run")
    losses = [m["loss"] for m in metrics]
    ok = proc.returncode == 0 and len(losses) == 6 and all(torch.isfinite(torch.tensor(losses)))
    return dict(ok=ok, returncode=proc.returncode, losses=losses, stderr_tail=None if ok else proc.stderr[-3000:])


def check_resume(tmp: Path, compiled: bool) -> dict:
    name = "compiled" if compiled else "eager"
    tmp = tmp / f"resume_{name}"
    snapshot = tiny_snapshot("qwen3_vl", tmp / "model")
    sets = dict(steps=RESUME_STEPS, precision={"param_dtype": "bfloat16"}, parallel={"compile": compiled})
    train(write_run_config(tmp / "full.yaml", snapshot, tmp / "full", **sets), timeout=600)
    out = tmp / "interrupted"
    cfg = write_run_config(tmp / "interrupted.yaml", snapshot, out, checkpoint={"interval": 0}, **sets)
    proc = start_train(cfg)
    deadline = time.time() + 300
    while len(read_metrics(out)) < 3 and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, f"the run ended before it could be interrupted:\n{proc.communicate()[1][-3000:]}"
    proc.send_signal(signal.SIGUSR1)
    proc.communicate(timeout=300)
    stopped_at = (out / "checkpoints" / "latest").read_text().strip()
    train(cfg, timeout=600)
    reference, resumed = read_metrics(tmp / "full"), read_metrics(out)
    same_losses = [m["loss"] for m in resumed] == [m["loss"] for m in reference]
    same_norms = [m["grad_norm"] for m in resumed] == [m["grad_norm"] for m in reference]
    ref_weights, weights = load_final_state_dict(tmp / "full" / "final"), load_final_state_dict(out / "final")
    different = [k for k in ref_weights if not torch.equal(weights[k], ref_weights[k])]
    ok = same_losses and same_norms and not different and len(resumed) == RESUME_STEPS
    return dict(
        ok=ok,
        stopped_at=stopped_at,
        steps=len(resumed),
        same_losses=same_losses,
        same_grad_norms=same_norms,
        tensors=len(ref_weights),
        different_tensors=different[:10],
        final_loss=resumed[-1]["loss"] if resumed else None,
    )


def check_grouped_mm_alignment(tmp: Path) -> dict:
    """Passes when vlmcore's padded path is right; the unpadded path's figures are the finding."""
    from grouped_mm_alignment import measure, print_table

    result = measure("30b-a3b", torch.device("cuda"), compile_too=True, steps=10)
    print_table(result)
    padded = [c for c in result["cases"] if c["path"] == "padded"]
    ok = all(c["runs"] and c["max_error"] < 0.05 for c in padded)
    for case in result["cases"]:
        case.pop("traceback", None)  # the error line stays; the table above shows it
    return dict(ok=ok, **result)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_checks: no CUDA device", file=sys.stderr)
        return 2
    results = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "checks": {},
    }
    checks = [
        ("expert_mesh", check_expert_mesh),
        ("moe_run_bf16", check_moe_run),
        ("resume_bf16_fused_adamw_eager", lambda tmp: check_resume(tmp, compiled=False)),
        ("resume_bf16_fused_adamw_compiled", lambda tmp: check_resume(tmp, compiled=True)),
        ("grouped_mm_alignment", check_grouped_mm_alignment),
    ]
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for name, check in checks:
            start = time.time()
            try:
                result = check(Path(tmp))
            except Exception:
                result = dict(ok=False, error=traceback.format_exc()[-3000:])
            result["wall_s"] = round(time.time() - start, 1)
            results["checks"][name] = result
            print(f"{'PASS' if result['ok'] else 'FAIL'} {name}: {json.dumps(result)}", flush=True)
            write_results(args.out / "gpu_checks.json", results)
    return 0 if all(r["ok"] for r in results["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
