"""FP8 (Config(precision="fp8"): DeepSeek-V3's recipe, docs/design.md "FP8"): the weights quantized once per
optimizer step, then the layer's forward and backward with them (the torch.library ops mok::forward_fp8 and
mok::backward_fp8: under torch.compile too, with the quantized weights made outside the compiled function).

    ws = mok.get_workspace(mok.Config(precision="fp8"), None, T, H, I, k, E)
    qw = mok.quantize_weights(w, transposed=True)      # after every optimizer step (w: mok.Weights, bf16)
    out, ctx = mok.forward_fp8(ws, x, topk_idx, router_weights, qw, master_weights=w)   # differentiable
    d_x, d_rw, grads = mok.backward_fp8(ws, d_out, x, topk_idx, router_weights, qw, ctx)  # or explicitly

The weight gradients are those of the bf16 weights the FP8 ones were quantized from (straight through the
quantization, as DeepSeek-V3 trains), computed in bf16 from bf16 activations (docs/design.md, "FP8 backward").
An inference-only workspace (Config(precision="fp8", backward=False)) needs only quantize_weights(w).
"""
import dataclasses
from typing import Optional, Tuple

import torch

from . import arguments, ops
from .checks import WEIGHT_NAMES, _describe as _describe_tensor, call_tokens, check_tensor, check_weights, check_x, \
    weight_dims
from .config import Weights

E4M3 = torch.float8_e4m3fn
# The transposed copies the FP8 backward's dgrads read (MoeWeights' order): [gate; up] and down, routed then shared.
TRANSPOSED_NAMES = ("expert_gate_up_t", "expert_down_t", "shared_gate_up_t", "shared_down_t")


def _describe(value) -> str:
    """A value in an error message: a tensor by dtype, device, shape and layout (not its values), anything else by
    its type and repr."""
    return _describe_tensor(value) if isinstance(value, torch.Tensor) else arguments.describe(value)


def _blocks(extent: int) -> int:
    return (extent + 127) // 128


@dataclasses.dataclass(frozen=True)
class Fp8Weights:
    """The six weights (mok.Weights' fields, None where absent) as e4m3 values with fp32 block scales per 128 x 128
    block of each expert's matrix: values[n] [.., rows, cols] float8_e4m3fn, scales[n] [.., ceil(rows/128),
    ceil(cols/128)]. With quantize_weights(transposed=True) also what the FP8 backward's dgrads read (K-major), in
    TRANSPOSED_NAMES' order: [gate; up] transposed (expert [E, H, 2I], shared [H, 2I]) and down transposed (expert
    [E, I, H], shared [I, H]; the shared ones None without a shared expert), values_t float8_e4m3fn and scales_t
    fp32 [.., ceil(cols/128), ceil(rows/128)]: the same e4m3 values and scales exactly (a 128 x 128 block's scale is
    its transpose's); empty tuples otherwise. Made by quantize_weights."""

    values: Tuple[Optional[torch.Tensor], ...]
    scales: Tuple[Optional[torch.Tensor], ...]
    values_t: Tuple[Optional[torch.Tensor], ...] = ()
    scales_t: Tuple[Optional[torch.Tensor], ...] = ()

    @property
    def nbytes(self) -> int:
        """Device bytes of the values and scales (the transposed copies included)."""
        return sum(t.numel() * t.element_size() for t in self.values + self.scales + self.values_t + self.scales_t
                   if t is not None)

    @property
    def transposed(self) -> bool:
        """Whether the backward's transposed copies are here (quantize_weights(transposed=True))."""
        return len(self.values_t) > 0

    def op_tensors(self) -> Tuple[Optional[torch.Tensor], ...]:
        """values, scales, values_t, scales_t as one tuple, the transposed ones None without them: the FP8 weights'
        entries of the ops (mok.ops.LayerFunction, mok::backward_fp8)."""
        missing = (None,) * len(TRANSPOSED_NAMES)
        return self.values + self.scales + (self.values_t or missing) + (self.scales_t or missing)


def quantize_weights(weights, power_of_two_scales: bool = False, transposed: bool = False) -> Fp8Weights:
    """The weights (a mok.Weights or dict of bf16 tensors on one CUDA device) quantized for the FP8 layer:
    scale = amax / 448 (at least 2^-126) of each 128 x 128 block (1 for an all-zero block, NaN for one holding a
    NaN or an infinity: what reads it turns NaN, never a finite wrong number), or that rounded up to a power of two;
    e4m3 = e4m3(value * (1 / scale)). transposed=True also writes what the FP8 backward reads (Fp8Weights.values_t, scales_t: [gate; up] and down transposed, the
    same values; twice the memory, in Fp8Weights.nbytes); it needs the intermediate size a multiple of 128, so that
    each 128-column block of [gate; up]^T is gate's or up's. Asynchronous on torch's current stream; new tensors
    (call it again after the weights change: the values are not tied to them)."""
    weights = Weights.of(weights)
    arguments.check_bool("power_of_two_scales", power_of_two_scales)
    arguments.check_bool("transposed", transposed)
    tensors = weights.tensors()
    for name, w in zip(WEIGHT_NAMES, tensors):
        if w is None:
            continue
        if not isinstance(w, torch.Tensor) or w.dtype != torch.bfloat16 or w.device.type != "cuda" or w.dim() not in (2, 3):
            raise ValueError(f"weights.{name}: expected a bf16 CUDA tensor [E_local, rows, cols] or [rows, cols], got "
                             f"{_describe(w)}")
        halves = 2 if name == "expert_gate" and weights.expert_up is None else 1  # [gate; up] fused
        if transposed and name in ("expert_gate", "shared_gate") and w.shape[-2] % (128 * halves) != 0:
            raise ValueError(f"transposed: True needs the intermediate size a multiple of 128 (each 128-column block "
                             f"of the FP8 backward's [gate; up]^T is gate's or up's), got weights.{name} "
                             f"{_describe(w)}")
    present = [w is not None for w in tensors]
    values, scales, copies, copy_scales = torch.ops.mok.quantize_weights_fp8(
        [None if w is None else w.detach().contiguous() for w in tensors], bool(power_of_two_scales),
        bool(transposed))
    values, scales = _spread(values, present), _spread(scales, present)
    if not transposed:
        return Fp8Weights(values, scales)
    copies_present = [present[0], present[2], present[3], present[5]]  # [gate; up] and down, routed then shared
    return Fp8Weights(values, scales, _spread(copies, copies_present), _spread(copy_scales, copies_present))


def _spread(tensors, present) -> Tuple[Optional[torch.Tensor], ...]:
    """The op's list of present tensors as a tuple with None where `present` is False."""
    it = iter(tensors)
    return tuple(next(it) if p else None for p in present)


def _check_fp8_weights(ws, weights: Fp8Weights, backward: bool = False) -> None:
    """weights: an Fp8Weights of the workspace's shape; with `backward`, holding the transposed copies."""
    if not isinstance(weights, Fp8Weights):
        raise TypeError(f"weights: expected mok.Fp8Weights (mok.quantize_weights), got {type(weights).__name__}")
    fused = weights.values[1] is None
    dims = weight_dims(ws.shape, fused)
    for n, name in enumerate(WEIGHT_NAMES):
        value, scale = weights.values[n], weights.scales[n]
        if name not in dims:
            if value is not None or scale is not None:
                raise ValueError(f"weights.{name}: expected None for this shape, got a tensor")
            continue
        letters, shape = dims[name]
        _check_fp8_pair(ws, f"weights.{name}", value, scale, letters, shape)
    if not backward:
        return
    if not weights.transposed:
        raise ValueError("weights: quantized without the transposed copies the FP8 backward reads: make them with "
                         "mok.quantize_weights(w, transposed=True)")
    e, h, i = ws.shape.local_experts, ws.shape.hidden, ws.shape.intermediate
    want = {"expert_gate_up_t": ("E_local, H, 2I", (e, h, 2 * i)), "expert_down_t": ("E_local, I, H", (e, i, h)),
            "shared_gate_up_t": ("H, 2I", (h, 2 * i)), "shared_down_t": ("I, H", (i, h))}
    for n, name in enumerate(TRANSPOSED_NAMES):
        value, scale = weights.values_t[n], weights.scales_t[n]
        if name.startswith("shared") and not ws.shape.shared_expert:
            if value is not None or scale is not None:
                raise ValueError(f"weights.{name}: expected None for this shape, got a tensor")
            continue
        _check_fp8_pair(ws, f"weights.{name}", value, scale, *want[name])


def _check_fp8_pair(ws, name, value, scale, letters, shape) -> None:
    if not isinstance(value, torch.Tensor) or value.dtype != E4M3 or tuple(value.shape) != shape or \
            value.device != ws.device or not value.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous float8_e4m3fn [{letters}] = {list(shape)} on {ws.device}, "
                         f"got {_describe(value)}")
    scale_shape = shape[:-2] + (_blocks(shape[-2]), _blocks(shape[-1]))
    if not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32 or tuple(scale.shape) != scale_shape \
            or scale.device != ws.device or not scale.is_contiguous():
        raise ValueError(f"{name} scales: expected a contiguous fp32 {list(scale_shape)} on {ws.device}, got "
                         f"{_describe(scale)}")


def _check_call(ws, name: str) -> None:
    from .layer import _check_workspace
    _check_workspace(ws)
    if ws.config.precision != "fp8":
        raise ValueError(f"mok.{name}: the workspace is Config(precision={ws.config.precision!r}); make it with "
                         "Config(precision='fp8')")


def _check_inputs(ws, x, topk_idx, router_weights) -> None:
    t = call_tokens(ws.shape, "topk_idx", topk_idx)
    check_tensor("topk_idx", topk_idx, (torch.int32, torch.int64), "T, k", (t, ws.shape.top_k), ws.device)
    check_x(ws.shape, ws.device, x, tokens=t)
    check_tensor("router_weights", router_weights, (torch.float32,), "T, k", (t, ws.shape.top_k), ws.device)


def forward_fp8(ws, x: torch.Tensor, topk_idx: torch.Tensor, router_weights: torch.Tensor, weights: Fp8Weights,
                ctx=None, *, master_weights=None, recompute: bool = False):
    """The layer's forward with FP8 weights on an FP8 workspace (Config(precision="fp8")): mok.forward's
    arguments and result, weights from quantize_weights. x is quantized per 1 x 128 once on this rank (the rows
    other ranks pull are FP8), h per 1 x 128 before the down GEMM.

    Differentiable (autograd's backward is backward_fp8's) in x, router_weights and master_weights: the bf16
    weights (a mok.Weights or dict) that `weights` were quantized from, whose gradients it computes (straight
    through the quantization); needs a workspace with backward=True and weights quantized with transposed=True.
    The context must still hold this forward when the backward runs (one context per forward in flight), unless
    recompute=True: then the backward rebuilds it first from x and `weights` (build_schedule and
    recompute_forward_context; the same bits), so layers may share one context. Under torch.compile and CUDA-graph
    capture pass ctx=ws.make_context(), made outside."""
    from .layer import _check_context
    _check_call(ws, "forward_fp8")
    _check_inputs(ws, x, topk_idx, router_weights)
    _check_fp8_weights(ws, weights)
    arguments.check_bool("recompute", recompute)
    if master_weights is not None:
        master_weights = Weights.of(master_weights)
        check_weights(ws.shape, ws.device, master_weights, "master_weights.")
        if (master_weights.expert_up is None) != (weights.values[1] is None):
            raise ValueError("master_weights: gate and up fused in one of master_weights and weights, not in both "
                             "(quantize the master weights themselves)")
    masters = master_weights.tensors() if master_weights is not None else (None,) * len(WEIGHT_NAMES)
    differentiable = torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in (x, router_weights) + tuple(masters))
    if differentiable:
        if not ws.config.backward:
            raise RuntimeError("mok.forward_fp8: a differentiable call (x, router_weights or master_weights requires "
                               "grad) on a workspace made with Config(backward=False): make it with backward=True, "
                               "or run under torch.no_grad()")
        _check_fp8_weights(ws, weights, backward=True)
    if ctx is None:
        if torch.compiler.is_compiling():
            raise RuntimeError("mok.forward_fp8 under torch.compile: pass ctx=ws.make_context(), made outside the "
                               "compiled function")
        if ws.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("mok.forward_fp8 under CUDA-graph capture: pass ctx=ws.make_context(), made before the "
                               "capture (a pooled context could be handed to another forward while the graph still "
                               "writes it)")
        ctx = ws.pooled_context()  # returned to the pool when the caller drops it: steady state allocates nothing
    _check_context(ws, ctx)
    out = ops.LayerFunction.apply(ws.handle, ctx.handle, False, x, topk_idx, router_weights, *masters,
                                  *([None] * len(WEIGHT_NAMES)), None, 0, 0, bool(recompute), *weights.op_tensors())
    return out, ctx


def fp8_layer_forward(ws, ctx, x, topk_idx, router_weights, weights: Fp8Weights, master_weights: Weights,
                      targets, recompute: bool) -> torch.Tensor:
    """forward_fp8 for mok.MoE's training forward: its context, its parameters as the master weights, with
    main_grad=True (targets: its MainGradTargets) the weight gradients added into their main_grad, and with
    recompute its context rebuilt by the backward."""
    from .layer import _check_context
    _check_call(ws, "forward_fp8")
    _check_inputs(ws, x, topk_idx, router_weights)
    _check_fp8_weights(ws, weights, backward=True)
    check_weights(ws.shape, ws.device, master_weights, "master_weights.")
    _check_context(ws, ctx)
    if targets is None:
        main = ([None] * len(WEIGHT_NAMES), None, 0, 0)
    else:
        main = (targets.main_grads(), targets.handle, targets.dummy_mask(), targets.zero_mask())
    return ops.LayerFunction.apply(ws.handle, ctx.handle, False, x, topk_idx, router_weights,
                                   *master_weights.tensors(), *main[0], *main[1:], recompute, *weights.op_tensors())


def backward_fp8(ws, d_out: torch.Tensor, x: torch.Tensor, topk_idx: torch.Tensor, router_weights: torch.Tensor,
                 weights: Fp8Weights, ctx, *, grads=None, main_grads=None, grad_dtype: torch.dtype = torch.bfloat16):
    """mok.backward for the FP8 forward that filled ctx (its x, topk_idx, router_weights and FP8 weights, these
    quantized with transposed=True): (d_x bf16 [T, H], d_router_weights fp32 [T, k], the weights' gradients as a
    mok.Weights). The dgrads run in FP8 (d_out and d(g|u) quantized per 1 x 128); the weight gradients are the bf16
    master weights', from FP8 GEMMs of their factors quantized per column per 128 rows of an expert (with the
    workspace's Config.bf16_weight_gradients: bf16 GEMMs of bf16 activations); grads=, main_grads= and grad_dtype as
    in mok.backward. Asynchronous on torch's current stream, deterministic bit for bit."""
    from .layer import _check_context, gradient_buffers
    _check_call(ws, "backward_fp8")
    if not ws.config.backward:
        raise ValueError("ws: made with Config(backward=False) (inference only): no backward")
    _check_inputs(ws, x, topk_idx, router_weights)
    check_x(ws.shape, ws.device, d_out, "d_out", tokens=topk_idx.shape[0])
    _check_fp8_weights(ws, weights, backward=True)
    _check_context(ws, ctx)
    # The FP8 values have the bf16 weights' shapes: the gradients' shapes.
    buffers, accumulate = gradient_buffers(ws, Weights(*weights.values), grads, main_grads, grad_dtype)
    d_x, d_router_weights = torch.ops.mok.backward_fp8(
        ws.handle, ctx.handle, d_out, x, topk_idx, router_weights, list(weights.values), list(weights.scales),
        list(weights.values_t), list(weights.scales_t), *buffers.tensors(), accumulate)
    return d_x, d_router_weights, buffers
