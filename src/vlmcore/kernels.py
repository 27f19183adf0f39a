"""`vlmcore kernels`: the GPU kernels' versions, checked before a job starts, never after the queue wait.

`check` chooses each part's backend for a GPU and refuses a combination known to compute wrongly.
`vlmcore train` calls it on its GPU before building the model (and hands the choice to the model
code, vlmcore.models.use_backends); the workflow calls it on the login node when it is parsed
(for the cluster's GPU, `train.gpu_capability`: vlmcore.workflow.check_kernels), so a broken
combination stops `snakemake` before any job is queued. `vlmcore kernels` prints the report.

Known bad combinations (docs/hpc.md has the versions each cluster needs):
- flash-linear-attention on Hopper (compute capability 9.x) with Triton >= 3.4.0 and < 3.7.1:
  the backward of the gated chunk kernel (`chunk_bwd_dqkwg`) gives wrong gradients (fla issue
  640). fla 0.6 refuses at the first backward, older releases silently train on wrong gradients.
  Correct: Triton >= 3.7.1, or tilelang installed for fla's TileLang backend of that kernel.
- torch's varlen attention: its signature changed in every release from 2.10 to 2.12; the
  installed kernel's signature is checked against the ones vlmcore calls (models/attention.py).
- MoE experts (models/moe.py) run as torch._grouped_mm. torch 2.8 has it on Hopper only (other
  GPUs raise "only supported on CUDA devices with compute capability = 9.0"); torch >= 2.9 runs
  it from compute capability 8.0, but only 9.x and 10.x get the grouped GEMM kernel (bf16, no host
  sync); other GPUs get torch's fallback, one GEMM per expert after reading the group offsets on
  the host (aten GroupedBlas.cpp `_grouped_mm_cuda`, GroupedMMUtils.h `_grouped_mm_fallback`).
"""

import argparse
import importlib.metadata
import os
import sys
import typing

from packaging.version import Version

from vlmcore.config import LinearAttentionBackend

LINEAR_ATTENTION_BACKENDS = typing.get_args(LinearAttentionBackend)
TRITON_HOPPER_BAD = (Version("3.4.0"), Version("3.7.1"))
GROUPED_MM_HOPPER_ONLY = Version("2.8.0")
GROUPED_MM_FROM_SM80 = Version("2.9.0")
GROUPED_GEMM_FAST_MAJORS = (9, 10)


class KernelError(RuntimeError):
    pass


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _fla_has_tilelang_backend() -> bool:
    """fla ships a TileLang backend for the Hopper bug's kernel (fla >= 0.5); without it tilelang
    does not help. Read from the installed file list: importing fla needs a GPU's Triton."""
    for dist in ("fla-core", "flash-linear-attention"):
        try:
            files = importlib.metadata.files(dist) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        if any(str(f).replace("\\", "/").startswith("fla/ops/common/backends/tilelang/") for f in files):
            return True
    return False


def installed_versions() -> dict:
    """Versions of the packages whose kernels vlmcore calls (None: not installed), read from the
    package metadata: nothing is imported, so this runs on a login node without a GPU."""
    return {
        "torch": _version("torch"),
        "triton": _version("triton") or _version("pytorch-triton"),
        "fla": _version("fla-core") or _version("flash-linear-attention"),
        "tilelang": _version("tilelang"),
        "flash_attn": _version("flash-attn") or _version("flash_attn"),
        "fla_tilelang_backend": _fla_has_tilelang_backend(),
        "fla_dispatch_disabled": os.environ.get("FLA_DISABLE_BACKEND_DISPATCH", "0") not in ("", "0"),
    }


def _base(version: str) -> Version:
    return Version(Version(version).base_version)


def fla_problem(versions: dict, capability: tuple[int, int] | None) -> str | None:
    """Why fla's Gated DeltaNet kernels would train wrongly on a GPU of `capability`, or None."""
    if versions.get("fla") is None or capability is None or capability[0] != 9 or versions.get("triton") is None:
        return None
    triton = _base(versions["triton"])
    if not TRITON_HOPPER_BAD[0] <= triton < TRITON_HOPPER_BAD[1]:
        return None
    if versions.get("tilelang") and versions.get("fla_tilelang_backend") and not versions.get("fla_dispatch_disabled"):
        return None
    return (
        f"flash-linear-attention {versions['fla']} with Triton {versions['triton']} on a Hopper GPU "
        f"(sm_{capability[0]}{capability[1]}) computes wrong Gated DeltaNet gradients (fla issue 640: "
        "chunk_bwd_dqkwg on Triton >= 3.4.0, < 3.7.1). Fix one of: `pip install tilelang` (fla >= 0.5 then "
        "runs that kernel in TileLang; unset FLA_DISABLE_BACKEND_DISPATCH), Triton >= 3.7.1 with a torch built "
        "for it, or parallel.linear_attention: torch in the stage (the pure-torch kernel: correct, slower)"
    )


def linear_attention_backend(requested: str, versions: dict, capability: tuple[int, int] | None) -> str:
    """'fla' or 'torch' for the Gated DeltaNet layers on a GPU of `capability` (None: no GPU);
    raises KernelError where the request cannot run correctly."""
    if requested not in LINEAR_ATTENTION_BACKENDS:
        raise KernelError(f"linear_attention: must be one of {', '.join(LINEAR_ATTENTION_BACKENDS)}, got {requested!r}")
    if requested == "torch" or capability is None:
        return "torch"
    if versions.get("fla") is None:
        if requested == "fla":
            raise KernelError(
                "linear_attention: fla is asked for but flash-linear-attention is not installed "
                "(pip install 'vlmcore[gpu]', see docs/hpc.md)"
            )
        return "torch"
    problem = fla_problem(versions, capability)
    if problem:
        raise KernelError(problem)
    return "fla"


def attention_backend(capability: tuple[int, int] | None) -> str:
    """Which kernel packed attention runs; raises KernelError for a varlen kernel vlmcore cannot call."""
    if capability is None:
        return "sdpa (per packed segment)"
    from vlmcore.models import attention

    kernel = attention.VARLEN.kernel
    if kernel is None:
        return "sdpa (per packed segment; no varlen kernel: install torch >= 2.10 or flash-attn)"
    try:
        attention.adapt_varlen_kernel(kernel)
    except TypeError as e:
        raise KernelError(f"attention: {e}") from None
    return f"{kernel.__module__}.{kernel.__name__}"


def experts_backend(versions: dict, capability: tuple[int, int] | None) -> str:
    """How the MoE experts run on a GPU of `capability` (None: no GPU); raises KernelError where
    the installed torch cannot run them there."""
    if capability is None:
        return "per-expert loop (no GPU)"
    gpu = f"sm_{capability[0]}{capability[1]}"
    torch_version = _base(versions["torch"]) if versions.get("torch") else Version("0")
    if torch_version < GROUPED_MM_HOPPER_ONLY or (torch_version < GROUPED_MM_FROM_SM80 and capability[0] != 9):
        raise KernelError(
            f"MoE experts: torch {versions.get('torch')} has no torch._grouped_mm for {gpu} "
            f"(torch 2.8 has it on Hopper only): install torch >= {GROUPED_MM_FROM_SM80}"
        )
    if capability < (8, 0):
        raise KernelError(f"MoE experts: torch._grouped_mm needs compute capability >= 8.0, this GPU is {gpu}")
    if capability[0] in GROUPED_GEMM_FAST_MAJORS:
        return "torch._grouped_mm (grouped GEMM, bf16)"
    return (
        f"torch._grouped_mm fallback on {gpu}: one GEMM per expert after a host read of the offsets "
        "(correct, slow; the grouped GEMM needs compute capability 9.x or 10.x)"
    )


def check(
    requested_linear_attention: str,
    capability: tuple[int, int] | None,
    has_linear_attention: bool,
    versions: dict | None = None,
    has_experts: bool = False,
) -> dict:
    """The backends a run will use, or KernelError naming the fix. `capability` None: no GPU."""
    versions = versions or installed_versions()
    chosen = {"attention": attention_backend(capability)}
    if has_linear_attention:
        chosen["linear_attention"] = linear_attention_backend(requested_linear_attention, versions, capability)
    if has_experts:
        chosen["experts"] = experts_backend(versions, capability)
    return chosen


def parse_capability(text: str | None) -> tuple[int, int] | None:
    if not text:
        return None
    try:
        major, minor = (int(x) for x in str(text).split("."))
    except ValueError:
        raise KernelError(f"gpu capability: expected MAJOR.MINOR such as 9.0, got {text!r}") from None
    return major, minor


def report(versions: dict, backends: dict, capability: tuple[int, int] | None) -> str:
    gpu = f"sm_{capability[0]}{capability[1]}" if capability else "none"
    lines = [f"GPU: {gpu}"]
    lines += [
        f"{name}: {versions[name] or 'not installed'}" for name in ("torch", "triton", "fla", "tilelang", "flash_attn")
    ]
    lines += [f"{part}: {backend}" for part, backend in backends.items()]
    return "\n".join(lines)


def capability_arg(text: str) -> str:
    try:
        parse_capability(text)
    except KernelError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("gpu capability: ")) from None
    return text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--gpu-capability",
        type=capability_arg,
        help="compute capability of the GPUs the job will run on, e.g. 9.0 "
        "for H100, H200 and GH200 (default: this machine's GPU, none without one)",
    )
    parser.add_argument(
        "--linear-attention",
        default="auto",
        choices=LINEAR_ATTENTION_BACKENDS,
        help="Gated DeltaNet backend as in the training config",
    )
    parser.add_argument("--no-linear-attention", action="store_true", help="the model has no linear attention")
    parser.add_argument("--experts", action="store_true", help="the model has mixture-of-experts layers")


def run(args: argparse.Namespace) -> int:
    try:
        capability = parse_capability(args.gpu_capability)
        if capability is None:
            import torch

            capability = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
        versions = installed_versions()
        backends = check(args.linear_attention, capability, not args.no_linear_attention, versions, args.experts)
    except KernelError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(report(versions, backends, capability))
    return 0
