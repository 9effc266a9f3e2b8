"""The plain data of the Python API: options (Config), the layer's shape, one rank's weights (or their gradients),
a status report.

Defaults are those of the C++ API (include/mok/moe.h, include/mok/routing.h); the C++ side validates every
value again and is authoritative (std::invalid_argument -> ValueError naming the field). Config's and LayerShape's
fields are the rows of the C++ option table (src/host/option_table.h), by which the extension takes them
(get_workspace passes them by name); test_cpu.py checks names, defaults and kinds against mok._mok.option_table().
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch

from . import arguments
from .arguments import INT32_MAX, INT64_MAX

PATHS = {"fused": 0, "unfused": 1}
PRECISIONS = {"bf16": 0, "fp8": 1}
MAX_EP_SIZE = 72  # kMaxEpSize, include/mok/routing.h
MAX_FEATURES = 2**20  # MoeShape::kMaxFeatures: the most hidden and intermediate may be
MAX_ROWS = 2**30 - 1  # std::numeric_limits<int32_t>::max() / 2: routes and expert rows (int32 on the GPU)
CHUNK_ROUTES = 1024  # schedule::kChunkRoutes, src/device/schedule/placement.h
MAX_WAIT_TIMEOUT_S = 24 * 3600  # kMaxWaitTimeoutS, include/mok/routing.h: a day (integer nanoseconds on the GPU)


@dataclasses.dataclass(frozen=True)
class Config:
    """How the layer runs. None of the knobs changes a bit of the results (the tests compare bitwise).

    comm_ctas        fused path: CTAs that only copy rows (0: every CTA computes, idle warps copy)
    minibatch_rows   fused path: rows whose gate/up tiles are ordered before their down tiles (multiple of 128,
                     at most 2^30)
    macrobatch_rows  fused path: rows of the expert-side ring buffers, the rows the context keeps (multiple of
                     128; 0: the balanced share, num_tokens * top_k plus padding, within context_budget_bytes);
                     the backward recomputes the rows past it (the unfused path: 0 or at least the capacity)
    capacity_rows    expert-major rows a rank can hold (0: from load_factor; else a multiple of tile_m below
                     2^30); overrides load_factor
    load_factor      with capacity_rows 0, a rank holds load_factor * num_tokens * top_k expert rows (plus
                     padding): the balanced load with headroom for imbalance (>= 1; >= the EP size: the worst
                     case, which never overflows). A step that needs more reports a capacity overflow
                     (check_status says by how much; its outputs are unspecified)
    tile_m           each expert's rows are padded to a multiple of this (64 or 128)
    wait_timeout_s   spin-waits give up after this long (seconds, finite, in (0, 86400]) and report through the
                     status word
    path             "fused" (one persistent megakernel) or "unfused" (its stage-by-stage twin)
    backward         allocate the backward's buffers (False: an inference-only workspace; backward and
                     recompute_forward_context raise)
    keep_gate_up     the forward keeps each row's g and u (2 * intermediate bf16 per row) in the context, so the
                     backward skips their recompute (False: recomputed; same bits, less memory, slower); with
                     precision="fp8" and backward=True also the bf16 h (3 * intermediate bf16 per row beside the
                     quantized h)
    context_budget_bytes  fused path with macrobatch_rows 0: device bytes one layer's context may hold; the
                     ring is the largest multiple of 128 rows of the balanced share that fits, the backward
                     recomputes the rest (0: no budget)
    backward_megakernel  fused path: the backward as one persistent launch per rank (the same bits as the
                     default's stage kernels; off because it is slower on the H200 today: docs/perf_notes.md);
                     True needs path="fused" and backward=True
    gather_rows      unfused path: the routed gate/up GEMM reads this rank's token rows straight from x into its
                     shared memory, without the expert-major copy (skipped at ep_size 1 with backward=False; the
                     context keeps it otherwise), and the backward's down dgrad reads this rank's d_out rows the
                     same way. The same bits. True needs path="unfused"
    scatter_rows     the routed store GEMMs write each row straight to its token's row of the combine buffer,
                     without the expert-major output and the copy after it: the unfused forward's down GEMM and the
                     stage-kernel backward's gate/up dgrad (the fused forward and the backward megakernel do not
                     scatter yet). The same bits
    precision        "bf16", or "fp8" (DeepSeek-V3's e4m3 with block scales: mok.quantize_weights,
                     mok.forward_fp8 and mok.backward_fp8); "fp8" needs gather_rows and scatter_rows False
                     for now, and with backward=True an intermediate size that is a
                     multiple of 128 and a context that keeps every row (the unfused path, or context_budget_bytes
                     0, or macrobatch_rows at least the capacity: the FP8 backward reads g, u and h from it, or
                     recomputes them from its FP8 x rows)
    fp8_power_of_two_scales  precision="fp8": the activations' scales (x's and h's, per 1 x 128) rounded up to
                     powers of two (the weights' are chosen by mok.quantize_weights(power_of_two_scales=...));
                     True needs precision="fp8"
    bf16_weight_gradients  precision="fp8": the weight gradients' GEMMs in bf16 from bf16 rows; False, the
                     default: in FP8 too, DeepSeek-V3's recipe (dy, h, d(g|u) and x quantized per column per 128
                     rows of an expert; docs/perf_notes.md, round 40, has both ways' speed, error and loss).
                     precision="bf16": bf16 either way
    fp8_weight_gradient_columns  precision="fp8" with FP8 weight gradients: their activation factors (x of the
                     gate/up weight gradient, h of the down one) quantized per column per 128 rows of an expert, as
                     dy and d(g|u) are (DeepSeek-V3's recipe); False, the default: per 128 rows x 128 columns, so that
                     the GEMM promotes with one multiply-add a value (docs/perf_notes.md, round 47: both ways' speed,
                     error and loss); True needs precision="fp8" and bf16_weight_gradients=False
    setup_timeout_s  EP > 1: making the workspace (its NCCL communicator and first collectives) waits this long for
                     the other ranks (seconds, finite, in (0, 86400]; 600, torch.distributed's default), then raises
                     RuntimeError instead of waiting forever for a rank that never comes

    Every field is checked when a Config is made (TypeError for a value of the wrong type, bool included where
    an int is expected; ValueError for a wrong value), naming it: "Config.tile_m: expected 64 or 128, got 100".
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
    gather_rows: bool = False
    scatter_rows: bool = False
    precision: str = "bf16"
    fp8_power_of_two_scales: bool = False
    bf16_weight_gradients: bool = False
    fp8_weight_gradient_columns: bool = False
    setup_timeout_s: float = 600.0

    def __post_init__(self):
        # The C++ rules (detail::plan_workspace, src/host/moe_args.cpp; ScheduleOptions::validate,
        # src/host/routing.cpp), checked here so that a bad option fails in Python naming Config's field.
        def check_int(name, expected, ok, maximum=INT32_MAX):
            arguments.check_int(f"Config.{name}", getattr(self, name), expected, ok, maximum)

        check_int("comm_ctas", "a non-negative int", lambda v: v >= 0)
        check_int("minibatch_rows", "a positive multiple of 128 up to 2^30",
                  lambda v: v > 0 and v % 128 == 0 and v <= 2**30)
        check_int("macrobatch_rows", "0 (the balanced share) or a positive multiple of 128",
                  lambda v: v >= 0 and v % 128 == 0, INT64_MAX)
        check_int("tile_m", "64 or 128", lambda v: v in (64, 128))
        check_int("capacity_rows", f"0 (from load_factor) or a positive multiple of tile_m = {self.tile_m} below "
                  f"2^30 (int32 row indices)", lambda v: v >= 0 and v % self.tile_m == 0 and v < MAX_ROWS, INT64_MAX)
        check_int("context_budget_bytes", "a non-negative int", lambda v: v >= 0, INT64_MAX)
        arguments.check_number("Config.load_factor", self.load_factor,
                               "a number >= 1 (the EP size or more: the worst case)", lambda v: v >= 1)
        arguments.check_number("Config.wait_timeout_s", self.wait_timeout_s,
                               f"a finite number of seconds in (0, {MAX_WAIT_TIMEOUT_S}] (the spin-waits' timeout, "
                               "an integer count of nanoseconds on the GPU)",
                               lambda v: 0 < v <= MAX_WAIT_TIMEOUT_S)
        arguments.check_number("Config.setup_timeout_s", self.setup_timeout_s,
                               f"a finite number of seconds in (0, {MAX_WAIT_TIMEOUT_S}] (how long making the "
                               "workspace waits for the other ranks)", lambda v: 0 < v <= MAX_WAIT_TIMEOUT_S)
        if not isinstance(self.path, str):
            raise TypeError(f"Config.path: expected one of {sorted(PATHS)}, got {arguments.describe(self.path)}")
        if self.path not in PATHS:
            raise ValueError(f"Config.path: expected one of {sorted(PATHS)}, got {self.path!r}")
        for name in ("backward", "keep_gate_up", "backward_megakernel", "gather_rows", "scatter_rows",
                     "fp8_power_of_two_scales", "bf16_weight_gradients", "fp8_weight_gradient_columns"):
            arguments.check_bool(f"Config.{name}", getattr(self, name))
        if self.backward_megakernel and (self.path != "fused" or not self.backward):
            raise ValueError("Config.backward_megakernel: expected False unless path='fused' and backward=True (the "
                             f"backward megakernel is the fused path's backward), got True with path={self.path!r}, "
                             f"backward={self.backward}")
        if not isinstance(self.precision, str):
            raise TypeError(f"Config.precision: expected one of {sorted(PRECISIONS)}, got "
                            f"{arguments.describe(self.precision)}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"Config.precision: expected one of {sorted(PRECISIONS)}, got {self.precision!r}")
        if self.precision == "fp8" and (self.gather_rows or self.scatter_rows):
            raise ValueError("Config.precision: 'fp8' runs with gather_rows=False and scatter_rows=False for now, got "
                             f"gather_rows={self.gather_rows}, scatter_rows={self.scatter_rows}")
        if self.fp8_power_of_two_scales and self.precision != "fp8":
            raise ValueError("Config.fp8_power_of_two_scales: expected False unless precision='fp8' (it rounds the FP8 "
                             f"activations' scales), got True with precision={self.precision!r}")
        if self.fp8_weight_gradient_columns and (self.precision != "fp8" or self.bf16_weight_gradients):
            raise ValueError("Config.fp8_weight_gradient_columns: expected False unless precision='fp8' and "
                             "bf16_weight_gradients=False (it scales the FP8 weight gradients' x and h per column), got "
                             f"True with precision={self.precision!r}, bf16_weight_gradients="
                             f"{self.bf16_weight_gradients}")
        if self.gather_rows and self.path != "unfused":
            raise ValueError("Config.gather_rows: expected False unless path='unfused' (the fused path does not gather "
                             f"rows yet), got True with path={self.path!r}")


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
        # The C++ rules (RoutingShape::validate, src/host/routing.cpp; MoeShape::validate, src/host/moe_args.cpp).
        check_int = arguments.check_int
        ep_size = check_int("ep_size", self.ep_size, f"the EP group's size, an int in [1, {MAX_EP_SIZE}]",
                            lambda v: 1 <= v <= MAX_EP_SIZE)
        check_int("num_tokens", self.num_tokens, "a positive int (tokens per rank)", lambda v: v > 0)
        num_experts = check_int("num_experts", self.num_experts, f"a positive multiple of the EP size {ep_size}",
                                lambda v: v > 0 and v % ep_size == 0)
        check_int("top_k", self.top_k, f"a positive int <= num_experts = {num_experts}",
                  lambda v: 0 < v <= num_experts)
        for name in ("hidden", "intermediate"):  # the GEMMs' K step and output store box
            check_int(name, getattr(self, name), "a positive multiple of 64", lambda v: v > 0 and v % 64 == 0,
                      MAX_FEATURES)
        arguments.check_bool("shared_expert", self.shared_expert)
        arguments.check_number("swiglu_limit", self.swiglu_limit, "a finite number >= 0 (0: plain SwiGLU; a float32)",
                               lambda v: 0 <= v <= arguments.FLOAT32_MAX)
        routes = ep_size * self.num_tokens * self.top_k
        if routes >= MAX_ROWS:  # route ids and row indices are int32 on the GPU
            raise ValueError(f"num_tokens: expected ep_size * num_tokens * top_k below 2^30 (int32 route ids), got "
                             f"{ep_size} * {self.num_tokens} * {self.top_k} = {routes}")
        if (num_experts // ep_size) * CHUNK_ROUTES > INT32_MAX:
            raise ValueError(f"num_experts: expected at most {INT32_MAX // CHUNK_ROUTES} experts per rank (int32 "
                             f"schedule offsets), got {num_experts // ep_size}")
        for name in ("ep_size", "num_tokens", "top_k", "num_experts", "hidden", "intermediate"):
            object.__setattr__(self, name, int(getattr(self, name)))  # numpy ints as ints
        object.__setattr__(self, "swiglu_limit", float(self.swiglu_limit))

    @property
    def local_experts(self) -> int:
        return self.num_experts // self.ep_size


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def capacity_rows(shape: LayerShape, config: Config) -> int:
    """The expert rows a rank holds: Config.capacity_rows, or from load_factor (resolved_capacity_rows,
    src/host/routing.cpp): the worst case (every route to one rank, each local expert's rows padded to tile_m)
    when load_factor >= the EP size, else load_factor * num_tokens * top_k plus padding, at most the worst case."""
    if config.capacity_rows > 0:
        return config.capacity_rows
    tile_m, local = config.tile_m, shape.local_experts
    routes = shape.ep_size * shape.num_tokens * shape.top_k
    # Padding: at most one tile's worth for each local expert that has a route, min(local, routes) of them.
    worst = _round_up(routes + min(local, routes) * (tile_m - 1), tile_m)
    if config.load_factor >= shape.ep_size:
        return worst
    balanced = math.ceil(shape.num_tokens * shape.top_k * config.load_factor)
    return min(_round_up(balanced + min(local, balanced) * (tile_m - 1), tile_m), worst)


def check_config_for_shape(config: Config, shape: LayerShape) -> None:
    """The rules that tie the options to the shape (MoeWorkspace's constructor, ScheduleOptions::validate): the
    capacity fits int32 row indices; the unfused path keeps every row (macrobatch_rows 0 or >= the capacity).
    Skipped for a load_factor below 1 (a Config past its own check: the C++ API refuses it, naming it)."""
    if not config.load_factor >= 1:
        return
    rows = capacity_rows(shape, config)
    if rows >= MAX_ROWS:
        raise ValueError(f"Config.capacity_rows: the capacity for this shape is {rows} rows, expected below 2^30 "
                         "(int32 row indices): lower load_factor or set capacity_rows")
    if config.precision == "fp8" and config.backward and shape.intermediate % 128 != 0:
        raise ValueError(f"intermediate: Config(precision='fp8', backward=True) needs a multiple of 128 (the FP8 "
                         f"backward's 1 x 128 blocks of d(g|u) are each half's own), got {shape.intermediate} (or "
                         "backward=False: the FP8 forward takes any multiple of 64)")
    if config.path != "fused" and 0 < config.macrobatch_rows < rows:
        raise ValueError(f"Config.macrobatch_rows: expected 0 or at least the capacity ({rows} rows for this shape) "
                         f"with path={config.path!r} (only the fused path keeps fewer rows), got "
                         f"{config.macrobatch_rows}")


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
        if isinstance(weights, dict):
            names = {f.name for f in dataclasses.fields(Weights)}
            unknown = sorted(set(weights) - names, key=str)
            if unknown:
                raise TypeError(f"weights: unknown keys {unknown}; expected some of {sorted(names)}")
            if "expert_gate" not in weights or "expert_down" not in weights:
                raise TypeError("weights: expert_gate and expert_down are required")
            weights = Weights(**{"expert_up": None, **weights})
        if not isinstance(weights, Weights):
            raise TypeError(f"weights: expected a mok.Weights or a dict, got {type(weights).__name__}")
        for name, value in zip(_WEIGHT_FIELDS, weights.tensors()):
            required = name in ("expert_gate", "expert_down")
            if not isinstance(value, torch.Tensor) and (required or value is not None):
                raise TypeError(f"weights.{name}: expected a torch.Tensor{'' if required else ' or None'}, got "
                                f"{type(value).__name__}")
        return weights

    @staticmethod
    def of_grads(grads, name: str) -> "Weights":
        """Gradient tensors (mok.backward's grads or main_grads) from a Weights or a dict with some of its keys;
        a missing key or None: that gradient is not computed."""
        if isinstance(grads, dict):
            names = [f.name for f in dataclasses.fields(Weights)]
            unknown = sorted(set(grads) - set(names), key=str)
            if unknown:
                raise TypeError(f"{name}: unknown keys {unknown}; expected some of {sorted(names)}")
            grads = Weights(**{n: grads.get(n) for n in names})
        if not isinstance(grads, Weights):
            raise TypeError(f"{name}: expected a mok.Weights or a dict, got {type(grads).__name__}")
        for field, value in zip(_WEIGHT_FIELDS, grads.tensors()):
            if value is not None and not isinstance(value, torch.Tensor):
                raise TypeError(f"{name}.{field}: expected a torch.Tensor or None, got {type(value).__name__}")
        return grads

    def tensors(self) -> tuple:
        """The six tensors (None where absent) in field order, the C++ API's (MoeWeights). Spelled out rather
        than through dataclasses.fields, so torch.compile traces it as plain attribute reads."""
        return (self.expert_gate, self.expert_up, self.expert_down, self.shared_gate, self.shared_up,
                self.shared_down)


_WEIGHT_FIELDS = tuple(f.name for f in dataclasses.fields(Weights))


@dataclasses.dataclass(frozen=True)
class Status:
    """A rank's device-side status word since its last schedule: ok, the error bits (include/mok/status.h),
    one line per error."""

    ok: bool
    error_bits: int = 0
    message: str = ""
