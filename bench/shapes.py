"""The layer benchmarks' shapes (bench/layer_bench.py, bench/bits.py) and the FLOP counts their TFLOP/s use.

A shape: the named model shapes (gemm_bench.SHAPES, at --tokens tokens per rank) or a custom one given as
    name:T:H:I:E:k[:shared]
T tokens per rank, H hidden, I the routed experts' intermediate size, E experts, top-k; shared: the shared
expert's intermediate size, 0 or absent for none. The library's shared expert has the routed experts' width, so
shared is 0 or I. The numbers are checked by the library's own rules, mok.LayerShape (python/mok/config.py: H
and I positive multiples of 64, 0 < k <= E, E a multiple of the EP size, EP * T * k below 2^30), with its
message. A name: letters, digits and ._+- , at most 20 characters (the tables' shape column, one word).

FLOP counts (forward 6, backward 12, forward + backward 18 per routed row per H*I):
  ours    the shared expert counts as one more route: 6 * (T + T*k) * H * I for the forward (T*k without one)
  sonic   SonicMoE's convention: routed experts only, 6 * T*k * H * I for the forward, 12 * T*k * H * I for the
          backward, whatever the layer also computes (a shared expert's time is in the measured time)
Without a shared expert the two agree.
"""
import collections
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gemm_bench import SHAPES  # noqa: E402  (name, experts, hidden, intermediate, top_k, shared)

PYTHON_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python")
SPEC = "name:T:H:I:E:k[:shared]"
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,19}")
FIELDS = ("T", "H", "I", "E", "k", "shared")
PASS_FACTOR = {"fwd": 6, "bwd": 12, "f+b": 18}  # flops per route per H*I
CONVENTIONS = ("ours", "sonic")

# tokens: tokens per rank, None for the run's --tokens (the named shapes)
Shape = collections.namedtuple("Shape", "name tokens num_experts hidden inter top_k shared")


def named_shapes():
    """The named model shapes, tokens None."""
    return [Shape(name, None, experts, hidden, inter, top_k, bool(shared))
            for name, experts, hidden, inter, top_k, shared in SHAPES]


def parse_shape(text):
    """A custom shape from name:T:H:I:E:k[:shared] (ValueError naming the field otherwise). Only the format and
    the shared expert's width are checked here; check_shape applies the library's rules."""
    fields = text.split(":")
    if len(fields) not in (6, 7):
        raise ValueError(f"shape {text!r}: expected {SPEC} (6 or 7 fields separated by ':'), got {len(fields)} "
                         f"field{'s' * (len(fields) != 1)}")
    name, numbers = fields[0], fields[1:]
    if not NAME.fullmatch(name):
        raise ValueError(f"shape {text!r}: name {name!r}: expected 1 to 20 letters, digits or ._+- (starting with a "
                         "letter or digit)")
    values = []
    for field, value in zip(FIELDS, numbers):
        if not re.fullmatch(r"[0-9]+", value):
            raise ValueError(f"shape {text!r}: {field}: expected a non-negative decimal integer, got {value!r}")
        values.append(int(value))
    tokens, hidden, inter, experts, top_k = values[:5]
    shared = values[5] if len(values) == 6 else 0
    if shared not in (0, inter):
        raise ValueError(f"shape {text!r}: shared: expected 0 (no shared expert) or I = {inter} (the library's "
                         f"shared expert has the routed experts' intermediate size), got {shared}")
    return Shape(name, tokens, experts, hidden, inter, top_k, shared != 0)


def check_shape(shape, tokens, ep):
    """ValueError naming the shape and the field when the library refuses it at this EP size (mok.LayerShape's
    rules, the C++ API's; tokens: the shape's own, or the run's for a named shape)."""
    if PYTHON_DIR not in sys.path:
        sys.path.insert(0, PYTHON_DIR)
    from mok.config import LayerShape  # the package's source: plain Python, no extension needed
    try:
        LayerShape(ep_size=ep, num_tokens=tokens, top_k=shape.top_k, num_experts=shape.num_experts,
                   hidden=shape.hidden, intermediate=shape.inter, shared_expert=shape.shared)
    except (TypeError, ValueError) as e:
        raise ValueError(f"shape {shape.name} (T={tokens}, H={shape.hidden}, I={shape.inter}, E={shape.num_experts}, "
                         f"k={shape.top_k}, EP={ep}): {e}") from None


def select_shapes(names="", customs=()):
    """The shapes of a run, in order: names (--shapes: comma-separated names of named shapes or custom specs;
    empty: all named shapes unless customs are given), then customs (--shape, each a spec). ValueError for an
    unknown name, a bad spec or a name used twice."""
    named = {s.name: s for s in named_shapes()}
    entries = [e for e in names.split(",") if e] if names else []
    shapes = []
    for entry in entries:
        if ":" in entry:
            shapes.append(parse_shape(entry))
        elif entry in named:
            shapes.append(named[entry])
        else:
            raise ValueError(f"unknown shape {entry!r}; known: {', '.join(named)}; or a custom shape {SPEC}")
    shapes += [parse_shape(text) for text in customs]
    if not entries and not customs:
        shapes = list(named.values())
    seen = set()
    for shape in shapes:
        if shape.name in seen:
            raise ValueError(f"shape {shape.name}: named twice (each shape of a run needs its own name)")
        seen.add(shape.name)
    return shapes


def flops(kind, convention, tokens, top_k, hidden, inter, shared):
    """The FLOP count of one call: kind "fwd", "bwd" or "f+b"; convention "ours" (the shared expert counts as a
    route) or "sonic" (routed experts only, SonicMoE's)."""
    if kind not in PASS_FACTOR:
        raise ValueError(f"kind: expected one of {list(PASS_FACTOR)}, got {kind!r}")
    if convention not in CONVENTIONS:
        raise ValueError(f"convention: expected one of {CONVENTIONS}, got {convention!r}")
    routes = tokens * top_k + (tokens if shared and convention == "ours" else 0)
    return float(PASS_FACTOR[kind]) * routes * hidden * inter
