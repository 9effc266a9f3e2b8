import torch
from torch import Tensor
print(torch.__version__[:4])
try:
    from torch._library.opaque_object import register_opaque_type, get_opaque_type_name
    try:
        from torch._custom_class_base import CustomClassBase as Base
    except ImportError:
        from torch._opaque_base import OpaqueBase as Base
    class Ctx(Base):
        pass
    register_opaque_type(Ctx, typ="reference")
    name = get_opaque_type_name(Ctx)
    try:
        @torch.library.custom_op("opq::fwd", mutates_args=("ctx",))
        def f(ctx: Ctx, x: Tensor) -> Tensor:
            return x.clone()
        print("opaque in mutates_args: accepted", torch.ops.opq.fwd.default._schema)
    except Exception as e:
        print("opaque in mutates_args:", type(e).__name__, str(e).splitlines()[0][:200])
    try:
        torch.library.define("opq::fwd2", f"({name}(a!) ctx, Tensor x) -> Tensor")
        print("opaque(a!) via define: accepted", torch.ops.opq.fwd2.default._schema)
    except Exception as e:
        print("opaque(a!) via define:", type(e).__name__, str(e).splitlines()[0][:200])
except Exception as e:
    print("opaque API:", type(e).__name__, str(e)[:200])
try:
    torch.library.impl("opq::fwd2", "CompositeExplicitAutograd")(lambda ctx, x: x.clone())
    torch.library.register_fake("opq::fwd2")(lambda ctx, x: torch.empty_like(x))
    c = Ctx()
    def fn(x):
        return torch.ops.opq.fwd2(c, x) * 2
    print("eager:", fn(torch.ones(2)).tolist())
    print("aot_eager:", torch.compile(fn, fullgraph=True, backend="aot_eager")(torch.ones(2)).tolist())
except Exception as e:
    lines = [l for l in str(e).splitlines() if l.strip() and not l.strip().endswith("raised:")]
    print("compile opaque(a!):", type(e).__name__, lines[0][:250] if lines else "")
