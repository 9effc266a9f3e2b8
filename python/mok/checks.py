"""Argument checks of the forward pass, made before anything touches the GPU, with messages that name the
argument: "x: expected a contiguous bf16 tensor on cuda:0 of shape [T, H] = [2048, 1024], got ...".

They run on real, meta and fake tensors (torch.compile traces them on fake ones); the 16-byte alignment of the
data pointer is checked only on real tensors (the extension checks it again when it runs).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from .config import LayerShape, Weights

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


def check_forward_args(shape: LayerShape, device: torch.device, x, topk_idx, router_weights,
                       weights: Optional[Weights]) -> None:
    """The checks of mok.forward (weights None: those of mok.build_schedule, topk_idx only)."""
    t, k, h, i, e = shape.num_tokens, shape.top_k, shape.hidden, shape.intermediate, shape.local_experts
    bf16 = (torch.bfloat16,)
    check_tensor("topk_idx", topk_idx, (torch.int32, torch.int64), "T, k", (t, k), device)
    if weights is None:
        return
    check_tensor("x", x, bf16, "T, H", (t, h), device)
    check_tensor("router_weights", router_weights, (torch.float32,), "T, k", (t, k), device)
    if weights.expert_up is None:
        check_tensor("expert_gate", weights.expert_gate, bf16, "E_local, 2I, H (gate and up fused: expert_up is None)",
                     (e, 2 * i, h), device)
    else:
        check_tensor("expert_gate", weights.expert_gate, bf16, "E_local, I, H", (e, i, h), device)
        check_tensor("expert_up", weights.expert_up, bf16, "E_local, I, H", (e, i, h), device)
    check_tensor("expert_down", weights.expert_down, bf16, "E_local, H, I", (e, h, i), device)
    if shape.shared_expert:
        check_tensor("shared_gate", weights.shared_gate, bf16, "I, H", (i, h), device)
        check_tensor("shared_up", weights.shared_up, bf16, "I, H", (i, h), device)
        check_tensor("shared_down", weights.shared_down, bf16, "H, I", (h, i), device)
    else:
        for name in ("shared_gate", "shared_up", "shared_down"):
            _check_absent(name, getattr(weights, name), "the workspace was made with shared_expert=False")
