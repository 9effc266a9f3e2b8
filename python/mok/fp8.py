"""FP8 (Config(precision="fp8"): DeepSeek-V3's recipe, docs/design.md "FP8"): the weights quantized once per
optimizer step, then the layer's forward with them. Inference only for now (the FP8 backward is issue 28): the
workspace needs Config(precision="fp8", backward=False) (the fused path, the default, or path="unfused").

    ws = mok.get_workspace(mok.Config(precision="fp8", backward=False), None, T, H, I, k, E)
    qw = mok.quantize_weights(w)                       # after every optimizer step (w: mok.Weights, bf16)
    out, ctx = mok.forward_fp8(ws, x, topk_idx, router_weights, qw)
"""
import dataclasses
from typing import Optional, Tuple

import torch

from . import arguments
from .checks import WEIGHT_NAMES, _describe as _describe_tensor, call_tokens, check_tensor, check_x, weight_dims
from .config import Weights

E4M3 = torch.float8_e4m3fn


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
    ceil(cols/128)]. With quantize_weights(transposed=True) also each matrix transposed, as the FP8 backward's
    dgrads read it (K-major): values_t[n] [.., cols, rows], scales_t[n] [.., ceil(cols/128), ceil(rows/128)], the
    same e4m3 values and scales exactly (a 128 x 128 block's scale is its transpose's); empty tuples otherwise.
    Made by quantize_weights."""

    values: Tuple[Optional[torch.Tensor], ...]
    scales: Tuple[Optional[torch.Tensor], ...]
    values_t: Tuple[Optional[torch.Tensor], ...] = ()
    scales_t: Tuple[Optional[torch.Tensor], ...] = ()

    @property
    def nbytes(self) -> int:
        """Device bytes of the values and scales (the transposed copies included)."""
        return sum(t.numel() * t.element_size() for t in self.values + self.scales + self.values_t + self.scales_t
                   if t is not None)


def quantize_weights(weights, power_of_two_scales: bool = False, transposed: bool = False) -> Fp8Weights:
    """The weights (a mok.Weights or dict of bf16 tensors on one CUDA device) quantized for the FP8 layer:
    scale = amax / 448 of each 128 x 128 block (1 for an all-zero block, NaN for one holding a NaN or an infinity:
    what reads it turns NaN, never a finite wrong number), or that rounded up to a power of two. transposed=True
    also writes each matrix transposed (Fp8Weights.values_t, scales_t: what the FP8 backward's dgrads read, the
    same values; twice the memory, in Fp8Weights.nbytes). Asynchronous on torch's current stream; new tensors (call
    it again after the weights change: the values are not tied to them)."""
    from .layer import _cuda_stream, _native_module
    weights = Weights.of(weights)
    arguments.check_bool("power_of_two_scales", power_of_two_scales)
    arguments.check_bool("transposed", transposed)
    ext = _native_module()
    values, scales, values_t, scales_t = [], [], [], []
    for name, w in zip(WEIGHT_NAMES, weights.tensors()):
        if w is None:
            for kept in (values, scales) + ((values_t, scales_t) if transposed else ()):
                kept.append(None)
            continue
        if not isinstance(w, torch.Tensor) or w.dtype != torch.bfloat16 or w.device.type != "cuda" or w.dim() not in (2, 3):
            raise ValueError(f"weights.{name}: expected a bf16 CUDA tensor [E_local, rows, cols] or [rows, cols], got "
                             f"{_describe(w)}")
        w = w.detach().contiguous()
        rows, cols = w.shape[-2], w.shape[-1]
        q = torch.empty(w.shape, dtype=torch.uint8, device=w.device)
        s = torch.empty(*w.shape[:-2], _blocks(rows), _blocks(cols), dtype=torch.float32, device=w.device)
        q_t = s_t = None
        if transposed:
            q_t = torch.empty(*w.shape[:-2], cols, rows, dtype=torch.uint8, device=w.device)
            s_t = torch.empty(*w.shape[:-2], _blocks(cols), _blocks(rows), dtype=torch.float32, device=w.device)
        ext.quantize_weights_fp8(w, q, s, q_t, s_t, bool(power_of_two_scales), _cuda_stream(w.device))
        values.append(q.view(E4M3))
        scales.append(s)
        if transposed:
            values_t.append(q_t.view(E4M3))
            scales_t.append(s_t)
    return Fp8Weights(tuple(values), tuple(scales), tuple(values_t), tuple(scales_t))


def _check_fp8_weights(ws, weights: Fp8Weights) -> None:
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
        if not isinstance(value, torch.Tensor) or value.dtype != E4M3 or tuple(value.shape) != shape or \
                value.device != ws.device or not value.is_contiguous():
            raise ValueError(f"weights.{name}: expected a contiguous float8_e4m3fn [{letters}] = {list(shape)} on "
                             f"{ws.device}, got {_describe(value)}")
        scale_shape = shape[:-2] + (_blocks(shape[-2]), _blocks(shape[-1]))
        if not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32 or tuple(scale.shape) != scale_shape \
                or scale.device != ws.device or not scale.is_contiguous():
            raise ValueError(f"weights.{name} scales: expected a contiguous fp32 {list(scale_shape)} on {ws.device}, "
                             f"got {_describe(scale)}")


def forward_fp8(ws, x: torch.Tensor, topk_idx: torch.Tensor, router_weights: torch.Tensor, weights: Fp8Weights,
                ctx=None):
    """The layer's forward with FP8 weights on an FP8 workspace (Config(precision="fp8")): mok.forward's
    arguments and result, weights from quantize_weights. x is quantized per 1 x 128 once on this rank (the rows
    other ranks pull are FP8), h per 1 x 128 before the down GEMM. Inference only: out has no autograd graph.
    Eager only for now (not under torch.compile or CUDA-graph capture with ctx=None)."""
    from .layer import _check_context, _check_workspace, _cuda_stream
    _check_workspace(ws)
    if ws.config.precision != "fp8":
        raise ValueError(f"mok.forward_fp8: the workspace is Config(precision={ws.config.precision!r}); make it with "
                         "Config(precision='fp8', backward=False)")
    if torch.compiler.is_compiling():
        raise RuntimeError("mok.forward_fp8 is eager only for now")
    if torch.is_grad_enabled() and isinstance(x, torch.Tensor) and x.requires_grad:
        raise RuntimeError("mok.forward_fp8 has no backward yet: x requires grad (run under torch.no_grad())")
    t = call_tokens(ws.shape, "topk_idx", topk_idx)
    check_tensor("topk_idx", topk_idx, (torch.int32, torch.int64), "T, k", (t, ws.shape.top_k), ws.device)
    check_x(ws.shape, ws.device, x, tokens=t)
    check_tensor("router_weights", router_weights, (torch.float32,), "T, k", (t, ws.shape.top_k), ws.device)
    _check_fp8_weights(ws, weights)
    if ctx is None:
        ctx = ws.pooled_context()  # returned to the pool when the caller drops it: steady state allocates nothing
    _check_context(ws, ctx)
    out = torch.empty_like(x)
    if ws.is_meta:
        return out, ctx
    as_bytes = [None if v is None else v.view(torch.uint8) for v in weights.values]
    ws._native.forward_fp8(x.detach(), topk_idx, router_weights.detach(), as_bytes, list(weights.scales), out,
                           ctx._native, _cuda_stream(ws.device))
    ctx.mark_written()
    return out, ctx
