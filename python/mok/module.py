"""mok.MoE: the layer as a torch.nn.Module, router inside (or the caller's routing), trained through autograd.

    moe = mok.MoE(hidden=1024, intermediate=512, num_experts=64, top_k=4)   # EP = 1 on the current GPU
    y = moe(x)                       # x [..., H] bf16; the router picks topk_idx and router_weights
    y = moe(x, topk_idx, router_weights)                     # or the caller's routing
    y.float().square().mean().backward()                     # gradients of x, router and every weight

Parameters (bf16): router.weight [E, H] (with router=True), expert_gate [E_local, I, H] and expert_up
[E_local, I, H] (or expert_gate [E_local, 2I, H] with fused_gate_up=True: rows 0..I-1 gate, I..2I-1 up),
expert_down [E_local, H, I], and with a shared expert shared_gate [I, H], shared_up [I, H], shared_down [H, I].

Megatron's convention (main_grad=True): the backward adds the six expert and shared weights' gradients into
param.main_grad (fp32, made by Megatron's DDP or by allocate_main_grads()) inside the layer's kernels, the
way Megatron's gradient_accumulation_fusion does (megatron/core/tensor_parallel/layers.py,
LinearWithGradAccumulationAndAsyncCommunication.backward): a parameter that has the attribute
grad_added_to_main_grad (Megatron's DDP sets it to False before each step) gets it set to True and autograd
gets a dummy gradient of the parameter's shape (zeros if param.zero_out_wgrad, else uninitialized), which
Megatron's gradient hook does not add and replaces by param.grad = None; a parameter without the attribute gets
no gradient (param.grad stays None). The router's gradient goes through autograd as usual (param.grad).
"""
from __future__ import annotations

import copy
import math
import weakref
from typing import Optional

import torch

from . import arguments, ops
from .arguments import check_type
from .config import Config, LayerShape, Weights
from .device import check_layer_device, layer_device
from .fp8 import Fp8Weights, fp8_layer_forward, forward_fp8, quantize_weights
from .layer import ForwardContext, Workspace, check_group, get_workspace, layer_forward


def _same_device(given: torch.device, actual: torch.device) -> bool:
    """given (as passed: "cuda" without an index means the current device) names the device `actual`."""
    return given.type == actual.type and given.index in (None, actual.index)


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class MoE(torch.nn.Module):
    """A mixture-of-experts layer: out[t] = shared(x[t]) + sum_j rw[t, j] * expert_{idx[t, j]}(x[t]).

    hidden, intermediate, num_experts (global), top_k: the layer's shape (H and I multiples of 64).
    shared_expert: one shared expert of width `intermediate`. fused_gate_up: one [E_local, 2I, H] gate/up weight.
    router: True: a bias-free linear router inside, logits in fp32, router_weights = top-k of softmax(logits)
      (renormalized to sum 1 with normalize_router_weights); False: forward needs topk_idx and router_weights.
    swiglu_limit: > 0 clamps SwiGLU (gate <= L, -L <= up <= L).
    config: mok.Config of the workspace; group: a torch.distributed group for EP = its size (None: EP = 1);
      the module holds its rank's num_experts / EP experts, the router and shared expert whole (replicated).
    num_tokens: the most tokens a forward call passes on this rank (each call may pass any count up to it,
      0 included, and the ranks of a step different ones); the workspace is made at construction when given,
      else at the first forward, for that call's count (outside torch.compile / CUDA-graph capture). workspace: a mok.Workspace of this
      shape to share with other layers (then config, num_tokens and device come from it: leave them None or
      pass the workspace's; group must be the workspace's EP group, None for EP = 1).
    main_grad: Megatron's fused weight-gradient accumulation (module docstring). recompute: the backward
      rebuilds the forward context from the saved inputs first, so that one context can serve several layers
      or forwards in flight (context=): activation checkpointing of the expert-side activations.
    context: a mok.ForwardContext of the workspace to use (shared between layers with recompute=True).
    device: where the parameters live (None: the current CUDA device; an int, a str or a torch.device;
      "meta": shapes only, no GPU).

    Every argument is checked before anything else (TypeError / ValueError naming it; bools must be bools), then
    the CUDA device: RuntimeError "mok needs an NVIDIA Hopper GPU (sm_90); found ..." before any parameter is made.
    """

    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int, *, shared_expert: bool = True,
                 fused_gate_up: bool = False, router: bool = True, normalize_router_weights: bool = False,
                 swiglu_limit: float = 0.0, config: Optional[Config] = None, group=None,
                 num_tokens: Optional[int] = None, workspace: Optional[Workspace] = None, main_grad: bool = False,
                 recompute: bool = False, context=None, device=None):
        super().__init__()
        check_bool = arguments.check_bool
        for name, value in (("shared_expert", shared_expert), ("fused_gate_up", fused_gate_up), ("router", router),
                            ("normalize_router_weights", normalize_router_weights), ("main_grad", main_grad),
                            ("recompute", recompute)):
            check_bool(name, value)
        if normalize_router_weights and not router:
            raise ValueError("normalize_router_weights: expected False with router=False (the caller's "
                             "router_weights are used as given), got True")
        check_type("config", config, Config, "a mok.Config (None: the defaults)", allow_none=True)
        check_group(group)
        if num_tokens is not None:
            arguments.check_int("num_tokens", num_tokens, "a positive int (tokens per forward call on this rank)",
                                lambda v: v > 0)
        check_type("workspace", workspace, Workspace, "a mok.Workspace (mok.get_workspace)", allow_none=True)
        check_type("context", context, ForwardContext, "a mok.ForwardContext (workspace.make_context())",
                   allow_none=True)
        if context is not None and (workspace is None or context.workspace is not workspace):
            raise ValueError("context: must be made by the workspace passed as workspace= (ws.make_context())")
        device = check_layer_device(device)
        if workspace is not None:
            ep_size = workspace.shape.ep_size
            self._check_workspace(workspace, config, group, num_tokens, device)
        else:
            ep_size = 1 if group is None else torch.distributed.get_world_size(group)
        # The shape's rules (those of get_workspace: LayerShape's checks, named after this constructor's arguments).
        LayerShape(ep_size=ep_size, num_tokens=num_tokens or 1, top_k=top_k, num_experts=num_experts, hidden=hidden,
                   intermediate=intermediate, shared_expert=shared_expert, swiglu_limit=swiglu_limit)
        if workspace is not None:
            s = workspace.shape
            want = (hidden, intermediate, num_experts, top_k, shared_expert, float(swiglu_limit))
            got = (s.hidden, s.intermediate, s.num_experts, s.top_k, s.shared_expert, s.swiglu_limit)
            if want != got:
                raise ValueError("workspace: made for (hidden, intermediate, num_experts, top_k, shared_expert, "
                                 f"swiglu_limit) = {got}, this layer is {want}")
            device = workspace.device
        else:
            device = layer_device(device)  # a Hopper GPU (or meta): before the parameters are made
        self.hidden, self.intermediate = int(hidden), int(intermediate)
        self.num_experts, self.top_k = int(num_experts), int(top_k)
        self.local_experts = self.num_experts // ep_size
        self.shared_expert, self.fused_gate_up = shared_expert, fused_gate_up
        self.normalize_router_weights = normalize_router_weights
        self.swiglu_limit = float(swiglu_limit)
        self.config = workspace.config if workspace is not None else config if config is not None else Config()
        self.group = group
        self.main_grad, self.recompute = main_grad, recompute

        bf16 = dict(dtype=torch.bfloat16, device=device)
        e, h, i = self.local_experts, self.hidden, self.intermediate
        self.router = torch.nn.Linear(h, self.num_experts, bias=False, **bf16) if router else None
        param = torch.nn.Parameter
        self.expert_gate = param(torch.empty(e, 2 * i if fused_gate_up else i, h, **bf16))
        self.expert_up = None if fused_gate_up else param(torch.empty(e, i, h, **bf16))
        self.expert_down = param(torch.empty(e, h, i, **bf16))
        self.shared_gate = param(torch.empty(i, h, **bf16)) if shared_expert else None
        self.shared_up = param(torch.empty(i, h, **bf16)) if shared_expert else None
        self.shared_down = param(torch.empty(h, i, **bf16)) if shared_expert else None
        for p in (self.expert_gate, self.expert_up, self.expert_down):
            if p is not None:
                p.allreduce = ep_size == 1  # Megatron's marker: expert-parallel weights are not all-reduced over EP
        self.reset_parameters()
        if group is not None and device.type == "cuda":
            self._broadcast_replicated(group)

        self._workspace = workspace
        self._own_workspace = workspace is None  # made by prepare(): remade when the module moves to another device
        self._context = context
        self._fp8_cache = None  # Config(precision="fp8"): (parameter identities and versions, Fp8Weights)
        self._targets = None  # main_grad: the MainGradTargets of the current parameters (_main_grad_targets)
        if workspace is None and num_tokens is not None:
            self.prepare(num_tokens)

    @staticmethod
    def _check_workspace(workspace: Workspace, config, group, num_tokens, device) -> None:
        """workspace= with the arguments it decides: config, num_tokens and device None or the workspace's; group
        the one of its EP group (its size; None only for EP = 1)."""
        if config is not None and config != workspace.config:
            raise ValueError(f"config: expected None or the workspace's {workspace.config} (a layer runs with its "
                             f"workspace's options), got {config}")
        if num_tokens is not None and num_tokens != workspace.shape.num_tokens:
            raise ValueError(f"num_tokens: expected None or the workspace's {workspace.shape.num_tokens} tokens per "
                             f"call, got {num_tokens}")
        if device is not None and not _same_device(device, workspace.device):
            raise ValueError(f"device: expected None or the workspace's {workspace.device}, got {device}")
        ep_size = workspace.shape.ep_size
        group_size = 1 if group is None else torch.distributed.get_world_size(group)
        if group_size != ep_size:
            raise ValueError(f"group: expected the workspace's EP group, of {ep_size} processes (None only for "
                             f"EP = 1; it broadcasts the router and the shared expert), got "
                             f"{'None' if group is None else f'a group of {group_size}'}")

    def reset_parameters(self) -> None:
        """nn.Linear's initialization for each expert's projections: U(-1/sqrt(fan_in), 1/sqrt(fan_in))."""
        with torch.no_grad():
            for name in ("expert_gate", "expert_up", "expert_down", "shared_gate", "shared_up", "shared_down"):
                p = getattr(self, name)
                if p is not None:
                    bound = 1.0 / math.sqrt(p.shape[-1])
                    p.uniform_(-bound, bound)
            if self.router is not None:
                self.router.reset_parameters()

    def _broadcast_replicated(self, group) -> None:
        """EP > 1: the router and the shared expert are replicated, so every rank starts from the group's rank 0
        values (the routed experts differ by rank). Their gradients are the rank's tokens' only: all-reduce
        them over the group (data parallelism) before the optimizer step."""
        import torch.distributed as dist
        src = dist.get_global_rank(group, 0)
        with torch.no_grad():
            for p in (self.router.weight if self.router is not None else None, self.shared_gate, self.shared_up,
                      self.shared_down):
                if p is not None:
                    dist.broadcast(p, src=src, group=group)

    def replicated_parameters(self):
        """The parameters every rank of the EP group holds whole (router, shared expert): with EP > 1 their
        gradients need an all-reduce over the group; the routed experts' do not (each rank holds its own)."""
        return [p for p in (self.router.weight if self.router is not None else None, self.shared_gate,
                            self.shared_up, self.shared_down) if p is not None]

    def weights(self) -> Weights:
        """The parameters as the functional API's mok.Weights (views of the parameters, no copies)."""
        return Weights(self.expert_gate, self.expert_up, self.expert_down, self.shared_gate, self.shared_up,
                       self.shared_down)

    @property
    def workspace(self) -> Optional[Workspace]:
        return self._workspace

    def prepare(self, num_tokens: int) -> None:
        """Makes the workspace (collective with EP > 1) and the forward context for calls of at most num_tokens
        tokens, if not made yet. Call it before torch.compile or CUDA-graph capture when no forward ran eagerly
        yet, and when later calls may pass more tokens than the first."""
        arguments.check_int("num_tokens", num_tokens, "a positive int (tokens per forward call on this rank)",
                            lambda v: v > 0)
        if self._workspace is None:
            self._workspace = get_workspace(self.config, self.group, num_tokens, self.hidden, self.intermediate,
                                            self.top_k, self.num_experts, shared_expert=self.shared_expert,
                                            swiglu_limit=self.swiglu_limit, device=self.expert_gate.device)
        elif num_tokens > self._workspace.shape.num_tokens:
            raise ValueError(f"num_tokens: {num_tokens}, more than the layer's workspace takes per call "
                             f"({self._workspace.shape.num_tokens})")
        if self._context is None:
            self._context = self._workspace.make_context()

    def allocate_main_grads(self) -> None:
        """param.main_grad = fp32 zeros for the six expert and shared weights that have none (main_grad=True
        without Megatron's DDP, which makes them itself)."""
        for p in self.weights().tensors():
            if p is not None and getattr(p, "main_grad", None) is None:
                p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device=p.device)

    def route(self, x: torch.Tensor):
        """(topk_idx int64 [T, k], router_weights fp32 [T, k]) of the router for tokens x [T, H]: the top k of
        softmax(x W_router^T) computed in fp32, renormalized with normalize_router_weights."""
        if self.router is None:
            raise TypeError("mok.MoE(router=False): forward needs topk_idx and router_weights")
        # fp32 under autocast too (a bf16 autocast would round the logits and change which experts are chosen).
        with torch.autocast("cuda" if x.is_cuda else "cpu", enabled=False):
            logits = torch.nn.functional.linear(x.float(), self.router.weight.float())
            router_weights, topk_idx = torch.softmax(logits, dim=-1).topk(self.top_k, dim=-1)
            if self.normalize_router_weights:
                router_weights = router_weights / router_weights.sum(dim=-1, keepdim=True)
        return topk_idx, router_weights.contiguous()

    def forward(self, x: torch.Tensor, topk_idx: Optional[torch.Tensor] = None,
                router_weights: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x [..., H] bf16 (the tokens of this rank); topk_idx and router_weights [T, k] (T = x.numel() // H) or
        None for the router's. Returns out with x's shape."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x: expected a bf16 tensor [..., H] with H = {self.hidden}, got {type(x).__name__}")
        if x.dim() == 0 or x.shape[-1] != self.hidden:
            raise ValueError(f"x: expected [..., H] with H = {self.hidden}, got shape {list(x.shape)}")
        tokens = x.reshape(-1, self.hidden)
        if (topk_idx is None) != (router_weights is None):
            raise TypeError("topk_idx, router_weights: pass both (the caller's routing) or neither (the router's)")
        if topk_idx is None:
            topk_idx, router_weights = self.route(tokens)
        else:  # the caller's routing, [..., k] like x's [..., H]: as [T, k]
            topk_idx, router_weights = self._caller_routing(tokens.shape[0], topk_idx, router_weights)
        if self._workspace is not None and self._workspace.device != tokens.device:
            self._moved_to(tokens.device)
        if self._workspace is None or self._context is None:
            if torch.compiler.is_compiling() or _capturing():
                raise RuntimeError("mok.MoE: the workspace is made at the first forward, which cannot be under "
                                   "torch.compile or CUDA-graph capture: call module.prepare(num_tokens) (or run "
                                   "one forward) first")
            if self._workspace is None and tokens.shape[0] == 0:
                raise ValueError("x: 0 tokens at the layer's first forward, which makes the workspace for its token "
                                 "count: make the layer with num_tokens= (the most tokens of a call) or call "
                                 "prepare(num_tokens) first")
            self.prepare(max(tokens.shape[0], 1))  # with a workspace given, only the context is made
        elif tokens.shape[0] > self._workspace.shape.num_tokens:
            raise ValueError(f"x: {tokens.shape[0]} tokens, more than the layer's workspace takes per call "
                             f"({self._workspace.shape.num_tokens}): make the layer with num_tokens= the largest "
                             "token count of a call (or call prepare(num_tokens) before its first forward)")
        if self.config.precision == "fp8":
            return self._forward_fp8(tokens.contiguous(), topk_idx, router_weights).view(x.shape)
        out = layer_forward(self._workspace, self._context, tokens.contiguous(), topk_idx, router_weights,
                            self.weights(), self._main_grad_targets() if self.main_grad else None, self.recompute)
        return out.view(x.shape)

    def _forward_fp8(self, tokens, topk_idx, router_weights) -> torch.Tensor:
        """Config(precision="fp8"): the FP8 forward with the cached quantized weights; differentiable (the parameters'
        gradients straight through the quantization, into main_grad with main_grad=True) when grad is enabled and
        something requires it."""
        weights = self.weights()
        # Under torch.compile the graph quantizes the weights in every forward (mok::quantize_weights_fp8): the
        # version-counter cache of fp8_weights() is Python state that no graph can consult.
        quantized = (quantize_weights(weights, self.config.fp8_power_of_two_scales, transposed=self.config.backward)
                     if torch.compiler.is_compiling() else self.fp8_weights())
        if not (torch.is_grad_enabled() and (tokens.requires_grad or router_weights.requires_grad or any(
                p is not None and p.requires_grad for p in weights.tensors()))):
            return forward_fp8(self._workspace, tokens, topk_idx, router_weights, quantized, self._context)[0]
        if not self.config.backward:
            raise RuntimeError("mok.MoE with Config(precision='fp8', backward=False) is inference only: run it under "
                               "torch.no_grad() or torch.inference_mode() (or freeze its parameters), or make it "
                               "with backward=True")
        return fp8_layer_forward(self._workspace, self._context, tokens, topk_idx, router_weights, quantized, weights,
                                 self._main_grad_targets() if self.main_grad else None, self.recompute)

    def _caller_routing(self, tokens: int, topk_idx, router_weights):
        """The caller's topk_idx and router_weights as [T, k] (contiguous), T the tokens of x; a clear error when
        their sizes do not match x's. The dtypes and devices are checked by the layer."""
        k = self.top_k
        for name, t in (("topk_idx", topk_idx), ("router_weights", router_weights)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name}: expected a tensor [..., k] with k = {k}, got {arguments.describe(t)}")
            if t.dim() == 0 or t.shape[-1] != k or t.numel() != tokens * k:
                raise ValueError(f"{name}: expected [..., k] with k = {k} and x's {tokens} tokens ({tokens * k} "
                                 f"values), got shape {list(t.shape)}")
        return topk_idx.reshape(tokens, k).contiguous(), router_weights.reshape(tokens, k).contiguous()

    def _moved_to(self, device: torch.device) -> None:
        """The module's parameters moved (module.to(), .to_empty() from meta) after its workspace was made on another
        device: a workspace the module made is made again at this forward (closed first: every rank of the group
        moves its module alike); one passed as workspace= is the caller's, so that is an error."""
        if not self._own_workspace:
            raise ValueError(f"x: on {device}, but this layer's workspace (passed as workspace=, or shared with the "
                             f"layer it was deep-copied from) is on {self._workspace.device}: make the workspace on "
                             "the device the layer runs on")
        if torch.compiler.is_compiling() or _capturing():
            raise RuntimeError(f"mok.MoE: the layer moved to {device} after its workspace was made on "
                               f"{self._workspace.device}; it is made again at the next eager forward, not under "
                               "torch.compile or CUDA-graph capture: call module.prepare(num_tokens) first")
        num_tokens = self._workspace.shape.num_tokens
        self._workspace.close()
        self._workspace, self._context, self._fp8_cache = None, None, None
        self.prepare(num_tokens)

    def _main_grad_targets(self) -> "ops.MainGradTargets":
        """main_grad: the parameters whose .main_grad the backward adds into, as they are now (made again when one
        was replaced since the last forward: `module.expert_down = nn.Parameter(...)`, load_state_dict(...,
        assign=True), to_empty())."""
        params = self.weights().tensors()
        if self._targets is None or any(a is not b for a, b in zip(self._targets.params, params)):
            self._targets = ops.MainGradTargets(params)
        return self._targets

    def fp8_weights(self) -> Fp8Weights:
        """Config(precision="fp8"): the weights quantized (mok.quantize_weights), again whenever a parameter changed
        since the last quantization: its version counter moved (an optimizer step, an in-place write, a
        load_state_dict) or it is another tensor (a parameter replaced, even by one at a freed one's address);
        with power-of-two block scales when the config's fp8_power_of_two_scales is set. A write through
        `param.data` bypasses the version counter, so it is not seen: call refresh_fp8_weights() after one.
        With Config(backward=True) also the transposed copies the FP8 backward reads (twice the memory)."""
        params = self.weights().tensors()
        key = tuple(None if p is None else (p._version, p.data_ptr()) for p in params)
        cache = self._fp8_cache
        if cache is None or cache[1] != key or any((r is None) != (p is None) or (r is not None and r() is not p)
                                                   for r, p in zip(cache[0], params)):
            weights = Weights(*[None if p is None else p.detach() for p in params])
            refs = tuple(None if p is None else weakref.ref(p) for p in params)
            self._fp8_cache = (refs, key, quantize_weights(weights, self.config.fp8_power_of_two_scales,
                                                           transposed=self.config.backward))
        return self._fp8_cache[2]

    def refresh_fp8_weights(self) -> None:
        """Forget the quantized weights: the next forward quantizes the parameters again (needed only after a write
        that bypasses the version counter, through `param.data`)."""
        self._fp8_cache = None

    def __deepcopy__(self, memo):
        """copy.deepcopy: the parameters and buffers copied; the workspace shared (layers of one shape share one);
        a context, main_grad targets and FP8 cache of the copy's own (made at its first forward): the original's
        name the original's parameters and activations."""
        copied = self.__class__.__new__(self.__class__)
        memo[id(self)] = copied
        for name, value in self.__dict__.items():
            if name in ("_workspace", "group"):
                copied.__dict__[name] = value
            elif name in ("_context", "_targets", "_fp8_cache"):
                copied.__dict__[name] = None
            else:
                copied.__dict__[name] = copy.deepcopy(value, memo)
        copied._own_workspace = False  # shared with the original, which may still run on it
        return copied

    def __getstate__(self):
        """pickle (torch.save of the module): without the device state (workspace, context, main_grad targets, FP8
        cache), which a loaded module makes again at its first forward. The parameters are what a checkpoint
        holds; prefer state_dict()."""
        state = self.__dict__.copy()
        state.update(_workspace=None, _own_workspace=True, _context=None, _targets=None, _fp8_cache=None)
        return state

    def extra_repr(self) -> str:
        return (f"hidden={self.hidden}, intermediate={self.intermediate}, num_experts={self.num_experts}, "
                f"local_experts={self.local_experts}, top_k={self.top_k}, shared_expert={self.shared_expert}, "
                f"fused_gate_up={self.fused_gate_up}, router={self.router is not None}, "
                f"swiglu_limit={self.swiglu_limit}, main_grad={self.main_grad}, recompute={self.recompute}")
