"""The torch.library custom ops of the layer, so torch.compile(fullgraph=True) traces forward and backward and
CUDA graphs capture them. Each has a fake (meta) implementation giving its output shapes.

    mok::forward(workspace, context, schedule_ready, x, topk_idx, router_weights, <6 weights>, main_grads=None,
                 dummy_mask=0, recompute=False) -> (out, seen)
        autograd formula (register_autograd): mok::backward, for x, router_weights and the weights
    mok::backward(workspace, context, d_out, x, topk_idx, router_weights, <6 weights>, grad_mask, fp32_grads,
                  main_grads, dummy_mask, recompute, seen=None) -> [d_x, d_router_weights, <6 weight gradients>]
    mok::backward_into(workspace, context, d_out, x, topk_idx, router_weights, <6 weights>, <6 gradients,
                       mutated>, accumulate) -> (d_x, d_router_weights)
    mok::recompute_forward_context(workspace, context, x, <6 weights>) -> ()

<6 weights> are expert_gate, expert_up?, expert_down, shared_gate?, shared_up?, shared_down? (mok.Weights order;
None where absent). The workspace, the forward context and a module's main-gradient targets are opaque Python
objects; the ops get them by handles into the weak tables below: small CPU int64 tensors holding the object's id,
so the schemas hold only tensors, ints and bools, and under torch.compile the handles are inputs of the graph
(not constants: layers of one shape share a compiled graph).

What the compiler does not see. forward writes the context and backward reads it; backward with main_grads
adds into parameters' .main_grad tensors found through the handle. None of that is in the schemas, so the ops
look pure: the order between them comes from data (autograd runs a layer's backward after its forward, and a
backward's outputs feed the gradients); a backward whose context a later forward overwrote raises when it runs
(mok::forward returns `seen`, the context's generation, which the backward compares), so in eager mode, under
torch.compile and in CUDA-graph capture alike; and mok::recompute_forward_context (which returns nothing) and
mok::backward (which may add into main_grad with no output used) are marked as having side effects, so that no
dead-code elimination drops them.
"""
from __future__ import annotations

import itertools
import weakref
from typing import List, Optional, Sequence, Tuple

import torch

from .checks import WEIGHT_NAMES, check_tensor

_next_handle = itertools.count(1)
_workspaces: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()
_contexts: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()
_main_grad_targets: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()

ALL_WEIGHTS = (1 << len(WEIGHT_NAMES)) - 1  # grad_mask: every weight's gradient
# Separate gate and up gradients come from one GEMM (its output split at row I): both or neither, so a mask
# asking for one of a pair asks for both (expert_gate/expert_up: bits 0, 1; shared_gate/shared_up: bits 3, 4).
_GATE_UP_PAIRS = (0b000011, 0b011000)


def with_partners(grad_mask: int, weights) -> int:
    """grad_mask plus the other half of each separate gate/up pair it asks for half of."""
    for pair in _GATE_UP_PAIRS:
        if grad_mask & pair and all(weights[i] is not None for i in range(len(weights)) if pair >> i & 1):
            grad_mask |= pair
    return grad_mask


def _register(table, obj) -> torch.Tensor:
    """The object's handle: a CPU int64 tensor [id]. A tensor, not an int, so that under torch.compile it is an
    input of the graph like the layer's weights, not a constant: layers of one shape (a model compiled block by
    block) share one compiled graph."""
    handle_id = next(_next_handle)
    table[handle_id] = obj
    return torch.tensor([handle_id], dtype=torch.int64)


def register_workspace(workspace) -> torch.Tensor:
    return _register(_workspaces, workspace)


def register_context(context) -> torch.Tensor:
    return _register(_contexts, context)


def register_main_grad_targets(targets) -> torch.Tensor:
    return _register(_main_grad_targets, targets)


def _lookup(table, handle: torch.Tensor, what: str, op: str):
    """The object behind a handle, when an op runs (a real tensor: never under tracing)."""
    handle_id = int(handle[0])
    obj = table.get(handle_id)
    if obj is None:
        raise RuntimeError(f"mok::{op}: no live {what} with handle {handle_id} (was it garbage-collected?)")
    return obj


def _stream(t: torch.Tensor) -> int:
    return torch.cuda.current_stream(t.device).cuda_stream


def _plain(*tensors):
    """The tensors as the extension takes them: detached (the same memory; a tensor that requires grad refuses
    __dlpack__, and the kernels of these ops see the caller's tensors as they are), None kept."""
    return [None if t is None else t.detach() for t in tensors]


class MainGradTargets:
    """The parameters (in weight order, None where absent) whose fp32 .main_grad a backward accumulates into:
    Megatron's fused weight-gradient accumulation. Made by mok.MoE(main_grad=True)."""

    def __init__(self, params: Sequence[Optional[torch.nn.Parameter]]):
        if len(params) != len(WEIGHT_NAMES):
            raise ValueError(f"MainGradTargets: expected {len(WEIGHT_NAMES)} parameters, got {len(params)}")
        self.params = tuple(params)
        self.handle = register_main_grad_targets(self)

    def dummy_mask(self) -> int:
        """The weights whose backward returns a dummy gradient: those that Megatron's DDP has set up (they have
        the attribute grad_added_to_main_grad; its hook discards the dummy and sets .grad to None). The others
        return None: their .grad stays None. Read when the forward runs (mok::forward takes it as an int; the
        backward asks for the weights that need a gradient among them)."""
        mask = 0
        for i, p in enumerate(self.params):
            if p is not None and p.requires_grad and hasattr(p, "grad_added_to_main_grad"):
                mask |= 1 << i
        return mask

    def main_grads(self, grad_mask: int) -> List[Optional[torch.Tensor]]:
        """Each asked-for parameter's .main_grad, checked (fp32, the parameter's shape, contiguous, its device).
        A frozen parameter asked for only as the other half of a gate/up pair gets fp32 zeros to add into,
        thrown away: its main_grad stays as it is."""
        grads: List[Optional[torch.Tensor]] = [None] * len(WEIGHT_NAMES)
        for i, p in enumerate(self.params):
            if p is None or not grad_mask >> i & 1:
                continue
            if not p.requires_grad:
                grads[i] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
                continue
            main_grad = getattr(p, "main_grad", None)
            if main_grad is None:
                raise RuntimeError(f"{WEIGHT_NAMES[i]}.main_grad: missing; with main_grad=True the backward "
                                   "accumulates into param.main_grad (module.allocate_main_grads(), or Megatron's DDP)")
            check_tensor(f"{WEIGHT_NAMES[i]}.main_grad", main_grad, (torch.float32,), "the parameter's shape",
                         tuple(p.shape), p.device)
            grads[i] = main_grad
        return grads

    def mark_added(self, grad_mask: int) -> None:
        """Megatron's flag: this parameter's gradient is in main_grad already (only where the attribute exists)."""
        for i, p in enumerate(self.params):
            if p is not None and grad_mask >> i & 1 and p.requires_grad and hasattr(p, "grad_added_to_main_grad"):
                p.grad_added_to_main_grad = True

    def dummy(self, i: int) -> torch.Tensor:
        """Megatron's dummy gradient: zeros if the parameter has zero_out_wgrad, else uninitialized."""
        p = self.params[i]
        make = torch.zeros if getattr(p, "zero_out_wgrad", False) else torch.empty
        return make(p.shape, dtype=p.dtype, device=p.device)


# ---------------------------------------------------------------------------------------------------------------
# mok::forward


@torch.library.custom_op("mok::forward", mutates_args=(), device_types="cuda")
def forward_op(workspace: torch.Tensor, context: torch.Tensor, schedule_ready: bool, x: torch.Tensor,
               topk_idx: torch.Tensor, router_weights: torch.Tensor, expert_gate: torch.Tensor, expert_up: Optional[torch.Tensor],
               expert_down: torch.Tensor, shared_gate: Optional[torch.Tensor], shared_up: Optional[torch.Tensor],
               shared_down: Optional[torch.Tensor], main_grads: Optional[torch.Tensor] = None,
               dummy_mask: int = 0, recompute: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """(out [T, H] bf16 of the layer on this rank, seen: the context's generation after this forward, a CPU int64
    tensor [1]); writes the context (schedule, expert-side activations). main_grads (a MainGradTargets handle),
    dummy_mask and recompute only tell its backward what to do (see mok::backward); seen lets the backward
    check, when it runs, that no later forward overwrote the context. Asynchronous on the current stream;
    collective over the workspace's EP group."""
    ws = _lookup(_workspaces, workspace, "workspace", "forward")
    ctx = _lookup(_contexts, context, "forward context", "forward")
    out = torch.empty_like(x)
    ws._native.forward(*_plain(x, topk_idx, router_weights, expert_gate, expert_up, expert_down, shared_gate,
                               shared_up, shared_down), out, ctx._native, _stream(x), schedule_ready)
    ctx.mark_written()
    return out, torch.tensor([ctx.generation], dtype=torch.int64)


@forward_op.register_fake
def _forward_fake(workspace, context, schedule_ready, x, topk_idx, router_weights, expert_gate, expert_up,
                  expert_down, shared_gate, shared_up, shared_down, main_grads=None, dummy_mask=0, recompute=False):
    return torch.empty_like(x), torch.empty(1, dtype=torch.int64)


def _is_eager(t) -> bool:
    """A real tensor outside any tracing."""
    return type(t) in (torch.Tensor, torch.nn.Parameter) and not torch.compiler.is_compiling()


def _forward_setup_context(ctx, inputs, output):
    (workspace, context, _, x, topk_idx, router_weights, *weights, main_grads, dummy_mask, recompute) = inputs
    ctx.mok_flags = (main_grads is not None, dummy_mask, recompute)
    # The handles and `seen` are never written in place: saving them costs nothing, and under torch.compile they
    # become inputs of the backward graph.
    ctx.save_for_backward(x, topk_idx, router_weights, *weights, workspace, context, main_grads, output[1])
    # Eager only: the context itself, held by the graph until it is freed (a pooled context, mok.forward(ctx=None),
    # goes back to its pool only then; pooled contexts are refused under torch.compile and capture).
    ctx.mok_context = _contexts.get(int(context[0])) if _is_eager(x) else None


def _forward_backward(ctx, d_out, d_seen):
    has_main_grads, dummy_mask, recompute = ctx.mok_flags
    x, topk_idx, router_weights, *rest = ctx.saved_tensors
    weights = rest[:len(WEIGHT_NAMES)]
    workspace, context, main_grads, seen = rest[len(WEIGHT_NAMES):]
    needs = ctx.needs_input_grad
    needed = 0
    for i, w in enumerate(weights):
        if w is not None and needs[6 + i]:
            needed |= 1 << i
    grad_mask = with_partners(needed, weights)  # computed: the needed ones and their gate/up partners
    dummy_mask &= needed
    # mok::backward checks `seen` against the context when it runs (eager, compiled or captured alike).
    grads = torch.ops.mok.backward(workspace, context, d_out.contiguous(), x, topk_idx, router_weights, *weights,
                                   grad_mask, False, main_grads, dummy_mask, recompute, seen)
    weight_grads = []
    for i in range(len(weights)):
        returned = needed >> i & 1 and (not has_main_grads or dummy_mask >> i & 1)
        weight_grads.append(grads[2 + i] if returned else None)
    return (None, None, None, grads[0] if needs[3] else None, None, grads[1] if needs[5] else None, *weight_grads,
            None, None, None)


forward_op.register_autograd(_forward_backward, setup_context=_forward_setup_context)


# ---------------------------------------------------------------------------------------------------------------
# mok::backward


def _empty_slot(x: torch.Tensor) -> torch.Tensor:
    """The output of a weight gradient that is not returned (absent weight, not asked for, or in main_grad)."""
    return x.new_empty(0)


def _backward_outputs(x, router_weights, weights, grad_mask, fp32_grads, main_grads, dummy_mask, make):
    """The shapes of mok::backward's outputs; make(i, like, dtype) allocates weight i's (fake or real)."""
    outs = [torch.empty_like(x), torch.empty_like(router_weights)]
    for i, w in enumerate(weights):
        if w is None or not grad_mask >> i & 1 or (main_grads is not None and not dummy_mask >> i & 1):
            outs.append(_empty_slot(x))
        else:
            outs.append(make(i, w, torch.float32 if fp32_grads and main_grads is None else w.dtype))
    return outs


def _check_training(ws, op: str) -> None:
    if not ws.config.backward:
        raise RuntimeError(f"mok::{op}: the workspace was made with Config(backward=False) (inference only)")


def _check_written(ctx, op: str) -> None:
    if not ctx.written:
        raise RuntimeError(f"mok::{op}: the forward context holds no forward of its current schedule (run "
                           "mok.forward, or mok.recompute_forward_context after mok.build_schedule, with it first)")


@torch.library.custom_op("mok::backward", mutates_args=(), device_types="cuda")
def backward_op(workspace: torch.Tensor, context: torch.Tensor, d_out: torch.Tensor, x: torch.Tensor,
                topk_idx: torch.Tensor, router_weights: torch.Tensor, expert_gate: torch.Tensor,
                expert_up: Optional[torch.Tensor], expert_down: torch.Tensor, shared_gate: Optional[torch.Tensor],
                shared_up: Optional[torch.Tensor], shared_down: Optional[torch.Tensor], grad_mask: int,
                fp32_grads: bool, main_grads: Optional[torch.Tensor], dummy_mask: int, recompute: bool,
                seen: Optional[torch.Tensor] = None) -> List[torch.Tensor]:
    """[d_x bf16 [T, H], d_router_weights fp32 [T, k], then the six weight gradients] of the forward in `context`.

    grad_mask: bit i asks for weight i's gradient (separate gate and up: both or neither, see with_partners); an
    unasked or absent one is an empty tensor. Written in the
    weight's dtype (bf16), or fp32 with fp32_grads; with main_grads (a MainGradTargets handle) instead added into
    the parameters' fp32 .main_grad, and the output is Megatron's dummy where dummy_mask has bit i, else empty.
    recompute: first rebuild the context from topk_idx, x and the weights (build_schedule and
    recompute_forward_context), so the context may have served other forwards since this layer's. seen (the
    forward's second output; None: unchecked): without recompute, the context must still hold that forward,
    else RuntimeError, checked here when the op runs (eager, torch.compile and CUDA-graph capture alike)."""
    ws = _lookup(_workspaces, workspace, "workspace", "backward")
    ctx = _lookup(_contexts, context, "forward context", "backward")
    if seen is not None and not recompute and ctx.generation != int(seen[0]):
        raise RuntimeError("mok: this layer's forward context was overwritten by a later forward before this "
                           "backward (the same context used by two forwards, e.g. one module called twice or "
                           "micro-batches interleaved): give each forward in flight its own context "
                           "(ws.make_context()), or use recompute=True")
    targets = _lookup(_main_grad_targets, main_grads, "main-gradient targets", "backward") \
        if main_grads is not None else None
    weights = [expert_gate, expert_up, expert_down, shared_gate, shared_up, shared_down]
    accumulated = targets.main_grads(grad_mask) if targets is not None else None
    stream = _stream(x)
    _check_training(ws, "backward")
    if recompute:
        ws._native.build_schedule(topk_idx, ctx._native, stream)
        ctx.mark_scheduled()
        ws._native.recompute_forward_context(x.detach(), _plain(*weights), ctx._native, stream)
        ctx.mark_written()
    _check_written(ctx, "backward")

    def make(i, like, dtype):
        return targets.dummy(i) if targets is not None else torch.empty_like(like, dtype=dtype)

    outs = _backward_outputs(x, router_weights, weights, grad_mask, fp32_grads, main_grads, dummy_mask, make)
    if targets is not None:
        grads = accumulated
    else:
        grads = [g if g.numel() else None for g in outs[2:]]
    ws._native.backward(*_plain(d_out, x, topk_idx, router_weights), _plain(*weights), outs[0], outs[1],
                        _plain(*grads), targets is not None, ctx._native, stream)
    if targets is not None:
        targets.mark_added(grad_mask)
    return outs


@backward_op.register_fake
def _backward_fake(workspace, context, d_out, x, topk_idx, router_weights, expert_gate, expert_up, expert_down,
                   shared_gate, shared_up, shared_down, grad_mask, fp32_grads, main_grads, dummy_mask, recompute,
                   seen=None):
    weights = [expert_gate, expert_up, expert_down, shared_gate, shared_up, shared_down]
    return _backward_outputs(x, router_weights, weights, grad_mask, fp32_grads, main_grads, dummy_mask,
                             lambda i, like, dtype: torch.empty_like(like, dtype=dtype))


# ---------------------------------------------------------------------------------------------------------------
# mok::backward_into: the gradients into the caller's tensors


@torch.library.custom_op("mok::backward_into", device_types="cuda",
                         mutates_args=tuple(f"grad_{name}" for name in WEIGHT_NAMES))
def backward_into_op(workspace: torch.Tensor, context: torch.Tensor, d_out: torch.Tensor, x: torch.Tensor, topk_idx: torch.Tensor,
                     router_weights: torch.Tensor, expert_gate: torch.Tensor, expert_up: Optional[torch.Tensor],
                     expert_down: torch.Tensor, shared_gate: Optional[torch.Tensor], shared_up: Optional[torch.Tensor],
                     shared_down: Optional[torch.Tensor], grad_expert_gate: Optional[torch.Tensor],
                     grad_expert_up: Optional[torch.Tensor], grad_expert_down: Optional[torch.Tensor],
                     grad_shared_gate: Optional[torch.Tensor], grad_shared_up: Optional[torch.Tensor],
                     grad_shared_down: Optional[torch.Tensor], accumulate: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """(d_x, d_router_weights); each given grad_* is written (bf16 or fp32), or with accumulate added to (fp32)."""
    ws = _lookup(_workspaces, workspace, "workspace", "backward_into")
    ctx = _lookup(_contexts, context, "forward context", "backward_into")
    _check_training(ws, "backward_into")
    _check_written(ctx, "backward_into")
    d_x, d_router_weights = torch.empty_like(x), torch.empty_like(router_weights)
    ws._native.backward(*_plain(d_out, x, topk_idx, router_weights),
                        _plain(expert_gate, expert_up, expert_down, shared_gate, shared_up, shared_down), d_x,
                        d_router_weights, _plain(grad_expert_gate, grad_expert_up, grad_expert_down, grad_shared_gate,
                                                 grad_shared_up, grad_shared_down), accumulate, ctx._native, _stream(x))
    return d_x, d_router_weights


@backward_into_op.register_fake
def _backward_into_fake(workspace, context, d_out, x, topk_idx, router_weights, *weights_grads_accumulate):
    return torch.empty_like(x), torch.empty_like(router_weights)


# ---------------------------------------------------------------------------------------------------------------
# mok::recompute_forward_context


@torch.library.custom_op("mok::recompute_forward_context", mutates_args=(), device_types="cuda")
def recompute_op(workspace: torch.Tensor, context: torch.Tensor, x: torch.Tensor, expert_gate: torch.Tensor,
                 expert_up: Optional[torch.Tensor], expert_down: torch.Tensor, shared_gate: Optional[torch.Tensor],
                 shared_up: Optional[torch.Tensor], shared_down: Optional[torch.Tensor]) -> None:
    """Rebuilds the context's activations from x and the weights, on the schedule already in it."""
    ws = _lookup(_workspaces, workspace, "workspace", "recompute_forward_context")
    ctx = _lookup(_contexts, context, "forward context", "recompute_forward_context")
    _check_training(ws, "recompute_forward_context")
    if not ctx.scheduled:
        raise RuntimeError("mok::recompute_forward_context: the forward context holds no schedule (run mok.forward "
                           "or mok.build_schedule with it first)")
    ws._native.recompute_forward_context(x.detach(), _plain(expert_gate, expert_up, expert_down, shared_gate,
                                                            shared_up, shared_down), ctx._native, _stream(x))
    ctx.mark_written()


@recompute_op.register_fake
def _recompute_fake(workspace, context, x, expert_gate, expert_up, expert_down, shared_gate, shared_up, shared_down):
    return None


# Effects outside their outputs: recompute_forward_context's only effect is on the context, and a backward with
# main_grads adds into .main_grad, also when autograd uses none of its outputs (no dummy gradients, x and the
# router weights frozen). Keep both in traced graphs (no dead-code elimination).
if hasattr(torch.fx.node, "has_side_effect"):
    torch.fx.node.has_side_effect(torch.ops.mok.recompute_forward_context.default)
    torch.fx.node.has_side_effect(torch.ops.mok.backward.default)
