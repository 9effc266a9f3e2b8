"""The functional API: get_workspace, build_schedule, forward, the status word.

    ws = mok.get_workspace(mok.Config(), group, T, H, I, top_k, E)   # collective for EP > 1
    out, ctx = mok.forward(ws, x, topk_idx, router_weights, weights)  # on torch's current stream
    mok.check_status(ws)                                              # where you synchronize anyway

A workspace on device "meta" has no memory and runs nothing: forward returns empty meta outputs (for shape
tracing, and the tests that run without a GPU).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from . import ops
from .checks import check_forward_args
from .config import PATHS, Config, LayerShape, Status, Weights


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
    layer, reused step after step; made by Workspace.make_context."""

    def __init__(self, workspace: "Workspace", native):
        self.workspace = workspace
        self._native = native
        self.handle = ops.register_context(self)

    @property
    def ring_rows(self) -> int:
        return self._native.ring_rows if self._native is not None else 0


class Workspace:
    """The layer's buffers on this rank (symmetric over the EP group); reuse it for every layer of this shape.
    Made by get_workspace."""

    def __init__(self, shape: LayerShape, config: Config, device: torch.device, rank: int, native):
        self.shape = shape
        self.config = config
        self.device = device
        self.rank = rank
        self._native = native
        self.handle = ops.register_workspace(self)

    def __repr__(self):
        return f"mok.Workspace({self.shape}, {self.config}, device={self.device}, rank={self.rank})"

    @property
    def is_meta(self) -> bool:
        return self._native is None

    def make_context(self) -> ForwardContext:
        return ForwardContext(self, None if self.is_meta else self._native.make_context())

    def read_status(self) -> Status:
        """The status word since the last reset_status (it is sticky): bad expert ids, capacity overflow,
        spin-wait timeouts. Synchronizes the current stream."""
        if self.is_meta:
            return Status(ok=True)
        ok, bits, message = self._native.read_status(_cuda_stream(self.device))
        return Status(ok=bool(ok), error_bits=int(bits), message=message.rstrip())

    def reset_status(self) -> None:
        """Clears the status word and the abort flag, asynchronously on the current stream (with EP > 1: on
        every rank, all resets finished before any rank's next call; include/mok/moe.h)."""
        if self.is_meta:
            return
        self._native.reset_status(_cuda_stream(self.device))

    @property
    def capacity_rows(self) -> int:
        return self._native.capacity_rows if not self.is_meta else 0

    @property
    def comm_ctas(self) -> int:
        return self._native.comm_ctas if not self.is_meta else self.config.comm_ctas


def _group_rank_size(group) -> Tuple[int, int]:
    if group is None:
        return 0, 1
    import torch.distributed as dist
    return dist.get_rank(group), dist.get_world_size(group)


def get_workspace(config: Config, group, num_local_tokens: int, hidden: int, intermediate: int, top_k: int,
                  num_experts: int, shared_expert: bool = True, swiglu_limit: float = 0.0,
                  device=None) -> Workspace:
    """A workspace for a layer of this shape. group: None for EP = 1 on `device`; a torch.distributed
    ProcessGroup of one process per GPU for EP = its size (collective: every rank calls it; rank 0 makes an
    NCCL unique id and broadcasts it over the group, and the library gets its own NCCL communicator).
    device: None for torch's current CUDA device; "meta" for a workspace without memory (shapes only)."""
    if not isinstance(config, Config):
        raise TypeError(f"config: expected a mok.Config, got {type(config).__name__}")
    rank, ep_size = _group_rank_size(group)
    shape = LayerShape(ep_size=ep_size, num_tokens=num_local_tokens, top_k=top_k, num_experts=num_experts,
                       hidden=hidden, intermediate=intermediate, shared_expert=bool(shared_expert),
                       swiglu_limit=float(swiglu_limit))
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device())
    device = torch.device(device)
    if device.type == "meta":
        return Workspace(shape, config, device, rank, None)
    if device.type != "cuda":
        raise ValueError(f"device: expected a CUDA device (or meta), got {device}")
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    ext = _native_module()
    nccl_id = None
    if ep_size > 1:
        import torch.distributed as dist
        box = [ext.nccl_unique_id() if rank == 0 else None]
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group, device=device)
        nccl_id = box[0]
    native = ext.Workspace(device.index, ep_size, rank, nccl_id, shape.num_tokens, shape.hidden, shape.intermediate,
                           shape.top_k, shape.num_experts, shape.shared_expert, shape.swiglu_limit, PATHS[config.path],
                           config.comm_ctas, config.minibatch_rows, config.macrobatch_rows, config.capacity_rows,
                           config.tile_m, float(config.wait_timeout_s))
    return Workspace(shape, config, device, rank, native)


def _check_context(ws: Workspace, ctx) -> None:
    if not isinstance(ctx, ForwardContext):
        raise TypeError(f"ctx: expected a mok.ForwardContext (ws.make_context()), got {type(ctx).__name__}")
    if ctx.workspace is not ws:
        raise ValueError("ctx: made by another workspace (a context is sized for its workspace's shape)")


def _check_workspace(ws) -> None:
    if not isinstance(ws, Workspace):
        raise TypeError(f"ws: expected a mok.Workspace (mok.get_workspace), got {type(ws).__name__}")


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


def forward(ws: Workspace, x: torch.Tensor, topk_idx: torch.Tensor, router_weights: torch.Tensor, weights,
            ctx: Optional[ForwardContext] = None, *, schedule_ready: bool = False
            ) -> Tuple[torch.Tensor, ForwardContext]:
    """out[t] = shared(x[t]) + sum_j router_weights[t, j] * expert_{topk_idx[t, j]}(x[t]), on this rank.

    x bf16 [T, H]; topk_idx int32/int64 [T, k] global expert ids (-1 masks a route); router_weights fp32 [T, k];
    weights a mok.Weights or dict (see Weights). ctx: a context from ws.make_context() (None: a new one;
    under torch.compile and CUDA-graph capture pass one made outside). schedule_ready: ctx holds the schedule
    of these topk_idx from build_schedule. Returns (out bf16 [T, H], ctx). Asynchronous on torch's current
    stream, collective over the EP group; data-dependent errors (bad expert ids, capacity overflow) go to the
    status word: check_status(ws) where you synchronize anyway (out is unspecified after an error)."""
    _check_workspace(ws)
    weights = Weights.of(weights)
    check_forward_args(ws.shape, ws.device, x, topk_idx, router_weights, weights)
    if ctx is None:
        if torch.compiler.is_compiling():
            raise RuntimeError("mok.forward under torch.compile: pass ctx=ws.make_context(), made outside the "
                               "compiled function")
        ctx = ws.make_context()
    _check_context(ws, ctx)
    out = torch.ops.mok.forward(ws.handle, ctx.handle, bool(schedule_ready), x, topk_idx, router_weights,
                                weights.expert_gate, weights.expert_up, weights.expert_down, weights.shared_gate,
                                weights.shared_up, weights.shared_down)
    return out, ctx


def check_status(ws: Workspace) -> None:
    """Raises RuntimeError with the status word's message if the GPU recorded an error. Synchronizes."""
    status = ws.read_status()
    if not status.ok:
        raise RuntimeError(f"mok: the GPU reported: {status.message} (status bits {status.error_bits:#x})")


def _missing(name):
    def fn(*args, **kwargs):
        raise NotImplementedError(f"mok.{name}: {ops.BACKWARD_MISSING}")
    fn.__name__ = name
    fn.__doc__ = f"Not available yet: {ops.BACKWARD_MISSING}."
    return fn


backward = _missing("backward")
recompute_forward_context = _missing("recompute_forward_context")
main_grads = _missing("main_grads")
