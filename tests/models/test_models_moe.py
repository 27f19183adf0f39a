"""Sparse MoE (models/moe.py) against transformers: Qwen3-MoE logits, loss with the load-balancing
term, every gradient; the grouped-GEMM calling path against the per-expert loop; snapshot IO in
the per-expert storage format the checkpoints use."""

import pytest
import torch
from helpers import grad_diffs, hf_and_native, max_rel
from safetensors.torch import load_file
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

import vlmcore.models as models
from vlmcore.models.moe import GroupedExperts, RoutingStats, grouped_mm, moe_blocks

SHAPES = {
    "top2-renormalised": dict(norm_topk_prob=True),
    "top2-raw-dense-layer": dict(norm_topk_prob=False, mlp_only_layers=[1], num_hidden_layers=3),
    "top3-sparse-step2-tied": dict(num_experts_per_tok=3, decoder_sparse_step=2, tie_word_embeddings=True),
}


def qwen3_moe_config(**overrides):
    return Qwen3MoeConfig(
        **{
            **dict(
                vocab_size=256,
                hidden_size=64,
                intermediate_size=96,
                moe_intermediate_size=48,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=16,
                num_experts=8,
                num_experts_per_tok=2,
                router_aux_loss_coef=0.02,
                tie_word_embeddings=False,
            ),
            **overrides,
        }
    )


def pair(tmp_path, **overrides):
    return hf_and_native(Qwen3MoeForCausalLM, qwen3_moe_config(**overrides), tmp_path / "hf")


@pytest.mark.parametrize("shape", SHAPES)
def test_logits_loss_with_aux_and_grads_match_transformers(tmp_path, shape):
    hf, native = pair(tmp_path, **SHAPES[shape])
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(1))
    ref = hf(input_ids=ids, labels=ids, output_router_logits=True)
    routing = RoutingStats(moe_blocks(native))
    out = native(ids).logits
    assert max_rel(out, ref.logits) < 1e-4
    labels = ids[:, 1:].flatten()
    ce = torch.nn.functional.cross_entropy(out[:, :-1].flatten(0, 1), labels)
    aux, counts = routing.loss()
    torch.testing.assert_close(aux, ref.aux_loss, rtol=1e-5, atol=1e-6)
    loss = ce + native.config.router_aux_loss_coef * aux
    torch.testing.assert_close(loss, ref.loss, rtol=1e-5, atol=1e-6)
    assert counts.sum().item() == len(moe_blocks(native)) * ids.numel() * native.config.num_experts_per_tok
    ref.loss.backward()
    loss.backward()
    diffs = grad_diffs(native, hf)
    assert max(diffs.values()) < 1e-4, sorted(diffs.items(), key=lambda kv: -kv[1])[:5]
    assert any("gate.weight" in n and d < 1e-4 for n, d in diffs.items())  # the aux loss reaches the router


def test_dense_and_sparse_layers_follow_the_config(tmp_path):
    _, native = pair(tmp_path, **SHAPES["top3-sparse-step2-tied"])
    kinds = [type(layer.mlp).__name__ for layer in native.decoder_layers()]
    assert kinds == ["SwiGLU", "SparseMoeBlock"]


def test_grouped_gemm_path_equals_the_expert_loop():
    """The GPU's grouped-GEMM call (torch._grouped_mm with its real signature, forced onto the CPU
    in fp32) against the exact per-expert loop, with empty experts and groups not multiple of 8."""
    torch.manual_seed(0)
    experts = GroupedExperts(num_experts=6, dim=64, hidden_dim=48)
    experts.reset_own_parameters(0.1)
    counts = torch.tensor([5, 0, 11, 1, 0, 3])
    x = torch.randn(int(counts.sum()), 64, requires_grad=True)
    loop = experts(x, counts)
    loop_grads = torch.autograd.grad(loop.square().sum(), [x, experts.gate_up_proj, experts.down_proj])
    previous = grouped_mm.set(torch._grouped_mm, force=True)
    try:
        grouped = experts(x, counts)
        grouped_grads = torch.autograd.grad(grouped.square().sum(), [x, experts.gate_up_proj, experts.down_proj])
    finally:
        grouped_mm.set(*previous)
    torch.testing.assert_close(grouped, loop, rtol=1e-5, atol=1e-6)
    for got, want in zip(grouped_grads, loop_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


class _FullSizeOutputs(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the ops whose output is a new tensor (not a view) of one of the given shapes."""

    def __init__(self, shapes):
        super().__init__()
        self.shapes, self.count = set(shapes), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view:
            self.count += sum(
                tuple(t.shape) in self.shapes
                for t in torch.utils._pytree.tree_leaves(out)
                if isinstance(t, torch.Tensor)
            )
        return out


def test_expert_loop_backward_writes_each_weight_gradient_once():
    """The CPU expert loop's backward builds each 3-D weight gradient in one op, not one zero-filled
    gradient of all the experts per expert (experts^2 memory traffic: 5% of a tiny MoE CPU step)."""
    experts = GroupedExperts(num_experts=16, dim=32, hidden_dim=16)
    experts.reset_own_parameters(0.1)
    counts = torch.full((16,), 3)
    loss = experts(torch.randn(48, 32), counts).square().sum()
    with _FullSizeOutputs([tuple(experts.gate_up_proj.shape), tuple(experts.down_proj.shape)]) as mode:
        loss.backward()
    assert mode.count <= 2, mode.count
    assert experts.gate_up_proj.grad.abs().sum(dim=(1, 2)).min() > 0  # every expert got its rows' gradient


def test_packed_rows_equal_samples_run_alone(tmp_path):
    _, native = pair(tmp_path, **SHAPES["top2-renormalised"])
    g = torch.Generator().manual_seed(3)
    lengths = [7, 13, 4, 9, 11, 4]
    samples = [torch.randint(0, 256, (n,), generator=g) for n in lengths]
    ids = torch.cat(samples).view(2, 24)
    cu = torch.nn.functional.pad(torch.tensor(lengths).cumsum(0), (1, 0)).to(torch.int32)
    packed = native(ids, position_ids=models.position_ids(native.config, ids, None, cu), cu_seqlens=cu).logits
    alone = torch.cat([native(s[None]).logits[0] for s in samples])
    assert max_rel(packed.flatten(0, 1), alone) < 1e-5


def test_snapshot_round_trip_keeps_the_per_expert_format(tmp_path):
    hf, native = pair(tmp_path, **SHAPES["top2-raw-dense-layer"])
    models.save_pretrained(native, tmp_path / "out", source_dir=tmp_path / "hf")
    original, written = load_file(tmp_path / "hf/model.safetensors"), load_file(tmp_path / "out/model.safetensors")
    assert "model.layers.0.mlp.experts.7.up_proj.weight" in written
    assert written.keys() == original.keys()
    assert all(torch.equal(written[k], original[k]) for k in original)
    reloaded = Qwen3MoeForCausalLM.from_pretrained(tmp_path / "out").eval()
    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(reloaded(input_ids=ids).logits, hf(input_ids=ids).logits)


def test_wrong_expert_count_is_named(tmp_path):
    pair(tmp_path, **SHAPES["top2-renormalised"])
    model = models.build_model(qwen3_moe_config(num_experts=4), device="cpu")
    with pytest.raises(ValueError, match=r"experts\.4\.gate_proj"):
        models.load_hf_weights(model, tmp_path / "hf")


def test_compiled_block_on_the_expert_loop_compiles_once():
    """The per-expert loop (CPU, and GPU without bf16) reads the counts on the host; traced, its
    code specialised on each expert's row count being 0 or 1, and every batch whose routing left
    an expert with 0 or 1 rows compiled the block again (10 recompiles in 10 steps of a tiny
    Qwen3-MoE, 50 s of a 60 s run, up to torch's limit). It runs eagerly inside the compiled
    block, which follows the eager one."""
    import copy

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = models.build_model(qwen3_moe_config(), device="cpu")
    model.init_weights()
    eager = moe_blocks(model)[0]
    block = copy.deepcopy(eager)
    block.compile()
    block(torch.randn(1, 12, 64, requires_grad=True)).sum().backward()
    block.zero_grad()
    seen_counts = set()
    with torch._dynamo.config.patch(error_on_recompile=True):
        for seed in range(1, 7):  # 12 tokens, top-2 of 8 experts: experts with 0, 1, 2+ rows vary by batch
            x = torch.randn(1, 12, 64, generator=torch.Generator().manual_seed(seed))
            outs = []
            for b in (eager, block):
                x_in = x.clone().requires_grad_()
                y = b(x_in)
                y.square().sum().backward()
                outs.append((y, x_in.grad, b.experts.gate_up_proj.grad.clone()))
                b.zero_grad()
            torch.testing.assert_close(outs[1], outs[0])
            _, _, experts = eager.gate(x.flatten(0, 1))
            seen_counts |= set(torch.bincount(experts.flatten(), minlength=8).tolist())
    assert {0, 1} <= seen_counts and max(seen_counts) > 1  # the batches did route 0 and 1 rows to experts
