"""CPU toys of mok's custom ops: which design declares its writes (context, main_grad) and still passes the
training patterns under eager, aot_eager and inductor. Usage: python toy.py VARIANT [backend ...]

The toy layer: out = h * h with h = x @ w^T; forward writes h into the context's "device memory" (a buffer found
through the context's handle, as the real ops find the native context); backward reads h from the context (or
recomputes it: recompute=True), checks the generation, and writes dw (returned) or adds it into main_grad.

Variants (what the schemas declare, how autograd is wired):
  base      mutates_args=() everywhere, register_autograd, has_side_effect (today's mok)
  save      context and main_grad declared mutated, torch.autograd.Function, both saved (save_for_backward)
  attr      declared, autograd.Function, context and main_grad kept as ctx attributes (not saved tensors)
  preserve  declared, autograd.Function, saved, every op call under no_grad + _unsafe_preserve_version_counter
            of the mutated arguments (the mutation is hidden from autograd's version counter)
  fresh     declared, autograd.Function, saved; the forward mutates a fresh per-forward handle (handle.clone()),
            the backward mutates main_grad through a fresh alias (main_grad.view_as(main_grad))
  token     declared; the forward mutates the context's handle and returns a token [context id, generation] (a new
            tensor per forward); the backward mutates the token (not the handle) and main_grad; the token and
            main_grad are stashed on ctx (ctx.x = x: no version-counter check, eager and AOTAutograd alike)
  token_save  token, but main_grad saved with save_for_backward
Prints one line per criterion: PASS/FAIL and the first line of any error. Run with both torches (2.15, 2.11).
"""
import itertools
import sys
import traceback
from typing import List, Optional, Tuple

import torch
from torch import Tensor

VARIANT = sys.argv[1]
BACKENDS = sys.argv[2:] or ["aot_eager", "inductor"]
DECLARE = VARIANT != "base"
T, H, I = 8, 16, 12

# ------------------------------------------------------------------------------------------------ the "native" side
_ids = itertools.count(1)
_contexts = {}


class Context:
    def __init__(self):
        self.buf = torch.zeros(T, I)  # the native context's memory
        self.generation = 0
        self.handle = torch.tensor([next(_ids)], dtype=torch.int64)
        _contexts[int(self.handle[0])] = self


def _lookup(handle):
    return _contexts[int(handle[0])]


def _check_seen(c, seen, recompute):
    if not recompute and c.generation != int(seen[0]):
        raise RuntimeError("toy: context overwritten by a later forward")


# ------------------------------------------------------------------------------------------------ the ops
FWD_MUT = ("context",) if DECLARE else ()
BWD_MUT = ("context", "main_grad") if DECLARE else ()


TOKEN = VARIANT.startswith("token")


@torch.library.custom_op("toy::fwd", mutates_args=FWD_MUT)
def fwd(context: Tensor, x: Tensor, w: Tensor) -> Tuple[Tensor, Tensor]:
    c = _lookup(context)
    h = x @ w.t()
    c.buf.copy_(h)
    c.generation += 1
    if TOKEN:  # the token: [context id, generation after this forward], a new tensor per forward
        return h * h, torch.tensor([int(context[0]), c.generation], dtype=torch.int64)
    return h * h, torch.tensor([c.generation], dtype=torch.int64)


@fwd.register_fake
def _(context, x, w):
    return x.new_empty(x.shape[0], w.shape[0]), torch.empty(2 if TOKEN else 1, dtype=torch.int64)


@torch.library.custom_op("toy::bwd", mutates_args=BWD_MUT)
def bwd(context: Tensor, d_out: Tensor, x: Tensor, w: Tensor, main_grad: Optional[Tensor], recompute: bool,
        seen: Tensor) -> Tuple[Tensor, Tensor]:
    c = _lookup(context)
    if TOKEN:
        _check_seen(c, context[1:], recompute)
    else:
        _check_seen(c, seen, recompute)
    if recompute:
        c.buf.copy_(x @ w.t())
        c.generation += 1
        if TOKEN:
            context.data[1] = c.generation  # the token now names the recomputed state
    dh = d_out * 2 * c.buf
    dx, dw = dh @ w, dh.t() @ x
    if main_grad is not None:
        main_grad.data.add_(dw)  # a kernel writes through the pointer: no version-counter bump of its own
        return dx, x.new_empty(0)
    return dx, dw


@bwd.register_fake
def _(context, d_out, x, w, main_grad, recompute, seen):
    return torch.empty_like(x), x.new_empty(0) if main_grad is not None else torch.empty_like(w)


@torch.library.custom_op("toy::recompute", mutates_args=FWD_MUT)
def recompute_op(context: Tensor, x: Tensor, w: Tensor) -> None:
    c = _lookup(context)
    c.buf.copy_(x @ w.t())
    c.generation += 1


@recompute_op.register_fake
def _(context, x, w):
    return None


# ------------------------------------------------------------------------------------------------ autograd
if VARIANT == "base":
    torch.fx.node.has_side_effect(torch.ops.toy.recompute.default)
    torch.fx.node.has_side_effect(torch.ops.toy.bwd.default)

    def setup(ctx, inputs, output):
        context, x, w, main_grad, recompute = inputs
        ctx.save_for_backward(x, w, context, main_grad, output[1])
        ctx.recompute = recompute

    def backward(ctx, d_out, _):
        x, w, context, main_grad, seen = ctx.saved_tensors
        dx, dw = torch.ops.toy.bwd(context, d_out.contiguous(), x, w, main_grad, ctx.recompute, seen)
        return None, dx, (dw if main_grad is None else None), None, None

    # the layer op: forward plus the autograd formula (main_grad and recompute only tell the backward)
    @torch.library.custom_op("toy::layer", mutates_args=())
    def layer_op(context: Tensor, x: Tensor, w: Tensor, main_grad: Optional[Tensor], recompute: bool
                 ) -> Tuple[Tensor, Tensor]:
        return torch.ops.toy.fwd(context, x, w)

    @layer_op.register_fake
    def _(context, x, w, main_grad, recompute):
        return x.new_empty(x.shape[0], w.shape[0]), torch.empty(1, dtype=torch.int64)

    layer_op.register_autograd(backward, setup_context=setup)

    def apply(context, x, w, main_grad, recompute):
        return torch.ops.toy.layer(context, x, w, main_grad, recompute)[0]
else:
    class Fn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, context, x, w, main_grad, recompute):
            if VARIANT == "preserve":
                with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(context):
                    out, seen = torch.ops.toy.fwd(context, x, w)
            elif VARIANT == "fresh":
                out, seen = torch.ops.toy.fwd(context.clone(), x, w)
            elif TOKEN:
                out, seen = torch.ops.toy.fwd(context, x, w)
                ctx.save_for_backward(x, w, seen)  # seen is the token; the context's handle is not saved
                if VARIANT == "token_save":
                    ctx.save_for_backward(x, w, seen, main_grad)
                ctx.main_grad = main_grad
                ctx.recompute = recompute
                ctx.mark_non_differentiable(seen)
                return out, seen
            else:
                out, seen = torch.ops.toy.fwd(context, x, w)
            if VARIANT == "attr":
                ctx.save_for_backward(x, w, seen)
                ctx.context, ctx.main_grad = context, main_grad
            else:
                ctx.save_for_backward(x, w, seen, context, main_grad)
            ctx.recompute = recompute
            ctx.mark_non_differentiable(seen)
            return out, seen

        @staticmethod
        def backward(ctx, d_out, _):
            if TOKEN:
                x, w, token, *mg = ctx.saved_tensors
                main_grad = mg[0] if mg else ctx.main_grad
                dx, dw = torch.ops.toy.bwd(token, d_out.contiguous(), x, w, main_grad, ctx.recompute, token)
                return None, dx, (dw if main_grad is None else None), None, None
            if VARIANT == "attr":
                x, w, seen = ctx.saved_tensors
                context, main_grad = ctx.context, ctx.main_grad
            else:
                x, w, seen, context, main_grad = ctx.saved_tensors
            if VARIANT == "preserve":
                mutated = (context,) if main_grad is None else (context, main_grad)
                with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(mutated):
                    dx, dw = torch.ops.toy.bwd(context, d_out.contiguous(), x, w, main_grad, ctx.recompute, seen)
            elif VARIANT == "fresh":
                mg = None if main_grad is None else main_grad.view_as(main_grad)
                dx, dw = torch.ops.toy.bwd(context.clone(), d_out.contiguous(), x, w, mg, ctx.recompute, seen)
            else:
                dx, dw = torch.ops.toy.bwd(context, d_out.contiguous(), x, w, main_grad, ctx.recompute, seen)
            return None, dx, (dw if main_grad is None else None), None, None

    def apply(context, x, w, main_grad, recompute):
        return Fn.apply(context, x, w, main_grad, recompute)[0]


class Block(torch.nn.Module):
    def __init__(self, seed, context=None, recompute=False, main_grad=False, weight=None):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.w = weight if weight is not None else torch.nn.Parameter(torch.randn(I, H, generator=g) / 4)
        self.context = context if context is not None else Context()
        self.recompute, self.use_main_grad = recompute, main_grad
        if main_grad and getattr(self.w, "main_grad", None) is None:
            self.w.main_grad = torch.zeros(I, H)

    def forward(self, x):
        # a square (T, I) -> (T, H) to chain blocks: out @ P with a fixed projection (plain torch ops)
        y = apply(self.context.handle, x, self.w, self.w.main_grad if self.use_main_grad else None, self.recompute)
        return x + (y @ self.w) * 0.125  # (T, I) @ (I, H), residual: values stay O(1)


# ------------------------------------------------------------------------------------------------ checks
def data(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, H, generator=g), torch.randn(T, H, generator=g)


def ref_dw(w, x, d):
    """The op's dw for loss = sum((h * h) @ w * d): what main_grad gets."""
    w = w.detach()
    h = x @ w.t()
    return ((d * 0.125) @ w.t() * 2 * h).t() @ x


def grads_of(blocks, x):
    out = {"x": x.grad}
    for i, b in enumerate(blocks):
        out[f"w{i}"] = b.w.grad
        if getattr(b.w, "main_grad", None) is not None:
            out[f"mg{i}"] = b.w.main_grad.clone()
    return out


def reset(blocks):
    for b in blocks:
        b.w.grad = None
        if getattr(b.w, "main_grad", None) is not None:
            b.w.main_grad.zero_()


def short(e):
    """The first informative line of an exception's message (BackendCompilerFailed: the inner one)."""
    lines = [l.strip() for l in str(e).splitlines() if l.strip()]
    for l in lines:
        if "raised:" in l and l.endswith("raised:"):
            continue
        return l[:150]
    return ""


def same(a, b):
    if a.keys() != b.keys():
        return f"keys {sorted(a)} vs {sorted(b)}"
    for k in a:
        if (a[k] is None) != (b[k] is None) or (a[k] is not None and not torch.equal(a[k], b[k])):
            return f"{k} differs" + ("" if a[k] is None or b[k] is None else f" by {(a[k] - b[k]).abs().max().item():.2e}")
    return None


def wrap(blocks, backend):
    if backend is None:
        return blocks
    return [torch.compile(b, fullgraph=True, backend=backend) for b in blocks]


def crit_schema():
    fs = torch.ops.toy.fwd.default._schema
    bs = torch.ops.toy.bwd.default._schema
    w = lambda s, n: any(a.name == n and a.alias_info is not None and a.alias_info.is_write for a in s.arguments)
    return w(fs, "context") and w(bs, "main_grad") and w(bs, "context"), f"{fs} | {bs}"


def crit_blocks(backend, main_grad):
    """8 blocks compiled one by one (each its own context): frames, graph breaks, grads vs eager."""
    import torch._dynamo.testing
    from torch._dynamo.utils import counters
    blocks = [Block(10 + i, main_grad=main_grad) for i in range(8)]

    def run(layers):
        reset(blocks)
        x = data(1)[0].requires_grad_(True)
        h = x
        for l in layers:
            h = l(h)
        (h * data(1)[1]).sum().backward()
        return grads_of(blocks, x)

    eager = run(blocks)
    torch._dynamo.reset()
    counters.clear()
    cc = torch._dynamo.testing.CompileCounterWithBackend(backend)
    comp = run(wrap(blocks, cc))
    comp2 = run(wrap(blocks, cc))  # second step: no recompile
    breaks = sum(counters["graph_break"].values())
    diff = same(comp, eager) or same(comp2, eager)
    return (cc.frame_count == 1 and breaks == 0 and diff is None,
            f"frames={cc.frame_count} breaks={breaks} diff={diff}")


def crit_overwritten(backend):
    b = Block(3)
    layer = wrap([b], backend)[0]
    x1, d = data(2)
    x2, _ = data(3)
    y1, y2 = layer(x1), layer(x2)
    try:
        ((y1 + y2) * d).sum().backward()
    except RuntimeError as e:
        return "overwritten" in str(e) or "inplace" in str(e), f"raised: {str(e).splitlines()[0][:90]}"
    return False, "no error"


def crit_shared_recompute(backend):
    """(a) two layers, one context, recompute=True: grads equal two layers with a context each (eager)."""
    shared = Context()
    sharing = [Block(20 + i, context=shared, recompute=True) for i in range(2)]
    separate = [Block(20 + i) for i in range(2)]

    def run(layers, blocks):
        reset(blocks)
        x = data(4)[0].requires_grad_(True)
        (layers[1](layers[0](x)) * data(4)[1]).sum().backward()
        return grads_of(blocks, x)

    want = run(separate, separate)
    try:
        got = run(wrap(sharing, backend), sharing)
    except Exception as e:
        return False, f"raised: {type(e).__name__}: {short(e)}"
    d = same(got, want)
    return d is None, d or "ok"


def _main_grad_case(backend, order, recompute):
    """(b) micro-batches: forwards of both, then both backwards (order), each adding into one main_grad;
    recompute=True (one context) or recompute=False with two layer objects (a context each) sharing the weight."""
    w = torch.nn.Parameter(torch.randn(I, H, generator=torch.Generator().manual_seed(5)) / 4)
    w.main_grad = torch.zeros(I, H)
    if recompute:
        layers = [Block(0, recompute=True, main_grad=True, weight=w)] * 2
    else:
        layers = [Block(0, main_grad=True, weight=w) for _ in range(2)]
    ref = [ref_dw(w, *data(30 + mb)) for mb in range(2)]
    compiled = wrap(layers, backend) if not recompute else [wrap(layers[:1], backend)[0]] * 2
    try:
        ys = []
        for mb in range(2):
            x, d = data(30 + mb)
            ys.append((compiled[mb](x) * d).sum())
        if order == "together":
            (ys[0] + ys[1]).backward()
        else:
            for mb in order:
                ys[mb].backward()
    except Exception as e:
        return False, f"raised: {type(e).__name__}: {short(e)}"
    ok = torch.allclose(w.main_grad, ref[0] + ref[1], rtol=1e-5, atol=1e-5)
    return ok, "ok" if ok else "main_grad wrong"


def crit_accumulate(backend):
    """(c) gradient accumulation: (forward, backward) twice into one main_grad."""
    w = torch.nn.Parameter(torch.randn(I, H, generator=torch.Generator().manual_seed(6)) / 4)
    b = Block(0, main_grad=True, weight=w)
    layer = wrap([b], backend)[0]
    ref = ref_dw(w, *data(40)) + ref_dw(w, *data(41))
    try:
        for mb in range(2):
            x, d = data(40 + mb)
            (layer(x) * d).sum().backward()
    except Exception as e:
        return False, f"raised: {type(e).__name__}: {short(e)}"
    ok = torch.allclose(w.main_grad, ref, rtol=1e-5, atol=1e-5)
    return ok, "ok" if ok else "main_grad wrong"


def crit_frozen_input_main_grad(backend):
    """The backward adds into main_grad with none of its outputs used (x frozen, w's gradient in main_grad):
    kept in the compiled backward (no dead-code elimination)."""
    w = torch.nn.Parameter(torch.randn(I, H, generator=torch.Generator().manual_seed(7)) / 4)
    b = Block(0, main_grad=True, weight=w)

    class Only(torch.nn.Module):  # no w @ after: the op's dw is the only gradient
        def forward(self, x):
            return apply(b.context.handle, x, b.w, b.w.main_grad, False)

    layer = wrap([Only()], backend)[0]
    x, _ = data(50)
    d = torch.randn(T, I, generator=torch.Generator().manual_seed(51))
    try:
        y = layer(x)
        if not y.requires_grad:
            return False, "output does not require grad"
        (y * d).sum().backward()
    except Exception as e:
        return False, f"raised: {type(e).__name__}: {short(e)}"
    ok = bool(w.main_grad.abs().sum() > 0)
    return ok, "ok" if ok else "main_grad untouched (op dropped)"


def crit_recompute_kept(backend):
    c = Context()
    w = torch.randn(I, H)

    def fn(x):
        torch.ops.toy.recompute(c.handle, x, w)
        return x * 2

    gen = c.generation
    torch._dynamo.reset()
    torch.compile(fn, fullgraph=True, backend=backend)(data(60)[0])
    return c.generation == gen + 1, f"generation {gen} -> {c.generation}"


def run_all():
    rows = []

    def rec(name, fn, *a):
        try:
            ok, msg = fn(*a)
        except Exception as e:
            ok, msg = False, f"EXC {type(e).__name__}: {short(e)}"
            if "-v" in sys.argv:
                traceback.print_exc()
        rows.append((name, ok, msg))
        print(f"{torch.__version__[:4]} {VARIANT:9s} {name:34s} {'PASS' if ok else 'FAIL'}  {msg}", flush=True)

    rec("schema declares writes", crit_schema)
    for backend in [None] + BACKENDS:
        tag = backend or "eager"
        torch._dynamo.reset()
        if backend:
            rec(f"8 blocks [{tag}]", crit_blocks, backend, False)
            rec(f"8 blocks main_grad [{tag}]", crit_blocks, backend, True)
            rec(f"recompute op kept [{tag}]", crit_recompute_kept, backend)
        rec(f"overwritten raises [{tag}]", crit_overwritten, backend)
        rec(f"(a) shared ctx recompute [{tag}]", crit_shared_recompute, backend)
        for order in ("together", (0, 1), (1, 0)):
            rec(f"(b) F F B B {order} rc [{tag}]", _main_grad_case, backend, order, True)
            rec(f"(b) F F B B {order} 2ctx [{tag}]", _main_grad_case, backend, order, False)
        rec(f"(c) accumulate [{tag}]", crit_accumulate, backend)
        rec(f"main_grad-only bwd kept [{tag}]", crit_frozen_input_main_grad, backend)
    return rows


if __name__ == "__main__":
    BACKENDS = [b for b in BACKENDS if b != "-v"]
    run_all()
