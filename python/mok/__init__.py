"""MoK for Hopper from Python: the fused mixture-of-experts layer's forward and backward passes on torch tensors.

    import mok
    ws = mok.get_workspace(mok.Config(), None, T, H, I, top_k, E)
    w = mok.Weights(gate, up, down, s_gate, s_up, s_down)
    out, ctx = mok.forward(ws, x, topk_idx, router_weights, w)                  # differentiable (autograd)
    d_x, d_rw, grads = mok.backward(ws, d_out, x, topk_idx, router_weights, w, ctx)
    mok.check_status(ws)

    moe = mok.MoE(hidden=H, intermediate=I, num_experts=E, top_k=top_k)         # nn.Module, router inside
    moe(x).float().sum().backward()

mok.require_hopper(device=None) checks that a device is an NVIDIA Hopper GPU (sm_90), the only one the extension
runs on (RuntimeError "mok needs an NVIDIA Hopper GPU (sm_90); found ..." otherwise); get_workspace and MoE call it
before anything touches CUDA.

The ops are torch.library custom ops with fake implementations (torch.compile(fullgraph=True) traces forward
and backward) that never synchronize with the host (CUDA graphs capture a whole training step).
"""
import torch  # noqa: F401  (first: its CUDA runtime and NCCL are the ones the extension then binds to)

from . import ops  # noqa: F401  (registers the torch.ops.mok custom ops)
from .config import Config, LayerShape, Status, Weights
from .device import require_hopper
from .fp8 import Fp8Weights, backward_fp8, forward_fp8, quantize_weights
from .layer import (ForwardContext, Workspace, backward, build_schedule, check_status, forward, get_workspace,
                    main_grads, recompute_forward_context)
from .module import MoE

__all__ = ["Config", "LayerShape", "Status", "Weights", "ForwardContext", "Workspace", "get_workspace",
           "build_schedule", "forward", "check_status", "backward", "recompute_forward_context", "main_grads",
           "MoE", "require_hopper", "nccl_versions", "Fp8Weights", "quantize_weights", "forward_fp8",
           "backward_fp8"]
__version__ = "0.1.0"


def nccl_versions():
    """(NCCL version the extension was compiled against, version loaded in this process), as NCCL_VERSION_CODE
    (e.g. 22807 = 2.28.7)."""
    from . import _mok
    return tuple(_mok.nccl_versions())
