"""vlmcore.kernels: the GPU kernels' versions are judged before a job starts."""

import subprocess
import sys

import pytest

from vlmcore import kernels
from vlmcore.kernels import KernelError, check, experts_backend, fla_problem, linear_attention_backend
from vlmcore.workflow import check_kernels as check_workflow
from vlmcore.workflow import planned_family

HOPPER, AMPERE = (9, 0), (8, 0)


def versions(triton="3.6.0", fla="0.6.0", tilelang=None, backend=True, dispatch_disabled=False, torch="2.11.0"):
    return {
        "torch": torch,
        "triton": triton,
        "fla": fla,
        "tilelang": tilelang,
        "flash_attn": None,
        "fla_tilelang_backend": backend,
        "fla_dispatch_disabled": dispatch_disabled,
    }


@pytest.mark.parametrize(
    "case,capability,broken",
    [
        (versions(), HOPPER, True),  # torch 2.11's Triton 3.6 on an H100/GH200, no tilelang: the issue's failure
        (versions(triton="3.4.0"), HOPPER, True),
        (versions(triton="3.7.0"), HOPPER, True),
        (versions(triton="3.7.1"), HOPPER, False),
        (versions(triton="3.8.0+git1234"), HOPPER, False),
        (versions(triton="3.3.1"), HOPPER, False),
        (versions(tilelang="0.1.9"), HOPPER, False),  # fla runs the kernel in TileLang
        (versions(tilelang="0.1.9", backend=False), HOPPER, True),  # an fla without that backend
        (versions(tilelang="0.1.9", dispatch_disabled=True), HOPPER, True),
        (versions(fla="0.4.2"), HOPPER, True),  # older fla: no refusal of its own, wrong gradients
        (versions(), AMPERE, False),
        (versions(), None, False),
        (versions(fla=None), HOPPER, False),
    ],
)
def test_fla_on_hopper_needs_triton_3_7_1_or_tilelang(case, capability, broken):
    problem = fla_problem(case, capability)
    assert (problem is not None) == broken
    if broken:
        assert "pip install tilelang" in problem and "3.7.1" in problem and "linear_attention: torch" in problem


def test_linear_attention_backend_choice():
    assert linear_attention_backend("auto", versions(triton="3.7.1"), HOPPER) == "fla"
    assert linear_attention_backend("auto", versions(fla=None), HOPPER) == "torch"
    assert linear_attention_backend("auto", versions(), None) == "torch"  # no GPU
    assert linear_attention_backend("torch", versions(), HOPPER) == "torch"  # asked: correct, slower
    with pytest.raises(KernelError, match="fla issue 640"):
        linear_attention_backend("auto", versions(), HOPPER)
    with pytest.raises(KernelError, match="not installed"):
        linear_attention_backend("fla", versions(fla=None), HOPPER)
    with pytest.raises(KernelError, match="must be one of"):
        linear_attention_backend("triton", versions(), HOPPER)


def test_check_calls_the_installed_varlen_kernel_signature():
    chosen = check("auto", HOPPER, has_linear_attention=True, versions=versions(fla=None))
    assert chosen == {"attention": "torch.nn.attention.varlen.varlen_attn", "linear_attention": "torch"}
    assert check("auto", None, has_linear_attention=False, versions=versions()) == {
        "attention": "sdpa (per packed segment)"
    }


@pytest.mark.parametrize(
    "torch_version,capability,expected",
    [
        ("2.11.0+cu128", HOPPER, "grouped GEMM"),  # MN5 H100, JUPITER GH200
        ("2.9.1", (10, 0), "grouped GEMM"),  # B200
        ("2.8.0", HOPPER, "grouped GEMM"),
        ("2.10.0", AMPERE, "fallback on sm_80"),  # A100: correct, one GEMM per expert
        ("2.10.0", (12, 0), "fallback on sm_120"),
        ("2.13.0", None, "per-expert loop"),  # no GPU
        ("2.8.0", AMPERE, KernelError("torch 2.8.0 has no torch._grouped_mm for sm_80 .* torch >= 2.9")),
        ("2.8.0", (12, 0), KernelError("Hopper only")),
        ("2.7.1", HOPPER, KernelError("install torch >= 2.9")),
        ("2.11.0", (7, 5), KernelError("compute capability >= 8.0, this GPU is sm_75")),
    ],
)
def test_moe_experts_need_a_torch_with_grouped_mm_for_the_gpu(torch_version, capability, expected):
    case = versions(torch=torch_version)
    if isinstance(expected, KernelError):
        with pytest.raises(KernelError, match=str(expected)):
            experts_backend(case, capability)
    else:
        assert expected in experts_backend(case, capability)
    # Asked only for models with experts.
    assert "experts" not in check("torch", capability, has_linear_attention=False, versions=case)


def test_model_has_experts_from_the_staged_config_or_the_name(tmp_path):
    assert planned_family({"repo_id": "Qwen/Qwen3-VL-30B-A3B-Instruct"}).experts
    assert planned_family({"repo_id": "Qwen/Qwen3.5-397B-A17B"}).experts
    assert not planned_family({"repo_id": "Qwen/Qwen3-VL-2B-Instruct"}).experts
    (tmp_path / "config.json").write_text('{"model_type": "qwen3_vl_moe", "text_config": {"num_experts": 128}}')
    assert planned_family({"staged_path": str(tmp_path), "repo_id": "my/finetune"}).experts
    (tmp_path / "config.json").write_text('{"model_type": "qwen3", "num_experts": 0}')
    assert not planned_family({"staged_path": str(tmp_path), "repo_id": "x/y-30B-A3B"}).experts


def _workflow_config(repo_id, stages):
    return {"model": {"source": "hub", "repo_id": repo_id}, "train": {"gpu_capability": "9.0", "stages": stages}}


def test_workflow_stops_a_broken_stage_on_the_login_node(monkeypatch):
    monkeypatch.setattr(kernels, "installed_versions", lambda: versions())
    stages = {"stage1": {"parallel": {"linear_attention": "torch"}}, "stage2": {}}
    with pytest.raises(KernelError, match=r"train.stages.stage2 on train.gpu_capability 9.0: .*tilelang"):
        check_workflow(_workflow_config("Qwen/Qwen3.5-9B", stages), stages)
    # Models without linear attention and CPU experiments are not concerned.
    check_workflow(_workflow_config("Qwen/Qwen3-VL-2B-Instruct", stages), stages)
    config = _workflow_config("Qwen/Qwen3.5-9B", stages)
    del config["train"]["gpu_capability"]
    check_workflow(config, stages)


def test_workflow_stops_an_moe_run_whose_torch_lacks_the_grouped_gemm(monkeypatch):
    stages = {"sft": {}}
    config = dict(_workflow_config("Qwen/Qwen3-VL-30B-A3B-Instruct", stages), train={"gpu_capability": "8.0"})
    monkeypatch.setattr(kernels, "installed_versions", lambda: versions(torch="2.8.0"))
    with pytest.raises(KernelError, match=r"train.stages.sft on train.gpu_capability 8.0: MoE experts: .*torch >= 2.9"):
        check_workflow(config, stages)
    monkeypatch.setattr(kernels, "installed_versions", lambda: versions(torch="2.10.0"))
    check_workflow(config, stages)


def test_staged_snapshot_config_decides_linear_attention(tmp_path):
    (tmp_path / "config.json").write_text(
        '{"model_type": "qwen3_5", "text_config": {"layer_types": ["linear_attention", "full_attention"]}}'
    )
    assert planned_family({"staged_path": str(tmp_path), "repo_id": "some/name"}).linear_attention
    (tmp_path / "config.json").write_text('{"model_type": "qwen3_vl", "text_config": {}}')
    assert not planned_family({"staged_path": str(tmp_path), "repo_id": "Qwen/Qwen3.5-9B"}).linear_attention


def test_cli_reports_versions_and_refuses_a_bad_capability():
    ok = subprocess.run(
        [sys.executable, "-m", "vlmcore.cli", "kernels", "--gpu-capability", "9.0", "--experts"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ok.returncode == 0, ok.stderr
    assert (
        "GPU: sm_90" in ok.stdout and "torch: 2." in ok.stdout and "attention: torch.nn.attention.varlen" in ok.stdout
    )
    assert "experts: torch._grouped_mm (grouped GEMM, bf16)" in ok.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "vlmcore.cli", "kernels", "--gpu-capability", "hopper"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "expected MAJOR.MINOR" in bad.stderr
