"""The torch.library custom op mok::forward, so torch.compile(fullgraph=True) traces mok.forward and
CUDA graphs capture it.

The workspace and the forward context are opaque Python objects; the op gets them by integer handles into
the tables below, so its schema holds only tensors, ints and bools. The op has no autograd formula yet: a
backward through it raises NotImplementedError (issue 14).
"""
from __future__ import annotations

import itertools
import weakref
from typing import Optional

import torch

BACKWARD_MISSING = "the backward pass is not built yet (issue 14)"

_next_handle = itertools.count(1)
_workspaces: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()
_contexts: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()


def register_workspace(workspace) -> int:
    handle = next(_next_handle)
    _workspaces[handle] = workspace
    return handle


def register_context(context) -> int:
    handle = next(_next_handle)
    _contexts[handle] = context
    return handle


def _lookup(table, handle: int, what: str):
    obj = table.get(handle)
    if obj is None:
        raise RuntimeError(f"mok::forward: no live {what} with handle {handle} (was it garbage-collected?)")
    return obj


@torch.library.custom_op("mok::forward", mutates_args=(), device_types="cuda")
def forward_op(workspace: int, context: int, schedule_ready: bool, x: torch.Tensor, topk_idx: torch.Tensor,
               router_weights: torch.Tensor, expert_gate: torch.Tensor, expert_up: Optional[torch.Tensor],
               expert_down: torch.Tensor, shared_gate: Optional[torch.Tensor], shared_up: Optional[torch.Tensor],
               shared_down: Optional[torch.Tensor]) -> torch.Tensor:
    """out [T, H] bf16 of the layer on this rank; writes the context (schedule, expert-side activations).
    Asynchronous on the current stream; collective over the workspace's EP group."""
    ws = _lookup(_workspaces, workspace, "workspace")
    ctx = _lookup(_contexts, context, "forward context")
    out = torch.empty_like(x)
    stream = torch.cuda.current_stream(x.device).cuda_stream
    ws._native.forward(x, topk_idx, router_weights, expert_gate, expert_up, expert_down, shared_gate, shared_up,
                       shared_down, out, ctx._native, stream, schedule_ready)
    return out


@forward_op.register_fake
def _forward_fake(workspace, context, schedule_ready, x, topk_idx, router_weights, expert_gate, expert_up,
                  expert_down, shared_gate, shared_up, shared_down):
    return torch.empty_like(x)


def _no_backward(ctx, grad):
    raise NotImplementedError(f"mok.forward: {BACKWARD_MISSING}")


forward_op.register_autograd(_no_backward)
