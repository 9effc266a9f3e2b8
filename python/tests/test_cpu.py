"""Tests that run without a GPU: the package and its extension load, defaults, argument checks (they fire
before any CUDA call), fake/meta shapes of the custom op, torch.compile(fullgraph=True) tracing, and the
NotImplementedError of the backward pass (issue 14)."""
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
    assert (c.comm_ctas, c.minibatch_rows, c.macrobatch_rows, c.capacity_rows, c.tile_m, c.wait_timeout_s, c.path) \
        == (0, 4096, 0, 0, 64, 10.0, "fused")


@pytest.mark.parametrize("field, value", [("path", "megakernel"), ("comm_ctas", -2), ("tile_m", 1.5),
                                          ("wait_timeout_s", 0), ("minibatch_rows", True)])
def test_config_rejects(field, value):
    with pytest.raises(ValueError, match=f"Config.{field}"):
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
    with pytest.raises(ValueError, match="topk_idx"):
        mok.build_schedule(ws, idx[:7], ws.make_context())


def test_fake_tensor_mode_shapes():
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    ws = meta_workspace()
    ctx = ws.make_context()
    with FakeTensorMode():
        x, idx, rw = make_inputs(SHAPE, "cpu")
        w = make_weights(SHAPE, "cpu")
        out = torch.ops.mok.forward(ws.handle, ctx.handle, False, x, idx, rw, w.expert_gate, w.expert_up,
                                    w.expert_down, w.shared_gate, w.shared_up, w.shared_down)
        assert isinstance(out, FakeTensor)
        assert (out.shape, out.dtype) == ((256, 128), torch.bfloat16)


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


def test_backward_is_not_built_yet():
    for fn in (mok.backward, mok.recompute_forward_context, mok.main_grads):
        with pytest.raises(NotImplementedError, match=r"backward pass is not built yet \(issue 14\)"):
            fn()
    ws = meta_workspace()
    x, idx, rw, w = meta_args()
    x.requires_grad_(True)
    out, _ = mok.forward(ws, x, idx, rw, w)
    with pytest.raises(NotImplementedError, match=r"issue 14"):
        out.float().sum().backward()


def test_cpp_errors_become_python_exceptions():
    from conftest import hopper_skip_reason
    if torch.cuda.is_available():
        pytest.skip("needs a machine without a usable CUDA device")
    from mok import _mok
    with pytest.raises(RuntimeError, match="cuda"):
        _mok.Workspace(0, 1, 0, None, 256, 128, 64, 2, 8, True, 0.0, 0, 0, 4096, 0, 0, 64, 10.0)
    assert hopper_skip_reason() is not None  # the process is alive
