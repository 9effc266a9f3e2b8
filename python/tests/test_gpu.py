"""Tests on a CUDA Hopper GPU (marker gpu; skipped with the reason elsewhere), EP = 1 on GPU 0: forward
against a float64 PyTorch reference, bitwise determinism and independence of the knobs, CUDA-graph capture,
torch.compile(fullgraph=True), bad inputs through the Python API. The backward's tests are in test_autograd.py."""
import dataclasses

import pytest
import torch

import mok
from conftest import make_inputs, make_weights

pytestmark = pytest.mark.gpu

TOLERANCE = 2e-2  # relative Frobenius error, bf16 level
SHAPES = {  # name: LayerShape (ep_size 1)
    "shared": mok.LayerShape(1, num_tokens=384, top_k=2, num_experts=8, hidden=256, intermediate=128),
    "no-shared": mok.LayerShape(1, num_tokens=300, top_k=4, num_experts=16, hidden=192, intermediate=64,
                                shared_expert=False),
    "clamped": mok.LayerShape(1, num_tokens=256, top_k=2, num_experts=4, hidden=128, intermediate=192,
                              swiglu_limit=0.5),
}


def workspace(shape, **config):
    return mok.get_workspace(mok.Config(**config), None, shape.num_tokens, shape.hidden, shape.intermediate,
                             shape.top_k, shape.num_experts, shared_expert=shape.shared_expert,
                             swiglu_limit=shape.swiglu_limit)


def reference(shape, x, idx, rw, w):
    """The layer in float64 (reference/moe_reference.h): shared(x) + sum_j rw[t, j] * expert_idx[t,j](x)."""
    f64 = torch.float64
    x, rw = x.to(f64), rw.to(f64)
    i = shape.intermediate
    limit = shape.swiglu_limit

    def mlp(rows, gate, up, down):
        g, u = rows @ gate.to(f64).T, rows @ up.to(f64).T
        if limit > 0:
            g, u = g.clamp(max=limit), u.clamp(-limit, limit)
        return (torch.nn.functional.silu(g) * u) @ down.to(f64).T

    gate_all = w.expert_gate if w.expert_up is not None else w.expert_gate[:, :i]
    up_all = w.expert_up if w.expert_up is not None else w.expert_gate[:, i:]
    out = torch.zeros_like(x)
    if shape.shared_expert:
        out += mlp(x, w.shared_gate, w.shared_up, w.shared_down)
    for e in range(shape.num_experts):
        tokens, slots = (idx == e).nonzero(as_tuple=True)
        if tokens.numel():
            out.index_add_(0, tokens, rw[tokens, slots, None] * mlp(x[tokens], gate_all[e], up_all[e], w.expert_down[e]))
    return out


def relative_error(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("name", sorted(SHAPES))
@pytest.mark.parametrize("path", ["fused", "unfused"])
def test_forward_matches_the_float64_reference(name, path):
    shape = SHAPES[name]
    ws = workspace(shape, path=path)
    x, idx, rw = make_inputs(shape, "cuda", seed=1)
    w = make_weights(shape, "cuda", seed=2)
    out, ctx = mok.forward(ws, x, idx, rw, w)
    mok.check_status(ws)
    assert (out.shape, out.dtype, out.device) == ((shape.num_tokens, shape.hidden), torch.bfloat16, x.device)
    error = relative_error(out, reference(shape, x, idx, rw, w))
    assert error < TOLERANCE, f"{name} {path}: relative Frobenius error {error:.3e} (seed 1/2)"


def test_variants_give_the_same_bits():
    """Fused gate/up weights, int64 ids, a separate build_schedule, the unfused path, other comm/minibatch/
    macrobatch splits and a rerun: all bitwise equal to one fused forward."""
    shape = SHAPES["shared"]
    x, idx, rw = make_inputs(shape, "cuda", seed=3)
    w = make_weights(shape, "cuda", seed=4)
    ws = workspace(shape)
    base, ctx = mok.forward(ws, x, idx, rw, w)
    results = {"rerun": mok.forward(ws, x, idx, rw, w, ctx)[0],
               "int64 ids": mok.forward(ws, x, idx.long(), rw, w, ctx)[0],
               "fused gate/up": mok.forward(ws, x, idx, rw, make_weights(shape, "cuda", seed=4, fused_gate_up=True),
                                            ctx)[0]}
    mok.build_schedule(ws, idx, ctx)
    results["build_schedule"] = mok.forward(ws, x, idx, rw, w, ctx, schedule_ready=True)[0]
    mok.check_status(ws)
    for config in (dict(path="unfused"), dict(comm_ctas=2), dict(minibatch_rows=128),
                   dict(macrobatch_rows=256, minibatch_rows=128)):
        other = workspace(shape, **config)
        results[str(config)] = mok.forward(other, x, idx, rw, w)[0]
        mok.check_status(other)
    for name, out in results.items():
        assert torch.equal(out, base), f"{name}: differs from the fused forward at " \
                                       f"{(out != base).nonzero()[:1].tolist()} (seeds 3/4)"


def test_cuda_graph_capture_and_replay():
    shape = SHAPES["shared"]
    ws = workspace(shape)
    ctx = ws.make_context()
    x, idx, rw = make_inputs(shape, "cuda", seed=5)
    w = make_weights(shape, "cuda", seed=6)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        mok.forward(ws, x, idx, rw, w, ctx)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, _ = mok.forward(ws, x, idx, rw, w, ctx)
    for seed in (7, 8):
        x2, idx2, rw2 = make_inputs(shape, "cuda", seed=seed)
        x.copy_(x2), idx.copy_(idx2), rw.copy_(rw2)
        graph.replay()
        expected, _ = mok.forward(ws, x2, idx2, rw2, w, ctx)
        mok.check_status(ws)
        assert torch.equal(out, expected), f"replay with seed {seed} differs from an eager forward"


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_fullgraph(backend):
    shape = SHAPES["shared"]
    ws = workspace(shape)
    ctx = ws.make_context()
    x, idx, rw = make_inputs(shape, "cuda", seed=9)
    w = make_weights(shape, "cuda", seed=10)

    def layer(x, idx, rw):
        out, _ = mok.forward(ws, x, idx, rw, w, ctx)
        return out.float() * 2 + 1

    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, backend=backend)
    got = compiled(x, idx, rw)
    assert torch.equal(got, layer(x, idx, rw))


def test_bad_expert_id_reports_and_recovers():
    shape = SHAPES["shared"]
    ws = workspace(shape)
    x, idx, rw = make_inputs(shape, "cuda", seed=11)
    w = make_weights(shape, "cuda", seed=12)
    good, ctx = mok.forward(ws, x, idx, rw, w)
    mok.check_status(ws)
    bad = idx.clone()
    bad[5, 1] = shape.num_experts + 3
    mok.forward(ws, x, bad, rw, w, ctx)
    with pytest.raises(RuntimeError, match=f"expert id {shape.num_experts + 3} out of range"):
        mok.check_status(ws)
    status = ws.read_status()
    assert not status.ok and status.error_bits & 1 and "token 5, slot 1" in status.message, status
    ws.reset_status()  # the sticky status word keeps errors until cleared
    again, _ = mok.forward(ws, x, idx, rw, w, ctx)
    mok.check_status(ws)
    assert torch.equal(again, good), "the call after a bad one differs from the first good one"


def test_ids_differing_from_the_schedule_report_and_recover():
    """A forward on a schedule built from other ids (schedule_ready=True) and a backward given other ids than
    the forward's: both report through the status word, naming the first differing route; the next calls with the
    right ids are bitwise the first ones."""
    shape = SHAPES["shared"]
    ws = workspace(shape)
    x, idx, rw = make_inputs(shape, "cuda", seed=31)
    w = make_weights(shape, "cuda", seed=32)
    d_out = torch.randn_like(x)
    ctx = ws.make_context()
    mok.build_schedule(ws, idx, ctx)
    good, _ = mok.forward(ws, x, idx, rw, w, ctx, schedule_ready=True)
    good_dx, good_drw, _ = mok.backward(ws, d_out, x, idx, rw, w, ctx)
    mok.check_status(ws)
    other = idx.clone()
    other[5, 1] = 0 if int(idx[5, 1]) < 0 else (int(idx[5, 1]) + 1) % shape.num_experts
    message = r"topk_idx differ from the ids the context's schedule was built from, first at token 5, slot 1"
    mok.build_schedule(ws, idx, ctx)
    mok.forward(ws, x, other, rw, w, ctx, schedule_ready=True)
    with pytest.raises(RuntimeError, match=message):
        mok.check_status(ws)
    ws.reset_status()
    again, _ = mok.forward(ws, x, idx, rw, w, ctx)
    mok.check_status(ws)
    assert torch.equal(again, good), "the forward after a mismatched one differs from the first"
    mok.backward(ws, d_out, x, other, rw, w, ctx)
    with pytest.raises(RuntimeError, match=message):
        mok.check_status(ws)
    ws.reset_status()
    dx, drw, _ = mok.backward(ws, d_out, x, idx, rw, w, ctx)
    mok.check_status(ws)
    assert torch.equal(dx, good_dx) and torch.equal(drw, good_drw), "the backward after a mismatched one differs"


def test_out_of_range_ids_act_as_masked_and_never_wrap():
    """Out-of-range ids (int64 ones that would wrap to a valid int32 id among them) report through the status
    word, contribute nothing (out == the same call with that route masked), and the next call is correct."""
    shape = SHAPES["shared"]
    ws = workspace(shape)
    x, idx, rw = make_inputs(shape, "cuda", seed=21, index_dtype=torch.int64)
    w = make_weights(shape, "cuda", seed=22)
    masked = idx.clone()
    masked[7, 0] = -1
    want, ctx = mok.forward(ws, x, masked, rw, w)
    mok.check_status(ws)
    for bad_id in (shape.num_experts, -2, 2**32 + 3, 2**40, -(2**63), 2**63 - 1):
        bad = idx.clone()
        bad[7, 0] = bad_id
        out, ctx = mok.forward(ws, x, bad, rw, w, ctx)
        with pytest.raises(RuntimeError, match=r"out of range .* token 7, slot 0"):
            mok.check_status(ws)
        ws.reset_status()
        assert torch.equal(out, want), f"id {bad_id}: out differs from the route masked"
    again, _ = mok.forward(ws, x, idx, rw, w, ctx)
    mok.check_status(ws)
    assert relative_error(again, reference(shape, x, idx, rw, w)) < TOLERANCE


@pytest.mark.parametrize("where", ["x", "router_weights"])
def test_nan_stays_in_its_token(where):
    """A NaN in one token's x or router weight makes exactly that token's output non-finite; no error; the
    next clean call is bitwise the clean result."""
    shape = SHAPES["shared"]
    ws = workspace(shape)
    x, idx, rw = make_inputs(shape, "cuda", seed=23)
    w = make_weights(shape, "cuda", seed=24)
    clean, ctx = mok.forward(ws, x, idx, rw, w)
    dirty_x, dirty_rw = x.clone(), rw.clone()
    if where == "x":
        dirty_x[9, 3] = float("nan")
    else:
        dirty_rw[9, 1] = float("nan")
    dirty, ctx = mok.forward(ws, dirty_x, idx, dirty_rw, w, ctx)
    mok.check_status(ws)
    assert not torch.isfinite(dirty[9]).all(), "token 9 should be non-finite"
    others = torch.ones(shape.num_tokens, dtype=torch.bool, device="cuda")
    others[9] = False
    assert torch.equal(dirty[others], clean[others]), "a NaN in token 9 reached other tokens"
    again, _ = mok.forward(ws, x, idx, rw, w, ctx)
    assert torch.equal(again, clean)


@pytest.mark.parametrize("tokens", [1, 63, 65, 129])
def test_token_counts_off_the_tiles(tokens):
    shape = dataclasses.replace(SHAPES["shared"], num_tokens=tokens)
    ws = workspace(shape)
    x, idx, rw = make_inputs(shape, "cuda", seed=25 + tokens)
    w = make_weights(shape, "cuda", seed=26)
    out, ctx = mok.forward(ws, x, idx, rw, w)
    mok.check_status(ws)
    assert relative_error(out, reference(shape, x, idx, rw, w)) < TOLERANCE
    assert torch.equal(mok.forward(ws, x, idx, rw, w, ctx)[0], out)


def test_all_routes_masked_and_zero_weights_give_the_shared_expert():
    shape = SHAPES["shared"]
    ws = workspace(shape)
    x, idx, rw = make_inputs(shape, "cuda", seed=27)
    w = make_weights(shape, "cuda", seed=28)
    masked, ctx = mok.forward(ws, x, torch.full_like(idx, -1), rw, w)
    zero, ctx = mok.forward(ws, x, idx, torch.zeros_like(rw), w, ctx)
    mok.check_status(ws)
    assert torch.equal(masked, zero)
    assert relative_error(masked, reference(shape, x, torch.full_like(idx, -1), rw, w)) < TOLERANCE


def test_capacity_overflow_reports():
    shape = SHAPES["shared"]
    ws = workspace(shape, capacity_rows=128)
    x, idx, rw = make_inputs(shape, "cuda", seed=13)
    w = make_weights(shape, "cuda", seed=14)
    _, ctx = mok.forward(ws, x, idx, rw, w)
    with pytest.raises(RuntimeError, match=r"capacity overflow: .* holds 128 \(raise ScheduleOptions.load_factor"):
        mok.check_status(ws)
    # After the reset, a routing that fits the 128 rows (32 routes to expert 0) is correct on the same workspace.
    ws.reset_status()
    fits = torch.full_like(idx, -1)
    fits[:32, 0] = 0
    out, _ = mok.forward(ws, x, fits, rw, w, ctx)
    mok.check_status(ws)
    assert relative_error(out, reference(shape, x, fits, rw, w)) < TOLERANCE


def test_load_factor_reaches_the_native_workspace():
    """Config.load_factor is passed to ScheduleOptions: past the Python check (bypassed here), the C++
    validation names it; at EP = 1 any valid factor gives the worst-case capacity (T * k + padding)."""
    shape = SHAPES["shared"]
    bad = mok.Config()
    object.__setattr__(bad, "load_factor", 0.5)  # a frozen dataclass: skip __post_init__'s check
    with pytest.raises(ValueError, match="ScheduleOptions.load_factor"):
        mok.get_workspace(bad, None, shape.num_tokens, shape.hidden, shape.intermediate, shape.top_k,
                          shape.num_experts)
    worst = workspace(shape).capacity_rows
    assert worst == -(-(shape.num_tokens * shape.top_k + shape.num_experts * 63) // 64) * 64
    assert workspace(shape, load_factor=1.0).capacity_rows == worst


def test_wrong_shapes_raise_and_the_process_goes_on():
    shape = SHAPES["shared"]
    ws = workspace(shape)
    x, idx, rw = make_inputs(shape, "cuda", seed=15)
    w = make_weights(shape, "cuda", seed=16)
    with pytest.raises(ValueError, match=r"x: expected .* \[T, H\] = \[384, 256\]"):
        mok.forward(ws, x[:100], idx, rw, w)
    with pytest.raises(ValueError, match="expert_down"):
        mok.forward(ws, x, idx, rw, dataclasses.replace(w, expert_down=w.expert_gate))
    ctx = ws.make_context()
    out = torch.empty_like(x)
    stream = torch.cuda.current_stream().cuda_stream
    # Past the Python checks, the C++ API's own (std::invalid_argument -> ValueError naming the argument).
    with pytest.raises(ValueError, match="router_weights"):
        ws._native.forward(x, idx, rw[:10], w.expert_gate, w.expert_up, w.expert_down, w.shared_gate, w.shared_up,
                           w.shared_down, out, ctx._native, stream, False)
    with pytest.raises(ValueError, match="x: data pointer not 16-byte aligned"):
        flat = torch.empty(x.numel() + 8, dtype=torch.bfloat16, device="cuda")
        ws._native.forward(flat[1:1 + x.numel()].view(x.shape), idx, rw, w.expert_gate, w.expert_up, w.expert_down,
                           w.shared_gate, w.shared_up, w.shared_down, out, ctx._native, stream, False)
    # Not a multiple of 64: the C++ rule (MoeShape::validate), checked in Python first (test_args.py has them all).
    with pytest.raises(ValueError, match="hidden: expected a positive multiple of 64, got 100"):
        mok.get_workspace(mok.Config(), None, 64, 100, 64, 2, 8)
    good, _ = mok.forward(ws, x, idx, rw, w, ctx)
    mok.check_status(ws)
    assert relative_error(good, reference(shape, x, idx, rw, w)) < TOLERANCE


@pytest.mark.parametrize("path", ["fused", "unfused"])
def test_any_token_count_up_to_the_workspaces(path):
    """Calls of T in {max, 200, 1, 0} tokens on one workspace: out and every gradient bitwise equal to a workspace
    made for exactly T (and out within the float64 reference's budget); mok.MoE takes any count up to its
    workspace's, and refuses more."""
    shape = SHAPES["shared"]
    ws = workspace(shape, path=path)
    x, idx, rw = make_inputs(shape, "cuda", seed=41)
    w = make_weights(shape, "cuda", seed=41)
    for t in (shape.num_tokens, 200, 1, 0):
        d_out = torch.randn(t, shape.hidden, device="cuda").to(torch.bfloat16)
        out, ctx = mok.forward(ws, x[:t].clone(), idx[:t].clone(), rw[:t].clone(), w, ws.make_context())
        d_x, d_rw, grads = mok.backward(ws, d_out, x[:t].clone(), idx[:t].clone(), rw[:t].clone(), w, ctx,
                                        grad_dtype=torch.float32)
        mok.check_status(ws)
        assert out.shape == (t, shape.hidden) and d_x.shape == (t, shape.hidden) and d_rw.shape == (t, shape.top_k)
        if t == 0:
            for g in grads.tensors():  # no tokens: every gradient exactly zero
                assert g is None or not g.any().item()
            continue
        exact_shape = dataclasses.replace(shape, num_tokens=t)
        exact = workspace(exact_shape, path=path)
        out2, ctx2 = mok.forward(exact, x[:t].clone(), idx[:t].clone(), rw[:t].clone(), w, exact.make_context())
        d_x2, d_rw2, grads2 = mok.backward(exact, d_out, x[:t].clone(), idx[:t].clone(), rw[:t].clone(), w, ctx2,
                                           grad_dtype=torch.float32)
        assert torch.equal(out.view(torch.int16), out2.view(torch.int16)), t
        assert torch.equal(d_x.view(torch.int16), d_x2.view(torch.int16)), t
        assert torch.equal(d_rw.view(torch.int32), d_rw2.view(torch.int32)), t
        for a, b in zip(grads.tensors(), grads2.tensors()):
            assert (a is None) == (b is None) and (a is None or torch.equal(a.view(torch.int32), b.view(torch.int32)))
        assert relative_error(out, reference(exact_shape, x[:t], idx[:t], rw[:t], w)) < TOLERANCE
    moe = mok.MoE(shape.hidden, shape.intermediate, shape.num_experts, shape.top_k, num_tokens=shape.num_tokens,
                  config=mok.Config(path=path))
    for t in (shape.num_tokens, 100, 0):
        xt = torch.randn(t, shape.hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        moe(xt).float().sum().backward()
        assert xt.grad.shape == (t, shape.hidden)
    with pytest.raises(ValueError, match="more than the layer's workspace takes per call"):
        moe(torch.randn(shape.num_tokens + 1, shape.hidden, device="cuda", dtype=torch.bfloat16))


def test_a_module_built_on_meta_runs_after_to_empty():
    """mok.MoE built on meta with num_tokens= (its workspace made there), moved with to_empty and initialized on
    the GPU: the first forward makes the workspace again on the GPU (the meta one closed), and the output matches
    the float64 reference; a second forward reuses it."""
    shape = SHAPES["shared"]
    moe = mok.MoE(shape.hidden, shape.intermediate, shape.num_experts, shape.top_k, router=False,
                  num_tokens=shape.num_tokens, device="meta")
    assert moe.workspace.device.type == "meta"
    moe.to_empty(device="cuda")
    moe.reset_parameters()
    x, idx, rw = make_inputs(shape, "cuda", seed=5)
    with torch.no_grad():
        out = moe(x, idx, rw)
    ws = moe.workspace
    assert ws.device.type == "cuda"
    w = mok.Weights(*[None if p is None else p.detach() for p in moe.weights().tensors()])
    want = reference(shape, x, idx, rw, w)
    assert torch.linalg.norm(out.double() - want) / torch.linalg.norm(want) < TOLERANCE
    with torch.no_grad():
        again = moe(x, idx, rw)
    assert moe.workspace is ws and torch.equal(again, out)
