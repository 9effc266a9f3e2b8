"""MoK for Hopper from Python: the fused mixture-of-experts layer's forward pass on torch tensors.

    import mok
    ws = mok.get_workspace(mok.Config(), None, T, H, I, top_k, E)
    out, ctx = mok.forward(ws, x, topk_idx, router_weights, mok.Weights(gate, up, down, s_gate, s_up, s_down))
    mok.check_status(ws)

The backward pass is not built yet (issue 14): backward, recompute_forward_context and main_grads raise
NotImplementedError, and so does autograd through forward.
"""
import torch  # noqa: F401  (first: its CUDA runtime and NCCL are the ones the extension then binds to)

from . import ops  # noqa: F401  (registers torch.ops.mok.forward)
from .config import Config, LayerShape, Status, Weights
from .layer import (ForwardContext, Workspace, backward, build_schedule, check_status, forward, get_workspace,
                    main_grads, recompute_forward_context)

__all__ = ["Config", "LayerShape", "Status", "Weights", "ForwardContext", "Workspace", "get_workspace",
           "build_schedule", "forward", "check_status", "backward", "recompute_forward_context", "main_grads",
           "nccl_versions"]
__version__ = "0.1.0"


def nccl_versions():
    """(NCCL version the extension was compiled against, version loaded in this process), as NCCL_VERSION_CODE
    (e.g. 22807 = 2.28.7)."""
    from . import _mok
    return tuple(_mok.nccl_versions())
