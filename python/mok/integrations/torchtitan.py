"""torchtitan's MoE models with their experts on this layer: the model, its config, its parameters and its checkpoints
stay torchtitan's; only the expert computation changes (the way liger-kernel patches Hugging Face models).

    from mok.integrations import torchtitan as mok_titan
    report = mok_titan.swap_moe_experts(model, max_tokens=local_batch * seq_len)  # after parallelize, before
    print(report)                                                  # the first forward and before torch.compile runs
    ... train as before ...
    mok_titan.restore_moe_experts(model)                           # torchtitan's own modules back

Tested with torchtitan 0.3.0 (TESTED_VERSIONS). Nothing in the core package imports this module or torchtitan.

What changes in a swapped MoE block (torchtitan.models.common.moe.MoE) and what does not:
  routed_experts   becomes a MokRoutedExperts that holds torchtitan's GroupedExperts as its `inner_experts` (the
                   same module object: its parameters w1_EFD [E, F, D] (gate), w3_EFD [E, F, D] (up) and w2_EDF
                   [E, D, F] (down), which are our expert_gate / expert_up / expert_down, keep their tensors and their
                   state-dict keys) and runs mok's forward and backward on them with the router's top-k expert ids
                   and scores. torchtitan's token dispatcher is not called (our kernels dispatch and combine).
  shared_experts   when it is a plain SwiGLU FeedForward (w1 gate, w3 up, w2 down, no biases) of the routed experts'
                   width F, our layer computes it in the same kernel: it becomes a FusedSharedExpert holding the same
                   Linear modules (same keys) whose forward returns None, which MoE.forward skips. Otherwise (another
                   width, a gated variant, tensor-parallel) it stays torchtitan's module and MoE.forward adds it.
  unchanged        the router (its score function, node-limited routing, route scaling and normalization), the
                   auxiliary-loss-free load balancing (expert_bias_E, tokens_per_expert_E: MoE.forward counts the
                   tokens, torchtitan's optimizer hook updates the bias) and everything outside the MoE blocks.
A block that has something the layer does not support is left as it was, and the report says which and why
(SwapReport.refused; a warning each unless warn=False).

Numerics: the layer computes in bf16 with fp32 accumulation like torchtitan's grouped GEMMs; parameters in fp32 are
cast to bf16 for each forward (as GroupedExperts does). The combine differs: torchtitan rounds each route's
weighted output to the activation dtype and adds the shared expert's output in it; ours sums routes and the fused
shared expert in fp32 in a fixed order and rounds once. So the bits differ, within bf16 rounding, and ours are
deterministic.

Workspaces: one per layer shape (and device and EP group), shared by the blocks of that shape; one forward
context per block. A workspace takes calls of up to its num_tokens tokens per rank: max_tokens (the largest
local_batch * seq_len of a call), or else the first forward's count. They are made at swap time for a model on a
CUDA device (or meta) when max_tokens is given, else by prepare_moe_experts(model, max_tokens) or at the first
forward, which must then run eagerly (not under torch.compile or CUDA-graph capture).

Expert parallelism (EP > 1): the EP group is `group=`, or the process group of the EP mesh torchtitan's
parallelize wired into the block's token dispatcher (so swap after parallelize). Each rank then holds E / EP
experts (torchtitan's Shard(0) over the "ep" mesh axis: rank r holds experts r*E/EP .. (r+1)*E/EP - 1, our layout),
DTensor parameters and inputs are used through their local tensors, and the default Config has load_factor = EP
(the worst case, which never overflows). This path is written but has not run on more than one GPU yet.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import warnings
from typing import Dict, List, Optional

import torch

from .. import arguments
from ..config import Config, Weights
from ..layer import Workspace, check_group, get_workspace, layer_forward

TESTED_VERSIONS = ("0.3.0",)
INSTALL_HINT = "pip install torchtitan==0.3.0"


def _titan():
    """torchtitan's MoE module and FeedForward class (ImportError saying what to install when it is missing)."""
    try:
        from torchtitan.models.common import moe as titan_moe
        from torchtitan.models.common.feed_forward import FeedForward
    except ImportError as e:
        raise ImportError(f"mok.integrations.torchtitan needs torchtitan (tested with "
                          f"{', '.join(TESTED_VERSIONS)}: {INSTALL_HINT}); importing it failed: {e}") from e
    return titan_moe, FeedForward


def patch_torch_for_torchtitan() -> bool:
    """Lets torchtitan 0.3.0's model code run on a torch older than the one it was written for (torch 2.11 on the
    GPU machine; torch 2.15 needs nothing). Call it before importing torchtitan's model packages. Two gaps:
    - torchtitan.models.deepseek_v3, qwen3, kimi_k2_7 and gpt_oss import torch.distributed.fsdp.DataParallelMeshDims,
      used only by torchtitan's FSDP parallelization: a placeholder class is added, so that the model packages import
      and their models build and train without FSDP (FSDP through torchtitan's parallelize needs a newer torch; the
      placeholder raises if it is ever made).
    - torchtitan's FlexAttention masks call create_block_mask(..., separate_full_blocks=...), an argument newer
      torches have: its True (the default there) is what older torches always do, so a wrapper accepts True and
      drops it, and raises for False (torchtitan's batch-invariant mode), which an older torch cannot do.
    Returns whether it changed anything."""
    import torch.distributed.fsdp as fsdp
    import torch.nn.attention.flex_attention as flex
    changed = False
    if not hasattr(fsdp, "DataParallelMeshDims"):

        class DataParallelMeshDims:  # noqa: D401  (a placeholder: only its name is imported)
            """Placeholder added by mok.integrations.torchtitan.patch_torch_for_torchtitan (this torch has none)."""

            def __init__(self, *args, **kwargs):
                raise RuntimeError("torch.distributed.fsdp.DataParallelMeshDims is a placeholder on this torch "
                                   f"({torch.__version__}): torchtitan's FSDP parallelization needs a newer torch")

        fsdp.DataParallelMeshDims = DataParallelMeshDims
        changed = True
    original = flex.create_block_mask
    if "separate_full_blocks" not in inspect.signature(original).parameters:

        @functools.wraps(original)
        def create_block_mask(*args, separate_full_blocks: bool = True, **kwargs):
            if not separate_full_blocks:
                raise NotImplementedError(f"create_block_mask(separate_full_blocks=False) needs a newer torch than "
                                          f"{torch.__version__} (mok.integrations.torchtitan.patch_torch_for_torchtitan)")
            return original(*args, **kwargs)

        flex.create_block_mask = create_block_mask
        changed = True
    return changed


# ---------------------------------------------------------------------------------------------------------------
# DTensors (torchtitan's parallelized parameters and activations): the layer works on the local tensors.


def _dtensor_type():
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch without torch.distributed: there are no DTensors
        return None
    return DTensor


_DTENSOR = _dtensor_type()


def _is_dtensor(t) -> bool:
    return _DTENSOR is not None and isinstance(t, _DTENSOR)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if _is_dtensor(t) else t


def _tensor_parallel_dims(t: torch.Tensor) -> List[int]:
    """The tensor dims that t (a DTensor) shards over a mesh axis named "tp" (tensor parallelism); [] for a plain
    tensor. FSDP's shards ("fsdp", "efsdp", "dp_shard" axes) and EP's ("ep") are not counted: FSDP gathers them
    before the forward, and EP's Shard(0) is our layout."""
    if not _is_dtensor(t):
        return []
    names = t.device_mesh.mesh_dim_names or ()
    dims = []
    for axis, placement in enumerate(t.placements):
        if axis < len(names) and names[axis] == "tp" and placement.is_shard():
            dims.append(placement.dim)
    return dims


def _bf16(t: torch.Tensor) -> torch.Tensor:
    """t's local tensor as a contiguous bf16 tensor (a cast per call for fp32 parameters, as GroupedExperts does)."""
    t = _local(t)
    if t.dtype != torch.bfloat16:
        t = t.to(torch.bfloat16)
    return t.contiguous()


# ---------------------------------------------------------------------------------------------------------------
# Workspaces shared by the swapped blocks of one shape


class _WorkspacePool:
    """The workspaces of one swap_moe_experts call: one per (device, EP group, layer shape), made on demand."""

    def __init__(self, config: Optional[Config], max_tokens: Optional[int]):
        self.config = config
        self.max_tokens = max_tokens
        self.workspaces: Dict[tuple, Workspace] = {}

    def get(self, device: torch.device, group, ep_size: int, hidden: int, intermediate: int, num_experts: int,
            top_k: int, shared_expert: bool, num_tokens: int) -> Workspace:
        key = (str(device), id(group), hidden, intermediate, num_experts, top_k, shared_expert)
        ws = self.workspaces.get(key)
        if ws is not None and not ws.closed:
            if num_tokens > ws.shape.num_tokens:
                raise ValueError(f"num_tokens: {num_tokens} tokens in a call, more than the workspace of this layer "
                                 f"shape takes ({ws.shape.num_tokens}): pass max_tokens= (the largest local batch * "
                                 "sequence length) to swap_moe_experts or prepare_moe_experts")
            return ws
        tokens = max(num_tokens, self.max_tokens or 0)
        config = self.config if self.config is not None else Config(load_factor=float(ep_size))
        ws = get_workspace(config, group, tokens, hidden, intermediate, top_k, num_experts,
                           shared_expert=shared_expert, device=device)
        self.workspaces[key] = ws
        return ws

    def close(self) -> None:
        for ws in self.workspaces.values():
            ws.close()
        self.workspaces.clear()


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


# ---------------------------------------------------------------------------------------------------------------
# The modules that stand in for torchtitan's


class FusedSharedExpert(torch.nn.Module):
    """Stands in for a MoE block's shared FeedForward whose computation the block's MokRoutedExperts fuses into the
    layer: it holds the same w1 (gate), w2 (down) and w3 (up) Linear modules, so the parameters and their
    state-dict keys (shared_experts.w1.weight, ...) stay, and its forward returns None, which torchtitan's
    MoE.forward skips (the shared expert's output is in routed_experts' output)."""

    def __init__(self, original: torch.nn.Module):
        super().__init__()
        self.w1, self.w2, self.w3 = original.w1, original.w2, original.w3
        self.__dict__["original"] = original  # torchtitan's FeedForward (not a child: its parameters are ours)

    def forward(self, x: torch.Tensor) -> None:
        return None


class MokRoutedExperts(torch.nn.Module):
    """Stands in for a torchtitan MoE block's RoutedExperts (same call signature): the routed experts (and, with a
    FusedSharedExpert, the shared expert) through mok's layer, on torchtitan's GroupedExperts parameters
    (`inner_experts`, the same module: no copies, the same state-dict keys).

    forward(x_BLD, topk_scores_BLK, topk_expert_ids_BLK, num_local_tokens_per_expert_E) -> out_BLD, x's dtype:
    out[t] = shared(x[t]) (when fused) + sum_j scores[t, j] * expert_{ids[t, j]}(x[t]). The token counts are not
    needed (the layer's schedule counts the routes on the GPU)."""

    def __init__(self, original: torch.nn.Module, *, shared: Optional[FusedSharedExpert], num_experts: int,
                 top_k: int, group, ep_size: int, pool: _WorkspacePool):
        super().__init__()
        self.inner_experts = original.inner_experts
        self.token_dispatcher = original.token_dispatcher  # kept (not called), as torchtitan's code may look for it
        # Not children (their parameters are inner_experts' and the shared Linears' already): torchtitan's
        # RoutedExperts (restore_moe_experts puts it back), the fused shared expert, the workspace pool.
        self.__dict__["original"] = original
        self.__dict__["shared"] = shared
        self.__dict__["_pool"] = pool
        self.__dict__["group"] = group
        w1 = self.inner_experts.w1_EFD
        self.hidden, self.intermediate = int(w1.shape[2]), int(w1.shape[1])
        self.num_experts, self.top_k, self.ep_size = int(num_experts), int(top_k), int(ep_size)
        self._workspace: Optional[Workspace] = None
        self._context = None

    @property
    def workspace(self) -> Optional[Workspace]:
        return self._workspace

    def weights(self) -> Weights:
        """This rank's weights as the layer takes them: bf16 local tensors of torchtitan's parameters (views when
        they are bf16 already; a differentiable cast when they are fp32)."""
        inner = self.inner_experts
        shared = self.shared
        if shared is None:
            return Weights(_bf16(inner.w1_EFD), _bf16(inner.w3_EFD), _bf16(inner.w2_EDF))
        return Weights(_bf16(inner.w1_EFD), _bf16(inner.w3_EFD), _bf16(inner.w2_EDF), _bf16(shared.w1.weight),
                       _bf16(shared.w3.weight), _bf16(shared.w2.weight))

    def prepare(self, num_tokens: int) -> None:
        """Makes (or takes from the swap's pool) the workspace for calls of up to num_tokens tokens on the device of
        the parameters, and this block's forward context. Eager only (not under torch.compile or capture)."""
        arguments.check_int("num_tokens", num_tokens, "a positive int (tokens per forward call on this rank)",
                            lambda v: v > 0)
        device = _local(self.inner_experts.w1_EFD).device
        ws = self._pool.get(device, self.group, self.ep_size, self.hidden, self.intermediate, self.num_experts,
                            self.top_k, self.shared is not None, num_tokens)
        if ws is not self._workspace or self._context is None:
            self._workspace, self._context = ws, ws.make_context()

    def release(self) -> None:
        """Forgets the workspace and context (the pool closes the workspaces: close_moe_workspaces)."""
        self._workspace, self._context = None, None

    def forward(self, x_BLD: torch.Tensor, topk_scores_BLK: torch.Tensor, topk_expert_ids_BLK: torch.Tensor,
                num_local_tokens_per_expert_E: Optional[torch.Tensor] = None) -> torch.Tensor:
        del num_local_tokens_per_expert_E  # the layer's schedule counts the routes itself
        wrap = _is_dtensor(x_BLD)
        x = _local(x_BLD)
        tokens = x.reshape(-1, self.hidden).to(torch.bfloat16).contiguous()
        t = tokens.shape[0]
        topk_idx = _local(topk_expert_ids_BLK).reshape(t, self.top_k).contiguous()
        router_weights = _local(topk_scores_BLK).reshape(t, self.top_k).float().contiguous()
        ws = self._workspace
        if ws is None or self._context is None or ws.closed or ws.device != tokens.device:
            if torch.compiler.is_compiling() or _capturing():
                raise RuntimeError("mok: the workspace of a swapped torchtitan MoE block is made eagerly, not under "
                                   "torch.compile or CUDA-graph capture: pass max_tokens= to swap_moe_experts for a "
                                   "model on its GPU, or call prepare_moe_experts(model, max_tokens) first")
            if t == 0 and self._pool.max_tokens is None:
                raise ValueError("x_BLD: 0 tokens at this block's first forward, which makes the workspace for its "
                                 "token count: pass max_tokens= (the largest local batch * sequence length) to "
                                 "swap_moe_experts, or call prepare_moe_experts(model, max_tokens) first")
            self.prepare(max(t, 1))  # the pool makes it for max(t, max_tokens) tokens
        elif t > ws.shape.num_tokens:
            raise ValueError(f"x_BLD: {t} tokens, more than this block's workspace takes per call "
                             f"({ws.shape.num_tokens}): pass max_tokens= (the largest local batch * sequence length) "
                             "to swap_moe_experts or prepare_moe_experts")
        out = layer_forward(self._workspace, self._context, tokens, topk_idx, router_weights, self.weights(), None,
                            False)
        out = out.to(x.dtype).view(x.shape)
        if wrap:  # each rank's tokens get their whole output here: the input's placements are the output's
            out = _DTENSOR.from_local(out, x_BLD.device_mesh, x_BLD.placements, run_check=False)
        return out

    def extra_repr(self) -> str:
        return (f"hidden={self.hidden}, intermediate={self.intermediate}, num_experts={self.num_experts}, "
                f"top_k={self.top_k}, ep_size={self.ep_size}, shared_expert_fused={self.shared is not None}")


# ---------------------------------------------------------------------------------------------------------------
# The swap


@dataclasses.dataclass
class SwapReport:
    """What swap_moe_experts did, by module name (e.g. "layers.1.moe"):
    swapped       the MoE blocks whose routed experts run on mok;
    shared_fused  those of them whose shared expert runs inside the layer too;
    shared_kept   those of them whose shared expert stays torchtitan's module, and why;
    refused       the MoE blocks left as they were, and why."""

    swapped: List[str] = dataclasses.field(default_factory=list)
    shared_fused: List[str] = dataclasses.field(default_factory=list)
    shared_kept: Dict[str, str] = dataclasses.field(default_factory=dict)
    refused: Dict[str, str] = dataclasses.field(default_factory=dict)

    def __str__(self) -> str:
        lines = [f"mok: {len(self.swapped)} torchtitan MoE block(s) swapped, {len(self.shared_fused)} with the shared "
                 f"expert fused, {len(self.refused)} left as they were"]
        lines += [f"  {name}: shared expert stays torchtitan's: {why}" for name, why in self.shared_kept.items()]
        lines += [f"  {name}: not swapped: {why}" for name, why in self.refused.items()]
        return "\n".join(lines)


@dataclasses.dataclass
class _Plan:
    num_experts: int
    top_k: int
    group: object
    ep_size: int
    fuse_shared: bool
    shared_note: Optional[str]


def _shape(t) -> tuple:
    return tuple(int(s) for s in t.shape)  # a DTensor's global shape


def _plan(moe, titan_moe, feed_forward, fuse_shared: bool, group):
    """A _Plan for one MoE block, or a str saying why it is left as it was."""
    if type(moe).forward is not titan_moe.MoE.forward:
        return (f"{type(moe).__qualname__} overrides torchtitan's MoE.forward (a model-specific MoE block): only "
                "MoE.forward's contract (router, then routed_experts(x, scores, ids, counts), then shared_experts(x)) "
                "is known")
    routed = moe.routed_experts
    if type(routed) is not titan_moe.RoutedExperts:
        return f"routed_experts is {type(routed).__qualname__}, not torchtitan's RoutedExperts"
    inner = routed.inner_experts
    if type(inner) is not titan_moe.GroupedExperts:
        return (f"routed_experts.inner_experts is {type(inner).__qualname__}, not torchtitan's GroupedExperts (plain "
                "SwiGLU without biases): mok computes silu(x W1^T) * (x W3^T) W2^T only (gpt-oss's experts have "
                "biases and a clamped SwiGLU with alpha 1.702 and +1 on the linear half)")
    if "_grouped_mm" in vars(inner):
        return ("GroupedExperts._grouped_mm is replaced on this module (a low-precision converter, e.g. MXFP8): mok "
                "runs BF16 only")
    router = moe.router
    if not isinstance(router, titan_moe.TokenChoiceTopKRouter):
        return (f"router is {type(router).__qualname__}: only token-choice top-k routing (TokenChoiceTopKRouter: "
                "[tokens, top_k] expert ids and scores) is known to fit the layer")
    num_experts, top_k = int(router.num_experts), int(router.top_k)
    w1, w2, w3 = inner.w1_EFD, inner.w2_EDF, inner.w3_EFD
    if w1.dim() != 3:
        return f"w1_EFD has shape {list(w1.shape)}, expected [E, F, D]"
    _, width, dim = _shape(w1)
    if _shape(w3)[1:] != (width, dim) or _shape(w2)[1:] != (dim, width):
        return (f"expert weights w1_EFD {list(w1.shape)}, w3_EFD {list(w3.shape)}, w2_EDF {list(w2.shape)} do not "
                "form [E, F, D], [E, F, D], [E, D, F]")
    for name, w in (("w1_EFD", w1), ("w2_EDF", w2), ("w3_EFD", w3)):
        if w.dtype not in (torch.bfloat16, torch.float32):
            return f"{name} is {w.dtype}: mok computes in bf16 from bf16 or fp32 parameters"
        tp = _tensor_parallel_dims(w)
        if tp:
            return (f"{name} is sharded along dim(s) {tp} over the tensor-parallel mesh axis (experts split by TP): "
                    "mok needs whole experts on a rank")
    if dim % 64 or width % 64:
        return f"model dim D = {dim} and expert width F = {width}: mok needs multiples of 64"
    if top_k > num_experts:
        return f"top_k = {top_k} > {num_experts} experts"

    ep_mesh = getattr(routed.token_dispatcher, "ep_mesh", None)
    ep_group = group
    if ep_mesh is not None and ep_mesh.size() > 1:
        if group is None:
            ep_group = ep_mesh.get_group()
        elif torch.distributed.get_world_size(group) != ep_mesh.size():
            return (f"group= has {torch.distributed.get_world_size(group)} processes, torchtitan's EP mesh of this "
                    f"block {ep_mesh.size()}")
    ep_size = 1 if ep_group is None else torch.distributed.get_world_size(ep_group)
    if num_experts % ep_size:
        return f"{num_experts} experts do not split over EP = {ep_size} ranks"
    experts_here = _shape(w1)[0]
    expected = num_experts if _is_dtensor(w1) else num_experts // ep_size
    if experts_here != expected:
        what = "experts in all (a DTensor's global shape)" if expected == num_experts else "local experts"
        return (f"w1_EFD holds {experts_here} experts, expected {expected} {what} for {num_experts} experts at EP = "
                f"{ep_size}")

    shared, note = moe.shared_experts, None
    if shared is None:
        pass
    elif not fuse_shared:
        note = "fuse_shared_expert=False"
    elif type(shared) is not feed_forward:
        note = (f"it is a {type(shared).__qualname__}, not a plain SwiGLU FeedForward (Qwen3.5's shared expert has a "
                "per-token sigmoid gate)")
    elif any(getattr(shared, n).bias is not None for n in ("w1", "w2", "w3")):
        note = "its Linear layers have biases"
    elif (_shape(shared.w1.weight), _shape(shared.w3.weight), _shape(shared.w2.weight)) != \
            ((width, dim), (width, dim), (dim, width)):
        note = (f"its width {_shape(shared.w1.weight)[0]} is not the routed experts' width F = {width} (the layer's "
                "shared expert has the routed width; e.g. DeepSeek-V3 with num_shared_experts = 2 has 2F)")
    elif any(_tensor_parallel_dims(getattr(shared, n).weight) for n in ("w1", "w2", "w3")):
        note = "it is sharded over the tensor-parallel mesh axis"
    elif any(getattr(shared, n).weight.dtype not in (torch.bfloat16, torch.float32) for n in ("w1", "w2", "w3")):
        note = f"its weights are {shared.w1.weight.dtype}, not bf16 or fp32"
    return _Plan(num_experts, top_k, ep_group, ep_size, shared is not None and note is None, note)


def _device_of(module: MokRoutedExperts) -> torch.device:
    return _local(module.inner_experts.w1_EFD).device


def swap_moe_experts(model: torch.nn.Module, *, max_tokens: Optional[int] = None, config: Optional[Config] = None,
                     group=None, fuse_shared_expert: bool = True, warn: bool = True) -> SwapReport:
    """Replaces the expert computation of every torchtitan MoE block of `model` that the layer supports (module
    docstring) and returns a SwapReport. The parameters, buffers and state-dict keys do not change; a swapped
    model loads torchtitan checkpoints and its checkpoints load into an unswapped model.

    max_tokens: the most tokens (local batch * sequence length) a forward call passes on this rank; with it the
      workspaces are made now for a model on a CUDA device (or meta), else at prepare_moe_experts or the first
      forward. config: the mok.Config of the workspaces (default Config(load_factor = the EP size)). group: the EP
      process group (None: the EP mesh torchtitan wired into the blocks' token dispatchers, else EP = 1).
    fuse_shared_expert: False keeps every shared expert torchtitan's. warn: a warning per refused block.
    Call it after torchtitan's parallelize (EP and FSDP; torch.compile's tracing happens at the first forward, so a
    model compiled block by block may be swapped before its first forward) and after the model is on its device
    (a model swapped on meta can be moved with to_empty and initialized with init_states afterwards; the
    workspaces then come with prepare_moe_experts). Already swapped blocks are counted as swapped and kept."""
    titan_moe, feed_forward = _titan()
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module (a torchtitan model), got {arguments.describe(model)}")
    if max_tokens is not None:
        arguments.check_int("max_tokens", max_tokens, "a positive int (tokens per forward call on this rank)",
                            lambda v: v > 0)
    arguments.check_type("config", config, Config, "a mok.Config (None: the defaults)", allow_none=True)
    check_group(group)
    arguments.check_bool("fuse_shared_expert", fuse_shared_expert)
    arguments.check_bool("warn", warn)
    report = SwapReport()
    pool = _WorkspacePool(config, max_tokens)
    for name, module in list(model.named_modules()):
        if not isinstance(module, titan_moe.MoE):
            continue
        name = name or "(the model)"
        if isinstance(module.routed_experts, MokRoutedExperts):
            report.swapped.append(name)
            if module.routed_experts.shared is not None:
                report.shared_fused.append(name)
            continue
        plan = _plan(module, titan_moe, feed_forward, fuse_shared_expert, group)
        if isinstance(plan, str):
            report.refused[name] = plan
            if warn:
                warnings.warn(f"mok: torchtitan MoE block {name} left as it was: {plan}", stacklevel=2)
            continue
        shared = None
        if plan.fuse_shared:
            shared = FusedSharedExpert(module.shared_experts)
            module.shared_experts = shared
            report.shared_fused.append(name)
        elif plan.shared_note is not None:
            report.shared_kept[name] = plan.shared_note
        routed = MokRoutedExperts(module.routed_experts, shared=shared, num_experts=plan.num_experts,
                                  top_k=plan.top_k, group=plan.group, ep_size=plan.ep_size, pool=pool)
        module.routed_experts = routed
        report.swapped.append(name)
        if max_tokens is not None and _device_of(routed).type in ("cuda", "meta"):
            routed.prepare(max_tokens)
    if not report.swapped and not report.refused and warn:
        warnings.warn("mok: the model has no torchtitan MoE block (torchtitan.models.common.moe.MoE)", stacklevel=2)
    return report


def swapped_modules(model: torch.nn.Module) -> List[MokRoutedExperts]:
    """The model's MokRoutedExperts modules, in module order."""
    return [m for m in model.modules() if isinstance(m, MokRoutedExperts)]


def prepare_moe_experts(model: torch.nn.Module, max_tokens: int) -> None:
    """Makes the workspaces and contexts of the swapped blocks for calls of up to max_tokens tokens per rank on
    the device of their parameters (collective for EP > 1). Call it eagerly, before the first compiled or
    captured forward, when the swap could not (the model was on meta or the CPU, or max_tokens was not given)."""
    arguments.check_int("max_tokens", max_tokens, "a positive int (tokens per forward call on this rank)",
                        lambda v: v > 0)
    for module in swapped_modules(model):
        module.prepare(max_tokens)


def close_moe_workspaces(model: torch.nn.Module) -> None:
    """Frees the workspaces of the swapped blocks (collective for EP > 1: every rank calls it); a later forward
    makes new ones (eagerly)."""
    modules = swapped_modules(model)
    pools = {id(m._pool): m._pool for m in modules}
    for module in modules:
        module.release()
    for pool in pools.values():
        pool.close()


def restore_moe_experts(model: torch.nn.Module) -> List[str]:
    """Puts torchtitan's RoutedExperts and shared FeedForward modules back into every swapped block (the same
    parameter objects: nothing is copied). Does not close the workspaces (close_moe_workspaces first to free
    them). Returns the names of the blocks restored."""
    titan_moe, _ = _titan()
    restored = []
    for name, module in list(model.named_modules()):
        if isinstance(module, titan_moe.MoE) and isinstance(module.routed_experts, MokRoutedExperts):
            module.routed_experts = module.routed_experts.original
            if isinstance(module.shared_experts, FusedSharedExpert):
                module.shared_experts = module.shared_experts.original
            restored.append(name or "(the model)")
    return restored
