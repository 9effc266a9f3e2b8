"""The FP8 layer from Python (Config(precision="fp8"), mok.quantize_weights, mok.forward_fp8, mok.backward_fp8,
mok.MoE): forward and backward against the BF16 layer (normwise errors printed and bounded), reruns and paths
bitwise, autograd against the explicit backward bitwise, the quantized weights' layout and memory, bad inputs with a
clear error and the next good call correct. GPU tests; they skip without a Hopper GPU."""
import pytest
import torch

import mok

pytestmark = pytest.mark.gpu

T, H, I, K, E = 256, 320, 384, 4, 16  # H 320: a partial last 128-column block


def _inputs(seed, shared=True):
    g = torch.Generator(device="cuda").manual_seed(seed)
    randn = lambda *s, scale=1.0: (torch.randn(*s, device="cuda", generator=g) * scale).bfloat16()
    x = randn(T, H)
    idx = torch.randn(T, E, device="cuda", generator=g).topk(K, dim=1).indices.int()
    rw = torch.rand(T, K, device="cuda", generator=g)
    w = mok.Weights(randn(E, I, H, scale=H**-0.5), randn(E, I, H, scale=H**-0.5), randn(E, H, I, scale=I**-0.5),
                    *((randn(I, H, scale=H**-0.5), randn(I, H, scale=H**-0.5), randn(H, I, scale=I**-0.5)) if shared
                      else (None, None, None)))
    return x, idx, rw, w


def _fp8_workspace(shared=True, path="unfused"):
    return mok.get_workspace(mok.Config(precision="fp8", path=path, backward=False), None, T, H, I, K, E,
                             shared_expert=shared)


@pytest.mark.parametrize("shared", [True, False])
def test_fp8_forward_against_bf16(shared):
    x, idx, rw, w = _inputs(1800 + shared, shared)
    with _fp8_workspace(shared) as ws8, mok.get_workspace(mok.Config(path="unfused", backward=False), None, T, H, I,
                                                          K, E, shared_expert=shared) as ws16:
        qw = mok.quantize_weights(w)
        out8, ctx = mok.forward_fp8(ws8, x, idx, rw, qw)
        again, _ = mok.forward_fp8(ws8, x, idx, rw, qw, ctx)
        out16, _ = mok.forward(ws16, x, idx, rw, w)
        mok.check_status(ws8)
        mok.check_status(ws16)
        assert not out8.isnan().any()
        assert torch.equal(out8, again), "FP8 reruns differ"
        err = ((out8.float() - out16.float()).norm() / out16.float().norm()).item()
        print(f"FP8 vs BF16 normwise error (shared={shared}): {err:.4f}")
        assert err < 0.10, err  # x's, the weights' and h's e4m3 roundings, about 3 % each


@pytest.mark.parametrize("shared", [True, False])
def test_fused_fp8_gives_the_unfused_bits(shared):
    """Config(precision="fp8") on the fused path (the forward megakernel) gives the unfused path's bits."""
    x, idx, rw, w = _inputs(1830 + shared, shared)
    qw = mok.quantize_weights(w)
    fused = mok.Config(precision="fp8", backward=False, minibatch_rows=128)
    with mok.get_workspace(fused, None, T, H, I, K, E, shared_expert=shared) as wsf, _fp8_workspace(shared) as wsu:
        out_fused, _ = mok.forward_fp8(wsf, x, idx, rw, qw)
        out_unfused, _ = mok.forward_fp8(wsu, x, idx, rw, qw)
        mok.check_status(wsf)
        mok.check_status(wsu)
        assert not out_fused.isnan().any()
        assert torch.equal(out_fused, out_unfused), "fused FP8 differs from unfused FP8"


def test_power_of_two_scales_through_the_layer():
    """Config(fp8_power_of_two_scales=True) with weights quantized alike: within the same budget of the BF16 layer,
    bitwise on a rerun and on the fused path, every weight scale a power of two, and not the bits of the plain
    scales."""
    x, idx, rw, w = _inputs(1815)
    config = mok.Config(precision="fp8", path="unfused", backward=False, fp8_power_of_two_scales=True)
    with mok.get_workspace(config, None, T, H, I, K, E, shared_expert=True) as ws2, _fp8_workspace() as ws8, \
            mok.get_workspace(mok.Config(path="unfused", backward=False), None, T, H, I, K, E,
                              shared_expert=True) as ws16:
        qw2 = mok.quantize_weights(w, power_of_two_scales=True)
        for s in qw2.scales:
            if s is not None:
                mantissa, _ = torch.frexp(s)
                assert bool((mantissa == 0.5).all()), "a weight scale that is not a power of two"
        out2, ctx = mok.forward_fp8(ws2, x, idx, rw, qw2)
        again, _ = mok.forward_fp8(ws2, x, idx, rw, qw2, ctx)
        with mok.get_workspace(mok.Config(precision="fp8", backward=False, fp8_power_of_two_scales=True), None, T, H,
                               I, K, E, shared_expert=True) as wsf:
            fused, _ = mok.forward_fp8(wsf, x, idx, rw, qw2)
            mok.check_status(wsf)
        assert torch.equal(fused, out2), "fused FP8 with power-of-two scales differs from unfused"
        out8, _ = mok.forward_fp8(ws8, x, idx, rw, mok.quantize_weights(w))
        out16, _ = mok.forward(ws16, x, idx, rw, w)
        for ws in (ws2, ws8, ws16):
            mok.check_status(ws)
        assert not out2.isnan().any()
        assert torch.equal(out2, again), "FP8 reruns differ"
        assert not torch.equal(out2, out8), "power-of-two scales gave the plain scales' bits"
        err = ((out2.float() - out16.float()).norm() / out16.float().norm()).item()
        print(f"FP8 (power-of-two scales) vs BF16 normwise error: {err:.4f}")
        assert err < 0.10, err


def test_quantize_weights_layout_and_memory():
    _, _, _, w = _inputs(1810)
    qw = mok.quantize_weights(w)
    assert qw.values[0].dtype == torch.float8_e4m3fn and qw.values[0].shape == (E, I, H)
    assert qw.scales[0].shape == (E, 3, 3) and qw.scales[2].shape == (E, 3, 3) and qw.scales[3].shape == (3, 3)
    assert qw.nbytes == sum(t.numel() for t in w.tensors()) + 4 * sum(s.numel() for s in qw.scales)
    # Dequantized, the weights are within e4m3's rounding of the bf16 ones, block by block: 2^-4 relative for
    # normal e4m3 values, half a subnormal step (2^-10 of the block's scale) for the small ones. I x H = 384 x 320:
    # padded with zeros to whole 128 x 128 blocks for the view.
    pad = lambda t: torch.nn.functional.pad(t.float(), (0, 3 * 128 - H)).view(E, 3, 128, 3, 128)
    scale = qw.scales[0][:, :, None, :, None]
    q, ref = pad(qw.values[0]) * scale, pad(w.expert_gate)
    assert ((q - ref).abs() <= ref.abs() * 2**-4 + scale * 2**-10).all()


@pytest.mark.parametrize("shared", [True, False])
def test_quantize_weights_transposed_is_the_transpose_exactly(shared):
    """transposed=True: the same forward copies, and [gate; up] and down transposed with their scales (the FP8
    backward's operands), bit for bit; nbytes counts both; fused gate/up weights give the same transposed copies."""
    _, _, _, w = _inputs(1815 + shared, shared)
    w.expert_up[1, 5, 7] = float("nan")  # a NaN block: its scale is NaN in both copies
    plain = mok.quantize_weights(w)
    both = mok.quantize_weights(w, transposed=True)
    assert plain.values_t == () and plain.scales_t == () and not plain.transposed and both.transposed
    bits = lambda t: t.view(torch.uint8)
    for n, (v, s) in enumerate(zip(both.values, both.scales)):
        assert (v is None) == (plain.values[n] is None)
        if v is not None:
            assert torch.equal(bits(v), bits(plain.values[n])) and torch.equal(bits(s), bits(plain.scales[n]))
    assert len(both.values_t) == len(both.scales_t) == 4
    for n, (gate, up, down) in enumerate(((0, 1, 2), (3, 4, 5))):
        gate_up_t, down_t = both.values_t[2 * n], both.values_t[2 * n + 1]
        if both.values[gate] is None:
            assert gate_up_t is None and down_t is None and both.scales_t[2 * n] is None
            continue
        gate_up = torch.cat([bits(both.values[gate]), bits(both.values[up])], dim=-2)
        gate_up_scales = torch.cat([both.scales[gate], both.scales[up]], dim=-2)
        for name, (v_t, s_t, v, s) in {
                "gate_up": (gate_up_t, both.scales_t[2 * n], gate_up, gate_up_scales),
                "down": (down_t, both.scales_t[2 * n + 1], bits(both.values[down]), both.scales[down])}.items():
            assert v_t.dtype == torch.float8_e4m3fn and v_t.shape == v.shape[:-2] + (v.shape[-1], v.shape[-2])
            assert torch.equal(bits(v_t), v.transpose(-1, -2)), f"{name} {n}: values"
            assert torch.equal(s_t.view(torch.int32), s.transpose(-1, -2).contiguous().view(torch.int32)), \
                f"{name} {n}: scales"
    assert both.scales[1].isnan().any(), "the NaN block's scale"
    assert both.nbytes == 2 * plain.nbytes
    fused = mok.quantize_weights(mok.Weights(torch.cat([w.expert_gate, w.expert_up], dim=1), None,
                                             *w.tensors()[2:]), transposed=True)
    for a, b in zip(fused.values_t + fused.scales_t, both.values_t + both.scales_t):
        assert (a is None and b is None) or torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    with pytest.raises(ValueError, match="transposed: True needs the intermediate size a multiple of 128"):
        mok.quantize_weights(mok.Weights(w.expert_gate[:, :192].contiguous(), w.expert_up[:, :192].contiguous(),
                                         w.expert_down[..., :192].contiguous()), transposed=True)
    # The op under it (mok::quantize_weights_fp8, which torch.compile traces): its schema, its fake's shapes,
    # strides and dtypes against the real outputs, both ways. Finite weights: opcheck compares outputs with
    # torch.testing.assert_close, to which the NaN block's NaN scales differ from themselves.
    finite = _inputs(1817, shared)[3]
    for transposed in (False, True):
        torch.library.opcheck(torch.ops.mok.quantize_weights_fp8.default, (list(finite.tensors()), False, transposed))


def test_bad_inputs_raise_and_the_next_call_works():
    x, idx, rw, w = _inputs(1820)
    with _fp8_workspace() as ws:
        qw = mok.quantize_weights(w)
        with pytest.raises(ValueError, match="mok.forward: the workspace is Config\\(precision='fp8'\\)"):
            mok.forward(ws, x, idx, rw, w)
        with pytest.raises(TypeError, match="expected mok.Fp8Weights"):
            mok.forward_fp8(ws, x, idx, rw, w)
        bad = mok.Fp8Weights(qw.values, (qw.scales[0][:, :2],) + qw.scales[1:])
        with pytest.raises(ValueError, match="weights.expert_gate scales"):
            mok.forward_fp8(ws, x, idx, rw, bad)
        with pytest.raises(ValueError, match="bf16 CUDA tensor"):
            mok.quantize_weights(mok.Weights(w.expert_gate.float(), *w.tensors()[1:]))
        out, _ = mok.forward_fp8(ws, x, idx, rw, qw)
        mok.check_status(ws)
        assert not out.isnan().any()


@pytest.mark.parametrize("path", ["unfused", "fused"])
def test_a_nan_in_x_is_reported_and_stays_in_its_token(path):
    x, idx, rw, w = _inputs(1830)
    with _fp8_workspace(path=path) as ws:
        qw = mok.quantize_weights(w)
        clean, _ = mok.forward_fp8(ws, x, idx, rw, qw)
        mok.check_status(ws)
        bad_x = x.clone()
        bad_x[9, 3] = float("nan")
        out, _ = mok.forward_fp8(ws, bad_x, idx, rw, qw)
        with pytest.raises(RuntimeError, match="NaN or infinity in x: token row 9 of rank 0"):
            mok.check_status(ws)
        assert out[9].isnan().all()
        others = torch.arange(T, device="cuda") != 9
        assert torch.equal(out[others], clean[others]), "a NaN in one token changed another token's output"
        ws.reset_status()
        again, _ = mok.forward_fp8(ws, x, idx, rw, qw)
        mok.check_status(ws)
        assert torch.equal(again, clean), "the next clean call"


def test_moe_requantizes_when_a_parameter_changes():
    cfg = mok.Config(precision="fp8", path="unfused", backward=False)
    moe = mok.MoE(H, I, E, K, num_tokens=T, config=cfg)
    x = torch.randn(T, H, device="cuda").bfloat16()
    with pytest.raises(RuntimeError, match="Config\\(precision='fp8', backward=False\\) is inference only"):
        moe(x)
    with torch.no_grad():
        first = moe(x)
        same = moe(x)
        assert torch.equal(first, same)
        cached = moe.fp8_weights()
        assert moe.fp8_weights() is cached, "re-quantized without a change"
        moe.expert_down.mul_(2)  # an in-place change, as an optimizer step makes
        assert moe.fp8_weights() is not cached, "stale FP8 weights after a parameter changed"
        changed = moe(x)
        assert not torch.equal(first, changed)


# ---------------------------------------------------------------------------------------------------------------
# The FP8 backward (Config(precision="fp8") with backward=True)


def _training_workspace(shared=True, path="unfused", **config):
    return mok.get_workspace(mok.Config(precision="fp8", path=path, **config), None, T, H, I, K, E,
                             shared_expert=shared)


def _leaves(x, rw, w):
    """Copies of x, router_weights and the weights that require grad (autograd's leaves)."""
    return (x.clone().requires_grad_(), rw.clone().requires_grad_(),
            mok.Weights(*[None if t is None else t.clone().requires_grad_() for t in w.tensors()]))


def _autograd(forward, x, rw, w, d_out):
    """(out, d_x, d_rw, the weights' gradients) of forward(x, rw, w) by autograd with upstream gradient d_out."""
    x, rw, w = _leaves(x, rw, w)
    out = forward(x, rw, w)
    out.backward(d_out)
    return out.detach(), x.grad, rw.grad, [None if t is None else t.grad for t in w.tensors()]


def _d_out(seed):
    """An upstream gradient d_out bf16 [T, H] ~ N(0, 1)."""
    return torch.randn(T, H, device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed)).bfloat16()


def _normwise(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("shared", [True, False])
def test_fp8_backward_against_bf16(shared):
    """Autograd through mok.forward_fp8 (master_weights: the bf16 weights) against mok.forward's in BF16: every
    gradient within the e4m3 roundings (x, the weights, h, d_out and d(g|u) each about 3 %; the weight gradients,
    FP8 by default, from their factors quantized along the rows), reruns bitwise, and the explicit mok.backward_fp8
    gives autograd's bits."""
    x, idx, rw, w = _inputs(1850 + shared, shared)
    d_out = _d_out(7)
    with _training_workspace(shared) as ws8, mok.get_workspace(mok.Config(path="unfused"), None, T, H, I, K, E,
                                                               shared_expert=shared) as ws16:
        qw = mok.quantize_weights(w, transposed=True)
        fp8 = lambda x, rw, w: mok.forward_fp8(ws8, x, idx, rw, qw, master_weights=w)[0]
        got = _autograd(fp8, x, rw, w, d_out)
        again = _autograd(fp8, x, rw, w, d_out)
        ref = _autograd(lambda x, rw, w: mok.forward(ws16, x, idx, rw, w)[0], x, rw, w, d_out)
        _, ctx = mok.forward_fp8(ws8, x, idx, rw, qw)
        d_x, d_rw, grads = mok.backward_fp8(ws8, d_out, x, idx, rw, qw, ctx)
        mok.check_status(ws8)
        mok.check_status(ws16)
    names = ["out", "d_x", "d_rw"] + [f"d_{n}" for n in ("expert_gate", "expert_up", "expert_down", "shared_gate",
                                                         "shared_up", "shared_down")]
    flat = lambda r: [r[0], r[1], r[2], *r[3]]
    for name, a, b, c in zip(names, flat(got), flat(again), flat(ref)):
        if c is None:
            assert a is None, name
            continue
        assert not a.isnan().any(), name
        assert torch.equal(a, b), f"{name}: FP8 reruns differ"
        err = _normwise(a, c)
        print(f"FP8 vs BF16 {name} normwise error (shared={shared}): {err:.4f}")
        assert err < 0.12, (name, err)
    assert torch.equal(d_x, got[1]) and torch.equal(d_rw, got[2]), "mok.backward_fp8 against autograd"
    for n, (a, b) in enumerate(zip(grads.tensors(), got[3])):
        assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), f"weight {n}: backward_fp8 vs autograd"


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_fp8_under_torch_compile_gives_the_eager_bits(backend):
    """mok.forward_fp8 with master_weights (autograd) and the explicit mok.backward_fp8, compiled with
    fullgraph=True (the ops mok::forward_fp8 and mok::backward_fp8 in the graphs; the quantized weights and the
    context made outside): every output and gradient bitwise the eager calls'."""
    x, idx, rw, w = _inputs(1870)
    d_out = _d_out(9)
    qw = mok.quantize_weights(w, transposed=True)
    with _training_workspace(path="fused") as ws:
        ctx = ws.make_context()

        def explicit(x, rw):
            mok.forward_fp8(ws, x, idx, rw, qw, ctx)
            return mok.backward_fp8(ws, d_out, x, idx, rw, qw, ctx)

        results = []
        for compiled in (False, True):
            torch._dynamo.reset()
            run = (lambda f: torch.compile(f, fullgraph=True, backend=backend)) if compiled else (lambda f: f)
            forward = run(lambda x, rw, w: mok.forward_fp8(ws, x, idx, rw, qw, ctx, master_weights=w)[0])
            out, d_x, d_rw, grads = _autograd(forward, x, rw, w, d_out)
            e_d_x, e_d_rw, e_grads = run(explicit)(x, rw)
            results.append([out, d_x, d_rw, *[g for g in grads if g is not None], e_d_x, e_d_rw,
                            *[g for g in e_grads.tensors() if g is not None]])
        mok.check_status(ws)
        torch._dynamo.reset()
    for n, (a, b) in enumerate(zip(*results)):
        assert torch.equal(a, b), f"value {n}: compiled ({backend}) against eager"


def test_fp8_backward_paths_grad_modes_and_token_counts():
    """The fused forward's context gives the unfused one's gradient bits; fp32 gradients written, and main_grads
    accumulated twice, are (0 + g) + g of them bit for bit; T tokens below the workspace's (0 included) give those
    of a workspace for exactly them (no expert row of another call's tokens), 0 tokens zero weight gradients."""
    x, idx, rw, w = _inputs(1860)
    d_out = _d_out(8)
    qw = mok.quantize_weights(w, transposed=True)
    with _training_workspace() as wsu, _training_workspace(path="fused") as wsf:
        results = []
        for ws in (wsu, wsf):
            _, ctx = mok.forward_fp8(ws, x, idx, rw, qw)
            results.append(mok.backward_fp8(ws, d_out, x, idx, rw, qw, ctx, grad_dtype=torch.float32))
        for a, b in zip([results[0][0], results[0][1], *results[0][2].tensors()],
                        [results[1][0], results[1][1], *results[1][2].tensors()]):
            assert (a is None and b is None) or torch.equal(a, b), "fused forward's context against the unfused one's"
        fp32 = results[0][2]
        main = mok.main_grads(w)
        for _ in range(2):
            _, ctx = mok.forward_fp8(wsu, x, idx, rw, qw)
            mok.backward_fp8(wsu, d_out, x, idx, rw, qw, ctx, main_grads=main)
        for n, (m, g) in enumerate(zip(main.tensors(), fp32.tensors())):
            if g is not None:
                assert torch.equal(m, (torch.zeros_like(g) + g) + g), f"weight {n}: main_grads accumulation"
        _, ctx = mok.forward_fp8(wsu, x, idx, rw, qw)
        bf16 = mok.backward_fp8(wsu, d_out, x, idx, rw, qw, ctx)[2]
        for n, (b, g) in enumerate(zip(bf16.tensors(), fp32.tensors())):
            if g is not None:
                assert torch.equal(b, g.bfloat16()), f"weight {n}: bf16 gradient is the fp32 one rounded"
        for tokens in (100, 0):
            with mok.get_workspace(mok.Config(precision="fp8", path="unfused"), None, max(tokens, 1), H, I, K,
                                   E) as exact:
                got = []
                for ws in (wsu, exact):
                    _, ctx = mok.forward_fp8(ws, x[:tokens], idx[:tokens], rw[:tokens], qw)
                    d_x, d_rw, grads = mok.backward_fp8(ws, d_out[:tokens], x[:tokens], idx[:tokens], rw[:tokens],
                                                        qw, ctx)
                    mok.check_status(ws)
                    got.append([d_x, d_rw, *[g for g in grads.tensors() if g is not None]])
                for a, b in zip(*got):
                    assert torch.equal(a, b), f"{tokens} tokens: against a workspace for exactly them"
                if tokens == 0:
                    assert all(not g.any() for g in got[0][2:]), "0 tokens: nonzero weight gradients"
        mok.check_status(wsu)
        mok.check_status(wsf)


@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("keep_gate_up", [True, False], ids=["kept", "recomputed"])
def test_fp8_backward_megakernel_gives_the_stage_kernels_bits(shared, keep_gate_up):
    """Config(precision="fp8", backward_megakernel=True): the FP8 backward as one persistent launch gives the FP8
    stage kernels' d_x, d_rw and weight gradients bit for bit (g | u kept by the forward or recomputed), reruns too."""
    x, idx, rw, w = _inputs(1880 + shared, shared)
    d_out = _d_out(10)
    qw = mok.quantize_weights(w, transposed=True)
    results = []
    for megakernel in (False, True, True):
        with _training_workspace(shared, path="fused", keep_gate_up=keep_gate_up,
                                 backward_megakernel=megakernel) as ws:
            _, ctx = mok.forward_fp8(ws, x, idx, rw, qw)
            d_x, d_rw, grads = mok.backward_fp8(ws, d_out, x, idx, rw, qw, ctx)
            mok.check_status(ws)
            results.append([d_x, d_rw, *[g for g in grads.tensors() if g is not None]])
    assert not any(t.isnan().any() for t in results[0])
    for run in (1, 2):
        for n, (a, b) in enumerate(zip(results[0], results[run])):
            assert torch.equal(a, b), f"value {n} (run {run}): the backward megakernel against the stage kernels"


def test_moe_fp8_trains():
    """mok.MoE(precision="fp8"): autograd gives the functional FP8 backward's bits (parameters as the master
    weights), an optimizer step quantizes again, main_grad=True adds into main_grad, recompute=True lets two
    layers share one context; backward=False in a differentiable call is refused with the option named."""
    torch.manual_seed(1870)
    config = mok.Config(precision="fp8", path="unfused")
    moe = mok.MoE(H, I, E, K, num_tokens=T, config=config)
    x = torch.randn(T, H, device="cuda").bfloat16().requires_grad_()
    idx, rw = (t.detach() for t in moe.route(x.detach()))  # the caller's: x's gradient is the layer's d_x alone
    out = moe(x, idx, rw)
    d_out = torch.randn_like(out)
    out.backward(d_out)
    qw = moe.fp8_weights()
    _, ctx = mok.forward_fp8(moe.workspace, x.detach(), idx, rw, qw)
    d_x, _, grads = mok.backward_fp8(moe.workspace, d_out, x.detach(), idx, rw, qw, ctx)
    mok.check_status(moe.workspace)
    assert torch.equal(x.grad, d_x), "module d_x against mok.backward_fp8"
    for n, (p, g) in enumerate(zip(moe.weights().tensors(), grads.tensors())):
        if p is not None:
            assert torch.equal(p.grad, g), f"module weight {n} gradient against mok.backward_fp8"
    before = moe.fp8_weights()
    with torch.no_grad():
        for p in moe.weights().tensors():
            if p is not None:
                p.sub_(p.grad, alpha=0.1)
    assert moe.fp8_weights() is not before, "stale FP8 weights after a step"
    main = mok.MoE(H, I, E, K, num_tokens=T, config=config, main_grad=True)
    main.load_state_dict(moe.state_dict())
    main.allocate_main_grads()
    main(x.detach(), idx, rw).backward(d_out)
    qw = main.fp8_weights()
    _, ctx = mok.forward_fp8(main.workspace, x.detach(), idx, rw, qw)
    fp32 = mok.backward_fp8(main.workspace, d_out, x.detach(), idx, rw, qw, ctx, grad_dtype=torch.float32)[2]
    for n, (p, g) in enumerate(zip(main.weights().tensors(), fp32.tensors())):
        if p is not None:
            assert torch.equal(p.main_grad, g), f"main_grad {n} against the fp32 gradient"
    # recompute=True: two layers sharing one context give the bits of the same two with a context each (the
    # backward rebuilds each layer's context from x and its FP8 weights: mok::recompute_forward_context_fp8).
    shared_context = moe.workspace.make_context()
    layers = {}
    for recompute in (False, True):
        layers[recompute] = [mok.MoE(H, I, E, K, workspace=moe.workspace, config=config, recompute=recompute,
                                     context=shared_context if recompute else None) for _ in range(2)]
        for n, layer in enumerate(layers[recompute]):
            layer.load_state_dict(moe.state_dict() if n == 0 else main.state_dict())
    got = {}
    for recompute, (first, second) in layers.items():
        leaf = x.detach().clone().requires_grad_()
        second(first(leaf, idx, rw), idx, rw).backward(d_out)
        got[recompute] = [leaf.grad] + [p.grad for layer in (first, second) for p in layer.weights().tensors()
                                        if p is not None]
    mok.check_status(moe.workspace)
    for n, (a, b) in enumerate(zip(got[False], got[True])):
        assert torch.equal(a, b), f"gradient {n}: recompute=True sharing a context against a context each"
    with pytest.raises(RuntimeError, match="backward=False\\) is inference only"):
        mok.MoE(H, I, E, K, num_tokens=T, config=mok.Config(precision="fp8", backward=False))(x)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_moe_fp8_under_torch_compile_gives_the_eager_bits(backend):
    """mok.MoE(precision="fp8") compiled with fullgraph=True quantizes its weights inside the graph in every forward
    (mok::quantize_weights_fp8): two training steps with an SGD step between, and a forward under no_grad, give the
    eager module's outputs and gradients bit for bit (the second step's from the updated weights)."""
    torch.manual_seed(1871)
    moe = mok.MoE(H, I, E, K, num_tokens=T, config=mok.Config(precision="fp8", path="fused"))
    start = {n: p.detach().clone() for n, p in moe.state_dict().items()}
    x = torch.randn(T, H, device="cuda").bfloat16()
    idx, rw = (t.detach() for t in moe.route(x))
    d_out = torch.randn(T, H, device="cuda").bfloat16()
    params = [p for p in moe.weights().tensors() if p is not None]

    def steps(layer):
        moe.load_state_dict(start)
        got = []
        for _ in range(2):
            leaf = x.clone().requires_grad_()
            for p in params:
                p.grad = None
            out = layer(leaf, idx, rw)
            out.backward(d_out)
            got += [out.detach(), leaf.grad, *[p.grad.clone() for p in params]]
            with torch.no_grad():
                for p in params:
                    p.sub_(p.grad, alpha=0.1)
        with torch.no_grad():
            got.append(layer(x, idx, rw))
        mok.check_status(moe.workspace)
        return got

    eager = steps(moe)
    torch._dynamo.reset()
    compiled = steps(torch.compile(moe, fullgraph=True, backend=backend))
    torch._dynamo.reset()
    for n, (a, b) in enumerate(zip(eager, compiled)):
        assert torch.equal(a, b), f"value {n}: compiled ({backend}) against eager"


@pytest.mark.parametrize("megakernel", [False, True], ids=["stage_kernels", "backward_megakernel"])
def test_fp8_backward_bad_inputs_raise_and_the_next_call_works(megakernel):
    """Weights without the transposed copies, a misshapen transposed copy, a context without a forward, one
    overwritten by a later forward, an inference workspace: each a clear error, and the next good backward gives
    the bits of one never refused. Through the stage kernels and through the backward megakernel."""
    x, idx, rw, w = _inputs(1880)
    d_out = _d_out(9)
    path = "fused" if megakernel else "unfused"  # the backward megakernel is the fused path's backward
    with _training_workspace(path=path, backward_megakernel=megakernel) as ws, _fp8_workspace() as inference:
        qw = mok.quantize_weights(w, transposed=True)
        _, ctx = mok.forward_fp8(ws, x, idx, rw, qw)
        clean = mok.backward_fp8(ws, d_out, x, idx, rw, qw, ctx)
        mok.check_status(ws)
        with pytest.raises(ValueError, match="quantized without the transposed copies"):
            mok.backward_fp8(ws, d_out, x, idx, rw, mok.quantize_weights(w), ctx)
        bad = mok.Fp8Weights(qw.values, qw.scales, (qw.values_t[0], qw.values_t[0]) + qw.values_t[2:], qw.scales_t)
        with pytest.raises(ValueError, match="weights.expert_down_t: expected a contiguous float8_e4m3fn"):
            mok.backward_fp8(ws, d_out, x, idx, rw, bad, ctx)
        with pytest.raises(RuntimeError, match="holds no forward"):
            mok.backward_fp8(ws, d_out, x, idx, rw, qw, ws.make_context())
        with pytest.raises(ValueError, match="ws: made with Config\\(backward=False\\)"):
            mok.backward_fp8(inference, d_out, x, idx, rw, qw, ctx)
        leaf = x.clone().requires_grad_()
        with pytest.raises(RuntimeError, match="on a workspace made with Config\\(backward=False\\)"):
            mok.forward_fp8(inference, leaf, idx, rw, qw)
        out, shared_ctx = mok.forward_fp8(ws, leaf, idx, rw, qw)
        mok.forward_fp8(ws, x, idx, rw, qw, shared_ctx)  # overwrites the context the first one's graph needs
        with pytest.raises(RuntimeError, match="overwritten by a later forward"):
            out.backward(d_out)
        _, ctx = mok.forward_fp8(ws, x, idx, rw, qw)
        again = mok.backward_fp8(ws, d_out, x, idx, rw, qw, ctx)
        mok.check_status(ws)
        for a, b in zip([clean[0], clean[1], *clean[2].tensors()], [again[0], again[1], *again[2].tensors()]):
            assert (a is None and b is None) or torch.equal(a, b), "the next good backward"


def test_fp8_weight_gradients_against_bf16_ones():
    """The default FP8 weight gradients (GEMMs of their factors quantized along the rows) against
    Config(bf16_weight_gradients=True)'s: d_x and d_rw bitwise (the dgrads do not change), every weight gradient
    within 0.05 normwise (FP8's roundings of the two factors, about 3 % each), reruns bitwise. A NaN in d_out:
    reported, its token's d_x NaN, every other token's bitwise the clean call's; after a reset the next clean call is
    bitwise clean. A BF16 Config takes either value (bf16 weight gradients either way)."""
    x, idx, rw, w = _inputs(1895)
    d_out = _d_out(11)
    qw = mok.quantize_weights(w, transposed=True)

    def run(ws, d):
        _, ctx = mok.forward_fp8(ws, x, idx, rw, qw)
        d_x, d_rw, grads = mok.backward_fp8(ws, d, x, idx, rw, qw, ctx, grad_dtype=torch.float32)
        return [d_x, d_rw, *[g for g in grads.tensors() if g is not None]]

    with _training_workspace(bf16_weight_gradients=True) as ws16w, _training_workspace() as ws:
        default = run(ws16w, d_out)
        got = run(ws, d_out)
        again = run(ws, d_out)
        mok.check_status(ws)
        mok.check_status(ws16w)
        assert torch.equal(got[0], default[0]) and torch.equal(got[1], default[1]), "d_x / d_rw changed"
        assert any(not torch.equal(a, b) for a, b in zip(got[2:], default[2:])), "FP8 weight gradients are not on"
        for n in range(2, len(got)):
            assert torch.equal(got[n], again[n]), f"weight gradient {n - 2}: a rerun differs"
            err = _normwise(got[n], default[n])
            print(f"FP8 weight gradient {n - 2} vs the bf16 one: normwise {err:.4f}")
            assert err < 0.05, (n, err)
        bad = d_out.clone()
        bad[9, 3] = float("nan")
        nan_run = run(ws, bad)
        with pytest.raises(RuntimeError, match="NaN or infinity in d_out at row"):
            mok.check_status(ws)
        others = torch.arange(T, device="cuda") != 9
        assert nan_run[0][9].isnan().all(), "the NaN token's d_x"
        assert torch.equal(nan_run[0][others], got[0][others]), "a NaN in one token's d_out changed another's d_x"
        ws.reset_status()
        clean = run(ws, d_out)
        mok.check_status(ws)
        assert all(torch.equal(a, b) for a, b in zip(clean, got)), "the next clean call"
    assert mok.Config(bf16_weight_gradients=True).bf16_weight_gradients


@pytest.mark.parametrize("path", ["unfused", "fused"])
def test_fp8_weight_gradient_columns(path):
    """The FP8 weight gradients' two recipes for x and h: per 128 x 128 block (the default) and per column
    (Config(fp8_weight_gradient_columns=True), DeepSeek-V3's). d_x and d_rw bitwise alike (the dgrads do not change);
    every weight gradient differs between them and is within 0.05 normwise of the bf16 one; reruns bitwise; the
    backward megakernel's the stage kernels' bits on the fused path."""
    x, idx, rw, w = _inputs(1897)
    d_out = _d_out(13)
    qw = mok.quantize_weights(w, transposed=True)

    def run(ws):
        _, ctx = mok.forward_fp8(ws, x, idx, rw, qw)
        d_x, d_rw, grads = mok.backward_fp8(ws, d_out, x, idx, rw, qw, ctx, grad_dtype=torch.float32)
        return [d_x, d_rw, *[g for g in grads.tensors() if g is not None]]

    with _training_workspace(path=path, bf16_weight_gradients=True) as ws16w, \
            _training_workspace(path=path, fp8_weight_gradient_columns=True) as ws, \
            _training_workspace(path=path) as wsb:
        bf16w, columns, blocks, again = run(ws16w), run(ws), run(wsb), run(wsb)
        for workspace in (ws16w, ws, wsb):
            mok.check_status(workspace)
        assert torch.equal(blocks[0], columns[0]) and torch.equal(blocks[1], columns[1]), "d_x / d_rw changed"
        for n in range(2, len(blocks)):
            assert torch.equal(blocks[n], again[n]), f"weight gradient {n - 2}: a rerun differs"
            assert not torch.equal(blocks[n], columns[n]), f"weight gradient {n - 2}: the per-column recipe's"
            err, err_columns = _normwise(blocks[n], bf16w[n]), _normwise(columns[n], bf16w[n])
            print(f"FP8 weight gradient {n - 2} vs the bf16 one: normwise {err:.4f} with blocks, {err_columns:.4f} "
                  "per column")
            assert err < 0.05 and err_columns < 0.05, (n, err, err_columns)
    if path == "fused":
        with _training_workspace(path=path, backward_megakernel=True) as wsm:
            mega = run(wsm)
            mok.check_status(wsm)
        for n, (a, b) in enumerate(zip(mega, blocks)):
            assert torch.equal(a, b), f"output {n}: the backward megakernel's differs from the stage kernels'"


@pytest.mark.parametrize("megakernel", [False, True], ids=["stage_kernels", "backward_megakernel"])
def test_fp8_backward_scale_edge_cases(megakernel):
    """The FP8 scale edge cases through the backward (the stage kernels and the backward megakernel). d_out scaled by
    2^20 (past e4m3's range) and 2^-60: every gradient exactly that multiple of the clean ones (a power of two
    commutes with each scale, reciprocal and fp32 product: the scales are not at their floor). 2^-120 (scales at
    their floor, 2^-126): finite, no report, the weight gradients near the scaled clean ones. All-zero d_out rows:
    those tokens' d_x and d_rw exactly 0. A NaN in d_out: reported through the status word, its token's d_x and d_rw
    NaN, every other token's bitwise the clean call's; after a reset the next clean call is bitwise clean."""
    x, idx, rw, w = _inputs(1890)
    d_out = _d_out(10)
    qw = mok.quantize_weights(w, transposed=True)
    path = "fused" if megakernel else "unfused"  # the backward megakernel is the fused path's backward
    with _training_workspace(path=path, backward_megakernel=megakernel) as ws:
        def run(d):
            _, ctx = mok.forward_fp8(ws, x, idx, rw, qw)
            d_x, d_rw, grads = mok.backward_fp8(ws, d, x, idx, rw, qw, ctx, grad_dtype=torch.float32)
            return [d_x, d_rw, *[g for g in grads.tensors() if g is not None]]

        clean = run(d_out)
        mok.check_status(ws)
        for power in (20, -60):
            scaled = run(d_out * 2.0**power)
            mok.check_status(ws)
            for n, (a, b) in enumerate(zip(scaled, clean)):
                assert torch.equal(a, (b.float() * 2.0**power).to(b.dtype)), f"2^{power}: output {n}"
        tiny = run(d_out * 2.0**-120)
        mok.check_status(ws)
        assert all(t.isfinite().all() for t in tiny), "2^-120: a non-finite gradient"
        for n in range(2, len(clean)):
            err = _normwise(tiny[n] * 2.0**120, clean[n])
            print(f"d_out x 2^-120: weight gradient {n - 2} normwise error {err:.4f}")
            assert err < 0.25, (n, err)
        zeroed = d_out.clone()
        zeroed[:10] = 0
        got = run(zeroed)
        mok.check_status(ws)
        assert not got[0][:10].any() and not got[1][:10].any(), "zero d_out rows: nonzero d_x or d_rw"
        bad = d_out.clone()
        bad[9, 3] = float("nan")
        got = run(bad)
        with pytest.raises(RuntimeError, match="NaN or infinity in d_out at row"):
            mok.check_status(ws)
        others = torch.arange(T, device="cuda") != 9
        assert got[0][9].isnan().all() and got[1][9].isnan().all(), "the NaN token's d_x and d_rw"
        assert torch.equal(got[0][others], clean[0][others]) and torch.equal(got[1][others], clean[1][others]), \
            "a NaN in one token's d_out changed another token's d_x or d_rw"
        ws.reset_status()
        again = run(d_out)
        mok.check_status(ws)
        assert all(torch.equal(a, b) for a, b in zip(again, clean)), "the next clean call"
