"""The torch.library custom ops of the layer, so torch.compile(fullgraph=True) traces forward and backward and
CUDA graphs capture them. Each has a fake (meta) implementation giving its output shapes. (a!): declared written.

    mok::forward(workspace, context(a!), schedule_ready, x, topk_idx, router_weights, <6 weights>)
        -> (out, token)
    mok::backward(workspace, context(a!), d_out, x, topk_idx, router_weights, <6 weights>, grad_mask, fp32_grads,
                  recompute=False) -> (d_x, d_router_weights, <6 weight gradients>)
    mok::backward_into(workspace, context(a!), d_out, x, topk_idx, router_weights, <6 weights>,
                       <6 gradients(a!)>, accumulate, recompute=False, main_grad_targets=None)
        -> (d_x, d_router_weights)
    mok::recompute_forward_context(workspace, context(a!), x, <6 weights>) -> ()
    mok::quantize_weights_fp8(weights, power_of_two_scales, transposed) -> (values, scales, values_t, scales_t)
    mok::forward_fp8(workspace, context(a!), x, topk_idx, router_weights, values, scales) -> (out, token)
    mok::recompute_forward_context_fp8(workspace, context(a!), x, values, scales) -> ()
    mok::backward_fp8(workspace, context(a!), d_out, x, topk_idx, router_weights, values, scales, values_t,
                      scales_t, <6 gradients(a!)>, accumulate, recompute=False, main_grad_targets=None)
        -> (d_x, d_router_weights)
    autograd: LayerFunction (mok::forward; its backward calls mok::backward, or mok::backward_into adding into
    the parameters' main_grad; with FP8 weights mok::forward_fp8 and mok::backward_fp8)

<6 weights> are expert_gate, expert_up?, expert_down, shared_gate?, shared_up?, shared_down? (mok.Weights order;
None where absent). values, scales, values_t, scales_t: mok.Fp8Weights' lists (e4m3 values and fp32 block scales of
the six weights, and the four transposed copies the FP8 backward reads; None entries where absent). The workspace,
the forward context and a module's main-gradient targets are opaque Python objects; the ops get them by handles
into the weak tables below: small CPU int64 tensors holding the object's id,
so the schemas hold only tensors, ints and bools, and under torch.compile the handles are inputs of the graph
(not constants: layers of one shape share a compiled graph).

What the schemas say. Every op that writes the context declares its context argument written: the context's
handle (forward, recompute_forward_context, and the backward ops called with a context), or, in autograd's
backward, the forward's token ([context id, generation], a new tensor per forward, which names the state the
forward left in the context). The gradient buffers of backward_into (Megatron's main_grad in autograd's backward)
are declared written. So the compiler orders the ops by these arguments and keeps them all (an op with a
declared write is never dead code: no torch.fx.node.has_side_effect); what is not in a schema is the
workspace's symmetric buffers (scratch, rewritten by every call) and Megatron's grad_added_to_main_grad flag (a
Python attribute, set when backward_into runs). A backward whose context a later forward overwrote raises when
it runs (the token's generation against the context's), in eager mode, under torch.compile and in CUDA-graph
capture alike.
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
    return torch.tensor([handle_id], dtype=torch.int64, device="cpu")  # whatever torch's default device


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


def _as_bytes(tensors):
    """e4m3 tensors as the extension takes them (uint8 views: DLPack exports no float8), None kept."""
    return [None if v is None else v.view(torch.uint8) for v in tensors]


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

    def zero_mask(self) -> int:
        """The weights whose dummy gradient is zeros (Megatron's zero_out_wgrad), else uninitialized."""
        return sum(1 << i for i, p in enumerate(self.params) if p is not None and getattr(p, "zero_out_wgrad", False))

    def main_grads(self) -> List[Optional[torch.Tensor]]:
        """Each parameter's .main_grad (None for an absent or frozen parameter), checked (fp32, the parameter's
        shape, contiguous, its device). Read when the forward runs: autograd's backward adds into these tensors
        (mok::backward_into declares them written)."""
        grads: List[Optional[torch.Tensor]] = [None] * len(WEIGHT_NAMES)
        for i, p in enumerate(self.params):
            if p is None or not p.requires_grad:
                continue
            main_grad = getattr(p, "main_grad", None)
            if main_grad is None:
                raise RuntimeError(f"{WEIGHT_NAMES[i]}.main_grad: missing; with main_grad=True the backward "
                                   "accumulates into param.main_grad (module.allocate_main_grads(), or Megatron's DDP, "
                                   "before the forward)")
            check_tensor(f"{WEIGHT_NAMES[i]}.main_grad", main_grad, (torch.float32,), "the parameter's shape",
                         tuple(p.shape), p.device)
            grads[i] = main_grad
        return grads

    def mark_added(self, grad_mask: int) -> None:
        """Megatron's flag: this parameter's gradient is in main_grad already (only where the attribute exists)."""
        for i, p in enumerate(self.params):
            if p is not None and grad_mask >> i & 1 and p.requires_grad and hasattr(p, "grad_added_to_main_grad"):
                p.grad_added_to_main_grad = True


def main_grad_buffers(weights, needed: int, grad_mask: int, main_grads) -> List[Optional[torch.Tensor]]:
    """autograd's backward with main_grad=True: what the backward adds into, per weight. Its main_grad where the
    weight needs a gradient (bit of `needed`); fp32 zeros, thrown away, where it is computed (bit of grad_mask) only
    as the other half of a gate/up pair (a frozen partner); None elsewhere."""
    buffers: List[Optional[torch.Tensor]] = [None] * len(WEIGHT_NAMES)
    for i, w in enumerate(weights):
        if grad_mask >> i & 1:
            buffers[i] = main_grads[i] if needed >> i & 1 else \
                torch.zeros(w.shape, dtype=torch.float32, device=w.device)
    return buffers


def dummy_grads(weights, needed: int, dummy_mask: int, zero_mask: int) -> List[Optional[torch.Tensor]]:
    """autograd's backward with main_grad=True: the .grad it returns per weight. Megatron's dummy gradient (zeros
    with zero_out_wgrad, else uninitialized) for the needed weights of dummy_mask, None for the others."""
    grads: List[Optional[torch.Tensor]] = [None] * len(WEIGHT_NAMES)
    for i, w in enumerate(weights):
        if (dummy_mask & needed) >> i & 1:
            make = torch.zeros if zero_mask >> i & 1 else torch.empty
            grads[i] = make(w.shape, dtype=w.dtype, device=w.device)
    return grads


def check_generation(ctx, generation: int) -> None:
    """RuntimeError unless the context is still in the state a forward left (its generation then)."""
    if ctx.generation != generation:
        raise RuntimeError("mok: this layer's forward context was overwritten by a later forward before this "
                           "backward (the same context used by two forwards, e.g. one module called twice or "
                           "micro-batches interleaved): give each forward in flight its own context "
                           "(ws.make_context()), or use recompute=True")


# ---------------------------------------------------------------------------------------------------------------
# mok::forward


def _token(ctx, context: torch.Tensor) -> torch.Tensor:
    """A forward's token: [context id, the context's generation after the forward], a new CPU int64 tensor."""
    return torch.tensor([int(context[0]), ctx.generation], dtype=torch.int64, device="cpu")


@torch.library.custom_op("mok::forward", mutates_args=("context",), device_types="cuda")
def forward_op(workspace: torch.Tensor, context: torch.Tensor, schedule_ready: bool, x: torch.Tensor,
               topk_idx: torch.Tensor, router_weights: torch.Tensor, expert_gate: torch.Tensor, expert_up: Optional[torch.Tensor],
               expert_down: torch.Tensor, shared_gate: Optional[torch.Tensor], shared_up: Optional[torch.Tensor],
               shared_down: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    """(out [T, H] bf16 of the layer on this rank, token); writes the context (schedule, expert-side
    activations), declared as the mutation of its handle `context`. token: a new CPU int64 tensor [2], the
    context's id and its generation after this forward, which the backward ops take as their context argument
    (and check, when they run, that no later forward overwrote the context). Asynchronous on the current
    stream; collective over the workspace's EP group."""
    ws = _lookup(_workspaces, workspace, "workspace", "forward")
    ctx = _lookup(_contexts, context, "forward context", "forward")
    out = torch.empty_like(x)
    ws._native.forward(*_plain(x, topk_idx, router_weights, expert_gate, expert_up, expert_down, shared_gate,
                               shared_up, shared_down), out, ctx._native, _stream(x), schedule_ready)
    ctx.mark_written()
    return out, _token(ctx, context)


@forward_op.register_fake
def _forward_fake(workspace, context, schedule_ready, x, topk_idx, router_weights, expert_gate, expert_up,
                  expert_down, shared_gate, shared_up, shared_down):
    return torch.empty_like(x), torch.empty(2, dtype=torch.int64, device="cpu")


def _is_eager(t) -> bool:
    """A real tensor outside any tracing."""
    return type(t) in (torch.Tensor, torch.nn.Parameter) and not torch.compiler.is_compiling()


class LayerFunction(torch.autograd.Function):
    """Autograd of mok::forward (an op that declares a mutation cannot have a register_autograd formula).

    apply(workspace, context, schedule_ready, x, topk_idx, router_weights, <6 weights>, <6 main_grads>,
          main_grad_targets, dummy_mask, zero_mask, recompute[, <20 FP8 weight entries>]) -> out

    With FP8 weight entries (mok.Fp8Weights.op_tensors(): values and scales of the six weights, then the four
    transposed copies'; Config(precision="fp8"); bf16 passes none) the forward is
    mok::forward_fp8 and the backward mok::backward_fp8; <6 weights> are then the bf16 master weights the FP8 ones
    were quantized from (None each where not given: no gradient), whose gradients go straight through the
    quantization. schedule_ready is False there.

    main_grads (None each without main_grad), main_grad_targets (a MainGradTargets handle, or None), dummy_mask
    (Megatron's dummy gradients) and zero_mask (the dummies that are zeros: zero_out_wgrad) are read when the
    forward runs (layer.layer_forward: MainGradTargets.main_grads, dummy_mask, zero_mask) and only tell the
    backward what to do.

    What the backward needs is kept two ways. x, topk_idx, router_weights, the weights and the forward's token are
    saved (save_for_backward: an in-place change of one of them before the backward raises). The token is saved,
    not stashed, for activation checkpointing: torch.utils.checkpoint(use_reentrant=False) drops the saved tensors
    and gives the backward those of its recomputation, whose mok::forward rewrote the context (the same bits) under
    a new generation; the recomputed token names it, so the generation check passes, while a context that another
    forward overwrote still fails it. The backward ops take a copy of the token (they declare it written: with
    recompute they set it to the rebuilt generation), so the saved one is never modified. The main_grad tensors are
    stashed on ctx instead: the backward ops declare them written every time, and autograd's saved-tensor version
    check would call a second micro-batch's backward adding into the same main_grad an in-place modification.
    PyTorch checks no version of tensors stashed on ctx, in eager mode and under torch.compile alike (AOTAutograd's
    "saved with no version counter check"); mok's own generation check in the backward ops is what catches an
    overwritten context."""

    @staticmethod
    def forward(ctx, workspace, context, schedule_ready, x, topk_idx, router_weights, *rest):
        n = len(WEIGHT_NAMES)
        weights = rest[:n]
        main_grads = rest[n:2 * n]
        targets, dummy_mask, zero_mask, recompute = rest[2 * n:2 * n + 4]
        fp8 = rest[2 * n + 4:]
        if fp8:
            out, token = torch.ops.mok.forward_fp8(workspace, context, x, topk_idx, router_weights, list(fp8[:n]),
                                                   list(fp8[n:2 * n]))
        else:
            out, token = torch.ops.mok.forward(workspace, context, schedule_ready, x, topk_idx, router_weights,
                                               *weights)
        ctx.save_for_backward(x, topk_idx, router_weights, *weights, token, *fp8)
        ctx.mok_main_grads, ctx.mok_workspace = main_grads, workspace
        ctx.mok_flags = (targets, dummy_mask, zero_mask, recompute)
        # Eager only: the context itself, held by the graph until it is freed (a pooled context, mok.forward(ctx=None),
        # goes back to its pool only then; pooled contexts are refused under torch.compile and capture).
        ctx.mok_context = _contexts.get(int(context[0])) if _is_eager(x) else None
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable  # the backward ops have no derivative: a double backward says so
    def backward(ctx, d_out):
        targets, dummy_mask, zero_mask, recompute = ctx.mok_flags
        n = len(WEIGHT_NAMES)
        x, topk_idx, router_weights, *rest = ctx.saved_tensors
        weights, token, fp8 = rest[:n], rest[n], rest[n + 1:]
        token = token.clone()  # the ops may rewrite it (recompute); the saved one stays as saved
        main_grads, workspace = ctx.mok_main_grads, ctx.mok_workspace
        needs = ctx.needs_input_grad
        needed = 0
        for i, w in enumerate(weights):
            if w is not None and needs[6 + i]:
                needed |= 1 << i
        grad_mask = with_partners(needed, weights)  # computed: the needed ones and their gate/up partners
        d_out = d_out.contiguous()
        weight_grads = [None] * len(WEIGHT_NAMES)
        if fp8:  # the FP8 backward into new tensors, or added into main_grad
            if targets is not None:
                buffers = main_grad_buffers(weights, needed, grad_mask, main_grads)
            else:
                buffers = [torch.empty_like(w) if grad_mask >> i & 1 else None for i, w in enumerate(weights)]
            d_x, d_router_weights = torch.ops.mok.backward_fp8(
                workspace, token, d_out, x, topk_idx, router_weights, list(fp8[:n]), list(fp8[n:2 * n]),
                list(fp8[2 * n:2 * n + 4]), list(fp8[2 * n + 4:]), *buffers, targets is not None, recompute, targets)
            if targets is not None:
                weight_grads = dummy_grads(weights, needed, dummy_mask, zero_mask)
            else:
                weight_grads = [g if needed >> i & 1 else None for i, g in enumerate(buffers)]
        elif targets is not None:
            # main_grad += this backward's gradient (declared: backward_into's gradient arguments).
            buffers = main_grad_buffers(weights, needed, grad_mask, main_grads)
            d_x, d_router_weights = torch.ops.mok.backward_into(
                workspace, token, d_out, x, topk_idx, router_weights, *weights, *buffers, True, recompute, targets)
            weight_grads = dummy_grads(weights, needed, dummy_mask, zero_mask)
        else:
            grads = torch.ops.mok.backward(workspace, token, d_out, x, topk_idx, router_weights, *weights,
                                           grad_mask, False, recompute)
            d_x, d_router_weights = grads[0], grads[1]
            for i in range(len(WEIGHT_NAMES)):
                if needed >> i & 1:
                    weight_grads[i] = grads[2 + i]
        return (None, None, None, d_x if needs[3] else None, None, d_router_weights if needs[5] else None,
                *weight_grads, *([None] * len(WEIGHT_NAMES)), None, None, None, None, *([None] * len(fp8)))


# ---------------------------------------------------------------------------------------------------------------
# mok::backward


def _empty_slot(x: torch.Tensor) -> torch.Tensor:
    """The output of a weight gradient that is not returned (absent weight, or not asked for)."""
    return x.new_empty(0)


def _backward_outputs(x, router_weights, weights, grad_mask, fp32_grads):
    """mok::backward's outputs (new tensors; fake ones under a fake mode)."""
    outs = [torch.empty_like(x), torch.empty_like(router_weights)]
    for i, w in enumerate(weights):
        if w is None or not grad_mask >> i & 1:
            outs.append(_empty_slot(x))
        else:
            outs.append(torch.empty_like(w, dtype=torch.float32 if fp32_grads else w.dtype))
    return tuple(outs)


def _check_training(ws, op: str) -> None:
    if not ws.config.backward:
        raise RuntimeError(f"mok::{op}: the workspace was made with Config(backward=False) (inference only)")


def _check_written(ctx, op: str) -> None:
    if not ctx.written:
        run = "mok.forward_fp8" if op.endswith("fp8") else \
            "mok.forward, or mok.recompute_forward_context after mok.build_schedule,"
        raise RuntimeError(f"mok::{op}: the forward context holds no forward of its current schedule (run {run} "
                           "with it first)")


def _prepare_backward(ws, ctx, context, recompute, x, topk_idx, weights, op: str, fp8=None) -> None:
    """What the backward ops do first: the generation check of a token (context [id, generation], the forward's)
    or the rebuild of the context (recompute: build_schedule and recompute_forward_context from the saved
    inputs, with fp8 = (values, scales) the FP8 weights; the token then names the rebuilt state), and the check
    that the context holds a forward."""
    _check_training(ws, op)
    token = context.numel() == 2
    if token and not recompute:
        check_generation(ctx, int(context[1]))
    if recompute:
        stream = _stream(x)
        ws._native.build_schedule(topk_idx, ctx._native, stream)
        ctx.mark_scheduled()
        _recompute(ws, ctx, x, weights, stream, fp8)
        if token:
            context[1] = ctx.generation
    _check_written(ctx, op)


@torch.library.custom_op("mok::backward", mutates_args=("context",), device_types="cuda")
def backward_op(workspace: torch.Tensor, context: torch.Tensor, d_out: torch.Tensor, x: torch.Tensor,
                topk_idx: torch.Tensor, router_weights: torch.Tensor, expert_gate: torch.Tensor,
                expert_up: Optional[torch.Tensor], expert_down: torch.Tensor, shared_gate: Optional[torch.Tensor],
                shared_up: Optional[torch.Tensor], shared_down: Optional[torch.Tensor], grad_mask: int,
                fp32_grads: bool, recompute: bool = False
                ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                           torch.Tensor, torch.Tensor]:
    """(d_x bf16 [T, H], d_router_weights fp32 [T, k], then the six weight gradients) of the forward in the
    context.

    context: the context's handle ([id]: unchecked), or the token mok::forward returned ([id, generation]):
    without recompute the context must still hold that forward, else RuntimeError, checked here when the op
    runs (eager, torch.compile and CUDA-graph capture alike). Declared written: the backward reads the context
    and, with recompute, first rebuilds it from topk_idx, x and the weights (build_schedule and
    recompute_forward_context; the token then names the rebuilt state), so the context may have served other
    forwards since this layer's. grad_mask: bit i asks for weight i's gradient (separate gate and up: both or
    neither, see with_partners); an unasked or absent one is an empty tensor. Written in the weight's dtype
    (bf16), or fp32 with fp32_grads."""
    ws = _lookup(_workspaces, workspace, "workspace", "backward")
    ctx = _lookup(_contexts, context, "forward context", "backward")
    weights = [expert_gate, expert_up, expert_down, shared_gate, shared_up, shared_down]
    _prepare_backward(ws, ctx, context, recompute, x, topk_idx, weights, "backward")
    outs = _backward_outputs(x, router_weights, weights, grad_mask, fp32_grads)
    grads = [g if g.numel() else None for g in outs[2:]]
    ws._native.backward(*_plain(d_out, x, topk_idx, router_weights), _plain(*weights), outs[0], outs[1],
                        _plain(*grads), False, ctx._native, _stream(x))
    return outs


@backward_op.register_fake
def _backward_fake(workspace, context, d_out, x, topk_idx, router_weights, expert_gate, expert_up, expert_down,
                   shared_gate, shared_up, shared_down, grad_mask, fp32_grads, recompute=False):
    weights = [expert_gate, expert_up, expert_down, shared_gate, shared_up, shared_down]
    return _backward_outputs(x, router_weights, weights, grad_mask, fp32_grads)


# ---------------------------------------------------------------------------------------------------------------
# mok::backward_into: the gradients into the caller's tensors


@torch.library.custom_op("mok::backward_into", device_types="cuda",
                         mutates_args=("context", *(f"grad_{name}" for name in WEIGHT_NAMES)))
def backward_into_op(workspace: torch.Tensor, context: torch.Tensor, d_out: torch.Tensor, x: torch.Tensor, topk_idx: torch.Tensor,
                     router_weights: torch.Tensor, expert_gate: torch.Tensor, expert_up: Optional[torch.Tensor],
                     expert_down: torch.Tensor, shared_gate: Optional[torch.Tensor], shared_up: Optional[torch.Tensor],
                     shared_down: Optional[torch.Tensor], grad_expert_gate: Optional[torch.Tensor],
                     grad_expert_up: Optional[torch.Tensor], grad_expert_down: Optional[torch.Tensor],
                     grad_shared_gate: Optional[torch.Tensor], grad_shared_up: Optional[torch.Tensor],
                     grad_shared_down: Optional[torch.Tensor], accumulate: bool, recompute: bool = False,
                     main_grad_targets: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """(d_x, d_router_weights); each given grad_* is written (bf16 or fp32), or with accumulate added to (fp32):
    Megatron's main_grad. context, recompute: as mok::backward's. main_grad_targets (a MainGradTargets handle,
    autograd's backward with main_grad=True): afterwards Megatron's grad_added_to_main_grad is set on the
    parameters whose gradient was added (a Python attribute, not a tensor)."""
    ws = _lookup(_workspaces, workspace, "workspace", "backward_into")
    ctx = _lookup(_contexts, context, "forward context", "backward_into")
    weights = [expert_gate, expert_up, expert_down, shared_gate, shared_up, shared_down]
    grads = [grad_expert_gate, grad_expert_up, grad_expert_down, grad_shared_gate, grad_shared_up, grad_shared_down]
    _prepare_backward(ws, ctx, context, recompute, x, topk_idx, weights, "backward_into")
    d_x, d_router_weights = torch.empty_like(x), torch.empty_like(router_weights)
    ws._native.backward(*_plain(d_out, x, topk_idx, router_weights), _plain(*weights), d_x, d_router_weights,
                        _plain(*grads), accumulate, ctx._native, _stream(x))
    _mark_added(main_grad_targets, grads, "backward_into")
    return d_x, d_router_weights


def _mark_added(main_grad_targets: Optional[torch.Tensor], grads, op: str) -> None:
    """Megatron's grad_added_to_main_grad on the parameters whose gradient a backward op added into main_grad."""
    if main_grad_targets is not None:
        _lookup(_main_grad_targets, main_grad_targets, "main-gradient targets", op).mark_added(
            sum(1 << i for i, g in enumerate(grads) if g is not None))


@backward_into_op.register_fake
def _gradients_into_fake(workspace, context, d_out, x, topk_idx, router_weights, *rest):
    """backward_into's and backward_fp8's: (d_x, d_router_weights); the gradients are written in place."""
    return torch.empty_like(x), torch.empty_like(router_weights)


# ---------------------------------------------------------------------------------------------------------------
# mok::recompute_forward_context


def _recompute(ws, ctx, x, weights, stream, fp8=None) -> None:
    """recompute_forward_context on the native workspace: bf16 weights, or with fp8 = (values, scales) the FP8
    ones (the forward's); the context marked written."""
    if fp8 is None:
        ws._native.recompute_forward_context(x.detach(), _plain(*weights), ctx._native, stream)
    else:
        ws._native.recompute_forward_context_fp8(x.detach(), _as_bytes(fp8[0]), list(fp8[1]), ctx._native, stream)
    ctx.mark_written()


def _check_scheduled(ctx, op: str) -> None:
    if not ctx.scheduled:
        forward = "mok.forward_fp8" if op.endswith("fp8") else "mok.forward"
        raise RuntimeError(f"mok::{op}: the forward context holds no schedule (run {forward} or mok.build_schedule "
                           "with it first)")


@torch.library.custom_op("mok::recompute_forward_context", mutates_args=("context",), device_types="cuda")
def recompute_op(workspace: torch.Tensor, context: torch.Tensor, x: torch.Tensor, expert_gate: torch.Tensor,
                 expert_up: Optional[torch.Tensor], expert_down: torch.Tensor, shared_gate: Optional[torch.Tensor],
                 shared_up: Optional[torch.Tensor], shared_down: Optional[torch.Tensor]) -> None:
    """Rebuilds the context's activations from x and the weights, on the schedule already in it."""
    ws = _lookup(_workspaces, workspace, "workspace", "recompute_forward_context")
    ctx = _lookup(_contexts, context, "forward context", "recompute_forward_context")
    _check_training(ws, "recompute_forward_context")
    _check_scheduled(ctx, "recompute_forward_context")
    _recompute(ws, ctx, x, (expert_gate, expert_up, expert_down, shared_gate, shared_up, shared_down), _stream(x))


@recompute_op.register_fake
def _recompute_fake(workspace, context, x, expert_gate, expert_up, expert_down, shared_gate, shared_up, shared_down):
    return None


@torch.library.custom_op("mok::recompute_forward_context_fp8", mutates_args=("context",), device_types="cuda")
def recompute_fp8_op(workspace: torch.Tensor, context: torch.Tensor, x: torch.Tensor,
                     values: List[Optional[torch.Tensor]], scales: List[Optional[torch.Tensor]]) -> None:
    """mok::recompute_forward_context of an FP8 workspace: the FP8 weights as mok::forward_fp8 takes them."""
    ws = _lookup(_workspaces, workspace, "workspace", "recompute_forward_context_fp8")
    ctx = _lookup(_contexts, context, "forward context", "recompute_forward_context_fp8")
    _check_training(ws, "recompute_forward_context_fp8")
    _check_scheduled(ctx, "recompute_forward_context_fp8")
    _recompute(ws, ctx, x, None, _stream(x), (values, scales))


@recompute_fp8_op.register_fake
def _recompute_fp8_fake(workspace, context, x, values, scales):
    return None


# ---------------------------------------------------------------------------------------------------------------
# mok::quantize_weights_fp8, mok::forward_fp8, mok::backward_fp8 (Config(precision="fp8"), python/mok/fp8.py)


def _quantized_weights(weights, transposed: bool, quantize=None):
    """mok::quantize_weights_fp8's outputs for `weights` (the six, None where absent; bf16 [.., rows, cols]): the
    present weights' e4m3 values and fp32 block scales [.., ceil(rows/128), ceil(cols/128)], each made by
    quantize(w, values, scales, values_t, scales_t) (None: only allocated, the fake), and with `transposed` the
    present transposed copies in fp8.TRANSPOSED_NAMES' order: [gate; up]^T joined along the last dimension, down^T."""
    blocks = lambda extent: (extent + 127) // 128  # noqa: E731
    values, scales, values_t, scales_t = [], [], [None] * len(weights), [None] * len(weights)
    for n, w in enumerate(weights):
        if w is None:
            continue
        rows, cols = w.shape[-2], w.shape[-1]
        q = torch.empty(w.shape, dtype=torch.float8_e4m3fn, device=w.device)
        s = torch.empty(*w.shape[:-2], blocks(rows), blocks(cols), dtype=torch.float32, device=w.device)
        if transposed:
            values_t[n] = torch.empty(*w.shape[:-2], cols, rows, dtype=torch.float8_e4m3fn, device=w.device)
            scales_t[n] = torch.empty(*w.shape[:-2], blocks(cols), blocks(rows), dtype=torch.float32, device=w.device)
        if quantize is not None:
            quantize(w, q, s, values_t[n], scales_t[n])
        values.append(q)
        scales.append(s)
    copies, copy_scales = [], []
    if transposed:
        for gate, up, down in ((0, 1, 2), (3, 4, 5)):  # routed, then shared
            for parts in ([n for n in (gate, up) if weights[n] is not None], [down] if weights[down] is not None
                          else []):
                if parts:
                    copies.append(_last_dim_cat([values_t[n] for n in parts]))
                    copy_scales.append(_last_dim_cat([scales_t[n] for n in parts]))
    return values, scales, copies, copy_scales


def _last_dim_cat(parts):
    """The parts joined along the last dimension into a new tensor (e4m3 copied as bytes: not every torch has float8
    copy kernels)."""
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    out = torch.empty(*first.shape[:-1], sum(p.shape[-1] for p in parts), dtype=first.dtype, device=first.device)
    as_bytes = (lambda t: t.view(torch.uint8)) if first.dtype == torch.float8_e4m3fn else (lambda t: t)  # noqa: E731
    col = 0
    for p in parts:
        as_bytes(out)[..., col:col + p.shape[-1]].copy_(as_bytes(p))
        col += p.shape[-1]
    return out


@torch.library.custom_op("mok::quantize_weights_fp8", mutates_args=(), device_types="cuda")
def quantize_weights_fp8_op(weights: List[Optional[torch.Tensor]], power_of_two_scales: bool,
                            transposed: bool) -> Tuple[List[torch.Tensor], List[torch.Tensor], List[torch.Tensor],
                                                       List[torch.Tensor]]:
    """mok.quantize_weights' kernels (the six weights, None where absent, checked by it): the present weights' e4m3
    values and block scales, and with `transposed` the present transposed copies' (mok.Fp8Weights' fields without
    their None entries). New tensors, written on torch's current stream."""
    from .layer import _native_module
    ext = _native_module()

    def quantize(w, q, s, q_t, s_t):
        ext.quantize_weights_fp8(w.detach(), q.view(torch.uint8), s, None if q_t is None else q_t.view(torch.uint8),
                                 s_t, power_of_two_scales, _stream(w))

    return _quantized_weights(weights, transposed, quantize)


@quantize_weights_fp8_op.register_fake
def _quantize_weights_fp8_fake(weights, power_of_two_scales, transposed):
    return _quantized_weights(weights, transposed)


@torch.library.custom_op("mok::forward_fp8", mutates_args=("context",), device_types="cuda")
def forward_fp8_op(workspace: torch.Tensor, context: torch.Tensor, x: torch.Tensor, topk_idx: torch.Tensor,
                   router_weights: torch.Tensor, values: List[Optional[torch.Tensor]],
                   scales: List[Optional[torch.Tensor]]) -> Tuple[torch.Tensor, torch.Tensor]:
    """mok::forward with FP8 weights (values e4m3, scales fp32, in weight order): (out, token), the context written
    as mok::forward writes it."""
    ws = _lookup(_workspaces, workspace, "workspace", "forward_fp8")
    ctx = _lookup(_contexts, context, "forward context", "forward_fp8")
    out = torch.empty_like(x)
    ws._native.forward_fp8(*_plain(x, topk_idx, router_weights), _as_bytes(values), list(scales), out, ctx._native,
                           _stream(x))
    ctx.mark_written()
    return out, _token(ctx, context)


@forward_fp8_op.register_fake
def _forward_fp8_fake(workspace, context, x, topk_idx, router_weights, values, scales):
    return torch.empty_like(x), torch.empty(2, dtype=torch.int64, device="cpu")


@torch.library.custom_op("mok::backward_fp8", device_types="cuda",
                         mutates_args=("context", *(f"grad_{name}" for name in WEIGHT_NAMES)))
def backward_fp8_op(workspace: torch.Tensor, context: torch.Tensor, d_out: torch.Tensor, x: torch.Tensor,
                    topk_idx: torch.Tensor, router_weights: torch.Tensor, values: List[Optional[torch.Tensor]],
                    scales: List[Optional[torch.Tensor]], values_t: List[Optional[torch.Tensor]],
                    scales_t: List[Optional[torch.Tensor]], grad_expert_gate: Optional[torch.Tensor],
                    grad_expert_up: Optional[torch.Tensor], grad_expert_down: Optional[torch.Tensor],
                    grad_shared_gate: Optional[torch.Tensor], grad_shared_up: Optional[torch.Tensor],
                    grad_shared_down: Optional[torch.Tensor], accumulate: bool, recompute: bool = False,
                    main_grad_targets: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """mok::backward_into of the FP8 forward in the context (its dgrads in FP8 from the transposed copies values_t,
    scales_t; the weight gradients of the bf16 master weights): (d_x, d_router_weights), each given grad_* written
    or added to. context, recompute (the context rebuilt first from x and the FP8 weights values, scales) and
    main_grad_targets as mok::backward_into's."""
    ws = _lookup(_workspaces, workspace, "workspace", "backward_fp8")
    ctx = _lookup(_contexts, context, "forward context", "backward_fp8")
    grads = [grad_expert_gate, grad_expert_up, grad_expert_down, grad_shared_gate, grad_shared_up, grad_shared_down]
    _prepare_backward(ws, ctx, context, recompute, x, topk_idx, None, "backward_fp8", fp8=(values, scales))
    d_x, d_router_weights = torch.empty_like(x), torch.empty_like(router_weights)
    ws._native.backward_fp8(*_plain(d_out, x, topk_idx, router_weights), _as_bytes(values), list(scales),
                            _as_bytes(values_t), list(scales_t), d_x, d_router_weights, _plain(*grads), accumulate,
                            ctx._native, _stream(x))
    _mark_added(main_grad_targets, grads, "backward_fp8")
    return d_x, d_router_weights


backward_fp8_op.register_fake(_gradients_into_fake)
