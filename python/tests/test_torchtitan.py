"""mok.integrations.torchtitan: torchtitan's MoE blocks swapped onto the layer (swap_moe_experts).

CPU (torchtitan installed, no GPU): which blocks swap and which are refused, with their messages; the swap's
wiring (torchtitan's weights, scores and shared expert into the layer) against torchtitan's own block with mok's
kernels replaced by a torch reference (output and every gradient); the state dict
unchanged (keys, tensors, the parameter objects themselves) and loading both ways; restore; the argument checks; the
swapped block's forward on meta tensors (shapes, the workspace shared by the blocks, the token limit, under
torch.compile(fullgraph=True)); the EP > 1 plumbing (the group given or taken from torchtitan's EP mesh, local
experts) in two CPU processes over gloo, on meta (no GPU, no NCCL: what the GPUs would run is not tested here).
GPU (marker gpu): a swapped MoE block's output and gradients against torchtitan's own (relative Frobenius error
within TOLERANCE, the bf16 budget of test_autograd.py), with and without the fused shared expert, bf16 and fp32
parameters; the whole DeepSeek-V3 debug model's loss and gradients; bitwise reruns; torchtitan's torch.compile per
block (apply_compile) of a swapped model against eager.

Skipped with the reason where torchtitan is not installed. It is not in the test extra: torchtitan 0.3.0 needs
Python >= 3.11 and torch >= 2.11 and brings datasets, tensorboard, wandb and tokenizers with it (pip install
torchtitan==0.3.0 adds it; docs/design.md, "torchtitan").
"""
import copy
import multiprocessing
import warnings

import pytest
import torch

import mok

pytest.importorskip("torchtitan", reason="torchtitan is not installed (pip install torchtitan==0.3.0; not in the "
                                         "test extra: docs/design.md, \"torchtitan\")")

from mok.integrations import torchtitan as mok_titan  # noqa: E402

mok_titan.patch_torch_for_torchtitan()  # torch 2.11: a placeholder for the FSDP class torchtitan 0.3.0 imports

from torchtitan.models.common import moe as titan_moe  # noqa: E402
from torchtitan.models.common.config_utils import (  # noqa: E402
    make_ffn_config, make_moe_config, make_routed_experts_config, make_router_config)
from torchtitan.models.common.feed_forward import FeedForward, SigmoidGatedFeedForward  # noqa: E402
from torchtitan.models.common.linear import Linear  # noqa: E402

TOLERANCE = 2e-2  # relative Frobenius error of outputs and gradients against torchtitan's own (test_autograd.py)


def relative_error(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def make_moe(dim=256, width=256, experts=8, top_k=2, shared="plain", shared_width=None, score_func="softmax"):
    """A torchtitan MoE block built by torchtitan's config helpers, on meta. shared: "plain" (a SwiGLU
    FeedForward of shared_width, default width), "sigmoid" (Qwen3.5's gated one) or None."""
    shared_width = width if shared_width is None else shared_width
    shared_cfg = None
    if shared == "plain":
        shared_cfg = make_ffn_config(dim=dim, hidden_dim=shared_width, w1_param_init={}, w2w3_param_init={})
    elif shared == "sigmoid":
        plain = make_ffn_config(dim=dim, hidden_dim=shared_width, w1_param_init={}, w2w3_param_init={})
        shared_cfg = SigmoidGatedFeedForward.Config(w1=plain.w1, w2=plain.w2, w3=plain.w3,
                                                    gate=Linear.Config(in_features=dim, out_features=1))
    config = make_moe_config(
        num_experts=experts,
        router=make_router_config(dim=dim, num_experts=experts, gate_param_init={}, top_k=top_k,
                                  score_func=score_func),
        routed_experts=make_routed_experts_config(dim=dim, hidden_dim=width, num_experts=experts, top_k=top_k,
                                                  param_init={}, comm_backend="standard"),
        shared_experts=shared_cfg)
    with torch.device("meta"):
        return config.build()


class Holder(torch.nn.Module):
    """A model of MoE blocks (what swap_moe_experts walks)."""

    def __init__(self, *blocks):
        super().__init__()
        self.blocks = torch.nn.ModuleList(blocks)


def deepseek_debug(shared_experts=2, device="meta", seed=None):
    """torchtitan's DeepSeek-V3 debugmodel (shared_experts=1: each shared expert of the routed width)."""
    from torchtitan.models.deepseek_v3 import model_registry
    config = model_registry("debugmodel").model
    for layer in config.layers:
        if layer.moe is not None and shared_experts != 2:
            width = layer.moe.routed_experts.inner_experts.hidden_dim * shared_experts
            s = layer.moe.shared_experts
            s.w1.out_features = s.w3.out_features = s.w2.in_features = width
    with torch.device("meta"):
        model = config.build()
    if device != "meta":
        model.to_empty(device=device)
        if seed is not None:
            torch.manual_seed(seed)
        model.init_states(buffer_device=None)
    return model


def routed_inputs(t=64, dim=256, top_k=2, experts=8, device="meta", dtype=torch.float32):
    shape = (2, t // 2)
    return (torch.empty(*shape, dim, device=device, dtype=dtype), torch.empty(*shape, top_k, device=device),
            torch.empty(*shape, top_k, device=device, dtype=torch.int64))


# ---------------------------------------------------------------------------------------------------------------
# Which blocks swap (CPU)


def test_deepseek_debugmodel_swaps_every_moe_block_and_keeps_its_wider_shared_expert():
    model = deepseek_debug()
    report = mok_titan.swap_moe_experts(model, max_tokens=256)
    names = [f"layers.{i}.moe" for i in range(1, 6)]
    assert report.swapped == names and report.shared_fused == [] and report.refused == {}
    for name in names:
        assert "width 512 is not the routed experts' width F = 256" in report.shared_kept[name]
        moe = model.get_submodule(name)
        assert isinstance(moe.routed_experts, mok_titan.MokRoutedExperts)
        assert type(moe.shared_experts) is FeedForward
    assert "5 torchtitan MoE block(s) swapped, 0 with the shared expert fused, 0 left as they were" in str(report)
    workspaces = {id(m.workspace) for m in mok_titan.swapped_modules(model)}
    assert len(workspaces) == 1  # one shape: one workspace, made at the swap (meta: no memory)
    ws = mok_titan.swapped_modules(model)[0].workspace
    assert (ws.shape.num_tokens, ws.shape.hidden, ws.shape.intermediate, ws.shape.num_experts, ws.shape.top_k,
            ws.shape.shared_expert) == (256, 256, 256, 8, 3, False)


@pytest.mark.parametrize("package, flavor, swapped, fused, kept", [
    ("qwen3", "debugmodel_moe", 8, 0, 0),  # no shared expert
    ("kimi_k2_7", "debugmodel", 5, 0, 5),  # 2 shared experts: one FeedForward of 2F
    ("deepseek_v3", "16B", 26, 0, 26),
    ("deepseek_v3", "671B", 58, 58, 0),  # 1 shared expert of the routed width: fused
])
def test_torchtitan_flavors(package, flavor, swapped, fused, kept):
    import importlib
    registry = importlib.import_module(f"torchtitan.models.{package}").model_registry
    with torch.device("meta"):
        model = registry(flavor).model.build()
    report = mok_titan.swap_moe_experts(model, warn=False)
    assert (len(report.swapped), len(report.shared_fused), len(report.shared_kept), report.refused) == \
        (swapped, fused, kept, {})


def test_shared_expert_of_the_routed_width_is_fused():
    model = deepseek_debug(shared_experts=1)
    report = mok_titan.swap_moe_experts(model)
    assert report.shared_fused == report.swapped == [f"layers.{i}.moe" for i in range(1, 6)]
    moe = model.layers["1"].moe
    assert isinstance(moe.shared_experts, mok_titan.FusedSharedExpert)
    assert moe.routed_experts.shared is moe.shared_experts
    assert moe.shared_experts(torch.empty(1, 256, device="meta")) is None  # MoE.forward skips it


def test_fuse_shared_expert_false_keeps_it():
    model = Holder(make_moe())
    report = mok_titan.swap_moe_experts(model, fuse_shared_expert=False)
    assert report.shared_fused == [] and report.shared_kept == {"blocks.0": "fuse_shared_expert=False"}


def test_state_dict_is_unchanged_and_loads_both_ways():
    torch.manual_seed(0)
    model = deepseek_debug(shared_experts=1, device="cpu", seed=0)
    before = model.state_dict(keep_vars=True)
    params = dict(model.named_parameters())
    mok_titan.swap_moe_experts(model)  # on the CPU: no workspace yet
    after = model.state_dict(keep_vars=True)
    assert list(after) == list(before)
    assert all(after[k] is before[k] for k in before)  # the same tensors: nothing copied
    assert dict(model.named_parameters()) == params

    # a swapped model loads an unswapped model's checkpoint ...
    other = deepseek_debug(shared_experts=1, device="cpu", seed=1)
    model.load_state_dict(other.state_dict())
    assert all(torch.equal(model.state_dict()[k], v) for k, v in other.state_dict().items())
    # ... and an unswapped model loads the swapped model's
    fresh = deepseek_debug(shared_experts=1, device="cpu", seed=2)
    with torch.no_grad():
        model.layers["1"].moe.routed_experts.inner_experts.w1_EFD.add_(1.0)
        model.layers["1"].moe.shared_experts.w2.weight.mul_(2.0)
    fresh.load_state_dict(model.state_dict())
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in model.state_dict().items())


def test_restore_puts_torchtitans_modules_back_with_the_same_parameters():
    model = deepseek_debug(shared_experts=1)
    params = dict(model.named_parameters())
    originals = {i: (model.layers[str(i)].moe.routed_experts, model.layers[str(i)].moe.shared_experts)
                 for i in range(1, 6)}
    mok_titan.swap_moe_experts(model)
    assert mok_titan.restore_moe_experts(model) == [f"layers.{i}.moe" for i in range(1, 6)]
    for i, (routed, shared) in originals.items():
        moe = model.layers[str(i)].moe
        assert moe.routed_experts is routed and moe.shared_experts is shared
        assert type(moe.routed_experts) is titan_moe.RoutedExperts and type(moe.shared_experts) is FeedForward
    assert dict(model.named_parameters()) == params
    assert mok_titan.swapped_modules(model) == []


def test_swap_is_idempotent():
    model = deepseek_debug(shared_experts=1)
    first = mok_titan.swap_moe_experts(model)
    modules = mok_titan.swapped_modules(model)
    second = mok_titan.swap_moe_experts(model)
    assert second.swapped == first.swapped and second.shared_fused == first.shared_fused
    assert mok_titan.swapped_modules(model) == modules


def test_swap_on_meta_then_to_empty_and_init_states():
    """torchtitan's order: build on meta, (swap,) to_empty on the device, init_states: the swapped blocks see the
    new parameters (they hold torchtitan's modules, not tensors)."""
    model = deepseek_debug(shared_experts=1)
    mok_titan.swap_moe_experts(model)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_states(buffer_device=None)
    routed = model.layers["1"].moe.routed_experts
    assert routed.inner_experts.w1_EFD.device.type == "cpu"
    assert routed.weights().expert_gate.dtype == torch.bfloat16 and routed.weights().shared_down.shape == (256, 256)
    assert torch.equal(model.layers["1"].moe.tokens_per_expert_E, torch.zeros(8))


# ---------------------------------------------------------------------------------------------------------------
# Refusals (CPU)


def refusal(model):
    with pytest.warns(UserWarning, match="left as it was") as caught:
        report = mok_titan.swap_moe_experts(model)
    assert len(caught) == len(report.refused)
    return report


def test_gpt_oss_experts_are_refused():
    from torchtitan.models.gpt_oss import model_registry
    # FlexAttention: the default backend ("varlen") activates FA3 on a Hopper GPU, which needs flash_attn_interface.
    with torch.device("meta"):
        model = model_registry("debugmodel", attn_backend="flex").model.build()
    report = refusal(model)
    assert report.swapped == [] and report.refused
    for why in report.refused.values():
        assert "GptOssGroupedExperts, not torchtitan's GroupedExperts" in why and "biases" in why


def test_dims_not_multiples_of_64_are_refused():
    report = refusal(Holder(make_moe(dim=96, width=64), make_moe()))
    assert report.swapped == ["blocks.1"]
    assert report.refused == {"blocks.0": "model dim D = 96 and expert width F = 64: mok needs multiples of 64"}


def test_a_converted_grouped_gemm_is_refused():
    moe = make_moe()
    moe.routed_experts.inner_experts._grouped_mm = lambda *, A, B_t, offs: torch._grouped_mm(A, B_t, offs=offs)
    report = refusal(Holder(moe))
    assert "low-precision converter" in report.refused["blocks.0"]


def test_fp16_experts_are_refused():
    moe = make_moe().to(torch.float16)
    report = refusal(Holder(moe))
    assert "w1_EFD is torch.float16: mok computes in bf16 from bf16 or fp32 parameters" == report.refused["blocks.0"]


def test_a_moe_subclass_with_its_own_forward_is_refused():
    class OwnMoE(titan_moe.MoE):
        def forward(self, x):
            return x

    moe = make_moe()
    moe.__class__ = OwnMoE
    report = refusal(Holder(moe))
    assert "overrides torchtitan's MoE.forward" in report.refused["blocks.0"]


def test_sigmoid_gated_shared_expert_stays_torchtitans():
    report = mok_titan.swap_moe_experts(Holder(make_moe(shared="sigmoid")))
    assert report.swapped == ["blocks.0"] and report.shared_fused == []
    assert "SigmoidGatedFeedForward, not a plain SwiGLU FeedForward" in report.shared_kept["blocks.0"]


def test_no_moe_block_warns():
    with pytest.warns(UserWarning, match="no torchtitan MoE block"):
        report = mok_titan.swap_moe_experts(torch.nn.Linear(4, 4))
    assert report.swapped == [] and report.refused == {}


def test_warn_false_is_quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        report = mok_titan.swap_moe_experts(Holder(make_moe(dim=96, width=64)), warn=False)
    assert list(report.refused) == ["blocks.0"]


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(max_tokens=0), ValueError, r"max_tokens: expected a positive int"),
    (dict(max_tokens=True), TypeError, r"max_tokens: expected a positive int .*bool"),
    (dict(config={}), TypeError, r"config: expected a mok.Config"),
    (dict(group=3), TypeError, r"group: expected a torch.distributed.ProcessGroup"),
    (dict(fuse_shared_expert=1), TypeError, r"fuse_shared_expert: expected a bool"),
])
def test_arguments_are_checked(kwargs, error, message):
    with pytest.raises(error, match=message):
        mok_titan.swap_moe_experts(Holder(make_moe()), **kwargs)


def test_model_must_be_a_module():
    with pytest.raises(TypeError, match="model: expected a torch.nn.Module"):
        mok_titan.swap_moe_experts("model")


# ---------------------------------------------------------------------------------------------------------------
# The swapped block's forward on meta (CPU)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_on_meta_returns_the_input_shape_and_dtype(dtype):
    moe = make_moe()
    mok_titan.swap_moe_experts(Holder(moe))  # no max_tokens: the workspace comes with the first forward
    routed = moe.routed_experts
    assert routed.workspace is None
    out = routed(*routed_inputs(dtype=dtype))
    assert (out.shape, out.dtype, out.device.type) == ((2, 32, 256), dtype, "meta")
    assert routed.workspace.shape.num_tokens == 64 and routed.workspace.shape.shared_expert
    with pytest.raises(ValueError, match=r"x_BLD: 128 tokens, more than this block's workspace takes per call \(64\)"):
        routed(*routed_inputs(t=128))
    mok_titan.prepare_moe_experts(Holder(moe), 64)  # the same size: kept
    assert routed.workspace.shape.num_tokens == 64


def test_zero_tokens_at_the_first_forward():
    """A first forward of 0 tokens cannot size the workspace: a clear error without max_tokens, the workspace of
    max_tokens with it (and an empty output)."""
    moe = make_moe()
    mok_titan.swap_moe_experts(Holder(moe))
    with pytest.raises(ValueError, match=r"x_BLD: 0 tokens at this block's first forward"):
        moe.routed_experts(*routed_inputs(t=0))
    moe = make_moe()
    model = Holder(moe)
    mok_titan.swap_moe_experts(model, max_tokens=64)
    mok_titan.close_moe_workspaces(model)  # the next forward makes the workspace again, for max_tokens
    out = moe.routed_experts(*routed_inputs(t=0))
    assert out.shape[-1] == 256 and out.numel() == 0
    assert moe.routed_experts.workspace.shape.num_tokens == 64


def test_prepare_and_close():
    model = Holder(make_moe(), make_moe(), make_moe(width=128))
    mok_titan.swap_moe_experts(model)
    mok_titan.prepare_moe_experts(model, 512)
    modules = mok_titan.swapped_modules(model)
    assert modules[0].workspace is modules[1].workspace is not modules[2].workspace  # one per layer shape
    assert modules[0]._context is not modules[1]._context  # one context per block
    workspaces = [m.workspace for m in modules]
    mok_titan.close_moe_workspaces(model)
    assert all(ws.closed for ws in workspaces) and all(m.workspace is None for m in modules)
    out = modules[0](*routed_inputs())  # a new workspace, eagerly
    assert out.shape == (2, 32, 256) and not modules[0].workspace.closed


def test_forward_under_torch_compile_fullgraph_on_meta():
    moe = make_moe()
    mok_titan.swap_moe_experts(Holder(moe), max_tokens=64)
    routed = moe.routed_experts
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    out = torch.compile(routed, fullgraph=True, backend=backend)(*routed_inputs())
    assert out.shape == (2, 32, 256)
    # the parameters require grad: the forward op is inside the autograd.Function's subgraph (a submodule)
    targets = [n.target for g in graphs for m in g.modules() if isinstance(m, torch.fx.GraphModule)
               for n in m.graph.nodes if n.op == "call_function"]
    assert torch.ops.mok.forward.default in targets or torch.ops.mok.forward in targets, targets


def test_compile_before_the_workspace_is_made_says_what_to_do():
    moe = make_moe()
    mok_titan.swap_moe_experts(Holder(moe))
    with pytest.raises(Exception, match="prepare_moe_experts"):
        torch.compile(moe.routed_experts, fullgraph=True, backend="eager")(*routed_inputs())


def reference_layer(ws, ctx, x, topk_idx, router_weights, w, targets, recompute):
    """What mok::forward computes, in torch ops (fp32 from the bf16 inputs; autograd gives its gradients): stands
    in for the GPU in the CPU test of the swap's wiring below."""
    def mlp(rows, gate, up, down):
        rows = rows.float()
        return (torch.nn.functional.silu(rows @ gate.float().T) * (rows @ up.float().T)) @ down.float().T

    out = torch.zeros(x.shape, dtype=torch.float32)
    if w.shared_gate is not None:
        out = out + mlp(x, w.shared_gate, w.shared_up, w.shared_down)
    for e in range(w.expert_gate.shape[0]):
        tokens, slots = (topk_idx == e).nonzero(as_tuple=True)
        if tokens.numel():
            y = mlp(x[tokens], w.expert_gate[e], w.expert_up[e], w.expert_down[e])
            out = out.index_add(0, tokens, router_weights[tokens, slots, None] * y)
    return out.to(torch.bfloat16)


@pytest.mark.parametrize("shared", ["plain", "wide", None])
def test_the_swap_wires_torchtitans_weights_and_routing_into_the_layer(shared, monkeypatch):
    """On the CPU, with mok's kernels replaced by reference_layer: the swapped block's output and gradients
    (x, router, every expert and shared weight) equal torchtitan's own block's within bf16 rounding, so w1 is
    the gate, w3 the up and w2 the down projection, the scores are the router weights, the shared expert is
    fused or kept as the report says, and the gradients reach torchtitan's parameters."""
    import types
    monkeypatch.setattr(mok_titan, "layer_forward", reference_layer)
    fake_ws = types.SimpleNamespace(closed=False, device=torch.device("cpu"),
                                    shape=types.SimpleNamespace(num_tokens=1 << 20))

    def fake_prepare(self, num_tokens):
        self._workspace, self._context = fake_ws, object()

    monkeypatch.setattr(mok_titan.MokRoutedExperts, "prepare", fake_prepare)
    titan = make_moe(dim=128, width=64, experts=8, top_k=3, shared="plain" if shared else None,
                     shared_width=128 if shared == "wide" else None)
    titan.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in titan.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
        titan.expert_bias_E.zero_()
        titan.tokens_per_expert_E.zero_()
    ours = copy.deepcopy(titan)
    report = mok_titan.swap_moe_experts(Holder(ours))
    assert report.shared_fused == (["blocks.0"] if shared == "plain" else [])
    x = torch.randn(2, 48, 128, generator=gen)
    d_out = torch.randn(2, 48, 128, generator=gen)

    def run(moe):
        moe.zero_grad(set_to_none=True)
        xx = x.clone().requires_grad_(True)
        out = moe(xx)
        out.backward(d_out)
        return out.detach(), xx.grad, {n: p.grad for n, p in moe.named_parameters()}

    ref_out, ref_dx, ref_grads = run(titan)
    out, dx, grads = run(ours)
    assert out.dtype == torch.float32 and relative_error(out, ref_out) < TOLERANCE
    assert relative_error(dx, ref_dx) < TOLERANCE
    assert grads.keys() == ref_grads.keys()
    for name, g in ref_grads.items():
        assert grads[name] is not None and relative_error(grads[name], g) < TOLERANCE, name
    assert torch.equal(ours.tokens_per_expert_E, titan.tokens_per_expert_E)


# ---------------------------------------------------------------------------------------------------------------
# EP > 1 plumbing: two CPU processes over gloo, workspaces on meta


def _ep_worker(rank, store_path, results):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    try:
        out = {}
        world = dist.group.WORLD
        # every expert on every rank (not parallelized): refused at EP = 2
        report = mok_titan.swap_moe_experts(Holder(make_moe()), group=world, warn=False)
        out["all experts"] = report.refused.get("blocks.0")
        # this rank's 4 of 8 experts (as torchtitan's EP shards them): swapped, the workspace's EP group is the group
        moe = make_moe()
        inner = moe.routed_experts.inner_experts
        for name in ("w1_EFD", "w2_EDF", "w3_EFD"):
            setattr(inner, name, torch.nn.Parameter(getattr(inner, name)[4 * rank:4 * rank + 4]))
        report = mok_titan.swap_moe_experts(Holder(moe), group=world, max_tokens=64, warn=False)
        routed = moe.routed_experts
        ws = routed.workspace
        out["local"] = (report.swapped, routed.ep_size, ws.shape.ep_size, ws.shape.local_experts, ws.rank,
                        ws.config.load_factor, tuple(routed(*routed_inputs()).shape))
        # the group from torchtitan's EP mesh, wired into the dispatcher by its parallelize
        moe = make_moe()
        inner = moe.routed_experts.inner_experts
        for name in ("w1_EFD", "w2_EDF", "w3_EFD"):
            setattr(inner, name, torch.nn.Parameter(getattr(inner, name)[4 * rank:4 * rank + 4]))
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))
        moe.routed_experts.token_dispatcher.ep_mesh = mesh
        report = mok_titan.swap_moe_experts(Holder(moe), max_tokens=64, warn=False)
        out["mesh"] = (report.swapped, moe.routed_experts.ep_size, moe.routed_experts.workspace.shape.ep_size)
        # a group of another size than the mesh: refused
        singles = [dist.new_group([0]), dist.new_group([1])]
        moe = make_moe()
        moe.routed_experts.token_dispatcher.ep_mesh = mesh
        report = mok_titan.swap_moe_experts(Holder(moe), group=singles[rank], warn=False)
        out["mismatch"] = report.refused.get("blocks.0")
        results.put((rank, out))
    except Exception as e:  # the parent reports it
        results.put((rank, repr(e)))
    finally:
        dist.destroy_process_group()


def test_ep_group_plumbing_in_two_cpu_processes(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    store = str(tmp_path / "store")
    procs = [ctx.Process(target=_ep_worker, args=(rank, store, results)) for rank in range(2)]
    for p in procs:
        p.start()
    got = dict(results.get(timeout=240) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    for rank in range(2):
        out = got[rank]
        assert isinstance(out, dict), out
        assert out["all experts"] == "w1_EFD holds 8 experts, expected 4 local experts for 8 experts at EP = 2"
        assert out["local"] == (["blocks.0"], 2, 2, 4, rank, 2.0, (2, 32, 256))
        assert out["mesh"] == (["blocks.0"], 2, 2)
        assert out["mismatch"] == "group= has 1 processes, torchtitan's EP mesh of this block 2"


# ---------------------------------------------------------------------------------------------------------------
# On a Hopper GPU: values against torchtitan's own experts


def init_moe_(moe, seed, dtype):
    """Parameters of a MoE block on the GPU: randn / sqrt(fan_in) (router gate, experts, shared expert)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    moe.to_empty(device="cuda")
    with torch.no_grad():
        for p in moe.parameters():
            p.data = (torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5).to(dtype).cuda()
        moe.expert_bias_E.zero_()
        moe.tokens_per_expert_E.zero_()


def run_block(moe, x, d_out):
    moe.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    out = moe(x)
    out.backward(d_out)
    grads = {name: p.grad.detach().clone() for name, p in moe.named_parameters()}
    return out.detach(), x.grad.detach(), grads


@pytest.mark.gpu
@pytest.mark.parametrize("shared", ["plain", "wide", "sigmoid", None])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_swapped_block_matches_torchtitans(shared, dtype):
    kind = "plain" if shared == "wide" else shared
    titan = make_moe(dim=256, width=128, experts=16, top_k=4, shared=kind,
                     shared_width=256 if shared == "wide" else None)
    init_moe_(titan, seed=1, dtype=dtype)
    ours = copy.deepcopy(titan)
    report = mok_titan.swap_moe_experts(Holder(ours), max_tokens=1024)
    assert report.swapped == ["blocks.0"] and (report.shared_fused == ["blocks.0"]) == (shared == "plain")
    gen = torch.Generator(device="cpu").manual_seed(2)
    x = torch.randn(4, 256, 256, generator=gen).to(dtype).cuda()  # the parameters' dtype, as torchtitan's modules take
    d_out = torch.randn(4, 256, 256, generator=gen).to(dtype).cuda()
    ref_out, ref_dx, ref_grads = run_block(titan, x, d_out)
    out, dx, grads = run_block(ours, x, d_out)
    assert relative_error(out, ref_out) < TOLERANCE
    assert relative_error(dx, ref_dx) < TOLERANCE
    assert grads.keys() == ref_grads.keys()
    for name in ref_grads:
        assert grads[name].dtype == dtype
        assert relative_error(grads[name], ref_grads[name]) < TOLERANCE, name
    assert torch.equal(ours.tokens_per_expert_E, titan.tokens_per_expert_E)  # torchtitan's counting, unchanged
    again = run_block(ours, x, d_out)
    assert torch.equal(again[0], out) and torch.equal(again[1], dx)
    assert all(torch.equal(again[2][k], grads[k]) for k in grads)
    mok.check_status(ours.routed_experts.workspace)


def debug_model_loss(model, tokens):
    positions = torch.arange(tokens.shape[1] - 1, device="cuda").expand(tokens.shape[0], -1)
    logits = model(tokens[:, :-1], positions=positions, attention_masks=model.get_attention_masks(positions))
    loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def bf16_debug_model(shared_experts, seed=0):
    model = deepseek_debug(shared_experts=shared_experts, device="cuda", seed=seed)
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.to(torch.bfloat16)
    return model


@pytest.mark.gpu
@pytest.mark.parametrize("shared_experts", [1, 2])
def test_deepseek_debug_model_loss_and_gradients(shared_experts):
    titan = bf16_debug_model(shared_experts)
    ours = bf16_debug_model(shared_experts)
    ours.load_state_dict(titan.state_dict())
    report = mok_titan.swap_moe_experts(ours, max_tokens=4 * 256)
    assert len(report.swapped) == 5 and not report.refused
    tokens = torch.randint(0, 2048, (4, 257), generator=torch.Generator().manual_seed(3)).cuda()
    ref_loss, ref_grads = debug_model_loss(titan, tokens)
    loss, grads = debug_model_loss(ours, tokens)
    assert abs(loss.item() - ref_loss.item()) < 0.01 * ref_loss.item()
    assert grads.keys() == ref_grads.keys()
    for name in ("layers.1.moe.routed_experts.inner_experts.w1_EFD", "layers.5.moe.routed_experts.inner_experts.w2_EDF",
                 "layers.3.moe.router.gate.weight", "layers.2.moe.shared_experts.w3.weight", "tok_embeddings.weight"):
        assert relative_error(grads[name], ref_grads[name]) < 5 * TOLERANCE, name  # through 6 layers


@pytest.mark.gpu
def test_compiled_per_block_as_torchtitan_does():
    from torchtitan.config import CompileConfig
    from torchtitan.distributed.compile import apply_compile

    class OneDevice:
        tp_enabled = False

    eager = bf16_debug_model(1)
    compiled = bf16_debug_model(1)
    compiled.load_state_dict(eager.state_dict())
    for model in (eager, compiled):
        mok_titan.swap_moe_experts(model, max_tokens=4 * 256)
    apply_compile(compiled, compile_config=CompileConfig(enable=True, backend="inductor"), parallel_dims=OneDevice())
    tokens = torch.randint(0, 2048, (4, 257), generator=torch.Generator().manual_seed(4)).cuda()
    ref_loss, ref_grads = debug_model_loss(eager, tokens)
    for _ in range(2):
        compiled.zero_grad()
        loss, grads = debug_model_loss(compiled, tokens)
        assert abs(loss.item() - ref_loss.item()) < 0.01 * ref_loss.item()
        name = "layers.2.moe.routed_experts.inner_experts.w1_EFD"
        assert relative_error(grads[name], ref_grads[name]) < 5 * TOLERANCE
