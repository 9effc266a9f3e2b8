"""The plain data of the Python API: options (Config), the layer's shape, one rank's weights (or their gradients),
a status report.

Defaults are those of the C++ API (include/mok/moe.h, include/mok/routing.h); the C++ side validates every
value again and is authoritative (std::invalid_argument -> ValueError naming the field).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

PATHS = {"fused": 0, "unfused": 1}


@dataclasses.dataclass(frozen=True)
class Config:
    """How the layer runs. None of the knobs changes a bit of the results (the tests compare bitwise).

    comm_ctas        fused path: CTAs that only copy rows (0: every CTA computes, idle warps copy)
    minibatch_rows   fused path: rows whose gate/up tiles are ordered before their down tiles (multiple of 128)
    macrobatch_rows  fused path: rows of the expert-side ring buffers, the rows the context keeps (multiple of
                     128; 0: the balanced share, num_tokens * top_k plus padding, within context_budget_bytes);
                     the backward recomputes the rows past it
    capacity_rows    expert-major rows a rank can hold (0: from load_factor); overrides load_factor
    load_factor      with capacity_rows 0, a rank holds load_factor * num_tokens * top_k expert rows (plus
                     padding): the balanced load with headroom for imbalance (>= 1; >= the EP size: the worst
                     case, which never overflows). A step that needs more reports a capacity overflow
                     (check_status says by how much; its outputs are unspecified)
    tile_m           each expert's rows are padded to a multiple of this (64 or 128)
    wait_timeout_s   spin-waits give up after this long and report through the status word
    path             "fused" (one persistent megakernel) or "unfused" (its stage-by-stage twin)
    backward         allocate the backward's buffers (False: an inference-only workspace; backward and
                     recompute_forward_context raise)
    keep_gate_up     the forward keeps each row's g and u (2 * intermediate bf16 per row) in the context, so the
                     backward skips their recompute (False: recomputed; same bits, less memory, slower)
    context_budget_bytes  fused path with macrobatch_rows 0: device bytes one layer's context may hold; the
                     ring is the largest multiple of 128 rows of the balanced share that fits, the backward
                     recomputes the rest (0: no budget)
    backward_megakernel  fused path: the backward as one persistent launch per rank (the same bits as the
                     default's stage kernels; off because it is slower on the H200 today: docs/perf_notes.md)
    """

    comm_ctas: int = 0
    minibatch_rows: int = 4096
    macrobatch_rows: int = 0
    capacity_rows: int = 0
    load_factor: float = 2.0
    tile_m: int = 64
    wait_timeout_s: float = 10.0
    path: str = "fused"
    backward: bool = True
    keep_gate_up: bool = True
    context_budget_bytes: int = 4 << 30
    backward_megakernel: bool = False

    def __post_init__(self):
        for name in ("comm_ctas", "minibatch_rows", "macrobatch_rows", "capacity_rows", "tile_m", "context_budget_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"Config.{name}: expected a non-negative int, got {value!r}")
        if isinstance(self.load_factor, bool) or not isinstance(self.load_factor, (int, float)) \
                or not self.load_factor >= 1:
            raise ValueError(f"Config.load_factor: expected a number >= 1 (the EP size or more: the worst case), "
                             f"got {self.load_factor!r}")
        if not isinstance(self.wait_timeout_s, (int, float)) or not self.wait_timeout_s > 0:
            raise ValueError(f"Config.wait_timeout_s: expected a positive number of seconds, got {self.wait_timeout_s!r}")
        if self.path not in PATHS:
            raise ValueError(f"Config.path: expected one of {sorted(PATHS)}, got {self.path!r}")
        for name in ("backward", "keep_gate_up", "backward_megakernel"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"Config.{name}: expected a bool, got {getattr(self, name)!r}")


@dataclasses.dataclass(frozen=True)
class LayerShape:
    """The layer as one rank sees it: num_tokens tokens per rank (the same on every rank), num_experts
    global experts, num_experts / ep_size of them on each rank."""

    ep_size: int
    num_tokens: int
    top_k: int
    num_experts: int
    hidden: int
    intermediate: int
    shared_expert: bool = True
    swiglu_limit: float = 0.0

    def __post_init__(self):
        for name in ("ep_size", "num_tokens", "top_k", "num_experts", "hidden", "intermediate"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        if self.num_experts % self.ep_size != 0:
            raise ValueError(f"num_experts: {self.num_experts} is not a multiple of the EP size {self.ep_size}")
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k: {self.top_k} is more than num_experts = {self.num_experts}")

    @property
    def local_experts(self) -> int:
        return self.num_experts // self.ep_size


@dataclasses.dataclass
class Weights:
    """One rank's weights, bf16 CUDA tensors, contiguous. expert_gate is [E_local, I, H]; or gate and up fused,
    [E_local, 2I, H] (rows 0..I-1 gate, I..2I-1 up), with expert_up None. The shared tensors are None without a
    shared expert. mok.backward returns the weights' gradients in the same structure."""

    expert_gate: torch.Tensor
    expert_up: Optional[torch.Tensor]
    expert_down: torch.Tensor
    shared_gate: Optional[torch.Tensor] = None
    shared_up: Optional[torch.Tensor] = None
    shared_down: Optional[torch.Tensor] = None

    @staticmethod
    def of(weights) -> "Weights":
        """A Weights from a Weights or a dict with the same keys (expert_up and shared_* may be missing)."""
        if isinstance(weights, Weights):
            return weights
        if isinstance(weights, dict):
            names = {f.name for f in dataclasses.fields(Weights)}
            unknown = sorted(set(weights) - names)
            if unknown:
                raise TypeError(f"weights: unknown keys {unknown}; expected some of {sorted(names)}")
            if "expert_gate" not in weights or "expert_down" not in weights:
                raise TypeError("weights: expert_gate and expert_down are required")
            return Weights(**{"expert_up": None, **weights})
        raise TypeError(f"weights: expected a mok.Weights or a dict, got {type(weights).__name__}")

    @staticmethod
    def of_grads(grads, name: str) -> "Weights":
        """Gradient tensors (mok.backward's grads or main_grads) from a Weights or a dict with some of its keys;
        a missing key or None: that gradient is not computed."""
        if isinstance(grads, Weights):
            return grads
        if isinstance(grads, dict):
            names = [f.name for f in dataclasses.fields(Weights)]
            unknown = sorted(set(grads) - set(names))
            if unknown:
                raise TypeError(f"{name}: unknown keys {unknown}; expected some of {sorted(names)}")
            return Weights(**{n: grads.get(n) for n in names})
        raise TypeError(f"{name}: expected a mok.Weights or a dict, got {type(grads).__name__}")

    def tensors(self) -> tuple:
        """The six tensors (None where absent) in field order, the C++ API's (MoeWeights). Spelled out rather
        than through dataclasses.fields, so torch.compile traces it as plain attribute reads."""
        return (self.expert_gate, self.expert_up, self.expert_down, self.shared_gate, self.shared_up,
                self.shared_down)


@dataclasses.dataclass(frozen=True)
class Status:
    """A rank's device-side status word since its last schedule: ok, the error bits (include/mok/status.h),
    one line per error."""

    ok: bool
    error_bits: int = 0
    message: str = ""
