"""The CUDA-only paths, checked on CPU.

- Calling conventions: stand-ins with the real signatures of every supported varlen attention
  kernel (torch 2.10, 2.11, 2.12+, flash-attn 2) and of fla's chunk_gated_delta_rule, computing
  with plain SDPA / the reference rule, are called through the same adapters the GPU uses and
  must give what the CPU path gives. (torch 2.11's signature took no `enable_gqa`: passing it was
  the bug that killed every GPU run at step 1.)
- No host sync: a training step of each family runs on the meta device, where any read of a
  device value is seen; the step's one read is counted. The MoE families run their experts
  through torch._grouped_mm (its meta kernel also checks the 16-byte stride alignment the CUDA
  kernel needs, in bf16), never the per-expert loop, which reads the token counts.
- No graph break: each decoder block compiles to one graph with attention (and the MoE block's
  grouped GEMMs) inside it.
- The GPU check of the experts' group padding (benchmarks/grouped_mm_alignment.py) runs.
"""

import inspect
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from vlmcore.models import build_model, linear_attention
from vlmcore.models.attention import adapt_varlen_kernel, attention, segment_sdpa, set_varlen_kernel
from vlmcore.models.linear_attention import chunk_gated_delta_rule, recurrent_gated_delta_rule, set_gdn_kernel
from vlmcore.models.moe import grouped_mm, moe_blocks
from vlmcore.tiny import hf_config as tiny_config


def masked_sdpa(q, k, v, cu_seqlens, causal, scale):
    """Reference on flattened (T, H, D) tensors: SDPA under the block-diagonal (and causal) mask.
    No host read, so it also runs on fake tensors and under torch.compile."""
    n = q.shape[0]
    seg = torch.bucketize(torch.arange(n, device=q.device), cu_seqlens[1:].long(), right=True)
    mask = seg[:, None] == seg[None, :]
    if causal:
        mask = mask & torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.transpose(0, 1),
        v.transpose(0, 1),
        attn_mask=mask,
        scale=scale,
        enable_gqa=k.shape[1] != q.shape[1],
    )
    return out.transpose(0, 1)


def _check_call(q, k, v, cu, max_q, max_k, gqa_allowed):
    assert q.dim() == 3 and k.dim() == 3, "varlen kernels take flattened (T, H, D) tensors"
    assert max_q == max_k
    assert isinstance(max_q, (int, torch.SymInt)), f"max_q must be a host int, got {type(max_q)}"
    if not gqa_allowed and k.shape[1] != q.shape[1]:
        raise ValueError(
            f"Expect query and key/value to have the same number of heads but got Hq={q.shape[1]} and Hkv={k.shape[1]}"
        )
    if not torch.compiler.is_compiling() and not cu.is_meta:
        assert max_q == int((cu[1:] - cu[:-1]).max()), "max_seqlen is not the longest segment"


# The real signatures (torch/nn/attention/varlen.py of each release; flash_attn_interface.py).
def varlen_attn_torch_2_10(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
    _check_call(query, key, value, cu_seq_q, max_q, max_k, gqa_allowed=False)
    return masked_sdpa(query, key, value, cu_seq_q, is_causal, None)


def varlen_attn_torch_2_11(
    query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1)
):
    _check_call(query, key, value, cu_seq_q, max_q, max_k, gqa_allowed=False)
    return masked_sdpa(query, key, value, cu_seq_q, tuple(window_size) == (-1, 0), scale)


def varlen_attn_torch_2_12(
    query,
    key,
    value,
    cu_seq_q,
    cu_seq_k,
    max_q,
    max_k,
    *,
    return_aux=None,
    scale=None,
    window_size=(-1, -1),
    enable_gqa=False,
    seqused_k=None,
    block_table=None,
    num_splits=None,
):
    _check_call(query, key, value, cu_seq_q, max_q, max_k, gqa_allowed=enable_gqa)
    return masked_sdpa(query, key, value, cu_seq_q, tuple(window_size) == (-1, 0), scale)


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    block_table=None,
):
    _check_call(q, k, v, cu_seqlens_q, max_seqlen_q, max_seqlen_k, gqa_allowed=True)
    return masked_sdpa(q, k, v, cu_seqlens_q, causal, softmax_scale)


VARLEN_KERNELS = [varlen_attn_torch_2_10, varlen_attn_torch_2_11, varlen_attn_torch_2_12, flash_attn_varlen_func]


def fla_chunk_gated_delta_rule(
    q,
    k,
    v,
    g,
    beta,
    scale=None,
    initial_state=None,
    output_final_state=False,
    use_qk_l2norm_in_kernel=False,
    use_beta_sigmoid_in_kernel=False,
    allow_neg_eigval=False,
    state_v_first=False,
    cu_seqlens=None,
    cu_seqlens_cpu=None,
    chunk_indices=None,
    cp_context=None,
    **kwargs,
):
    """fla 0.6.0's signature; (B=1, T, H, D) tensors, returns (out, final_state): final_state
    (N_segments, H, Dk, Dv) with output_final_state, else None."""
    assert q.dim() == 4 and q.shape[0] == 1, "fla takes (1, T, H, D) for packed sequences"
    assert g.dtype == torch.float32 and cu_seqlens.dtype == torch.long
    assert scale is None and initial_state is None
    if cu_seqlens_cpu is not None:
        assert cu_seqlens_cpu.device.type == "cpu" and cu_seqlens_cpu.dtype == torch.long
    if not output_final_state:
        out = chunk_gated_delta_rule(q[0], k[0], v[0], g[0], beta[0], cu_seqlens, use_qk_l2norm_in_kernel)
        return out[None], None
    out, state = chunk_gated_delta_rule(
        q[0], k[0], v[0], g[0], beta[0], cu_seqlens, use_qk_l2norm_in_kernel, final_state=True
    )
    return out[None], state.to(q.dtype)  # fla's state is in the inputs' dtype


@pytest.fixture
def restore_kernels():
    varlen, gdn, grouped = set_varlen_kernel(None), set_gdn_kernel(None), grouped_mm.set(None)
    yield
    set_varlen_kernel(*varlen)
    set_gdn_kernel(*gdn)
    grouped_mm.set(*grouped)


def test_stand_ins_have_the_installed_torch_signature():
    """The stand-in for this torch's release has its varlen_attn's exact signature."""
    from torch.nn.attention.varlen import varlen_attn  # torch >= 2.10, the project's floor

    real = inspect.signature(varlen_attn)
    names = [[(p.name, p.kind, p.default) for p in inspect.signature(k).parameters.values()] for k in VARLEN_KERNELS]
    assert [(p.name, p.kind, p.default) for p in real.parameters.values()] in names


@pytest.mark.parametrize("kernel", VARLEN_KERNELS, ids=lambda k: k.__name__)
@pytest.mark.parametrize("kv_heads", [4, 2])
@pytest.mark.parametrize("causal,scale", [(True, None), (False, None), (True, 0.3)])
def test_varlen_adapter_matches_sdpa(kernel, kv_heads, causal, scale, restore_kernels):
    torch.manual_seed(0)
    cu = torch.tensor([0, 5, 6, 13, 24], dtype=torch.int32)
    q = torch.randn(2, 12, 4, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 12, kv_heads, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 12, kv_heads, 8, dtype=torch.float64, requires_grad=True)
    expected = segment_sdpa(q, k, v, cu, causal, scale)
    grads = torch.autograd.grad(expected.square().sum(), (q, k, v))

    set_varlen_kernel(kernel, force=True)
    out = attention(q, k, v, cu, max_seqlen=11, causal=causal, scale=scale)
    torch.testing.assert_close(out, expected)
    for got, want in zip(torch.autograd.grad(out.square().sum(), (q, k, v)), grads):
        torch.testing.assert_close(got, want)


def test_unknown_varlen_signature_is_refused():
    def other_kernel(q, k, v, offsets):
        return q

    with pytest.raises(TypeError, match="not a known varlen attention signature"):
        adapt_varlen_kernel(other_kernel)


def _batch(family, device="cpu"):
    from vlmcore.train.random_data import RandomBatches

    config = tiny_config(family)
    data = RandomBatches(
        config,
        seq_len=64,
        segments=3,
        image_fraction=1.0,
        micro_batch_size=2,
        dp_rank=0,
        dp_world=1,
        grad_accum_steps=1,
        seed=0,
        image_side=2,
    )
    return config, data.batch(0).to(torch.device(device))


def _forward_backward(model, batch):
    images = batch.images
    out = model(
        batch.input_ids,
        pixel_values=images.pixel_values if images else None,
        image_grid_thw=images.grid_thw if images else None,
        position_ids=batch.position_ids,
        cu_seqlens=batch.cu_seqlens,
        max_seqlen=batch.max_seqlen,
    ).logits
    out.float().square().mean().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", ["qwen3", "qwen3_vl", "qwen3_5", "qwen3_vl_moe"])
def test_models_on_the_gpu_calling_path_match_the_cpu_path(family, restore_kernels):
    """Whole models through the varlen (torch 2.11 signature) and fla stand-ins, and the experts
    through torch._grouped_mm, equal the CPU kernels: max_seqlen, the image grids and the
    segment bounds reach every attention call."""
    config, batch = _batch(family)
    torch.manual_seed(0)
    model = build_model(config, device="cpu")
    model.init_weights()
    logits, grads = _forward_backward(model, batch)
    model.zero_grad()
    set_varlen_kernel(varlen_attn_torch_2_11, force=True)
    set_gdn_kernel(fla_chunk_gated_delta_rule, force=True)
    grouped_mm.set(torch._grouped_mm, force=True)
    got_logits, got_grads = _forward_backward(model, batch)
    torch.testing.assert_close(got_logits, logits)
    assert got_grads.keys() == grads.keys()
    for name in grads:
        torch.testing.assert_close(got_grads[name], grads[name], msg=name)


def test_fla_adapter_matches_the_reference_rule(restore_kernels):
    torch.manual_seed(0)
    cu = torch.tensor([0, 7, 30, 41], dtype=torch.int32)
    q, k = torch.randn(41, 2, 8), torch.randn(41, 2, 8)
    v = torch.randn(41, 2, 6)
    g, beta = -torch.rand(41, 2), torch.rand(41, 2)
    expected = recurrent_gated_delta_rule(q, k, v, g, beta, cu)
    set_gdn_kernel(fla_chunk_gated_delta_rule, force=True)
    torch.testing.assert_close(
        linear_attention.gated_delta_rule(q, k, v, g, beta, cu, cu_seqlens_cpu=cu.cpu()), expected, atol=1e-4, rtol=1e-4
    )


def test_generation_through_the_fla_calling_path_matches_the_cpu_path(restore_kernels):
    """A generation's prefill asks fla for each segment's final state (output_final_state) and
    decodes on from it: Qwen3.5's greedy tokens and log-probabilities through the fla stand-in
    equal the CPU path's."""
    from vlmcore.generate import Prompt, SamplingSettings, generate

    torch.manual_seed(0)
    model = build_model(tiny_config("qwen3_5"), device="cpu")
    model.init_weights()
    prompts = [Prompt(torch.randint(0, 100, (n,))) for n in (9, 70, 3)]  # 70: two chunks of 64
    settings = SamplingSettings(max_new_tokens=4, temperature=1.0, seed=3)
    expected = generate(model, prompts, settings)
    set_gdn_kernel(fla_chunk_gated_delta_rule, force=True)
    got = generate(model, prompts, settings)
    assert [g.tokens for g in got] == [g.tokens for g in expected]
    torch.testing.assert_close(
        torch.tensor([g.log_probs for g in got]), torch.tensor([g.log_probs for g in expected]), atol=1e-5, rtol=0
    )


def test_chunk_count_bound_keeps_the_rule_exact():
    """On a GPU the torch rule sizes its chunks from shapes (no host read): spare chunks change
    nothing. On the meta device (no values) it needs no read either."""
    torch.manual_seed(0)
    for bounds in ([0, 1, 2, 3, 130], [0, 64, 128], [0, 65], [0, 3, 3, 70]):
        cu = torch.tensor(bounds, dtype=torch.int32)
        n = bounds[-1]
        q, k, v = torch.randn(n, 2, 8), torch.randn(n, 2, 8), torch.randn(n, 2, 4)
        g, beta = -torch.rand(n, 2), torch.rand(n, 2)
        expected = recurrent_gated_delta_rule(q, k, v, g, beta, cu)
        with torch.device("meta"):
            shape = chunk_gated_delta_rule(*(t.to("meta") for t in (q, k, v, g, beta, cu))).shape
        assert shape == expected.shape
        torch.testing.assert_close(
            chunk_gated_delta_rule(q, k, v, g, beta, cu, bound_chunks=True), expected, atol=1e-4, rtol=1e-4
        )


class _HostReads(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts what would wait for the GPU when the meta device stands for it: scalar reads and
    copies to the host of meta tensors (host tensors' reads, such as the MoE metrics computed
    from the step's one read, wait for nothing). Each answers zeros, so the step runs on."""

    def __init__(self):
        super().__init__()
        self.reads = []
        self.grouped_gemms = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.grouped_gemms += func is torch.ops.aten._grouped_mm.default
        if func is torch.ops.aten._local_scalar_dense.default and args[0].is_meta:
            self.reads.append(f"{func} of {tuple(args[0].shape)}")
            return 0
        if (
            func is torch.ops.aten._to_copy.default
            and args[0].is_meta
            and kwargs.get("device") is not None
            and torch.device(kwargs["device"]).type == "cpu"
        ):
            self.reads.append(f"{func} to the host of {tuple(args[0].shape)}")
            return torch.zeros(args[0].shape, dtype=kwargs.get("dtype") or args[0].dtype)
        return func(*args, **kwargs)


@pytest.mark.parametrize(
    "family,forward_reads", [("qwen3", 0), ("qwen3_vl", 0), ("qwen3_5", 1), ("qwen3_moe", 0), ("qwen3_vl_moe", 0)]
)
def test_training_step_never_waits_for_the_gpu(family, forward_reads, restore_kernels, monkeypatch):
    """A bf16 training step with the GPU kernels' calling path, on the meta device (which holds
    no values, so any read of one is seen): forward/backward reads nothing from the device
    (Qwen3.5: the segment bounds once, for fla), and the step reads once (norm and loss, and
    the MoE statistics with them). The MoE experts run as grouped GEMMs (with their backward)."""
    from vlmcore.train import step as step_module

    set_varlen_kernel(varlen_attn_torch_2_11, force=True)
    set_gdn_kernel(fla_chunk_gated_delta_rule, force=True)
    grouped_mm.set(torch._grouped_mm, force=True)
    step_reads = []
    monkeypatch.setattr(
        step_module, "read_host", lambda *v: step_reads.append(len(v)) or [0.0] * sum(t.numel() for t in v)
    )
    config, host_batch = _batch(family)
    model = build_model(config, device="meta").to(torch.bfloat16)
    # The GPU's fused AdamW reads nothing on the host; SGD stands for it on meta, where AdamW's
    # non-fused paths would read their step counts.
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    train_step = step_module.build_step(model, optimizer, set(), None, chunk_tokens=32, max_grad_norm=1.0)
    batch = host_batch.to(torch.device("meta"))
    assert isinstance(batch.max_seqlen, int) and (batch.images is None or not torch.is_tensor(batch.images.grid_thw))
    with _HostReads() as reads:
        step_module.forward_backward(model, [batch], 100.0, train_step.vision_dummy, 32, moe=train_step.moe)
    assert len(reads.reads) == forward_reads, reads.reads
    # Per MoE block: 2 GEMMs forward, and each one's input and weight gradients backward.
    assert reads.grouped_gemms == 6 * len(moe_blocks(model)), reads.grouped_gemms
    model.zero_grad()
    with _HostReads() as reads:
        result = train_step([batch], 100.0, set_lr=lambda opt: None)
    assert len(reads.reads) == forward_reads, reads.reads
    assert step_reads == [2] and result.applied
    assert (result.moe is not None) == bool(moe_blocks(model))


def _block_inputs(family, block_kind):
    config, batch = _batch(family)
    model = build_model(config, device="cpu")
    model.init_weights()
    if block_kind == "vision":
        vision = model.model.visual
        grids = batch.images.grid_thw
        x = torch.randn(sum(t * h * w for t, h, w in grids), vision.config.hidden_size)
        cos, sin = vision.rotary(grids, x.device)
        lengths = [h * w for t, h, w in grids for _ in range(t)]
        cu = F.pad(torch.tensor(lengths).cumsum(0, dtype=torch.int32), (1, 0))
        return vision.blocks[0], (x, cos, sin, cu), {"max_seqlen": max(lengths)}
    text = model.model.language_model if hasattr(model.model, "language_model") else model.model
    layer = next(layer for layer in text.layers if getattr(layer, "layer_type", "full_attention") == block_kind)
    h = torch.randn(*batch.input_ids.shape, config.get_text_config().hidden_size)
    if family == "qwen3_5":
        cos, sin = text.rotary(batch.position_ids, h.dtype)
    else:
        from vlmcore.models.layers import mrope_cos_sin, rope_cos_sin, rope_inv_freq

        text_config = config.get_text_config()
        inv_freq = rope_inv_freq(text_config.rope_parameters, model.head_dim, "test")
        if family == "qwen3":
            cos, sin = rope_cos_sin(inv_freq, torch.arange(h.shape[1]).expand(h.shape[0], -1), h.dtype)
        else:
            cos, sin = mrope_cos_sin(
                inv_freq, batch.position_ids, text_config.rope_parameters["mrope_section"], h.dtype
            )
    return layer, (h, cos, sin, batch.cu_seqlens), {"max_seqlen": batch.max_seqlen}


@pytest.mark.parametrize(
    "family,block_kind,breaks",
    [
        ("qwen3", "full_attention", 0),
        ("qwen3_vl", "full_attention", 0),
        ("qwen3_vl", "vision", 0),
        ("qwen3_5", "full_attention", 0),
        ("qwen3_vl_moe", "full_attention", 0),
        # The Gated DeltaNet kernel (fla's Triton, not traceable) runs eagerly between two graphs:
        # every break is that one call.
        ("qwen3_5", "linear_attention", "gated_delta_rule"),
    ],
)
def test_blocks_compile_with_attention_inside(family, block_kind, breaks, restore_kernels):
    torch._dynamo.reset()
    set_varlen_kernel(varlen_attn_torch_2_12, force=True)
    set_gdn_kernel(fla_chunk_gated_delta_rule, force=True)
    grouped_mm.set(torch._grouped_mm, force=True)
    block, args, kwargs = _block_inputs(family, block_kind)
    if moe_blocks(block):  # torch._grouped_mm traces in bf16 only (its meta kernel), as it runs on the GPU
        block = block.to(torch.bfloat16)
        args = tuple(a.to(torch.bfloat16) if a.is_floating_point() else a for a in args)
    explanation = torch._dynamo.explain(block)(*args, **kwargs)
    if breaks == 0:
        assert explanation.graph_break_count == 0, explanation.break_reasons
    else:
        assert explanation.graph_break_count >= 1
        assert all(breaks in reason.reason for reason in explanation.break_reasons), explanation.break_reasons


@pytest.mark.parametrize("grouped", [False, True])
def test_compiled_moe_block_runs_its_local_experts_under_ep(grouped, restore_kernels, one_process_group):
    """Expert parallelism makes the experts' weights DTensors sharded over the EP ranks, and the
    MoE recipes compile each block: compiled, the block must still run its local experts, on the
    CPU loop and on the GPU's grouped GEMMs (torch._grouped_mm forced, bf16 as on the GPU). Under
    torch.compile, hasattr(weight, "to_local") was False for the DTensor, which went on into the
    expert matmuls and failed the first step. One rank (EP over a 1-rank mesh), against the
    eager block of the plain model on the same path."""
    import copy

    from torch.distributed.device_mesh import init_device_mesh

    from vlmcore.models.parts import breaks_graph
    from vlmcore.parallel.expert_parallel import apply_ep

    torch._dynamo.reset()
    dtype = torch.bfloat16 if grouped else torch.float32
    if grouped:
        grouped_mm.set(torch._grouped_mm, force=True)
    torch.manual_seed(0)
    model = build_model(tiny_config("qwen3_moe"), device="cpu")
    model.init_weights()
    model.to(dtype)
    sharded = copy.deepcopy(model)
    apply_ep(sharded, init_device_mesh("cpu", (1,), mesh_dim_names=("ep",)))
    block = moe_blocks(sharded)[0]
    assert breaks_graph(block) and not breaks_graph(moe_blocks(model)[0])  # the host-read split sizes
    block.compile()
    x = torch.randn(2, 24, model.config.hidden_size, dtype=dtype)
    runs = []
    for b in (moe_blocks(model)[0], block):
        x_in = x.clone().requires_grad_()
        y = b(x_in)
        y.float().square().sum().backward()
        grads = {n: p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for n, p in b.named_parameters()}
        runs.append((y.detach(), x_in.grad, grads))
    assert type(block.experts.gate_up_proj).__name__ == "DTensor"
    tolerance = dict(rtol=2e-2, atol=2e-3) if grouped else {}
    (want, want_dx, want_grads), (got, got_dx, got_grads) = runs
    torch.testing.assert_close(got, want, **tolerance)
    torch.testing.assert_close(got_dx, want_dx, **tolerance)
    assert got_grads.keys() == want_grads.keys()
    for name in want_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], msg=name, **tolerance)


@pytest.mark.parametrize("checkpointing", ["full", "selective"])
def test_moe_blocks_compile_whole_under_activation_checkpointing(checkpointing, restore_kernels):
    """Dynamo traces a checkpointed block as one region and runs the whole block eagerly if any of
    it cannot go in: the MoE block's kept routing (a side effect) did that, so compile did nothing
    for MoE models under activation checkpointing. On the GPU's calling path (varlen and grouped
    GEMM stand-ins, bf16), the compiled blocks are one graph, and loss and gradients, the router's
    through the load-balancing loss included, follow the eager model."""
    import copy

    from torch._dynamo.utils import counters

    from vlmcore.models.moe import RoutingStats
    from vlmcore.parallel.ac import apply_ac
    from vlmcore.parallel.compile import apply_compile

    torch._dynamo.reset()
    counters.clear()
    set_varlen_kernel(varlen_attn_torch_2_12, force=True)
    grouped_mm.set(torch._grouped_mm, force=True)
    config = tiny_config("qwen3_moe")
    torch.manual_seed(0)
    model = build_model(config, device="cpu")
    model.init_weights()
    model.to(torch.bfloat16)
    compiled = copy.deepcopy(model)
    for m in (model, compiled):
        apply_ac(m.model.layers, checkpointing)
    apply_compile(compiled.model.layers, checkpointing)
    ids = torch.randint(0, config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(1))
    runs = []
    for m in (model, compiled):
        routing = RoutingStats(moe_blocks(m))
        logits = m(ids).logits
        aux, _ = routing.loss()
        loss = logits.float().square().mean() + config.router_aux_loss_coef * aux
        with routing.not_kept():
            loss.backward()
        runs.append((loss.detach(), {n: p.grad for n, p in m.named_parameters()}))
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"], dict(counters["graph_break"])
    (want_loss, want), (got_loss, got) = runs
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-3, atol=1e-5)
    assert got.keys() == want.keys() and any("gate.weight" in name for name in want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=2e-2, atol=1e-3, msg=name)


@pytest.mark.parametrize("checkpointing, graphs", [("full", 6), ("selective", 2)])
def test_blocks_with_a_graph_break_compile_under_activation_checkpointing(checkpointing, graphs, restore_kernels):
    """Qwen3.5 (3 Gated DeltaNet layers, whose fla call breaks the graph, and 1 attention layer,
    with a vision tower) on the GPU's calling path. Checkpointed, the DeltaNet blocks could not
    compile as regions, and their failure made dynamo skip the checkpoint wrapper's code for every
    block: only the vision blocks, which run first, compiled (1 graph). Now under full
    checkpointing the DeltaNet layers compile inside the checkpoint, in pieces; under selective
    they run eagerly; the attention layer and the vision blocks compile as regions (1 graph each
    kind). Loss and every gradient follow the eager model."""
    import copy

    from torch._dynamo.utils import counters

    from vlmcore.models.parts import breaks_graph
    from vlmcore.parallel.ac import apply_ac
    from vlmcore.parallel.compile import apply_compile

    torch._dynamo.reset()
    counters.clear()
    set_varlen_kernel(varlen_attn_torch_2_12, force=True)
    set_gdn_kernel(fla_chunk_gated_delta_rule, force=True)
    config, batch = _batch("qwen3_5")
    torch.manual_seed(0)
    model = build_model(config, device="cpu")
    model.init_weights()
    compiled = copy.deepcopy(model)
    assert [breaks_graph(block) for block in model.decoder_layers()] == [True, True, True, False]
    for m in (model, compiled):
        for stack in (m.decoder_layers(), m.vision_layers()):
            apply_ac(stack, checkpointing)
    for stack in (compiled.decoder_layers(), compiled.vision_layers()):
        apply_compile(stack, checkpointing)
    (want_out, want), (got_out, got) = [_forward_backward(m, batch) for m in (model, compiled)]
    # Full: 6, as many as the same blocks compile without checkpointing (the vision blocks, the
    # attention layer, 4 pieces of the DeltaNet layers).
    assert counters["stats"]["unique_graphs"] == graphs, dict(counters["stats"])
    torch.testing.assert_close(got_out, want_out, rtol=1e-4, atol=1e-5)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-3, atol=1e-5, msg=name)


# Inductor, as training compiles, once; the checkpointed blocks with AOTAutograd alone: where their
# sizes are symbolic is dynamo's (the checkpoint wrapper's argument names), and inductor's C++
# compile of the same blocks would add 30 s of CPU.
@pytest.mark.parametrize(
    "checkpointing, backend", [("none", "inductor"), ("selective", "aot_eager"), ("full", "aot_eager")]
)
def test_compiled_blocks_take_a_new_batch_shape_without_compiling_again(checkpointing, backend, restore_kernels):
    """What changes from one packed batch to the next: the longest segment (max_seqlen, a host
    integer for the varlen kernel), the number of segments (cu_seqlens), and the vision tower's
    images and patches. The blocks compiled the first batch's values as constants, then every
    block kind again as symbols at the first batch that differed, at the start of every job. Now
    the first compile is the only one (the models mark those sizes, `varies_by_batch`; compile.py
    max_seqlen), checkpointed blocks too, whose compiled code is the checkpoint wrapper's."""
    from torch._dynamo.utils import counters

    from vlmcore.parallel.ac import apply_ac
    from vlmcore.parallel.compile import apply_compile
    from vlmcore.train.random_data import RandomBatches

    torch._dynamo.reset()
    counters.clear()
    set_varlen_kernel(varlen_attn_torch_2_12, force=True)
    config = tiny_config("qwen3_vl")
    torch.manual_seed(0)
    model = build_model(config, device="cpu")
    model.init_weights()
    for stack in (model.decoder_layers(), model.vision_layers()):
        apply_ac(stack, checkpointing)
        apply_compile(stack, checkpointing, backend=backend)
    batches = []
    for seed, (segments, image_side) in enumerate([(3, 2), (2, 3), (4, 2), (3, 4)]):
        data = RandomBatches(
            config,
            seq_len=96,
            segments=segments,
            image_fraction=1.0,
            micro_batch_size=2,
            dp_rank=0,
            dp_world=1,
            grad_accum_steps=1,
            seed=seed,
            image_side=image_side,
        )
        batches.append(data.batch(0).to(torch.device("cpu")))
    assert len({b.max_seqlen for b in batches}) > 1
    assert len({b.cu_seqlens.numel() for b in batches}) > 1
    assert len({b.images.pixel_values.shape[0] for b in batches}) > 1
    _forward_backward(model, batches[0])
    assert counters["stats"]["unique_graphs"] == 2  # one graph a block kind: the vision and the decoder blocks
    with torch._dynamo.config.patch(error_on_recompile=True):
        for batch in batches[1:]:
            model.zero_grad()
            _forward_backward(model, batch)


def test_chunked_loss_compiles_to_one_graph():
    from vlmcore.train.loss import _chunk_loss_and_grad

    torch._dynamo.reset()
    logits, target = torch.randn(16, 40, dtype=torch.bfloat16), torch.randint(0, 40, (16,))
    explanation = torch._dynamo.explain(_chunk_loss_and_grad)(logits, target, target != 3, 40, None)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1, explanation.break_reasons


def test_the_data_loader_pins_every_tensor_of_a_batch(monkeypatch):
    """torch's DataLoader with pin_memory=True (the packed loader's on a GPU machine) pins what
    has a `pin_memory()` method and passes other objects through unpinned: the batch must have
    one that reaches every tensor, the images' pixels above all (their copy was pageable on the
    H200 before). Tensor.pin_memory needs CUDA, so a stand-in records the calls."""
    from torch.utils.data._utils.pin_memory import pin_memory

    from vlmcore.train.random_data import RandomBatches

    config = tiny_config("qwen3_vl")
    batch = RandomBatches(
        config,
        seq_len=128,
        segments=2,
        image_fraction=1.0,
        micro_batch_size=2,
        dp_rank=0,
        dp_world=1,
        grad_accum_steps=1,
        seed=0,
        video_fraction=1.0,
    ).batch(0)
    pinned = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t, *args, **kwargs: pinned.append(t) or t.clone())
    out = pin_memory(batch)
    expected = [
        batch.input_ids,
        batch.labels,
        batch.cu_seqlens,
        batch.position_ids,
        batch.images.pixel_values,
        batch.videos.pixel_values,
    ]
    assert all(any(t is p for p in pinned) for t in expected)
    assert type(out) is type(batch) and torch.equal(out.images.pixel_values, batch.images.pixel_values)


def test_grouped_mm_alignment_check_runs_both_paths():
    """benchmarks/grouped_mm_alignment.py, the GPU check of whether the experts' groups still need
    padding to 8 rows, on CPU at its tiny shape (bf16, eager and compiled): both paths run on the
    same routing, which has groups that are not multiples of 8 and an empty expert, and are
    compared with the fp32 per-expert loop. On CPU the kernel takes unaligned groups, and the
    unpadded path gives the padded one's results bit for bit."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from grouped_mm_alignment import measure

    result = measure("tiny", torch.device("cpu"), compile_too=True, steps=1)
    assert result["counts_not_multiple_of_align"] > 0 and result["empty_experts"] == 1
    assert [(c["path"], c["compiled"]) for c in result["cases"]] == [
        ("padded", False),
        ("unpadded", False),
        ("padded", True),
        ("unpadded", True),
    ]
    for case in result["cases"]:
        assert case["runs"], case.get("traceback")
        assert 0 < case["max_error"] < 2e-2, case["errors"]
        assert case["ms"] > 0
        if case["path"] == "unpadded":
            assert case["bit_equal_to_padded"] and case["usable"]
