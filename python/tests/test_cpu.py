"""Tests that run without a GPU: the package and its extension load, defaults, argument checks of forward,
backward and recompute (they fire before any CUDA call), fake/meta shapes of the custom ops, autograd and
mok.MoE on meta tensors, torch.compile(fullgraph=True) tracing of forward and backward."""
import dataclasses
import shutil
import subprocess

import pytest
import torch

import mok
from conftest import make_inputs, make_weights

SHAPE = mok.LayerShape(ep_size=1, num_tokens=256, top_k=2, num_experts=8, hidden=128, intermediate=64)


def meta_workspace(shared_expert=True, **config):
    return mok.get_workspace(mok.Config(**config), None, SHAPE.num_tokens, SHAPE.hidden, SHAPE.intermediate,
                             SHAPE.top_k, SHAPE.num_experts, shared_expert=shared_expert, device="meta")


def meta_args(shared_expert=True, fused_gate_up=False):
    shape = dataclasses.replace(SHAPE, shared_expert=shared_expert)
    x, idx, rw = make_inputs(shape, "meta")
    return x, idx, rw, make_weights(shape, "meta", fused_gate_up=fused_gate_up)


def test_extension_loads():
    compiled, loaded = mok.nccl_versions()
    assert compiled >= 22800, f"compiled against NCCL {compiled}, need >= 2.28"
    assert loaded > 0


def test_extension_exports_only_its_init():
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("no nm (binutils) on PATH")
    from mok import _mok
    out = subprocess.run([nm, "-D", "--defined-only", _mok.__file__], check=True, capture_output=True, text=True)
    symbols = [line.split()[-1] for line in out.stdout.splitlines() if line.strip()]
    assert symbols == ["PyInit__mok"], f"{_mok.__file__} exports {symbols}"


def test_config_defaults_are_the_cpp_defaults():
    c = mok.Config()
    assert (c.comm_ctas, c.minibatch_rows, c.macrobatch_rows, c.capacity_rows, c.tile_m, c.wait_timeout_s, c.path,
            c.backward, c.keep_gate_up, c.context_budget_bytes, c.backward_megakernel, c.gather_rows, c.scatter_rows,
            c.precision) == (0, 4096, 0, 0, 64, 10.0, "fused", True, True, 4 << 30, False, False, False, "bf16")
    assert c.load_factor == 2.0 and isinstance(c.load_factor, float)


def test_config_and_layer_shape_match_the_option_table():
    """Every option is defined once, in the C++ option table (src/host/option_table.h), from which the extension's
    keywords are derived: Config's fields are its "config" rows and LayerShape's its "shape" rows, with the same
    names, defaults (where LayerShape has one) and kinds; the "cpp" rows (the C++ and C APIs only) are in neither.
    Adding an option to the table without Config's field (or the reverse) fails here."""
    from mok import _mok
    table = _mok.option_table()
    python_types = {"bool": bool, "int32": int, "int64": int, "float32": float, "float64": float, "enum": str}
    homes = {"config": mok.Config, "shape": mok.LayerShape}
    for home, cls in homes.items():
        rows = {row["name"]: row for row in table if row["home"] == home}
        fields = {f.name: f for f in dataclasses.fields(cls)}
        assert set(fields) == set(rows), f"{cls.__name__} fields {sorted(fields)} != table rows {sorted(rows)}"
        for name, row in rows.items():
            field = fields[name]
            assert field.type in (python_types[row["kind"]].__name__, python_types[row["kind"]]), \
                f"{cls.__name__}.{name}: annotated {field.type}, the table's kind is {row['kind']}"
            if field.default is dataclasses.MISSING:
                assert home == "shape", f"Config.{name} has no default"
                continue
            assert type(field.default) is python_types[row["kind"]] and field.default == row["default"], \
                f"{cls.__name__}.{name}: default {field.default!r}, C++ {row['default']!r}"
    path = next(row for row in table if row["name"] == "path")
    assert path["choices"] == sorted(mok.config.PATHS, key=mok.config.PATHS.get)  # Config's names, C++'s codes
    for row in table:
        if row["home"] == "cpp":
            assert not any(row["name"] in {f.name for f in dataclasses.fields(cls)} for cls in homes.values())
    assert [row["name"] for row in table if not row["agreed"]] == ["wait_timeout_s", "setup_timeout_s"]  # own waits


def test_extension_takes_the_options_by_name():
    """The extension's Workspace takes the shape and options as keywords named as the table's rows, checking each
    value's type and range before any CUDA call: unknown names, wrong types and out-of-range values name the option."""
    from mok import _mok
    base = dict(num_tokens=256, hidden=128, intermediate=64, top_k=2, num_experts=8)
    for options, error, text in [
            (dict(base, fused=1), TypeError, "unknown option 'fused'"),
            (dict(base, tile_m=True), TypeError, "option tile_m: expected an int, got bool"),
            (dict(base, backward=1), TypeError, "option backward: expected a bool, got int"),
            (dict(base, load_factor="2"), TypeError, "option load_factor: expected a number, got str"),
            (dict(base, path="megakernel"), ValueError, "option path: expected one of fused, unfused, got 'megakernel'"),
            (dict(base, path=0), TypeError, "option path: expected a str, got int"),
            (dict(base, minibatch_rows=2**31), ValueError,
             r"option minibatch_rows \(MoeOptions.fused.minibatch_rows\): expected an int32, got 2147483648"),
            (dict(base, context_budget_bytes=2**64), ValueError, "option context_budget_bytes: .* is out of range")]:
        with pytest.raises(error, match=text):
            _mok.Workspace(0, 0, None, **options)


def test_config_load_factor():
    """load_factor: any number >= 1 (an int too; inf: the worst case), passed to the native workspace's
    ScheduleOptions (test_gpu.py checks the capacity it gives)."""
    for value in (1, 1.0, 1.5, 8, float("inf")):
        assert mok.Config(load_factor=value).load_factor == value
    for value in (0.999, 0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="Config.load_factor"):
            mok.Config(load_factor=value)
    for value in (True, "2", None):  # not a number: TypeError
        with pytest.raises(TypeError, match="Config.load_factor"):
            mok.Config(load_factor=value)


@pytest.mark.parametrize("field, value, exception", [
    ("path", "megakernel", ValueError), ("comm_ctas", -2, ValueError), ("tile_m", 1.5, TypeError),
    ("wait_timeout_s", 0, ValueError), ("minibatch_rows", True, TypeError), ("backward", 1, TypeError),
    ("keep_gate_up", 1, TypeError), ("context_budget_bytes", -1, ValueError),
    ("backward_megakernel", "yes", TypeError), ("gather_rows", 1, TypeError), ("gather_rows", True, ValueError),
    ("scatter_rows", 1, TypeError),
    ("precision", "fp16", ValueError), ("precision", 8, TypeError)])
def test_config_rejects(field, value, exception):
    """A wrong value: ValueError; a value of the wrong type (bool for an int, int for a bool): TypeError.
    test_args.py has the whole table of bad constructor arguments (docs/bad_inputs.md)."""
    with pytest.raises(exception, match=f"Config.{field}"):
        mok.Config(**{field: value})


def test_shape_rejects():
    with pytest.raises(ValueError, match="num_experts"):
        dataclasses.replace(SHAPE, ep_size=3)
    with pytest.raises(ValueError, match="hidden"):
        dataclasses.replace(SHAPE, hidden=0)


def test_get_workspace_rejects():
    with pytest.raises(TypeError, match="config"):
        mok.get_workspace({}, None, 256, 128, 64, 2, 8, device="meta")
    with pytest.raises(ValueError, match="device"):
        mok.get_workspace(mok.Config(), None, 256, 128, 64, 2, 8, device="cpu")


def test_forward_on_meta_returns_the_output_shape():
    ws = meta_workspace()
    x, idx, rw, w = meta_args()
    out, ctx = mok.forward(ws, x, idx, rw, w)
    assert (out.shape, out.dtype, out.device.type) == ((256, 128), torch.bfloat16, "meta")
    assert isinstance(ctx, mok.ForwardContext) and ctx.workspace is ws
    out, _ = mok.forward(ws, x, idx.long(), rw, dataclasses.asdict(w), ctx)  # int64 ids, weights as a dict
    assert out.shape == (256, 128)


def test_forward_fused_gate_up_and_no_shared_expert():
    ws = meta_workspace(shared_expert=False)
    x, idx, rw, w = meta_args(shared_expert=False, fused_gate_up=True)
    assert w.expert_gate.shape == (8, 128, 128)
    out, _ = mok.forward(ws, x, idx, rw, w)
    assert out.shape == (256, 128)


def _replace(w, **kw):
    return dataclasses.replace(w, **kw)


BAD_ARGS = {  # case: (function of (x, idx, rw, w) -> new (x, idx, rw, w), exception, pattern)
    "x dtype": (lambda x, i, r, w: (x.float(), i, r, w), ValueError,
                r"x: expected a contiguous bf16 tensor on meta of shape \[T, H\] = \[256, 128\], got a float32"),
    "x shape": (lambda x, i, r, w: (x[:128], i, r, w), ValueError, r"x: .* got .* shape \[128, 128\]"),
    "x not a tensor": (lambda x, i, r, w: ([[0.0]], i, r, w), TypeError, "x: .* got list"),
    "x non-contiguous": (lambda x, i, r, w: (torch.empty(128, 256, dtype=torch.bfloat16, device="meta").t(), i, r, w),
                         ValueError, "x: .*non-contiguous"),
    "topk dtype": (lambda x, i, r, w: (x, i.float(), r, w), ValueError, "topk_idx: expected .*int32 or int64"),
    "topk shape": (lambda x, i, r, w: (x, i[:, :1], r, w), ValueError, r"topk_idx: .*\[T, k\] = \[256, 2\]"),
    "router dtype": (lambda x, i, r, w: (x, i, r.bfloat16(), w), ValueError, "router_weights: expected .*float32"),
    "gate shape": (lambda x, i, r, w: (x, i, r, _replace(w, expert_gate=w.expert_down)), ValueError,
                   r"expert_gate: .*\[E_local, I, H\] = \[8, 64, 128\]"),
    "fused gate shape": (lambda x, i, r, w: (x, i, r, _replace(w, expert_up=None)), ValueError,
                         r"expert_gate: .*2I.*= \[8, 128, 128\]"),
    "down transposed": (lambda x, i, r, w: (x, i, r, _replace(w, expert_down=w.expert_gate)), ValueError,
                        r"expert_down: .*\[8, 128, 64\]"),
    "shared missing": (lambda x, i, r, w: (x, i, r, _replace(w, shared_up=None)), TypeError, "shared_up: .*NoneType"),
    "weights type": (lambda x, i, r, w: (x, i, r, [w.expert_gate]), TypeError, "weights: expected"),
    "weights key": (lambda x, i, r, w: (x, i, r, {**dataclasses.asdict(w), "bias": None}), TypeError,
                    r"weights: unknown keys \['bias'\]"),
}


@pytest.mark.parametrize("case", sorted(BAD_ARGS))
def test_forward_rejects(case):
    change, exception, pattern = BAD_ARGS[case]
    ws = meta_workspace()
    x, idx, rw, w = change(*meta_args())
    with pytest.raises(exception, match=pattern):
        mok.forward(ws, x, idx, rw, w)


def test_forward_rejects_shared_weights_without_a_shared_expert():
    ws = meta_workspace(shared_expert=False)
    x, idx, rw, w = meta_args(shared_expert=True)
    with pytest.raises(ValueError, match="shared_gate: expected None .*shared_expert=False"):
        mok.forward(ws, x, idx, rw, w)


def test_forward_rejects_the_wrong_device_before_any_cuda_call():
    # A workspace object on cuda:0 without native state: the checks must fail on the CPU tensors first.
    ws = mok.Workspace(SHAPE, mok.Config(), torch.device("cuda", 0), 0, None)
    x, idx, rw = make_inputs(SHAPE, "cpu")
    w = make_weights(SHAPE, "cpu")
    with pytest.raises(ValueError, match=r"topk_idx: expected a contiguous int32 or int64 tensor on cuda:0 .* on cpu"):
        mok.forward(ws, x, idx, rw, w)


def test_forward_rejects_misaligned_data():
    ws = mok.Workspace(SHAPE, mok.Config(), torch.device("cpu"), 0, None)  # checks only: runs nothing
    x, idx, rw = make_inputs(SHAPE, "cpu")
    w = make_weights(SHAPE, "cpu")
    flat = torch.empty(x.numel() + 1, dtype=torch.bfloat16)
    misaligned = flat[1:].view(x.shape)  # 2 bytes past a 16-byte boundary
    with pytest.raises(ValueError, match="x: the data pointer .* not 16-byte aligned"):
        mok.forward(ws, misaligned, idx, rw, w)


def test_context_from_another_workspace():
    x, idx, rw, w = meta_args()
    ctx = meta_workspace().make_context()
    with pytest.raises(ValueError, match="ctx: made by another workspace"):
        mok.forward(meta_workspace(), x, idx, rw, w, ctx)
    with pytest.raises(TypeError, match="ctx: expected a mok.ForwardContext"):
        mok.forward(meta_workspace(), x, idx, rw, w, object())


def test_build_schedule_checks():
    ws = meta_workspace()
    _, idx, _, _ = meta_args()
    mok.build_schedule(ws, idx, ws.make_context())
    mok.build_schedule(ws, idx[:7], ws.make_context())  # any token count up to the workspace's
    with pytest.raises(ValueError, match="topk_idx"):
        mok.build_schedule(ws, idx[:, :1], ws.make_context())


def test_fake_tensor_mode_shapes():
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    ws = meta_workspace()
    ctx = ws.make_context()
    with FakeTensorMode(allow_non_fake_inputs=True):  # the handles are real (torch.compile fakes them itself)
        x, idx, rw = make_inputs(SHAPE, "cpu")
        w = make_weights(SHAPE, "cpu")
        out, token = torch.ops.mok.forward(ws.handle, ctx.handle, False, x, idx, rw, w.expert_gate, w.expert_up,
                                           w.expert_down, w.shared_gate, w.shared_up, w.shared_down)
        assert isinstance(out, FakeTensor)
        assert (out.shape, out.dtype) == ((256, 128), torch.bfloat16)
        assert (token.shape, token.dtype, token.device.type) == ((2,), torch.int64, "cpu")


def test_opcheck_on_meta():
    ws = meta_workspace()
    ctx = ws.make_context()
    x, idx, rw, w = meta_args()
    args = (ws.handle, ctx.handle, False, x, idx, rw, w.expert_gate, w.expert_up, w.expert_down, w.shared_gate,
            w.shared_up, w.shared_down)
    torch.library.opcheck(torch.ops.mok.forward.default, args,
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


def test_compile_fullgraph_traces_the_op():
    ws = meta_workspace()
    ctx = ws.make_context()
    x, idx, rw, w = meta_args()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def layer(x, idx, rw):
        out, _ = mok.forward(ws, x, idx, rw, w, ctx)
        return out.float() * 2

    compiled = torch.compile(layer, fullgraph=True, backend=backend)
    out = compiled(x, idx, rw)
    assert (out.shape, out.dtype) == ((256, 128), torch.float32)
    targets = [n.target for g in graphs for n in g.graph.nodes if n.op == "call_function"]
    assert torch.ops.mok.forward.default in targets or torch.ops.mok.forward in targets, targets
    out = torch.compile(layer, fullgraph=True, backend="aot_eager")(x, idx, rw)
    assert out.shape == (256, 128)


def test_compile_without_a_context_says_so():
    ws = meta_workspace()
    x, idx, rw, w = meta_args()

    def layer(x, idx, rw):
        return mok.forward(ws, x, idx, rw, w)[0]

    with pytest.raises(Exception, match="pass ctx=ws.make_context"):
        torch.compile(layer, fullgraph=True, backend="eager")(x, idx, rw)


def test_cpp_errors_become_python_exceptions():
    from conftest import hopper_skip_reason
    if torch.cuda.is_available():
        pytest.skip("needs a machine without a usable CUDA device")
    from mok import _mok
    with pytest.raises(RuntimeError, match="cuda"):
        _mok.Workspace(0, 0, None, num_tokens=256, hidden=128, intermediate=64, top_k=2, num_experts=8)
    assert hopper_skip_reason() is not None  # the process is alive


# ---------------------------------------------------------------------------------------------------------------
# Backward, recompute, autograd and mok.MoE on meta tensors (shapes and checks; the GPU tests check the values)

GRAD_SHAPES = {"expert_gate": (8, 64, 128), "expert_up": (8, 64, 128), "expert_down": (8, 128, 64),
               "shared_gate": (64, 128), "shared_up": (64, 128), "shared_down": (128, 64)}


def meta_backward_args(shared_expert=True, fused_gate_up=False):
    x, idx, rw, w = meta_args(shared_expert, fused_gate_up)
    return torch.empty_like(x), x, idx, rw, w


def test_backward_on_meta_returns_the_gradient_shapes():
    ws = meta_workspace()
    d_out, x, idx, rw, w = meta_backward_args()
    _, ctx = mok.forward(ws, x, idx, rw, w)
    for dtype in (torch.bfloat16, torch.float32):
        d_x, d_rw, grads = mok.backward(ws, d_out, x, idx, rw, w, ctx, grad_dtype=dtype)
        assert (d_x.shape, d_x.dtype, d_rw.shape, d_rw.dtype) == ((256, 128), torch.bfloat16, (256, 2), torch.float32)
        assert isinstance(grads, mok.Weights)
        for name, shape in GRAD_SHAPES.items():
            g = getattr(grads, name)
            assert (tuple(g.shape), g.dtype, g.device.type) == (shape, dtype, "meta"), name


def test_backward_fused_gate_up_and_no_shared_expert_on_meta():
    ws = meta_workspace(shared_expert=False)
    d_out, x, idx, rw, w = meta_backward_args(shared_expert=False, fused_gate_up=True)
    _, ctx = mok.forward(ws, x, idx, rw, w)
    _, _, grads = mok.backward(ws, d_out, x, idx, rw, w, ctx)
    assert grads.expert_gate.shape == (8, 128, 128) and grads.expert_down.shape == (8, 128, 64)
    assert grads.expert_up is None and grads.shared_gate is None and grads.shared_up is None
    assert grads.shared_down is None


def test_backward_into_buffers_and_main_grads_on_meta():
    ws = meta_workspace()
    d_out, x, idx, rw, w = meta_backward_args()
    _, ctx = mok.forward(ws, x, idx, rw, w)
    main = mok.main_grads(w)
    assert all(g.dtype == torch.float32 and tuple(g.shape) == GRAD_SHAPES[n]
               for n, g in dataclasses.asdict(main).items())
    d_x, d_rw, grads = mok.backward(ws, d_out, x, idx, rw, w, ctx, main_grads=main)
    assert grads is main and d_x.shape == (256, 128) and d_rw.shape == (256, 2)
    only_down = {"expert_down": torch.empty(8, 128, 64, dtype=torch.bfloat16, device="meta")}
    _, _, grads = mok.backward(ws, d_out, x, idx, rw, w, ctx, grads=only_down)
    assert grads.expert_down is only_down["expert_down"] and grads.expert_gate is None
    assert mok.main_grads(meta_args(shared_expert=False, fused_gate_up=True)[3]).expert_up is None


def _meta_grad(name, dtype=torch.bfloat16):
    return torch.empty(GRAD_SHAPES[name], dtype=dtype, device="meta")


BAD_BACKWARD = {  # case: (function of (d_out, x, idx, rw, w) -> (args, kwargs), exception, pattern)
    "d_out shape": (lambda d, x, i, r, w: ((d[:100], x, i, r, w), {}), ValueError,
                    r"d_out: expected a contiguous bf16 tensor on meta of shape \[T, H\] = \[256, 128\], got .*\[100, 128\]"),
    "d_out dtype": (lambda d, x, i, r, w: ((d.float(), x, i, r, w), {}), ValueError, r"d_out: .* got a float32"),
    "d_out non-contiguous": (lambda d, x, i, r, w: ((torch.empty(128, 256, dtype=torch.bfloat16, device="meta").t(),
                                                     x, i, r, w), {}), ValueError, "d_out: .*non-contiguous"),
    "d_out not a tensor": (lambda d, x, i, r, w: ((None, x, i, r, w), {}), TypeError, "d_out: .* got NoneType"),
    "x shape": (lambda d, x, i, r, w: ((d, x[:8], i, r, w), {}), ValueError, r"x: .*\[8, 128\]"),
    "router dtype": (lambda d, x, i, r, w: ((d, x, i, r.double(), w), {}), ValueError, "router_weights: .*float64"),
    "grads dtype": (lambda d, x, i, r, w: ((d, x, i, r, w), {"grads": {"expert_gate": _meta_grad("expert_gate",
                                                                                                 torch.float16)}}),
                    ValueError, r"grads.expert_gate: expected a contiguous float32 or bf16 tensor .*float16"),
    "grads shape": (lambda d, x, i, r, w: ((d, x, i, r, w), {"grads": {"expert_down": _meta_grad("expert_gate")}}),
                    ValueError, r"grads.expert_down: .*\[E_local, H, I\] = \[8, 128, 64\]"),
    "grads key": (lambda d, x, i, r, w: ((d, x, i, r, w), {"grads": {"gate": None}}), TypeError,
                  r"grads: unknown keys \['gate'\]"),
    "grads type": (lambda d, x, i, r, w: ((d, x, i, r, w), {"grads": [None]}), TypeError, "grads: expected"),
    "main_grads bf16": (lambda d, x, i, r, w: ((d, x, i, r, w), {"main_grads": {"shared_up": _meta_grad("shared_up")}}),
                        ValueError, r"main_grads.shared_up: expected a contiguous float32 tensor .* got a bf16"),
    "grads and main_grads": (lambda d, x, i, r, w: ((d, x, i, r, w), {"grads": {}, "main_grads": {}}), ValueError,
                             "grads, main_grads: pass one of them"),
    "grad_dtype": (lambda d, x, i, r, w: ((d, x, i, r, w), {"grad_dtype": torch.float16}), ValueError,
                   "grad_dtype: expected torch.bfloat16 or torch.float32"),
    "gate without up": (lambda d, x, i, r, w: ((d, x, i, r, w), {"grads": {"expert_gate": _meta_grad("expert_gate")}}),
                        ValueError, r"grads.expert_gate, grads.expert_up: both or neither, of one dtype"),
    "shared up without gate": (lambda d, x, i, r, w: ((d, x, i, r, w), {"main_grads": {
        "shared_up": _meta_grad("shared_up", torch.float32)}}), ValueError,
        r"main_grads.shared_gate, main_grads.shared_up: both or neither"),
    "gate and up dtypes": (lambda d, x, i, r, w: ((d, x, i, r, w), {"grads": {
        "shared_gate": _meta_grad("shared_gate"), "shared_up": _meta_grad("shared_up", torch.float32)}}),
        ValueError, r"grads.shared_gate, grads.shared_up: both or neither, of one dtype .*bf16.*float32"),
}


@pytest.mark.parametrize("case", sorted(BAD_BACKWARD))
def test_backward_rejects(case):
    change, exception, pattern = BAD_BACKWARD[case]
    ws = meta_workspace()
    d_out, x, idx, rw, w = meta_backward_args()
    _, ctx = mok.forward(ws, x, idx, rw, w)
    args, kwargs = change(d_out, x, idx, rw, w)
    with pytest.raises(exception, match=pattern):
        mok.backward(ws, *args, ctx, **kwargs)


def test_backward_rejects_gradients_of_absent_weights():
    ws = meta_workspace(shared_expert=False)
    d_out, x, idx, rw, w = meta_backward_args(shared_expert=False, fused_gate_up=True)
    _, ctx = mok.forward(ws, x, idx, rw, w)
    with pytest.raises(ValueError, match="grads.expert_up: expected None .*gate and up are fused"):
        mok.backward(ws, d_out, x, idx, rw, w, ctx, grads={"expert_up": _meta_grad("expert_up")})
    with pytest.raises(ValueError, match="main_grads.shared_down: expected None .*shared_expert=False"):
        mok.backward(ws, d_out, x, idx, rw, w, ctx, main_grads={"shared_down": _meta_grad("shared_down", torch.float32)})


def test_backward_and_recompute_check_the_context_and_the_workspace():
    d_out, x, idx, rw, w = meta_backward_args()
    ws = meta_workspace()
    other = meta_workspace().make_context()
    with pytest.raises(ValueError, match="ctx: made by another workspace"):
        mok.backward(ws, d_out, x, idx, rw, w, other)
    with pytest.raises(TypeError, match="ctx: expected a mok.ForwardContext"):
        mok.backward(ws, d_out, x, idx, rw, w, None)
    with pytest.raises(ValueError, match="ctx: made by another workspace"):
        mok.recompute_forward_context(ws, x, w, other)
    with pytest.raises(TypeError, match="ws: expected a mok.Workspace"):
        mok.backward(None, d_out, x, idx, rw, w, other)
    inference = meta_workspace(backward=False)
    _, ctx = mok.forward(inference, x, idx, rw, w)
    with pytest.raises(ValueError, match=r"Config\(backward=False\)"):
        mok.backward(inference, d_out, x, idx, rw, w, ctx)
    with pytest.raises(ValueError, match=r"Config\(backward=False\)"):
        mok.recompute_forward_context(inference, x, w, ctx)


def test_recompute_forward_context_checks():
    ws = meta_workspace()
    _, x, idx, rw, w = meta_backward_args()
    _, ctx = mok.forward(ws, x, idx, rw, w)
    assert mok.recompute_forward_context(ws, x, w, ctx) is ctx
    with pytest.raises(ValueError, match=r"x: .*\[T, H\] = \[256, 128\]"):
        mok.recompute_forward_context(ws, x[:, :64], w, ctx)
    with pytest.raises(ValueError, match=r"x: 300 tokens, but the workspace takes at most num_tokens = 256"):
        mok.recompute_forward_context(ws, torch.empty(300, 128, dtype=torch.bfloat16, device="meta"), w, ctx)
    with pytest.raises(ValueError, match="expert_down"):
        mok.recompute_forward_context(ws, x, dataclasses.replace(w, expert_down=w.expert_gate), ctx)


def test_backward_rejects_the_wrong_device_before_any_cuda_call():
    ws = mok.Workspace(SHAPE, mok.Config(), torch.device("cuda", 0), 0, None)  # no native state
    x, idx, rw = make_inputs(SHAPE, "cpu")
    w = make_weights(SHAPE, "cpu")
    ctx = mok.ForwardContext(ws, None)
    d_out = torch.zeros_like(x)
    with pytest.raises(ValueError, match=r"topk_idx: expected a contiguous int32 or int64 tensor on cuda:0 .* on cpu"):
        mok.backward(ws, d_out, x, idx, rw, w, ctx)
    with pytest.raises(ValueError, match=r"x: expected a contiguous bf16 tensor on cuda:0 .* on cpu"):
        mok.recompute_forward_context(ws, x, w, ctx)


def test_fake_tensor_mode_shapes_of_the_backward_ops():
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    ws = meta_workspace()
    ctx = ws.make_context()
    with FakeTensorMode(allow_non_fake_inputs=True):
        x, idx, rw = make_inputs(SHAPE, "cpu")
        w = make_weights(SHAPE, "cpu").tensors()
        d_out = torch.empty_like(x)
        # grad_mask 0b000101: expert_gate and expert_down, fp32
        outs = torch.ops.mok.backward(ws.handle, ctx.handle, d_out, x, idx, rw, *w, 0b000101, True)
        assert all(isinstance(t, FakeTensor) for t in outs)
        assert [(tuple(t.shape), t.dtype) for t in outs] == [
            ((256, 128), torch.bfloat16), ((256, 2), torch.float32), ((8, 64, 128), torch.float32), ((0,), torch.bfloat16),
            ((8, 128, 64), torch.float32), ((0,), torch.bfloat16), ((0,), torch.bfloat16), ((0,), torch.bfloat16)]
        outs = torch.ops.mok.backward(ws.handle, ctx.handle, d_out, x, idx, rw, *w, 0b111111, False, True)
        assert [t.dtype for t in outs[2:]] == [torch.bfloat16] * 6
        grads = [torch.empty(GRAD_SHAPES[n], dtype=torch.float32) for n in GRAD_SHAPES]
        d_x, d_rw = torch.ops.mok.backward_into(ws.handle, ctx.handle, d_out, x, idx, rw, *w, *grads, True)
        assert (d_x.shape, d_rw.shape) == ((256, 128), (256, 2))
        targets = torch.tensor([7])  # a MainGradTargets handle (the fake kernel looks nothing up)
        d_x, d_rw = torch.ops.mok.backward_into(ws.handle, ctx.handle, d_out, x, idx, rw, *w, *grads, True, True,
                                                targets)
        assert (d_x.shape, d_rw.shape) == ((256, 128), (256, 2))
        assert torch.ops.mok.recompute_forward_context(ws.handle, ctx.handle, x, *w) is None


def test_opcheck_backward_ops_on_meta():
    ws = meta_workspace()
    d_out, x, idx, rw, w = meta_backward_args()
    _, ctx = mok.forward(ws, x, idx, rw, w)
    tests = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")
    base = (ws.handle, ctx.handle, d_out, x, idx, rw, *w.tensors())
    torch.library.opcheck(torch.ops.mok.backward.default, (*base, 0b111111, False, False), test_utils=tests)
    grads = tuple(torch.empty(s, dtype=torch.float32, device="meta") for s in GRAD_SHAPES.values())
    torch.library.opcheck(torch.ops.mok.backward_into.default, (*base, *grads, True), test_utils=tests)
    torch.library.opcheck(torch.ops.mok.recompute_forward_context.default,
                          (ws.handle, ctx.handle, x, *w.tensors()), test_utils=tests)


def _requires_grad(*tensors):
    for t in tensors:
        if t is not None:
            t.requires_grad_(True)


def test_autograd_on_meta_gives_every_gradient():
    ws = meta_workspace()
    x, idx, rw, w = meta_args()
    _requires_grad(x, rw, *w.tensors())
    out, _ = mok.forward(ws, x, idx, rw, w)
    out.float().sum().backward()
    assert (x.grad.shape, x.grad.dtype, rw.grad.shape, rw.grad.dtype) == ((256, 128), torch.bfloat16, (256, 2),
                                                                          torch.float32)
    for name, shape in GRAD_SHAPES.items():
        g = getattr(w, name).grad
        assert (tuple(g.shape), g.dtype) == (shape, torch.bfloat16), name


def test_autograd_on_meta_only_where_asked():
    ws = meta_workspace(shared_expert=False)
    x, idx, rw, w = meta_args(shared_expert=False, fused_gate_up=True)
    _requires_grad(rw, w.expert_down)  # x, expert_gate frozen
    out, _ = mok.forward(ws, x, idx, rw, w)
    out.float().sum().backward()
    assert x.grad is None and w.expert_gate.grad is None
    assert rw.grad.shape == (256, 2) and w.expert_down.grad.shape == (8, 128, 64)


def test_autograd_computes_a_gate_up_pair_together():
    """Separate gate and up gradients come from one GEMM: asking for one computes both (the op's outputs), and
    autograd hands over only the asked one."""
    ws = meta_workspace()
    x, idx, rw, w = meta_args()
    _requires_grad(w.expert_gate, w.shared_up)
    out, _ = mok.forward(ws, x, idx, rw, w)
    out.float().sum().backward()
    assert w.expert_gate.grad.shape == (8, 64, 128) and w.shared_up.grad.shape == (64, 128)
    assert w.expert_up.grad is None and w.shared_gate.grad is None and w.expert_down.grad is None
    assert mok.ops.with_partners(0b000001, w.tensors()) == 0b000011
    assert mok.ops.with_partners(0b010100, w.tensors()) == 0b011100
    fused = meta_args(fused_gate_up=True)[3]
    assert mok.ops.with_partners(0b000001, fused.tensors()) == 0b000001


def test_blocks_compiled_one_by_one_share_one_compiled_graph():
    """A model compiled block by block (torch.compile per block, as torchtitan does), 8 blocks sharing one
    workspace, each with its own context: the handles are graph inputs, not constants, so the first block's
    compiled graph serves all 8 (one frame compiled), forward and backward, without graph breaks."""
    import torch._dynamo.testing
    ws = meta_workspace()
    blocks = [mok.MoE(SHAPE.hidden, SHAPE.intermediate, SHAPE.num_experts, SHAPE.top_k, router=False, workspace=ws,
                      context=ws.make_context(), device="meta") for _ in range(8)]
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = [torch.compile(b, fullgraph=True, backend=counter) for b in blocks]
    x, idx, rw, _ = meta_args()
    h = x.clone().requires_grad_(True)
    for block in compiled:
        h = block(h, idx, rw)
    h.float().sum().backward()
    assert counter.frame_count == 1, f"{counter.frame_count} frames compiled for 8 blocks of one shape"
    torch._dynamo.reset()


def meta_module(**kw):
    return mok.MoE(SHAPE.hidden, SHAPE.intermediate, SHAPE.num_experts, SHAPE.top_k, device="meta", **kw)


def test_module_parameters_and_gradients_on_meta():
    moe = meta_module()
    names = {n: tuple(p.shape) for n, p in moe.named_parameters()}
    assert names == {"router.weight": (8, 128), **GRAD_SHAPES}, names
    assert all(p.dtype == torch.bfloat16 for p in moe.parameters())
    x = torch.empty(4, 64, 128, dtype=torch.bfloat16, device="meta", requires_grad=True)
    y = moe(x)
    assert (y.shape, y.dtype) == ((4, 64, 128), torch.bfloat16)
    y.float().sum().backward()
    assert x.grad.shape == (4, 64, 128)
    for n, p in moe.named_parameters():
        assert p.grad is not None and p.grad.shape == p.shape, n
    assert moe.workspace.shape.num_tokens == 256 and "top_k=2" in repr(moe)


def test_module_variants_on_meta():
    moe = meta_module(fused_gate_up=True, shared_expert=False, router=False, swiglu_limit=7.0)
    assert {n for n, _ in moe.named_parameters()} == {"expert_gate", "expert_down"}
    assert moe.expert_gate.shape == (8, 128, 128)
    x, idx, rw = make_inputs(SHAPE, "meta")
    assert moe(x, idx, rw).shape == (256, 128)
    with pytest.raises(TypeError, match="forward needs topk_idx and router_weights"):
        moe(x)
    with pytest.raises(TypeError, match="pass both"):
        moe(x, idx)
    assert moe(x[:128], idx[:128], rw[:128]).shape == (128, 128)  # fewer tokens than the workspace's: any count
    assert moe(x[:0], idx[:0], rw[:0]).shape == (0, 128)
    big = torch.empty(257, 128, dtype=torch.bfloat16, device="meta")
    with pytest.raises(ValueError, match=r"x: 257 tokens, more than the layer's workspace takes per call \(256\)"):
        moe(big, torch.zeros(257, 2, dtype=torch.int64, device="meta"), torch.empty(257, 2, device="meta"))
    with pytest.raises(ValueError, match=r"x: expected \[..., H\] with H = 128"):
        moe(x[:, :64])


def test_module_shares_a_workspace():
    ws = meta_workspace()
    a = meta_module(workspace=ws)
    b = meta_module(workspace=ws, recompute=True, context=ws.make_context())
    assert a.workspace is ws and b.workspace is ws
    with pytest.raises(ValueError, match=r"workspace: made for .* this layer is"):
        mok.MoE(SHAPE.hidden, 128, SHAPE.num_experts, SHAPE.top_k, workspace=ws)
    with pytest.raises(ValueError, match="context: must be made by the workspace"):
        meta_module(workspace=ws, context=meta_workspace().make_context())


def test_module_main_grad_convention_on_meta():
    """main_grad=True: weights with Megatron's grad_added_to_main_grad attribute get a dummy gradient (the meta
    op does not run, so main_grad itself is untouched here), the others none; the router's goes through autograd."""
    moe = meta_module(main_grad=True)
    moe.allocate_main_grads()
    assert moe.expert_gate.main_grad.dtype == torch.float32 and moe.router.weight.__dict__.get("main_grad") is None
    moe.expert_down.grad_added_to_main_grad = False
    x = torch.empty(256, 128, dtype=torch.bfloat16, device="meta", requires_grad=True)
    moe(x).float().sum().backward()
    assert moe.expert_down.grad is not None and moe.expert_down.grad.shape == moe.expert_down.shape
    for name in ("expert_gate", "expert_up", "shared_gate", "shared_up", "shared_down"):
        assert getattr(moe, name).grad is None, name
    assert moe.router.weight.grad is not None and x.grad is not None


def _aot_graphs():
    """A torch.compile backend (AOTAutograd, eager kernels) that keeps the forward and backward graphs."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    graphs = []

    def compiler(gm, example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    return aot_autograd(fw_compiler=compiler, bw_compiler=compiler), graphs


def _targets(gm):
    """The functions a graph calls; an op with declared writes appears inside auto_functionalized(_v2) (the
    functional form AOTAutograd gives it): named by the op itself."""
    names = set()
    for n in gm.graph.nodes:
        if n.op == "call_function":
            functionalized = "auto_functionalized" in str(n.target)
            names.add(str(n.args[0]) if functionalized else str(n.target))
    return names


def test_compile_fullgraph_traces_forward_and_backward():
    ws = meta_workspace()
    ctx = ws.make_context()
    x, idx, rw, w = meta_args()
    _requires_grad(x, rw, *w.tensors())

    def loss(x, rw):
        out, _ = mok.forward(ws, x, idx, rw, w, ctx)
        return (out.float() * 2).sum()

    torch._dynamo.reset()
    backend, graphs = _aot_graphs()
    torch.compile(loss, fullgraph=True, backend=backend)(x, rw).backward()
    assert len(graphs) == 2, graphs
    assert "mok.forward.default" in _targets(graphs[0]) and "mok.backward.default" in _targets(graphs[1])
    assert x.grad.shape == (256, 128) and rw.grad.shape == (256, 2) and w.shared_up.grad.shape == (64, 128)


def test_compile_fullgraph_module_with_its_router():
    moe = meta_module()
    moe.prepare(256)
    x = torch.empty(256, 128, dtype=torch.bfloat16, device="meta", requires_grad=True)
    torch._dynamo.reset()
    backend, graphs = _aot_graphs()
    torch.compile(moe, fullgraph=True, backend=backend)(x).float().sum().backward()
    assert "mok.backward.default" in _targets(graphs[-1])
    assert moe.router.weight.grad.shape == (8, 128) and moe.expert_down.grad.shape == (8, 128, 64)


def test_compile_keeps_recompute_forward_context():
    ws = meta_workspace()
    x, idx, rw, w = meta_args()
    _, ctx = mok.forward(ws, x, idx, rw, w)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def fn(x):
        mok.recompute_forward_context(ws, x, w, ctx)
        return x * 2

    torch._dynamo.reset()
    torch.compile(fn, fullgraph=True, backend=backend)(x)
    assert any("recompute_forward_context" in t for t in _targets(graphs[0])), _targets(graphs[0])


def test_module_under_compile_needs_its_workspace_first():
    moe = meta_module()
    x = torch.empty(256, 128, dtype=torch.bfloat16, device="meta")
    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"module.prepare\(num_tokens\)"):
        torch.compile(moe, fullgraph=True, backend="eager")(x)


def test_any_token_count_up_to_the_workspaces():
    """A call passes any T in [0, num_tokens]: x, topk_idx and router_weights agree on it, out and the gradients
    have it; more than num_tokens, or tensors that disagree, are refused naming the argument."""
    ws = meta_workspace()
    x, idx, rw, w = meta_args()
    for t in (256, 100, 1, 0):
        out, ctx = mok.forward(ws, x[:t], idx[:t], rw[:t], w, ws.make_context())
        assert out.shape == (t, SHAPE.hidden)
        d_x, d_rw, grads = mok.backward(ws, out, x[:t], idx[:t], rw[:t], w, ctx)
        assert d_x.shape == (t, SHAPE.hidden) and d_rw.shape == (t, SHAPE.top_k)
        assert grads.expert_gate.shape == w.expert_gate.shape
    big_idx = torch.zeros(257, SHAPE.top_k, dtype=torch.int32, device="meta")
    with pytest.raises(ValueError, match=r"topk_idx: 257 tokens, but the workspace takes at most num_tokens = 256"):
        mok.forward(ws, x, big_idx, rw, w, ws.make_context())
    with pytest.raises(ValueError, match=r"x: expected a contiguous bf16 tensor on meta of shape \[T, H\] = \[100, 128\]"):
        mok.forward(ws, x, idx[:100], rw[:100], w, ws.make_context())
    with pytest.raises(ValueError, match=r"router_weights: .* = \[100, 2\]"):
        mok.forward(ws, x[:100], idx[:100], rw, w, ws.make_context())
    out, ctx = mok.forward(ws, x[:100], idx[:100], rw[:100], w, ws.make_context())
    with pytest.raises(ValueError, match=r"d_out: .* = \[100, 128\]"):
        mok.backward(ws, torch.empty_like(x), x[:100], idx[:100], rw[:100], w, ctx)


# -- Lifetimes (docs/design.md, "Lifetimes"): close, the context manager, the warning, the context pool --------


class FakeNative:
    """Stands for the extension's workspace where no GPU is: counts the contexts made and the closes."""

    def __init__(self):
        self.made = 0
        self.closes = 0

    def make_context(self, stream):
        self.made += 1
        return object()

    def close(self):
        self.closes += 1


def fake_workspace(monkeypatch, ep_size=1):
    monkeypatch.setattr(mok.layer, "_cuda_stream", lambda device: 0)  # no CUDA: the stream is never used
    native = FakeNative()
    shape = dataclasses.replace(SHAPE, ep_size=ep_size)
    return mok.Workspace(shape, mok.Config(), torch.device("cuda", 0), 0, native), native


def test_workspace_close_is_idempotent_and_later_calls_raise(monkeypatch):
    ws, native = fake_workspace(monkeypatch)
    with ws as same:  # the context manager closes
        assert same is ws and not ws.closed
    assert ws.closed and native.closes == 1
    ws.close()
    assert native.closes == 1, "a second close() must not reach the native workspace"
    for call in (ws.make_context, ws.pooled_context, ws.read_status, ws.reset_status):
        with pytest.raises(RuntimeError, match="closed"):
            call()
    meta = meta_workspace()
    x, idx, rw, w = meta_args()
    _, ctx = mok.forward(meta, x, idx, rw, w)
    meta.close()
    meta.close()
    with pytest.raises(RuntimeError, match=r"ws: the workspace is closed \(Workspace.close\(\) was called\)"):
        mok.forward(meta, x, idx, rw, w, ctx)
    with pytest.raises(RuntimeError, match="closed"):
        mok.backward(meta, x, x, idx, rw, w, ctx)
    with pytest.raises(RuntimeError, match="closed"):
        mok.recompute_forward_context(meta, x, w, ctx)
    with pytest.raises(RuntimeError, match="closed"):
        mok.build_schedule(meta, idx, ctx)
    with pytest.raises(RuntimeError, match="closed"):
        meta_module(workspace=meta)(x)
    assert "closed" in repr(meta)


def test_an_unclosed_ep2_workspace_warns_when_collected(monkeypatch):
    import gc
    import warnings
    ws, _ = fake_workspace(monkeypatch, ep_size=2)
    with pytest.warns(ResourceWarning, match=r"collected without close\(\): its NCCL windows and communicator"):
        del ws
        gc.collect()
    for ep_size, close in ((2, True), (1, False)):  # closed, or nothing collective to release: silent
        ws, _ = fake_workspace(monkeypatch, ep_size=ep_size)
        if close:
            ws.close()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            del ws
            gc.collect()
        assert not [w for w in caught if issubclass(w.category, ResourceWarning)], (ep_size, close, caught)


def test_pooled_contexts_are_reused_once_their_lease_is_gone(monkeypatch):
    """mok.forward(ctx=None)'s rule: a pooled native context is handed out again only after the ForwardContext
    that leased it (held by the caller and by the forward's autograd graph) is gone."""
    ws, native = fake_workspace(monkeypatch)
    a = ws.pooled_context()
    b = ws.pooled_context()
    assert native.made == 2 and a._native is not b._native  # both leased: two contexts
    first = a._native
    del a  # the lease dies: its context goes back to the pool
    c = ws.pooled_context()
    assert native.made == 2 and c._native is first, "a free pooled context must be reused"
    d = ws.pooled_context()
    assert native.made == 3 and d._native is not first and d._native is not b._native
    assert len({id(x.handle) for x in (b, c, d)}) == 3 and len({int(x.handle[0]) for x in (b, c, d)}) == 3
    ws.close()
    del b, c, d  # after close the pool is dropped, not refilled
    assert ws._free_contexts == []


def test_the_autograd_graph_holds_the_context_of_its_forward():
    """The lease of mok.forward(ctx=None) lasts as long as the forward's graph: the graph holds the context (eager
    mode), so it is not reused while a backward may still need it, and is released when the graph goes."""
    import gc
    import weakref
    ws = meta_workspace()
    x, idx, rw, w = meta_args()
    _requires_grad(x)
    out, ctx = mok.forward(ws, x, idx, rw, w)
    assert out.grad_fn.mok_context is ctx
    held = weakref.ref(ctx)
    del ctx
    gc.collect()
    assert held() is not None, "the graph must keep the context of its forward"
    out.float().sum().backward()
    assert held() is not None, "a graph kept by its output may run again (retain_graph): the context stays"
    del out
    gc.collect()
    assert held() is None, "the context must go with the graph"


# -- Declared writes (docs/design.md, "Python package", custom ops): the schemas, and the training patterns on a
# -- CPU stand-in of the kernels -------------------------------------------------------------------------------


def _writes(op):
    return [a.name for a in op._schema.arguments if a.alias_info is not None and a.alias_info.is_write]


def test_the_schemas_declare_what_the_ops_write():
    """Each op that writes the context declares its context argument written (the handle, or autograd's
    per-forward token), backward_into and backward_fp8 their gradient buffers (Megatron's main_grad in autograd's
    backward); no op relies on torch.fx.node.has_side_effect to stay in a traced graph."""
    grads = [f"grad_{n}" for n in mok.checks.WEIGHT_NAMES]
    assert _writes(torch.ops.mok.forward.default) == ["context"]
    assert _writes(torch.ops.mok.backward.default) == ["context"]
    assert _writes(torch.ops.mok.backward_into.default) == ["context", *grads]
    assert _writes(torch.ops.mok.recompute_forward_context.default) == ["context"]
    assert _writes(torch.ops.mok.forward_fp8.default) == ["context"]
    assert _writes(torch.ops.mok.backward_fp8.default) == ["context", *grads]
    side_effectful = getattr(torch.fx.node, "_side_effectful_functions", set())
    assert not [f for f in side_effectful if "mok" in str(f)], side_effectful


class _RefContext:
    """The stand-in's forward context: what a forward leaves for its backward (its inputs, as the real one holds
    its schedule and activations)."""
    idx = x = weights = None


class ReferenceNative:
    """The extension's workspace replaced by torch on the CPU (float32 from the bf16 inputs): forward writes the
    context, backward computes the gradients of the forward the context holds (its x, ids and weights, not the
    arguments: a backward of an overwritten context would give another forward's gradients), build_schedule and
    recompute_forward_context rebuild it. Separate gate and up weights only."""

    def make_context(self, stream):
        return _RefContext()

    @staticmethod
    def layer(x, idx, rw, w):
        def mlp(rows, gate, up, down):
            return (torch.nn.functional.silu(rows @ gate.T) * (rows @ up.T)) @ down.T
        out = mlp(x, w[3], w[4], w[5]) if w[3] is not None else torch.zeros_like(x)
        for e in range(w[0].shape[0]):
            tokens, slots = (idx == e).nonzero(as_tuple=True)
            if tokens.numel():
                out = out.index_add(0, tokens, rw[tokens, slots, None] * mlp(x[tokens], w[0][e], w[1][e], w[2][e]))
        return out

    def build_schedule(self, topk_idx, ctx, stream):
        ctx.idx = topk_idx.clone()

    def recompute_forward_context(self, x, weights, ctx, stream):
        ctx.x, ctx.weights = x.clone(), [None if w is None else w.clone() for w in weights]

    def forward(self, x, idx, rw, *rest):
        weights, (out, ctx, stream, _) = rest[:6], rest[6:]
        self.build_schedule(idx, ctx, stream)
        self.recompute_forward_context(x, weights, ctx, stream)
        out.copy_(self.layer(x.float(), idx, rw, [None if w is None else w.float() for w in weights]))

    @staticmethod
    def mlp_backward(rows, gate, up, down, dy):
        """(d_rows, d_gate, d_up, d_down, y) of y = (silu(rows gate^T) * (rows up^T)) down^T (written out: the
        ops run below autograd)."""
        a, b = rows @ gate.T, rows @ up.T
        s = torch.sigmoid(a)
        z = a * s * b
        dz = dy @ down
        da, db = dz * b * s * (1 + a * (1 - s)), dz * a * s
        return da @ gate + db @ up, da.T @ rows, db.T @ rows, dy.T @ z, z @ down.T

    def backward(self, d_out, x, idx, rw, weights, d_x, d_rw, grads, accumulate, ctx, stream):
        x, w, dy = ctx.x.float(), [None if t is None else t.float() for t in ctx.weights], d_out.float()
        g = [torch.zeros_like(x), torch.zeros(rw.shape)] + [None if t is None else torch.zeros_like(t) for t in w]
        if w[3] is not None:
            dx, g[5], g[6], g[7], _ = self.mlp_backward(x, w[3], w[4], w[5], dy)
            g[0] += dx
        for e in range(w[0].shape[0]):
            tokens, slots = (ctx.idx == e).nonzero(as_tuple=True)
            if tokens.numel():
                rows, r = x[tokens], rw[tokens, slots, None].float()
                drows, dg, du, dd, y = self.mlp_backward(rows, w[0][e], w[1][e], w[2][e], r * dy[tokens])
                g[0].index_add_(0, tokens, drows)
                g[2][e], g[3][e], g[4][e] = dg, du, dd
                g[1][tokens, slots] = (dy[tokens] * y).sum(-1)
        d_x.copy_(g[0])
        d_rw.copy_(g[1])
        for buffer, grad in zip(grads, g[2:]):
            if buffer is not None:
                buffer.add_(grad) if accumulate else buffer.copy_(grad)


@pytest.fixture
def cpu_workspace(monkeypatch):
    """A workspace on the CPU whose kernels are ReferenceNative's: the ops' real Python implementations run (the
    handles, the token, the generation check, main_grad), registered as the ops' CPU kernels."""
    for op in (mok.ops.forward_op, mok.ops.backward_op, mok.ops.backward_into_op, mok.ops.recompute_op,
               mok.ops.forward_fp8_op, mok.ops.backward_fp8_op, mok.ops.recompute_fp8_op):
        if "cpu" not in op._backend_fns:
            op.register_kernel("cpu")(op._init_fn)
    monkeypatch.setattr(mok.ops, "_stream", lambda t: 0)
    monkeypatch.setattr(mok.layer, "_cuda_stream", lambda device: 0)
    torch._dynamo.reset()
    yield mok.Workspace(SHAPE, mok.Config(), torch.device("cpu"), 0, ReferenceNative())
    torch._dynamo.reset()


def cpu_block(ws, seed, **kw):
    torch.manual_seed(seed)
    return mok.MoE(SHAPE.hidden, SHAPE.intermediate, SHAPE.num_experts, SHAPE.top_k, router=False, workspace=ws,
                   **kw)


def _step(layers, blocks, x, idx, rw, d_out):
    """loss = sum(layers(x) * d_out), backward: the input's and every parameter's gradient and main_grad."""
    for b in blocks:
        for p in b.parameters():
            p.grad = None
    h0 = x.detach().clone().requires_grad_(True)
    h = h0
    for layer in layers:
        h = layer(h, idx, rw)
    (h.float() * d_out.float()).sum().backward()
    got = {"x": h0.grad, "out": h.detach()}
    for n, b in enumerate(blocks):
        for name, p in b.named_parameters():
            got[f"{n}.{name}"] = p.grad
            if getattr(p, "main_grad", None) is not None:
                got[f"{n}.{name}.main_grad"] = p.main_grad.clone()
    return got


def _assert_same(got, want, what):
    assert got.keys() == want.keys(), what
    for k in want:
        assert (got[k] is None) == (want[k] is None), f"{what}: {k}"
        assert got[k] is None or torch.equal(got[k], want[k]), f"{what}: {k} differs"


@pytest.mark.parametrize("main_grad, backend", [(False, "aot_eager"), (True, "aot_eager"), (True, "inductor")],
                         ids=["grads-aot_eager", "main_grad-aot_eager", "main_grad-inductor"])
def test_blocks_compiled_one_by_one_equal_eager_on_the_cpu_stand_in(cpu_workspace, main_grad, backend):
    """8 blocks sharing the workspace, a context each, the routing given, compiled block by block: one compiled
    frame for the 8, no graph break, two steps bitwise equal to eager (gradients, or main_grad accumulated)."""
    import torch._dynamo.testing
    from torch._dynamo.utils import counters
    ws = cpu_workspace
    blocks = [cpu_block(ws, 90 + i, context=ws.make_context(), main_grad=main_grad) for i in range(8)]
    if main_grad:
        for b in blocks:
            b.allocate_main_grads()
    x, idx, rw = make_inputs(SHAPE, "cpu", seed=92)
    d_out = torch.randn(x.shape, generator=torch.Generator().manual_seed(93)).to(torch.bfloat16)

    def zero_main_grads():
        for b in blocks:
            for p in b.weights().tensors():
                if getattr(p, "main_grad", None) is not None:
                    p.main_grad.zero_()

    eager = [_step(blocks, blocks, x, idx, rw, d_out) for _ in range(2)]
    zero_main_grads()
    counters.clear()
    counter = torch._dynamo.testing.CompileCounterWithBackend(backend)
    compiled = [torch.compile(b, fullgraph=True, backend=counter) for b in blocks]
    got = [_step(compiled, blocks, x, idx, rw, d_out) for _ in range(2)]
    assert counter.frame_count == 1, f"{counter.frame_count} frames compiled for 8 blocks of one shape"
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    for step in range(2):
        _assert_same(got[step], eager[step], f"step {step}: 8 blocks compiled one by one vs eager")
    if main_grad:
        assert all(g is None for k, g in got[1].items() if k.endswith(("gate", "up", "down"))), \
            "with main_grad (no Megatron attributes) the weights get no .grad"
        assert torch.equal(got[1]["0.expert_down.main_grad"], 2 * got[0]["0.expert_down.main_grad"])


@pytest.mark.parametrize("backend", [None, "aot_eager"], ids=["eager", "aot_eager"])
def test_a_context_overwritten_before_its_backward_raises_on_the_cpu_stand_in(cpu_workspace, backend):
    ws = cpu_workspace
    moe = cpu_block(ws, 85, context=ws.make_context())
    layer = moe if backend is None else torch.compile(moe, fullgraph=True, backend=backend)
    x1, idx1, rw1 = make_inputs(SHAPE, "cpu", seed=86)
    x2, idx2, rw2 = make_inputs(SHAPE, "cpu", seed=87)
    y1, y2 = layer(x1, idx1, rw1), layer(x2, idx2, rw2)
    with pytest.raises(RuntimeError, match="overwritten by a later forward"):
        (y1.float() + y2.float()).sum().backward()
    d_out = torch.ones(x1.shape, dtype=torch.bfloat16)
    want = _step([moe], [moe], x1, idx1, rw1, d_out)
    _assert_same(_step([layer], [moe], x1, idx1, rw1, d_out), want, "the step after the refused backward")


def test_main_grad_follows_replaced_parameters_on_the_cpu_stand_in(cpu_workspace):
    """main_grad=True: a parameter replaced after a forward (module.expert_down = Parameter(...), what
    load_state_dict(assign=True) and to_empty do) gets the next backward's gradient in its own main_grad; the old
    one's main_grad is left as it was."""
    ws = cpu_workspace
    moe = cpu_block(ws, 51, context=ws.make_context(), main_grad=True)
    moe.allocate_main_grads()
    x, idx, rw = make_inputs(SHAPE, "cpu", seed=52)
    (moe(x, idx, rw).float().sum()).backward()
    old = moe.expert_down
    old_main_grad = old.main_grad.clone()
    moe.expert_down = torch.nn.Parameter(old.detach().clone())
    moe.allocate_main_grads()
    (moe(x, idx, rw).float().sum()).backward()
    assert torch.equal(old.main_grad, old_main_grad), "the replaced parameter's main_grad changed"
    assert torch.equal(moe.expert_down.main_grad, old_main_grad), "the new parameter did not get the gradient"


def test_deepcopy_and_pickle_of_a_block_on_the_cpu_stand_in(cpu_workspace):
    """copy.deepcopy: the copy shares the workspace, gets a context and main_grad targets of its own, and the two
    run interleaved (both forwards, then both backwards) with the gradients of each alone. pickle: the device state
    is left out (made again at the first forward), the parameters kept."""
    import copy
    import pickle
    ws = cpu_workspace
    moe = cpu_block(ws, 41, context=ws.make_context(), main_grad=True)
    moe.allocate_main_grads()
    twin = copy.deepcopy(moe)
    assert twin.workspace is ws and twin._context is None and twin.expert_down is not moe.expert_down
    assert not twin._own_workspace  # shared: a moved copy does not close the original's workspace
    twin.prepare(SHAPE.num_tokens)
    twin.allocate_main_grads()  # a deep-copied Parameter has no main_grad attribute (torch copies the data only)
    x, idx, rw = make_inputs(SHAPE, "cpu", seed=42)
    d_out = torch.randn(x.shape, generator=torch.Generator().manual_seed(43)).to(torch.bfloat16)
    want = _step([moe], [moe], x, idx, rw, d_out)
    for p in moe.weights().tensors():
        p.main_grad.zero_()
    y1, y2 = moe(x, idx, rw), twin(x, idx, rw)
    ((y1.float() + y2.float()) * d_out.float()).sum().backward()
    assert torch.equal(moe.expert_down.main_grad, want["0.expert_down.main_grad"])
    assert torch.equal(twin.expert_down.main_grad, want["0.expert_down.main_grad"])
    loaded = pickle.loads(pickle.dumps(moe))
    assert loaded.workspace is None and loaded._context is None
    assert torch.equal(loaded.expert_down, moe.expert_down)


def test_caller_routing_shaped_like_x_on_the_cpu_stand_in(cpu_workspace):
    """mok.MoE with the caller's routing: x [B, S, H] with topk_idx and router_weights [B, S, k] (non-contiguous
    too) gives the [T, k] call's bits."""
    ws = cpu_workspace
    moe = cpu_block(ws, 31, context=ws.make_context())
    x, idx, rw = make_inputs(SHAPE, "cpu", seed=32)
    want = moe(x, idx, rw)
    b = 4
    got = moe(x.view(b, -1, SHAPE.hidden), idx.view(b, -1, SHAPE.top_k).transpose(0, 1).contiguous().transpose(0, 1),
              rw.view(b, -1, SHAPE.top_k))
    assert torch.equal(got.view(want.shape), want)


@pytest.mark.parametrize("backward", [False, True])
def test_fp8_weights_are_quantized_again_when_a_parameter_changes(monkeypatch, backward):
    """mok.MoE(precision="fp8")'s quantized weights (quantize_weights counted, on meta): kept while the parameters
    are unchanged; made again after an in-place write (the version counter), after a parameter is replaced (another
    tensor), and after refresh_fp8_weights() (for writes through .data, which bypass the counter); with the
    backward's transposed copies exactly when the workspace has a backward."""
    calls = []

    def quantize(weights, pow2, transposed):
        assert transposed == backward, "the transposed copies are the backward's"
        calls.append(weights)
        return len(calls)

    monkeypatch.setattr(mok.module, "quantize_weights", quantize)
    moe = mok.MoE(128, 128, 8, 2, config=mok.Config(precision="fp8", backward=backward), device="meta")
    assert moe.fp8_weights() == 1 and moe.fp8_weights() == 1
    with torch.no_grad():
        moe.expert_down.add_(1)
    assert moe.fp8_weights() == 2
    moe.expert_down = torch.nn.Parameter(torch.empty_like(moe.expert_down))
    assert moe.fp8_weights() == 3
    moe.expert_down.data.zero_()
    assert moe.fp8_weights() == 3, "a write through .data is not seen (documented)"
    moe.refresh_fp8_weights()
    assert moe.fp8_weights() == 4


def test_a_double_backward_says_it_is_not_supported_on_the_cpu_stand_in(cpu_workspace):
    """The layer is once differentiable: differentiating its gradient raises torch's own error for that (its
    gradient has no graph: "does not require grad", or once_differentiable's where an input of the backward
    requires grad), not a hint to register a formula the ops cannot have."""
    ws = cpu_workspace
    moe = cpu_block(ws, 21, context=ws.make_context())
    x, idx, rw = make_inputs(SHAPE, "cpu", seed=22)
    x.requires_grad_(True)
    (d_x,) = torch.autograd.grad(moe(x, idx, rw).float().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="does not require grad|marked with @once_differentiable"):
        d_x.float().sum().backward()


def test_the_router_computes_in_fp32_under_autocast_on_the_cpu_stand_in(cpu_workspace):
    """mok.MoE's router under a bf16 autocast: the same experts and weights as without it (fp32 logits)."""
    moe = mok.MoE(SHAPE.hidden, SHAPE.intermediate, SHAPE.num_experts, SHAPE.top_k, workspace=cpu_workspace)
    x, _, _ = make_inputs(SHAPE, "cpu", seed=58)
    want = moe.route(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = moe.route(x)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert got[1].dtype == torch.float32


def test_handles_made_under_another_default_device_on_the_cpu_stand_in(cpu_workspace):
    """A context made inside `with torch.device("meta")` (a module built there) still has a CPU handle, and its
    forward and backward give the bits of a context made outside."""
    ws = cpu_workspace
    with torch.device("meta"):
        context = ws.make_context()
    assert context.handle.device.type == "cpu"
    x, idx, rw = make_inputs(SHAPE, "cpu", seed=56)
    d_out = torch.randn(x.shape, generator=torch.Generator().manual_seed(57)).to(torch.bfloat16)
    inside, outside = cpu_block(ws, 55, context=context), cpu_block(ws, 55, context=ws.make_context())
    _assert_same(_step([inside], [inside], x, idx, rw, d_out), _step([outside], [outside], x, idx, rw, d_out),
                 "a context made under the meta default device vs outside")


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "aot_eager"])
def test_non_reentrant_checkpointing_on_the_cpu_stand_in(cpu_workspace, compiled):
    """torch.utils.checkpoint(use_reentrant=False), the activation checkpointing torchtitan applies, around two
    blocks with a context each: the backward's recomputation runs mok::forward again (a new generation of the
    context, with the same bits) and the backward takes that forward's token, so no "overwritten" error, and every
    gradient bitwise the step without checkpointing. A context really overwritten still raises (the test above)."""
    from torch.utils.checkpoint import checkpoint
    ws = cpu_workspace
    blocks = [cpu_block(ws, 61 + i, context=ws.make_context()) for i in range(2)]
    x, idx, rw = make_inputs(SHAPE, "cpu", seed=63)
    d_out = torch.randn(x.shape, generator=torch.Generator().manual_seed(64)).to(torch.bfloat16)
    want = _step(blocks, blocks, x, idx, rw, d_out)
    layers = [torch.compile(b, fullgraph=True, backend="aot_eager") for b in blocks] if compiled else blocks
    checkpointed = [lambda h, i, r, layer=layer: checkpoint(layer, h, i, r, use_reentrant=False) for layer in layers]
    for step in range(2):
        _assert_same(_step(checkpointed, blocks, x, idx, rw, d_out), want, f"step {step}: checkpointed vs plain")


@pytest.mark.parametrize("backend", [None, "aot_eager"], ids=["eager", "aot_eager"])
def test_layers_sharing_one_context_with_recompute_on_the_cpu_stand_in(cpu_workspace, backend):
    """(a) Two layers on one context with recompute=True: no error (the second layer's backward rewrites the
    context the first one's reads), gradients bitwise those of the same layers with a context each."""
    ws = cpu_workspace
    shared = ws.make_context()
    sharing = [cpu_block(ws, 81 + i, recompute=True, context=shared) for i in range(2)]
    separate = [cpu_block(ws, 81 + i, context=ws.make_context()) for i in range(2)]
    x, idx, rw = make_inputs(SHAPE, "cpu", seed=83)
    d_out = torch.randn(x.shape, generator=torch.Generator().manual_seed(84)).to(torch.bfloat16)
    layers = sharing if backend is None else [torch.compile(b, fullgraph=True, backend=backend) for b in sharing]
    got = _step(layers, sharing, x, idx, rw, d_out)
    want = _step(separate, separate, x, idx, rw, d_out)
    _assert_same({k: v for k, v in got.items()}, want, "shared context + recompute vs a context each")


@pytest.mark.parametrize("backend", [None, "aot_eager"], ids=["eager", "aot_eager"])
@pytest.mark.parametrize("order", ["together", "first-first", "last-first", "one-after-another"])
def test_micro_batches_adding_into_one_main_grad_on_the_cpu_stand_in(cpu_workspace, backend, order):
    """(b) Two micro-batches' forwards, then both backwards (1F1B-like, either order, or one backward call for
    both), and (c) forward+backward one micro-batch after another: each backward adds into the same main_grad
    (declared written) without autograd calling that an in-place modification; main_grad ends bitwise g1 + g2
    (each g computed alone into zeros)."""
    ws = cpu_workspace
    moe = cpu_block(ws, 71, context=ws.make_context(), recompute=True, main_grad=True)
    moe.allocate_main_grads()
    layer = moe if backend is None else torch.compile(moe, fullgraph=True, backend=backend)
    batches = [make_inputs(SHAPE, "cpu", seed=s) for s in (72, 74)]
    d_outs = [torch.randn(SHAPE.num_tokens, SHAPE.hidden, generator=torch.Generator().manual_seed(s)).to(
        torch.bfloat16) for s in (73, 75)]
    alone = []
    for (x, idx, rw), d in zip(batches, d_outs):  # each micro-batch's gradient alone, eagerly
        for p in moe.weights().tensors():
            p.main_grad.zero_()
        (moe(x, idx, rw).float() * d.float()).sum().backward()
        alone.append({n: p.main_grad.clone() for n, p in zip(mok.checks.WEIGHT_NAMES, moe.weights().tensors())})
    for p in moe.weights().tensors():
        p.main_grad.zero_()
    losses = []
    for (x, idx, rw), d in zip(batches, d_outs):
        if order == "one-after-another":
            (layer(x, idx, rw).float() * d.float()).sum().backward()
        else:
            losses.append((layer(x, idx, rw).float() * d.float()).sum())
    if order == "together":
        (losses[0] + losses[1]).backward()
    elif order in ("first-first", "last-first"):
        for i in ((0, 1) if order == "first-first" else (1, 0)):
            losses[i].backward()
    for n, p in zip(mok.checks.WEIGHT_NAMES, moe.weights().tensors()):
        first, second = (alone[1][n], alone[0][n]) if order == "last-first" else (alone[0][n], alone[1][n])
        assert torch.equal(p.main_grad, first + second), f"{n}: main_grad differs from g1 + g2"


# ---------------------------------------------------------------------------------------------------------------
# The FP8 layer's Python side (mok.forward_fp8 under autograd, mok.backward_fp8, mok.MoE(precision="fp8")) on the CPU
# stand-in: weights exactly representable in e4m3 with scales 1, so the FP8 layer's reference is the bf16 layer's and
# every gradient must be the BF16 path's bits.


def _e4m3_exact(t: torch.Tensor) -> torch.Tensor:
    """t rounded to e4m3 and back (bf16): values the FP8 weights hold exactly with scale 1."""
    return t.to(torch.float8_e4m3fn).to(torch.bfloat16)


def _fake_quantize(weights, power_of_two_scales=False, transposed=False) -> mok.Fp8Weights:
    """mok.quantize_weights on the CPU for e4m3-exact weights: the values cast, every block scale 1, the transposed
    copies [gate; up]^T and down^T."""
    w = mok.Weights.of(weights)
    blocks = lambda t: torch.ones(*t.shape[:-2], -(-t.shape[-2] // 128), -(-t.shape[-1] // 128))
    tensors = [None if t is None else t.detach() for t in w.tensors()]
    values = tuple(None if t is None else t.to(torch.float8_e4m3fn) for t in tensors)
    scales = tuple(None if t is None else blocks(t) for t in tensors)
    if not transposed:
        return mok.Fp8Weights(values, scales)
    copies = []
    for gate, up, down in ((0, 1, 2), (3, 4, 5)):
        if tensors[gate] is None:
            copies += [None, None]
            continue
        gate_up = torch.cat([t for t in (tensors[gate], tensors[up]) if t is not None], dim=-2)
        copies += [gate_up.transpose(-1, -2).contiguous(), tensors[down].transpose(-1, -2).contiguous()]
    return mok.Fp8Weights(values, scales, tuple(None if t is None else t.to(torch.float8_e4m3fn) for t in copies),
                          tuple(None if t is None else blocks(t) for t in copies))


class Fp8ReferenceNative(ReferenceNative):
    """ReferenceNative with the extension's FP8 entry points: the layer on the FP8 weights as given (e4m3 values,
    scales 1 here), forward and backward as ReferenceNative's."""

    def forward_fp8(self, x, idx, rw, values, scales, out, ctx, stream):
        assert all(s is None or bool((s == 1).all()) for s in scales), "the stand-in takes scales 1 only"
        weights = [None if v is None else v.view(torch.float8_e4m3fn).to(torch.bfloat16) for v in values]
        self.forward(x, idx, rw, *weights, out, ctx, stream, False)

    def recompute_forward_context_fp8(self, x, values, scales, ctx, stream):
        assert all(s is None or bool((s == 1).all()) for s in scales), "the stand-in takes scales 1 only"
        weights = [None if v is None else v.view(torch.float8_e4m3fn).to(torch.bfloat16) for v in values]
        self.recompute_forward_context(x, weights, ctx, stream)

    def backward_fp8(self, d_out, x, idx, rw, values, scales, transposed, transposed_scales, d_x, d_rw, grads,
                     accumulate, ctx, stream):
        assert len(transposed) == len(transposed_scales) == 4
        self.backward(d_out, x, idx, rw, None, d_x, d_rw, grads, accumulate, ctx, stream)


@pytest.fixture
def cpu_fp8_workspace(cpu_workspace):
    """The CPU stand-in's FP8 twin (Config(precision="fp8")); cpu_workspace, the BF16 one, beside it."""
    yield mok.Workspace(SHAPE, mok.Config(precision="fp8"), torch.device("cpu"), 0, Fp8ReferenceNative())


def _exact_block(block):
    """block (a mok.MoE) with its parameters rounded to e4m3 (exact in the FP8 layer with scales 1), and its
    main_grad buffers when it has main_grad=True."""
    with torch.no_grad():
        for p in block.weights().tensors():
            if p is not None:
                p.copy_(_e4m3_exact(p))
    if block.main_grad:
        block.allocate_main_grads()
    return block


def _exact_weights(seed, shared=True):
    w = make_weights(SHAPE, "cpu", seed=seed)
    return mok.Weights(*[None if t is None or (not shared and n >= 3) else _e4m3_exact(t)
                         for n, t in enumerate(w.tensors())])


@pytest.mark.parametrize("frozen_up", [False, True])
def test_fp8_autograd_on_the_cpu_stand_in(cpu_workspace, cpu_fp8_workspace, frozen_up):
    """mok.forward_fp8 under autograd (master_weights: the bf16 weights) gives mok.forward's gradients bit for bit
    (x, router weights, every master weight; a frozen expert_up gets none and its partner still its own), and
    mok.backward_fp8 gives the same; fp32 main_grads accumulated twice are (0 + g) + g; a second forward on the
    context before the backward raises."""
    w = _exact_weights(120)
    x, idx, rw = make_inputs(SHAPE, "cpu", seed=121)
    d_out = torch.randn(x.shape, generator=torch.Generator().manual_seed(122)).to(torch.bfloat16)
    qw = _fake_quantize(w, transposed=True)
    results = []
    for fp8 in (False, True):
        leaves = [x.clone().requires_grad_(), rw.clone().requires_grad_()]
        masters = mok.Weights(*[None if t is None else t.clone().requires_grad_(not (frozen_up and n == 1))
                                for n, t in enumerate(w.tensors())])
        if fp8:
            out, _ = mok.forward_fp8(cpu_fp8_workspace, leaves[0], idx, leaves[1], qw,
                                     cpu_fp8_workspace.make_context(), master_weights=masters)
        else:
            out, _ = mok.forward(cpu_workspace, leaves[0], idx, leaves[1], masters, cpu_workspace.make_context())
        out.backward(d_out)
        results.append([out.detach(), leaves[0].grad, leaves[1].grad] + [None if t is None else t.grad
                                                                          for t in masters.tensors()])
    for n, (a, b) in enumerate(zip(*results)):
        assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), f"output {n}: FP8 vs BF16 path"
    assert (results[1][4] is None) == frozen_up and results[1][3] is not None
    _, ctx = mok.forward_fp8(cpu_fp8_workspace, x, idx, rw, qw)
    d_x, d_rw, grads = mok.backward_fp8(cpu_fp8_workspace, d_out, x, idx, rw, qw, ctx, grad_dtype=torch.float32)
    assert torch.equal(d_x, results[0][1]) and torch.equal(d_rw, results[0][2])
    main = mok.main_grads(w)
    for _ in range(2):
        _, ctx = mok.forward_fp8(cpu_fp8_workspace, x, idx, rw, qw, ctx)
        mok.backward_fp8(cpu_fp8_workspace, d_out, x, idx, rw, qw, ctx, main_grads=main)
    for n, (m, g) in enumerate(zip(main.tensors(), grads.tensors())):
        assert torch.equal(m, (torch.zeros_like(g) + g) + g), f"weight {n}: main_grads"
    leaf = x.clone().requires_grad_()
    out, ctx = mok.forward_fp8(cpu_fp8_workspace, leaf, idx, rw, qw)
    mok.forward_fp8(cpu_fp8_workspace, x, idx, rw, qw, ctx)
    with pytest.raises(RuntimeError, match="overwritten by a later forward") as raised:
        out.backward(d_out)
    assert "recompute=True" in str(raised.value), "FP8's recompute is the other way out"
    with pytest.raises(ValueError, match="quantized without the transposed copies"):
        mok.forward_fp8(cpu_fp8_workspace, leaf, idx, rw, _fake_quantize(w))


@pytest.mark.parametrize("main_grad", [False, True])
def test_fp8_module_trains_like_bf16_on_the_cpu_stand_in(cpu_workspace, cpu_fp8_workspace, monkeypatch, main_grad):
    """mok.MoE(precision="fp8") with e4m3-exact parameters: two steps of gradients (or main_grad accumulated)
    bitwise the BF16 module's; after an optimizer step the weights are quantized again (the step's values are
    rounded to e4m3 first, so that they stay exact); with recompute=True two layers share one context."""
    monkeypatch.setattr(mok.module, "quantize_weights", _fake_quantize)
    blocks = [_exact_block(cpu_block(ws, 130, context=ws.make_context(), main_grad=main_grad))
              for ws in (cpu_workspace, cpu_fp8_workspace)]
    x, idx, rw = make_inputs(SHAPE, "cpu", seed=131)
    d_out = torch.randn(x.shape, generator=torch.Generator().manual_seed(132)).to(torch.bfloat16)
    for step in range(2):
        got = [_step([b], [b], x, idx, rw, d_out) for b in blocks]
        _assert_same(got[1], got[0], f"step {step}: FP8 module vs BF16 module")
        for b in blocks:
            with torch.no_grad():
                for p in b.weights().tensors():
                    if p is not None:
                        g = p.main_grad if main_grad else p.grad
                        p.copy_(_e4m3_exact(p - 0.25 * g))
    # recompute=True: two layers sharing one context (the backward rebuilds it from x and the FP8 weights) give the
    # bits of the same two layers with a context each.
    shared_context = cpu_fp8_workspace.make_context()
    layers = {recompute: [_exact_block(cpu_block(
        cpu_fp8_workspace, 133 + n, main_grad=main_grad, recompute=recompute,
        context=shared_context if recompute else cpu_fp8_workspace.make_context())) for n in range(2)]
        for recompute in (False, True)}
    got = {r: _step(pair, pair, x, idx, rw, d_out) for r, pair in layers.items()}
    _assert_same(got[True], got[False], "FP8 layers sharing a context with recompute=True vs a context each")
    # The functional recompute takes the FP8 weights on an FP8 workspace, bf16 ones on a bf16 workspace.
    w = _exact_weights(134)
    ctx = cpu_fp8_workspace.make_context()
    mok.forward_fp8(cpu_fp8_workspace, x, idx, rw, _fake_quantize(w), ctx)
    with pytest.raises(TypeError, match="expected mok.Fp8Weights"):
        mok.recompute_forward_context(cpu_fp8_workspace, x, w, ctx)
    with pytest.raises(TypeError):
        mok.recompute_forward_context(cpu_workspace, x, _fake_quantize(w), cpu_workspace.make_context())
    with pytest.raises(TypeError, match="recompute"):
        mok.forward_fp8(cpu_fp8_workspace, x, idx, rw, _fake_quantize(w), ctx, recompute="yes")
    assert mok.recompute_forward_context(cpu_fp8_workspace, x, _fake_quantize(w), ctx) is ctx


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_fp8_compiled_equals_eager_on_the_cpu_stand_in(cpu_fp8_workspace, backend):
    """mok.forward_fp8 (master_weights under autograd) and the explicit mok.backward_fp8 under
    torch.compile(fullgraph=True): the ops mok::forward_fp8 / mok::backward_fp8 traced (forward and backward
    graphs), and every output and gradient bitwise the eager calls'; the pooled context (ctx=None) is refused under
    compile."""
    ws = cpu_fp8_workspace
    w = _exact_weights(140)
    qw = _fake_quantize(w, transposed=True)
    x, idx, rw = make_inputs(SHAPE, "cpu", seed=141)
    d_out = torch.randn(x.shape, generator=torch.Generator().manual_seed(142)).to(torch.bfloat16)
    ctx = ws.make_context()

    def train(x, rw, masters):
        out, _ = mok.forward_fp8(ws, x, idx, rw, qw, ctx, master_weights=masters)
        return (out.float() * d_out.float()).sum()

    def explicit(x, rw):
        mok.forward_fp8(ws, x, idx, rw, qw, ctx)
        return mok.backward_fp8(ws, d_out, x, idx, rw, qw, ctx, grad_dtype=torch.float32)

    results = []
    for compiled in (False, True):
        torch._dynamo.reset()
        graphs = []
        if compiled and backend == "aot_eager":
            backend_fn, graphs = _aot_graphs()
        else:
            backend_fn = backend
        run = (lambda f: torch.compile(f, fullgraph=True, backend=backend_fn)) if compiled else (lambda f: f)
        leaves = [x.clone().requires_grad_(), rw.clone().requires_grad_()]
        masters = mok.Weights(*[None if t is None else t.clone().requires_grad_() for t in w.tensors()])
        run(train)(*leaves, masters).backward()
        if compiled and backend == "aot_eager":
            assert len(graphs) == 2, graphs  # forward and backward: one graph each, no break
            assert "mok.forward_fp8.default" in _targets(graphs[0]), _targets(graphs[0])
            assert "mok.backward_fp8.default" in _targets(graphs[1]), _targets(graphs[1])
        d_x, d_rw, grads = run(explicit)(x, rw)
        results.append([leaves[0].grad, leaves[1].grad, *[t.grad for t in masters.tensors() if t is not None],
                        d_x, d_rw, *[g for g in grads.tensors() if g is not None]])
    for n, (a, b) in enumerate(zip(*results)):
        assert torch.equal(a, b), f"value {n}: compiled ({backend}) vs eager"
    torch._dynamo.reset()
    with pytest.raises(Exception, match="pass ctx=ws.make_context\\(\\)"):
        torch.compile(lambda x: mok.forward_fp8(ws, x, idx, rw, qw)[0], fullgraph=True, backend="eager")(x)
    torch._dynamo.reset()


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_fp8_module_compiled_equals_eager_on_the_cpu_stand_in(cpu_fp8_workspace, monkeypatch, backend):
    """mok.MoE(precision="fp8") under torch.compile(fullgraph=True) quantizes its weights inside the graph in every
    forward (not through its eager cache): two steps with an update of the parameters between, and a forward under
    no_grad, give the eager module's outputs and gradients bit for bit; one forward graph holds mok::forward_fp8."""
    monkeypatch.setattr(mok.module, "quantize_weights", _fake_quantize)
    moe = cpu_block(cpu_fp8_workspace, 150, context=cpu_fp8_workspace.make_context())
    with torch.no_grad():
        for p in moe.weights().tensors():
            if p is not None:
                p.copy_(_e4m3_exact(p))
    start = {n: t.detach().clone() for n, t in moe.state_dict().items()}
    x, idx, rw = make_inputs(SHAPE, "cpu", seed=151)
    d_out = torch.randn(x.shape, generator=torch.Generator().manual_seed(152)).to(torch.bfloat16)

    def steps(layer):
        moe.load_state_dict(start)
        got = []
        for _ in range(2):
            grads = _step([layer], [moe], x, idx, rw, d_out)
            got += [grads[n] for n in sorted(grads)]
            with torch.no_grad():
                for p in moe.weights().tensors():
                    if p is not None:
                        p.copy_(_e4m3_exact(p - 0.25 * p.grad))
        with torch.no_grad():
            got.append(layer(x, idx, rw))
        return got

    eager = steps(moe)
    torch._dynamo.reset()
    graphs = []
    backend_fn = backend
    if backend == "aot_eager":
        backend_fn, graphs = _aot_graphs()
    compiled = steps(torch.compile(moe, fullgraph=True, backend=backend_fn))
    torch._dynamo.reset()
    if graphs:
        assert any("mok.forward_fp8.default" in _targets(g) for g in graphs), [_targets(g) for g in graphs]
    for n, (a, b) in enumerate(zip(eager, compiled)):
        assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), f"value {n}: compiled vs eager"


def test_fp8_ops_called_directly_with_a_dead_handle_say_so(cpu_fp8_workspace):
    """torch.ops.mok.forward_fp8 / backward_fp8 called by hand with a handle no live object has: a RuntimeError
    naming the op and the handle; the next good call through mok.forward_fp8 works."""
    ws = cpu_fp8_workspace
    qw = _fake_quantize(_exact_weights(150), transposed=True)
    x, idx, rw = make_inputs(SHAPE, "cpu", seed=151)
    ctx = ws.make_context()
    dead = torch.tensor([10**12], dtype=torch.int64)
    with pytest.raises(RuntimeError, match="mok::forward_fp8: no live workspace with handle"):
        torch.ops.mok.forward_fp8(dead, ctx.handle, x, idx, rw, list(qw.values), list(qw.scales))
    with pytest.raises(RuntimeError, match="mok::backward_fp8: no live forward context with handle"):
        torch.ops.mok.backward_fp8(ws.handle, dead, x, x, idx, rw, list(qw.values), list(qw.scales),
                                   list(qw.values_t), list(qw.scales_t), *([None] * 6), False)
    out, ctx = mok.forward_fp8(ws, x, idx, rw, qw, ctx)
    d_x, _, _ = mok.backward_fp8(ws, torch.ones_like(out), x, idx, rw, qw, ctx)
    assert not out.isnan().any() and not d_x.isnan().any()
