"""Argument checks of the forward and backward passes, made before anything touches the GPU, with messages that
name the argument: "x: expected a contiguous bf16 tensor on cuda:0 of shape [T, H] = [2048, 1024], got ...".

They run on real, meta and fake tensors (torch.compile traces them on fake ones); the 16-byte alignment of the
data pointer is checked only on real tensors (the extension checks it again when it runs).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from .config import LayerShape, Weights

# The six weights in the C++ API's order (MoeWeights); mok.Weights has the same fields.
WEIGHT_NAMES = ("expert_gate", "expert_up", "expert_down", "shared_gate", "shared_up", "shared_down")

_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float32: "float32", torch.int32: "int32", torch.int64: "int64"}


def _dtype_name(dtype) -> str:
    return _DTYPE_NAMES.get(dtype, str(dtype).replace("torch.", ""))


def _describe(t: torch.Tensor) -> str:
    layout = "" if t.is_contiguous() else ", non-contiguous"
    return f"a {_dtype_name(t.dtype)} tensor on {t.device} of shape {list(t.shape)}{layout}"


def _has_storage(t: torch.Tensor) -> bool:
    if t.device.type == "meta" or torch.compiler.is_compiling():
        return False
    return not isinstance(t, torch._subclasses.fake_tensor.FakeTensor)


def check_tensor(name: str, t, dtypes: Sequence[torch.dtype], dims: str, shape: Sequence[int],
                 device: torch.device) -> None:
    """Raises TypeError (not a tensor) or ValueError naming `name` unless `t` is a contiguous tensor of one of
    `dtypes` on `device` with `shape` (`dims` spells the shape in letters, e.g. "T, H")."""
    want = " or ".join(_dtype_name(d) for d in dtypes)
    expected = f"a contiguous {want} tensor on {device} of shape [{dims}] = {list(shape)}"
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected {expected}, got {type(t).__name__}")
    if (t.dtype not in dtypes or t.device != device or tuple(t.shape) != tuple(shape) or not t.is_contiguous()):
        raise ValueError(f"{name}: expected {expected}, got {_describe(t)}")
    if _has_storage(t) and t.data_ptr() % 16 != 0:
        raise ValueError(f"{name}: the data pointer {t.data_ptr():#x} is not 16-byte aligned (a view at an odd "
                         "offset?); pass a tensor of its own, e.g. .clone()")


def _check_absent(name: str, t, why: str) -> None:
    if t is not None:
        raise ValueError(f"{name}: expected None ({why}), got {_describe(t) if isinstance(t, torch.Tensor) else t!r}")


def call_tokens(shape: LayerShape, name: str, t) -> int:
    """T of a call: the first extent of `t` (a tensor [T, ...]), which may be anything in [0, num_tokens] (the
    workspace's maximum per call); ValueError naming `name` past it. Not a tensor: num_tokens (check_tensor
    then says what is wrong)."""
    if not isinstance(t, torch.Tensor) or t.dim() < 1:
        return shape.num_tokens
    tokens = t.shape[0]
    if tokens > shape.num_tokens:
        raise ValueError(f"{name}: {tokens} tokens, but the workspace takes at most num_tokens = {shape.num_tokens} "
                         "per call (make it for the largest token count of a call)")
    return tokens


def check_forward_args(shape: LayerShape, device: torch.device, x, topk_idx, router_weights,
                       weights: Optional[Weights]) -> None:
    """The checks of mok.forward (weights None: those of mok.build_schedule, topk_idx only). T, the call's
    tokens, is topk_idx's first extent (at most the workspace's num_tokens); x and router_weights agree."""
    t, k = call_tokens(shape, "topk_idx", topk_idx), shape.top_k
    check_tensor("topk_idx", topk_idx, (torch.int32, torch.int64), "T, k", (t, k), device)
    if weights is None:
        return
    check_x(shape, device, x, tokens=t)
    check_tensor("router_weights", router_weights, (torch.float32,), "T, k", (t, k), device)
    check_weights(shape, device, weights)


def check_x(shape: LayerShape, device: torch.device, x, name: str = "x", tokens: Optional[int] = None) -> None:
    """x (or d_out) bf16 [T, H]: T = tokens, or x's own first extent (at most num_tokens)."""
    t = call_tokens(shape, name, x) if tokens is None else tokens
    check_tensor(name, x, (torch.bfloat16,), "T, H", (t, shape.hidden), device)


def weight_dims(shape: LayerShape, fused_gate_up: bool):
    """{weight name: (dims in letters, shape)} of one rank's weights; the shared ones only with a shared expert."""
    e, h, i = shape.local_experts, shape.hidden, shape.intermediate
    dims = {}
    if fused_gate_up:
        dims["expert_gate"] = ("E_local, 2I, H (gate and up fused: expert_up is None)", (e, 2 * i, h))
    else:
        dims["expert_gate"] = ("E_local, I, H", (e, i, h))
        dims["expert_up"] = ("E_local, I, H", (e, i, h))
    dims["expert_down"] = ("E_local, H, I", (e, h, i))
    if shape.shared_expert:
        dims["shared_gate"] = ("I, H", (i, h))
        dims["shared_up"] = ("I, H", (i, h))
        dims["shared_down"] = ("H, I", (h, i))
    return dims


def check_weights(shape: LayerShape, device: torch.device, weights: Weights, prefix: str = "") -> None:
    """The six bf16 weights of the shape, named `prefix` + the field in a message."""
    dims = weight_dims(shape, weights.expert_up is None)
    for name, (letters, extents) in dims.items():
        check_tensor(prefix + name, getattr(weights, name), (torch.bfloat16,), letters, extents, device)
    if not shape.shared_expert:
        for name in ("shared_gate", "shared_up", "shared_down"):
            _check_absent(prefix + name, getattr(weights, name), "the workspace was made with shared_expert=False")


def check_backward_args(shape: LayerShape, device: torch.device, d_out, x, topk_idx, router_weights,
                        weights: Weights) -> None:
    """The checks of mok.backward's inputs: those of mok.forward, and d_out bf16 [T, H]."""
    check_forward_args(shape, device, x, topk_idx, router_weights, weights)
    check_x(shape, device, d_out, "d_out", tokens=topk_idx.shape[0])


def check_weight_grads(shape: LayerShape, device: torch.device, weights: Weights, grads: Weights, name: str,
                       accumulate: bool) -> None:
    """grads (mok.backward's grads or main_grads): for each weight None (that gradient is not computed) or a
    contiguous tensor of the weight's shape, bf16 or fp32 (accumulate: fp32 only); None for absent weights."""
    dims = weight_dims(shape, weights.expert_up is None)
    dtypes = (torch.float32,) if accumulate else (torch.float32, torch.bfloat16)
    for field in WEIGHT_NAMES:
        grad = getattr(grads, field)
        if field not in dims:
            why = ("gate and up are fused: expert_gate's gradient holds both" if field == "expert_up"
                   else "the workspace was made with shared_expert=False")
            _check_absent(f"{name}.{field}", grad, why)
        elif grad is not None:
            letters, extents = dims[field]
            check_tensor(f"{name}.{field}", grad, dtypes, letters, extents, device)
    # Separate gate and up gradients come from one GEMM whose output splits at row I.
    for gate, up in (("expert_gate", "expert_up"), ("shared_gate", "shared_up")):
        if gate in dims and up in dims:
            g, u = getattr(grads, gate), getattr(grads, up)
            if (g is None) != (u is None) or (g is not None and g.dtype != u.dtype):
                raise ValueError(f"{name}.{gate}, {name}.{up}: both or neither, of one dtype (one GEMM computes "
                                 f"them), got {_describe(g) if g is not None else None} and "
                                 f"{_describe(u) if u is not None else None}")
