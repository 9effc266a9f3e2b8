"""The FP8 layer from Python (Config(precision="fp8"), mok.quantize_weights, mok.forward_fp8): against the BF16 layer
(normwise error printed and bounded), reruns bitwise, the quantized weights' layout and memory, bad inputs with a
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
    """transposed=True: the same forward copies, and each matrix transposed with its scales (the FP8 backward's
    operands), bit for bit; nbytes counts both."""
    _, _, _, w = _inputs(1815 + shared, shared)
    w.expert_up[1, 5, 7] = float("nan")  # a NaN block: its scale is NaN in both copies
    plain = mok.quantize_weights(w)
    both = mok.quantize_weights(w, transposed=True)
    assert plain.values_t == () and plain.scales_t == ()
    assert len(both.values_t) == len(both.scales_t) == 6
    bits = lambda t: t.view(torch.uint8)
    for n, (v, s, v_t, s_t) in enumerate(zip(both.values, both.scales, both.values_t, both.scales_t)):
        if v is None:
            assert plain.values[n] is None and v_t is None and s_t is None
            continue
        assert torch.equal(bits(v), bits(plain.values[n])) and torch.equal(bits(s), bits(plain.scales[n]))
        assert v_t.dtype == torch.float8_e4m3fn and v_t.shape == v.shape[:-2] + (v.shape[-1], v.shape[-2])
        assert torch.equal(bits(v_t), bits(v).transpose(-1, -2)), f"values {n}"
        assert torch.equal(s_t.view(torch.int32), s.transpose(-1, -2).contiguous().view(torch.int32)), f"scales {n}"
    assert both.scales[1].isnan().any(), "the NaN block's scale"
    assert both.nbytes == 2 * plain.nbytes


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
    with pytest.raises(RuntimeError, match="has no backward yet"):
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
