"""The functional API: get_workspace, build_schedule, forward, backward, recompute_forward_context, the status
word.

    ws = mok.get_workspace(mok.Config(), group, T, H, I, top_k, E)   # collective for EP > 1
    out, ctx = mok.forward(ws, x, topk_idx, router_weights, weights)  # on torch's current stream
    d_x, d_rw, grads = mok.backward(ws, d_out, x, topk_idx, router_weights, weights, ctx)
    mok.check_status(ws)                                              # where you synchronize anyway
    ws.close()                                                        # collective for EP > 1 (or `with ws:`)

Autograd: mok.forward is differentiable (mok.ops.LayerFunction, whose backward calls the backward op), for x,
router_weights and every weight that requires grad.

A workspace on device "meta" has no memory and runs nothing: forward returns empty meta outputs (for shape
tracing, and the tests that run without a GPU).
"""
from __future__ import annotations

import dataclasses
import warnings
import weakref
from typing import Optional, Tuple

import torch

from . import arguments, ops
from .checks import (WEIGHT_NAMES, check_backward_args, check_forward_args, check_weight_grads, check_weights,
                     check_x)
from .config import Config, LayerShape, Status, Weights, check_config_for_shape
from .device import check_layer_device, layer_device


def _native_module():
    try:
        from . import _mok
    except ImportError as e:
        raise ImportError(f"mok: the extension mok._mok does not load ({e}); reinstall with pip install .") from e
    return _mok


def _cuda_stream(device: torch.device) -> int:
    return torch.cuda.current_stream(device).cuda_stream


class ForwardContext:
    """What one layer's forward leaves for its backward on this rank (schedule, expert-side activations). One per
    layer, reused step after step; made by Workspace.make_context (or, for mok.forward(ctx=None), leased from the
    workspace's pool: Workspace.pooled_context). The autograd graph of a forward keeps its context alive (eager
    mode) until the graph is freed.

    scheduled / written: whether it holds a schedule (forward, build_schedule) / the activations of that
    schedule (forward, recompute_forward_context); generation counts the calls that changed it. The ops set
    them when they run; the forward returns its generation in its token and the backward ops compare it when
    they run, so a backward whose context was overwritten by a later forward raises (eager, compiled, captured).
    handle: the CPU int64 tensor [id] the ops find it by, declared written by every op that writes the context."""

    def __init__(self, workspace: "Workspace", native):
        self.workspace = workspace
        self._native = native
        self.handle = ops.register_context(self)
        self.scheduled = False
        self.written = False
        self.generation = 0

    def mark_scheduled(self) -> None:
        """A new schedule: the activations are those of the previous one until a forward or recompute."""
        self.scheduled, self.written = True, False
        self.generation += 1

    def mark_written(self) -> None:
        self.scheduled = self.written = True
        self.generation += 1

    @property
    def ring_rows(self) -> int:
        return self._native.ring_rows if self._native is not None else 0


def _recycle_context(workspace_ref, native) -> None:
    """weakref.finalize callback of a pooled ForwardContext: its native context goes back to the workspace's pool
    (a list append, atomic under the GIL, wherever the last reference died)."""
    ws = workspace_ref()
    if ws is not None and not ws.closed:
        ws._free_contexts.append(native)


class Workspace:
    """The layer's buffers on this rank (symmetric over the EP group); reuse it for every layer of this shape.
    Made by get_workspace.

    Lifetime (docs/design.md, "Lifetimes"): close() frees the buffers; with EP > 1 it is collective (every rank
    calls it: it deregisters the NCCL windows and destroys the library's communicator), so it is never left to
    the garbage collector, which collects objects at different times on different ranks. `with ws:` closes at
    the end of the block. An EP > 1 workspace collected without close() leaks its windows and communicator and
    warns (ResourceWarning); EP = 1 frees everything when collected."""

    def __init__(self, shape: LayerShape, config: Config, device: torch.device, rank: int, native):
        self.shape = shape
        self.config = config
        self.device = device
        self.rank = rank
        self._native = native
        self._closed = False
        self._free_contexts = []  # native contexts of forward(ctx=None) that no forward's graph holds any more
        self.handle = ops.register_workspace(self)

    def __repr__(self):
        closed = ", closed" if self._closed else ""
        return f"mok.Workspace({self.shape}, {self.config}, device={self.device}, rank={self.rank}{closed})"

    @property
    def is_meta(self) -> bool:
        return self._native is None

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Frees the workspace's buffers now. EP > 1: collective, every rank of the group calls it (waits for
        this rank's GPU, deregisters the NCCL windows, destroys the library's NCCL communicator). Idempotent;
        afterwards every call with the workspace raises RuntimeError ("... closed"). Contexts made by it stay
        valid Python objects (their memory goes when they are collected) but can no longer be used."""
        if self._closed:
            return
        self._closed = True
        self._free_contexts.clear()
        if self._native is not None:
            self._native.close()

    def __enter__(self) -> "Workspace":
        return self

    def __exit__(self, *exc_info) -> bool:
        self.close()
        return False

    def __del__(self):
        try:
            if not self._closed and self._native is not None and self.shape.ep_size > 1:
                warnings.warn(f"mok.Workspace (EP = {self.shape.ep_size}, rank {self.rank}) collected without "
                              "close(): its NCCL windows and communicator are leaked, not released (releasing them "
                              "is collective): call ws.close() on every rank, or use `with ws:`",
                              ResourceWarning, stacklevel=2)
        except Exception:  # interpreter shutdown: warnings or the attributes may be gone
            pass

    def require_open(self, name: str = "ws") -> None:
        """RuntimeError naming `name` if the workspace was closed."""
        if self._closed:
            raise RuntimeError(f"{name}: the workspace is closed (Workspace.close() was called): make a new one "
                               "with mok.get_workspace")

    def make_context(self) -> ForwardContext:
        """A new forward context (device memory of this rank, zero-filled asynchronously on the current stream;
        no host synchronization). Not under torch.compile or CUDA-graph capture."""
        self.require_open()
        if self.is_meta:
            return ForwardContext(self, None)
        return ForwardContext(self, self._native.make_context(_cuda_stream(self.device)))

    def pooled_context(self) -> ForwardContext:
        """The context of one mok.forward(ctx=None): a native context from the workspace's pool (a new one only
        when every pooled one is in use), wrapped in a new ForwardContext. The wrapper is the lease: while it is
        alive (the caller holds it, or the autograd graph of the forward that used it, which keeps it until the
        graph is freed) its native context is not handed out again; when it is collected the native context
        returns to the pool. So in steady state forward(ctx=None) allocates nothing: a training loop needs as
        many contexts as forwards whose graphs are alive at once (two for `loss = step(); loss.backward()` in a
        loop, the previous step's loss still holding its graph)."""
        self.require_open()
        if self.is_meta:
            return ForwardContext(self, None)
        native = self._free_contexts.pop() if self._free_contexts else \
            self._native.make_context(_cuda_stream(self.device))
        ctx = ForwardContext(self, native)
        weakref.finalize(ctx, _recycle_context, weakref.ref(self), native).atexit = False
        return ctx

    def read_status(self) -> Status:
        """The status word since the last reset_status (it is sticky): bad expert ids, capacity overflow,
        spin-wait timeouts. Synchronizes the current stream."""
        self.require_open()
        if self.is_meta:
            return Status(ok=True)
        ok, bits, message = self._native.read_status(_cuda_stream(self.device))
        return Status(ok=bool(ok), error_bits=int(bits), message=message.rstrip())

    def reset_status(self) -> None:
        """Clears the status word and the abort flag, asynchronously on the current stream (with EP > 1: on
        every rank, all resets finished before any rank's next call; include/mok/moe.h)."""
        self.require_open()
        if self.is_meta:
            return
        self._native.reset_status(_cuda_stream(self.device))

    @property
    def capacity_rows(self) -> int:
        return self._native.capacity_rows if not self.is_meta else 0

    @property
    def comm_ctas(self) -> int:
        return self._native.comm_ctas if not self.is_meta else self.config.comm_ctas


def check_group(group, name: str = "group"):
    """group if it is None (EP = 1) or a torch.distributed ProcessGroup; TypeError naming `name` otherwise."""
    if group is None:
        return group
    import torch.distributed as dist
    if not dist.is_available():
        raise TypeError(f"{name}: torch.distributed is not available in this PyTorch build, so there is no process "
                        f"group: pass None (EP = 1), got {type(group).__name__}")
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"{name}: expected a torch.distributed.ProcessGroup (None: EP = 1), got "
                        f"{type(group).__name__}")
    return group


def _group_rank_size(group) -> Tuple[int, int]:
    if check_group(group) is None:
        return 0, 1
    import torch.distributed as dist
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    if rank < 0:
        raise ValueError("group: this process is not a member of the group (every rank of the EP group calls "
                         "get_workspace with it)")
    return rank, size


def get_workspace(config: Config, group, num_local_tokens: int, hidden: int, intermediate: int, top_k: int,
                  num_experts: int, shared_expert: bool = True, swiglu_limit: float = 0.0,
                  device=None) -> Workspace:
    """A workspace for a layer of this shape. group: None for EP = 1 on `device`; a torch.distributed
    ProcessGroup of one process per GPU for EP = its size (collective: every rank calls it; rank 0 makes an
    NCCL unique id and broadcasts it over the group, and the library gets its own NCCL communicator).
    device: None for torch's current CUDA device (an int, a str or a torch.device); "meta" for a workspace
    without memory (shapes only).

    Every argument is checked first, in Python (TypeError / ValueError naming it: the shape rules of the C++ API,
    e.g. hidden and intermediate positive multiples of 64, top_k <= num_experts); then, for a CUDA device, that
    it is a Hopper GPU (RuntimeError "mok needs an NVIDIA Hopper GPU (sm_90); found ..."), before any CUDA call."""
    if not isinstance(config, Config):
        raise TypeError(f"config: expected a mok.Config, got {type(config).__name__}")
    rank, ep_size = _group_rank_size(group)
    arguments.check_int("num_local_tokens", num_local_tokens, "a positive int (tokens per rank)", lambda v: v > 0)
    shape = LayerShape(ep_size=ep_size, num_tokens=num_local_tokens, top_k=top_k, num_experts=num_experts,
                       hidden=hidden, intermediate=intermediate, shared_expert=shared_expert,
                       swiglu_limit=swiglu_limit)
    device = check_layer_device(device)
    check_config_for_shape(config, shape)
    device = layer_device(device)  # a Hopper GPU (or meta): before anything touches CUDA
    if device.type == "meta":
        return Workspace(shape, config, device, rank, None)
    ext = _native_module()
    nccl_id = None
    if ep_size > 1:
        import torch.distributed as dist
        box = [ext.nccl_unique_id() if rank == 0 else None]
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group, device=device)
        nccl_id = box[0]
    # The shape's and the config's fields by name: the extension's keywords are the option table's names
    # (src/host/option_table.h; test_cpu.py checks that Config and LayerShape match it).
    options = {f.name: getattr(shape, f.name) for f in dataclasses.fields(LayerShape)}
    options.update({f.name: getattr(config, f.name) for f in dataclasses.fields(Config)})
    native = ext.Workspace(device.index, rank, nccl_id, **options)
    return Workspace(shape, config, device, rank, native)


def _check_context(ws: Workspace, ctx) -> None:
    if not isinstance(ctx, ForwardContext):
        raise TypeError(f"ctx: expected a mok.ForwardContext (ws.make_context()), got {type(ctx).__name__}")
    if ctx.workspace is not ws:
        raise ValueError("ctx: made by another workspace (a context is sized for its workspace's shape)")


def _check_workspace(ws) -> None:
    if not isinstance(ws, Workspace):
        raise TypeError(f"ws: expected a mok.Workspace (mok.get_workspace), got {type(ws).__name__}")
    ws.require_open()


def build_schedule(ws: Workspace, topk_idx: torch.Tensor, ctx: ForwardContext) -> None:
    """All-gathers the top-k ids over the EP group and builds this rank's schedule into ctx, asynchronously;
    then forward(..., ctx, schedule_ready=True) skips that step. Eager only (forward builds the schedule
    itself under torch.compile)."""
    _check_workspace(ws)
    if torch.compiler.is_compiling():
        raise RuntimeError("mok.build_schedule is not traceable; under torch.compile call mok.forward, which "
                           "builds the schedule itself")
    check_forward_args(ws.shape, ws.device, None, topk_idx, None, None)
    _check_context(ws, ctx)
    if ws.is_meta:
        return
    ws._native.build_schedule(topk_idx, ctx._native, _cuda_stream(ws.device))
    ctx.mark_scheduled()


def forward(ws: Workspace, x: torch.Tensor, topk_idx: torch.Tensor, router_weights: torch.Tensor, weights,
            ctx: Optional[ForwardContext] = None, *, schedule_ready: bool = False, recompute: bool = False
            ) -> Tuple[torch.Tensor, ForwardContext]:
    """out[t] = shared(x[t]) + sum_j router_weights[t, j] * expert_{topk_idx[t, j]}(x[t]), on this rank.

    x bf16 [T, H]; topk_idx int32/int64 [T, k] global expert ids (-1 masks a route); router_weights fp32 [T, k];
    weights a mok.Weights or dict (see Weights). ctx: a context from ws.make_context(), or None: one of the
    workspace's pool (Workspace.pooled_context: reused once the graph of the forward that last used it is gone,
    so steady-state calls allocate nothing; under torch.compile and CUDA-graph capture pass one made outside).
    schedule_ready: ctx holds the schedule
    of these topk_idx from build_schedule (other ids are reported by check_status). Returns (out bf16 [T, H], ctx). Asynchronous on torch's current
    stream, collective over the EP group; data-dependent errors (bad expert ids, capacity overflow) go to the
    status word: check_status(ws) where you synchronize anyway (out is unspecified after an error).

    Differentiable: autograd's backward of out is mok.backward's (gradients of x, router_weights and the weights
    that require grad, bf16). The context must still hold this forward when it runs (one context per forward in
    flight), unless recompute=True: then the backward rebuilds the context first (build_schedule and
    recompute_forward_context from the saved inputs), so layers may share one context (activation
    checkpointing of the expert-side activations)."""
    _check_workspace(ws)
    if ws.config.precision != "bf16":
        raise ValueError(f"mok.forward: the workspace is Config(precision={ws.config.precision!r}); its forward is "
                         "mok.forward_fp8 with mok.quantize_weights' weights")
    arguments.check_bool("schedule_ready", schedule_ready)
    arguments.check_bool("recompute", recompute)
    if schedule_ready and ctx is None:
        raise ValueError("schedule_ready: True needs ctx, the context that mok.build_schedule filled (ctx=None makes "
                         "a new context, which holds no schedule)")
    weights = Weights.of(weights)
    check_forward_args(ws.shape, ws.device, x, topk_idx, router_weights, weights)
    if ctx is None:
        if torch.compiler.is_compiling():
            raise RuntimeError("mok.forward under torch.compile: pass ctx=ws.make_context(), made outside the "
                               "compiled function")
        if not ws.is_meta and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("mok.forward under CUDA-graph capture: pass ctx=ws.make_context(), made before the "
                               "capture (a pooled context could be handed to another forward while the graph "
                               "still writes it)")
        ctx = ws.pooled_context()
    _check_context(ws, ctx)
    out = ops.LayerFunction.apply(ws.handle, ctx.handle, bool(schedule_ready), x, topk_idx, router_weights,
                                  *weights.tensors(), *([None] * len(WEIGHT_NAMES)), None, 0, 0, bool(recompute))
    return out, ctx


def layer_forward(ws: Workspace, ctx: ForwardContext, x, topk_idx, router_weights, weights: Weights,
                  targets: Optional[ops.MainGradTargets], recompute: bool) -> torch.Tensor:
    """mok.forward for mok.MoE: the context given, and its backward accumulating into the parameters' main_grad
    (targets: the module's MainGradTargets, None for none)."""
    ws.require_open()
    check_forward_args(ws.shape, ws.device, x, topk_idx, router_weights, weights)
    _check_context(ws, ctx)
    if targets is None:
        main = ([None] * len(WEIGHT_NAMES), None, 0, 0)
    else:
        main = (targets.main_grads(), targets.handle, targets.dummy_mask(), targets.zero_mask())
    return ops.LayerFunction.apply(ws.handle, ctx.handle, False, x, topk_idx, router_weights, *weights.tensors(),
                                   *main[0], *main[1:], recompute)


def backward(ws: Workspace, d_out: torch.Tensor, x: torch.Tensor, topk_idx: torch.Tensor,
             router_weights: torch.Tensor, weights, ctx: ForwardContext, *, grads=None, main_grads=None,
             grad_dtype: torch.dtype = torch.bfloat16) -> Tuple[torch.Tensor, torch.Tensor, Weights]:
    """The gradients of the forward that filled ctx, for d_out = dL/d(out): (d_x bf16 [T, H], d_router_weights
    fp32 [T, k], weight_grads: a mok.Weights of the weights' gradients).

    x, topk_idx, router_weights, weights: the forward's (other ids are reported by check_status). Where the weight gradients go (one of):
      default      new tensors of the weights' shapes in grad_dtype (bf16 like the weights, or torch.float32);
      grads=       your tensors (a mok.Weights or a dict; bf16 or fp32, the weights' shapes), written;
      main_grads=  your fp32 tensors, accumulated in place: main_grad += this call's gradient (Megatron's
                   main_grad over micro-batches; mok.main_grads(weights) makes zeros).
    With grads or main_grads, a None entry (or missing key) skips that gradient; weight_grads is what was given.
    d_router_weights[t, j] = <d_out[t], expert_j(x[t])> (0 for masked routes), exact also where the router weight
    is 0. Asynchronous on torch's current stream, collective over the EP group, deterministic bit for bit."""
    _check_workspace(ws)
    weights = Weights.of(weights)
    check_backward_args(ws.shape, ws.device, d_out, x, topk_idx, router_weights, weights)
    _check_context(ws, ctx)
    if not ws.config.backward:
        raise ValueError("ws: made with Config(backward=False) (inference only): no backward")
    buffers, accumulate = gradient_buffers(ws, weights, grads, main_grads, grad_dtype, allocate=False)
    if buffers is None:
        outs = torch.ops.mok.backward(ws.handle, ctx.handle, d_out, x, topk_idx, router_weights, *weights.tensors(),
                                      ops.ALL_WEIGHTS, grad_dtype == torch.float32)
        present = [w is not None for w in weights.tensors()]
        return outs[0], outs[1], Weights(*[g if p else None for g, p in zip(outs[2:], present)])
    d_x, d_router_weights = torch.ops.mok.backward_into(ws.handle, ctx.handle, d_out, x, topk_idx, router_weights,
                                                        *weights.tensors(), *buffers.tensors(), accumulate)
    return d_x, d_router_weights, buffers


def gradient_buffers(ws: Workspace, weights: Weights, grads, main_grads, grad_dtype: torch.dtype,
                     allocate: bool = True) -> Tuple[Optional[Weights], bool]:
    """Where a backward's weight gradients go (mok.backward's and mok.backward_fp8's grads=, main_grads= and
    grad_dtype, checked against the weights' shapes): (the tensors, accumulate). Neither given: new tensors of
    grad_dtype for every weight, or with allocate=False (None, False)."""
    grad_dtypes = "torch.bfloat16 or torch.float32 (the dtype of new gradient tensors)"
    if not isinstance(grad_dtype, torch.dtype):
        raise TypeError(f"grad_dtype: expected {grad_dtypes}, got {arguments.describe(grad_dtype)}")
    if grad_dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"grad_dtype: expected {grad_dtypes}, got {grad_dtype}")
    if grads is not None and main_grads is not None:
        raise ValueError("grads, main_grads: pass one of them (written or accumulated), not both")
    if grad_dtype != torch.bfloat16 and (grads is not None or main_grads is not None):
        given = "grads" if grads is not None else "main_grads"
        raise ValueError(f"grad_dtype: expected the default torch.bfloat16 with {given}= (the gradients go to the "
                         f"given tensors, in their dtypes), got {grad_dtype}")
    if grads is None and main_grads is None:
        if not allocate:
            return None, False
        return Weights(*[None if w is None else torch.empty(w.shape, dtype=grad_dtype, device=ws.device)
                         for w in weights.tensors()]), False
    accumulate = main_grads is not None
    name = "main_grads" if accumulate else "grads"
    buffers = Weights.of_grads(main_grads if accumulate else grads, name)
    check_weight_grads(ws.shape, ws.device, weights, buffers, name, accumulate)
    return buffers, accumulate


def recompute_forward_context(ws: Workspace, x: torch.Tensor, weights, ctx: ForwardContext) -> ForwardContext:
    """Rebuilds ctx's expert-side activations from x and the weights on the schedule already in ctx (that of its
    last forward, or of mok.build_schedule), without computing out: activation checkpointing. The bits equal the
    forward's. An FP8 workspace (Config(precision="fp8")) takes the forward's mok.Fp8Weights. Asynchronous on
    torch's current stream, collective over the EP group. Returns ctx."""
    _check_workspace(ws)
    check_x(ws.shape, ws.device, x)
    if ws.config.precision == "fp8":
        from .fp8 import _check_fp8_weights
        _check_fp8_weights(ws, weights)
    else:
        weights = Weights.of(weights)
        check_weights(ws.shape, ws.device, weights)
    _check_context(ws, ctx)
    if not ws.config.backward:
        raise ValueError("ws: made with Config(backward=False) (inference only): no recompute_forward_context")
    if ws.config.precision == "fp8":
        torch.ops.mok.recompute_forward_context_fp8(ws.handle, ctx.handle, x, list(weights.values),
                                                     list(weights.scales))
    else:
        torch.ops.mok.recompute_forward_context(ws.handle, ctx.handle, x, *weights.tensors())
    return ctx


def main_grads(weights) -> Weights:
    """fp32 zeros shaped like the weights (None where a weight is absent): mok.backward's main_grads."""
    weights = Weights.of(weights)
    return Weights(*[None if w is None else torch.zeros(w.shape, dtype=torch.float32, device=w.device)
                     for w in weights.tensors()])


def check_status(ws: Workspace) -> None:
    """Raises RuntimeError with the status word's message if the GPU recorded an error. Synchronizes."""
    status = ws.read_status()
    if not status.ok:
        raise RuntimeError(f"mok: the GPU reported: {status.message} (status bits {status.error_bits:#x})")
