"""CPU tests of the Python API's argument checks: every constructor and option (Config, LayerShape, get_workspace,
mok.MoE, Weights.of, forward/backward keywords, main_grads, require_hopper) refuses a bad value in Python, before any
work, with TypeError (wrong type; bool where an int is expected) or ValueError (wrong value) whose message starts with
the argument's name.

CASES is the table "Python constructors and options" of docs/bad_inputs.md, row for row: each row's call is run
here as written (eval, in the namespace of `names()`), and test_the_doc_table_is_the_test_table checks that the
document's rows and CASES are the same set, so the two cannot drift apart.

Also mok.require_hopper's messages: on this machine (no Hopper GPU: get_workspace and mok.MoE refuse it), and with
torch.cuda's queries monkeypatched (an A100, a missing cuda:1, an sm_90 device that passes).
"""
import re
from pathlib import Path

import pytest
import torch

import mok
from conftest import make_inputs, make_weights

DOC = Path(__file__).resolve().parents[2] / "docs" / "bad_inputs.md"
SECTION = "## Python constructors and options"
HOPPER = "mok needs an NVIDIA Hopper GPU (sm_90); found "
WS = "mok.get_workspace(mok.Config(), None, 256, 128, 64, 2, 8, device=\"meta\")"


def names():
    """The namespace the calls run in: ws a meta workspace (T 256, H 128, I 64, k 2, E 8, a shared expert), x, idx,
    rw, w its inputs and weights (meta), ctx the context of a forward, d_out a bf16 [256, 128] meta tensor; ws8 an FP8
    inference workspace of the same shape (meta) and q8 its weights, a mok.Fp8Weights of meta tensors."""
    ws = eval(WS, {"mok": mok})
    shape = ws.shape
    x, idx, rw = make_inputs(shape, "meta")
    w = make_weights(shape, "meta")
    _, ctx = mok.forward(ws, x, idx, rw, w)
    ws8 = mok.get_workspace(mok.Config(precision="fp8", backward=False), None, 256, 128, 64, 2, 8, device="meta")
    e4m3 = lambda t: torch.empty(t.shape, dtype=torch.float8_e4m3fn, device="meta")
    blocks = lambda t: torch.empty(*t.shape[:-2], -(-t.shape[-2] // 128), -(-t.shape[-1] // 128), device="meta")
    q8 = mok.Fp8Weights(tuple(e4m3(t) for t in w.tensors()), tuple(blocks(t) for t in w.tensors()))
    return dict(mok=mok, torch=torch, ws=ws, x=x, idx=idx, rw=rw, w=w, ctx=ctx, d_out=torch.empty_like(x), ws8=ws8,
                q8=q8)


# (call, exception, start of the message): the rows of docs/bad_inputs.md's table, in its order.
CASES = [
    # mok.Config: the options, checked when made (the C++ rules of MoeWorkspace's constructor and ScheduleOptions)
    ('mok.Config(tile_m=100)', ValueError, "Config.tile_m: expected 64 or 128, got 100"),
    ('mok.Config(tile_m=True)', TypeError, "Config.tile_m: expected 64 or 128, got bool True"),
    ('mok.Config(minibatch_rows=100)', ValueError, "Config.minibatch_rows: expected a positive multiple of 128"),
    ('mok.Config(minibatch_rows=0)', ValueError, "Config.minibatch_rows: expected a positive multiple of 128"),
    ('mok.Config(minibatch_rows=2**31)', ValueError,
     "Config.minibatch_rows: expected a positive multiple of 128 up to 2^30, got 2147483648"),
    ('mok.Config(minibatch_rows=2**30 + 128)', ValueError,
     "Config.minibatch_rows: expected a positive multiple of 128 up to 2^30, got 1073741952"),
    ('mok.Config(macrobatch_rows=100)', ValueError,
     "Config.macrobatch_rows: expected 0 (the balanced share) or a positive multiple of 128"),
    ('mok.Config(macrobatch_rows=-128)', ValueError,
     "Config.macrobatch_rows: expected 0 (the balanced share) or a positive multiple of 128"),
    ('mok.Config(capacity_rows=100)', ValueError,
     "Config.capacity_rows: expected 0 (from load_factor) or a positive multiple of tile_m = 64"),
    ('mok.Config(capacity_rows=2**30)', ValueError,
     "Config.capacity_rows: expected 0 (from load_factor) or a positive multiple of tile_m = 64 below 2^30"),
    ('mok.Config(comm_ctas=-1)', ValueError, "Config.comm_ctas: expected a non-negative int"),
    ('mok.Config(comm_ctas=1.0)', TypeError, "Config.comm_ctas: expected a non-negative int, got float 1.0"),
    ('mok.Config(context_budget_bytes=-1)', ValueError, "Config.context_budget_bytes: expected a non-negative int"),
    ('mok.Config(load_factor=0.5)', ValueError, "Config.load_factor: expected a number >= 1"),
    ('mok.Config(load_factor=float("nan"))', ValueError, "Config.load_factor: expected a number >= 1"),
    ('mok.Config(load_factor="2")', TypeError, "Config.load_factor: expected a number >= 1"),
    ('mok.Config(wait_timeout_s=0)', ValueError, "Config.wait_timeout_s: expected a finite number of seconds in (0, "
                                                 "86400]"),
    ('mok.Config(wait_timeout_s=float("inf"))', ValueError, "Config.wait_timeout_s: expected a finite number"),
    ('mok.Config(wait_timeout_s=float("nan"))', ValueError, "Config.wait_timeout_s: expected a finite number"),
    ('mok.Config(wait_timeout_s=1e30)', ValueError, "Config.wait_timeout_s: expected a finite number"),
    ('mok.Config(wait_timeout_s=True)', TypeError, "Config.wait_timeout_s: expected a finite number"),
    ('mok.Config(setup_timeout_s=0)', ValueError, "Config.setup_timeout_s: expected a finite number of seconds in (0, "
                                                  "86400]"),
    ('mok.Config(setup_timeout_s=float("nan"))', ValueError, "Config.setup_timeout_s: expected a finite number"),
    ('mok.Config(setup_timeout_s="600")', TypeError, "Config.setup_timeout_s: expected a finite number"),
    ('mok.Config(path="megakernel")', ValueError, "Config.path: expected one of ['fused', 'unfused']"),
    ('mok.Config(path=0)', TypeError, "Config.path: expected one of ['fused', 'unfused'], got int 0"),
    ('mok.Config(backward=1)', TypeError, "Config.backward: expected a bool (True or False), got int 1"),
    ('mok.Config(keep_gate_up="yes")', TypeError, "Config.keep_gate_up: expected a bool"),
    ('mok.Config(backward_megakernel=True, path="unfused")', ValueError,
     "Config.backward_megakernel: expected False unless path='fused' and backward=True"),
    ('mok.Config(backward_megakernel=True, backward=False)', ValueError,
     "Config.backward_megakernel: expected False unless path='fused' and backward=True"),
    ('mok.Config(gather_rows=True)', ValueError, "Config.gather_rows: expected False unless path='unfused'"),
    ('mok.Config(gather_rows=1, path="unfused")', TypeError, "Config.gather_rows: expected a bool"),
    ('mok.Config(scatter_rows=1)', TypeError, "Config.scatter_rows: expected a bool"),
    ('mok.Config(precision="fp8", scatter_rows=True, path="unfused")', ValueError,
     "Config.precision: 'fp8' runs with gather_rows=False and scatter_rows=False"),
    ('mok.Config(precision="e5m2")', ValueError, "Config.precision: expected one of ['bf16', 'fp8']"),
    ('mok.Config(fp8_power_of_two_scales=True)', ValueError,
     "Config.fp8_power_of_two_scales: expected False unless precision='fp8'"),
    ('mok.Config(fp8_power_of_two_scales=1, precision="fp8", backward=False)', TypeError,
     "Config.fp8_power_of_two_scales: expected a bool"),
    ('mok.Config(bf16_weight_gradients="yes", precision="fp8")', TypeError,
     "Config.bf16_weight_gradients: expected a bool"),
    ('mok.Config(fp8_weight_gradient_columns=True)', ValueError,
     "Config.fp8_weight_gradient_columns: expected False unless precision='fp8' and bf16_weight_gradients=False"),
    ('mok.Config(fp8_weight_gradient_columns=True, precision="fp8", bf16_weight_gradients=True)', ValueError,
     "Config.fp8_weight_gradient_columns: expected False unless precision='fp8' and bf16_weight_gradients=False"),
    ('mok.Config(fp8_weight_gradient_columns=1, precision="fp8")', TypeError,
     "Config.fp8_weight_gradient_columns: expected a bool"),
    ('mok.Config(precision="fp8", gather_rows=True, path="unfused")', ValueError,
     "Config.precision: 'fp8' runs with gather_rows=False and scatter_rows=False"),
    ('mok.get_workspace(mok.Config(precision="fp8"), None, 256, 128, 64, 2, 8, device="meta")', ValueError,
     "intermediate: Config(precision='fp8', backward=True) needs a multiple of 128"),
    ('mok.quantize_weights(w, power_of_two_scales="yes")', TypeError, "power_of_two_scales: expected a bool"),
    ('mok.quantize_weights(w, transposed=1)', TypeError, "transposed: expected a bool"),
    ('mok.forward_fp8(ws, x, idx, rw, q8)', ValueError, "mok.forward_fp8: the workspace is Config(precision='bf16')"),
    ('mok.forward_fp8(ws8, x, idx, rw, w)', TypeError, "weights: expected mok.Fp8Weights"),
    ('mok.forward(ws8, x, idx, rw, w)', ValueError, "mok.forward: the workspace is Config(precision='fp8')"),
    ('mok.forward_fp8(ws8, x.detach().requires_grad_(), idx, rw, q8)', RuntimeError,
     "mok.forward_fp8: a differentiable call (x, router_weights or master_weights requires grad) on a workspace made "
     "with Config(backward=False)"),
    ('mok.forward_fp8(ws8, x, idx, rw, q8, master_weights=mok.Weights(torch.cat([w.expert_gate, w.expert_up], 1), '
     'None, *w.tensors()[2:]))', ValueError,
     "master_weights: gate and up fused in one of master_weights and weights, not in both"),
    ('mok.forward_fp8(ws8, x, idx, rw, q8, master_weights=mok.Weights(w.expert_gate.float(), *w.tensors()[1:]))',
     ValueError, "master_weights.expert_gate: expected a contiguous bf16 tensor"),
    ('mok.backward_fp8(ws, d_out, x, idx, rw, q8, ctx)', ValueError,
     "mok.backward_fp8: the workspace is Config(precision='bf16')"),
    ('mok.backward_fp8(ws8, d_out, x, idx, rw, q8, ctx)', ValueError,
     "ws: made with Config(backward=False) (inference only): no backward"),
    ('mok.forward_fp8(ws8, x, idx, rw, mok.Fp8Weights(q8.values[:1] + (None,) + q8.values[2:], q8.scales))', ValueError,
     "weights.expert_gate: expected a contiguous float8_e4m3fn [E_local, 2I, H (gate and up fused"),
    ('mok.forward_fp8(ws8, x, idx, rw, mok.Fp8Weights(q8.values, (q8.scales[0][..., :0],) + q8.scales[1:]))',
     ValueError, "weights.expert_gate scales: expected a contiguous fp32"),
    # mok.LayerShape (also the shape checks of get_workspace and mok.MoE)
    ('mok.LayerShape(0, 256, 2, 8, 128, 64)', ValueError, "ep_size: expected the EP group's size, an int in [1, 72]"),
    ('mok.LayerShape(73, 256, 2, 73, 128, 64)', ValueError, "ep_size: expected the EP group's size"),
    ('mok.LayerShape(1, 0, 2, 8, 128, 64)', ValueError, "num_tokens: expected a positive int"),
    ('mok.LayerShape(3, 256, 2, 8, 128, 64)', ValueError, "num_experts: expected a positive multiple of the EP size 3"),
    ('mok.LayerShape(1, 256, 9, 8, 128, 64)', ValueError, "top_k: expected a positive int <= num_experts = 8, got 9"),
    ('mok.LayerShape(1, 256, 2, 8, 100, 64)', ValueError, "hidden: expected a positive multiple of 64, got 100"),
    ('mok.LayerShape(1, 256, 2, 8, 128.0, 64)', TypeError,
     "hidden: expected a positive multiple of 64, got float 128.0"),
    ('mok.LayerShape(1, 256, 2, 8, 2**20 + 64, 64)', ValueError,
     "hidden: expected a positive multiple of 64 up to 1048576, got 1048640"),
    ('mok.LayerShape(1, 256, 2, 8, 128, 2**20 + 64)', ValueError,
     "intermediate: expected a positive multiple of 64 up to 1048576, got 1048640"),
    ('mok.LayerShape(1, 256, 2, 8, 128, 32)', ValueError, "intermediate: expected a positive multiple of 64"),
    ('mok.LayerShape(1, 2**29, 4, 8, 128, 64)', ValueError,
     "num_tokens: expected ep_size * num_tokens * top_k below 2^30"),
    ('mok.LayerShape(1, 256, 2, 8, 128, 64, shared_expert=1)', TypeError, "shared_expert: expected a bool"),
    ('mok.LayerShape(1, 256, 2, 8, 128, 64, swiglu_limit=-1.0)', ValueError,
     "swiglu_limit: expected a finite number >= 0"),
    # mok.get_workspace (on meta; a CUDA device is checked to be a Hopper GPU after these)
    ('mok.get_workspace({}, None, 256, 128, 64, 2, 8, device="meta")', TypeError,
     "config: expected a mok.Config, got dict"),
    ('mok.get_workspace(mok.Config(), object(), 256, 128, 64, 2, 8, device="meta")', TypeError,
     "group: expected a torch.distributed.ProcessGroup (None: EP = 1), got object"),
    ('mok.get_workspace(mok.Config(), None, 0, 128, 64, 2, 8, device="meta")', ValueError,
     "num_local_tokens: expected a positive int"),
    ('mok.get_workspace(mok.Config(), None, 256.0, 128, 64, 2, 8, device="meta")', TypeError,
     "num_local_tokens: expected a positive int"),
    ('mok.get_workspace(mok.Config(), None, 256, 100, 64, 2, 8, device="meta")', ValueError,
     "hidden: expected a positive multiple of 64, got 100"),
    ('mok.get_workspace(mok.Config(), None, 256, True, 64, 2, 8, device="meta")', TypeError,
     "hidden: expected a positive multiple of 64, got bool True"),
    ('mok.get_workspace(mok.Config(), None, 256, 128, 0, 2, 8, device="meta")', ValueError,
     "intermediate: expected a positive multiple of 64"),
    ('mok.get_workspace(mok.Config(), None, 256, 128, 64, 9, 8, device="meta")', ValueError,
     "top_k: expected a positive int <= num_experts = 8"),
    ('mok.get_workspace(mok.Config(), None, 256, 128, 64, 0, 8, device="meta")', ValueError,
     "top_k: expected a positive int <= num_experts = 8"),
    ('mok.get_workspace(mok.Config(), None, 256, 128, 64, 2, 0, device="meta")', ValueError,
     "num_experts: expected a positive multiple of the EP size 1"),
    ('mok.get_workspace(mok.Config(), None, 256, 128, 64, 2, 8, shared_expert="yes", device="meta")', TypeError,
     "shared_expert: expected a bool"),
    ('mok.get_workspace(mok.Config(), None, 256, 128, 64, 2, 8, swiglu_limit=-1.0, device="meta")', ValueError,
     "swiglu_limit: expected a finite number >= 0"),
    ('mok.get_workspace(mok.Config(), None, 256, 128, 64, 2, 8, swiglu_limit=float("inf"), device="meta")',
     ValueError, "swiglu_limit: expected a finite number >= 0"),
    ('mok.get_workspace(mok.Config(), None, 256, 128, 64, 2, 8, device="cpu")', ValueError,
     "device: expected a CUDA device (or meta), got cpu"),
    ('mok.get_workspace(mok.Config(), None, 256, 128, 64, 2, 8, device=1.5)', TypeError,
     "device: expected None, a str, an int or a torch.device, got float 1.5"),
    ('mok.get_workspace(mok.Config(), None, 256, 128, 64, 2, 8, device="gpu0")', ValueError,
     "device: 'gpu0' is not a device"),
    ('mok.get_workspace(mok.Config(), None, 256, 128, 64, 2, 8, device=-1)', ValueError,
     "device: expected a CUDA device index >= 0, got -1"),
    ('mok.get_workspace(mok.Config(path="unfused", macrobatch_rows=128), None, 256, 128, 64, 2, 8, device="meta")',
     ValueError, "Config.macrobatch_rows: expected 0 or at least the capacity (1024 rows for this shape) with "
                 "path='unfused'"),
    # mok.MoE
    ('mok.MoE(0, 64, 8, 2, device="meta")', ValueError, "hidden: expected a positive multiple of 64, got 0"),
    ('mok.MoE(100, 64, 8, 2, device="meta")', ValueError, "hidden: expected a positive multiple of 64, got 100"),
    ('mok.MoE(128, 64, 8, True, device="meta")', TypeError, "top_k: expected a positive int <= num_experts = 8"),
    ('mok.MoE(128, 64, 8, 9, device="meta")', ValueError, "top_k: expected a positive int <= num_experts = 8, got 9"),
    ('mok.MoE(128, 64, 0, 2, device="meta")', ValueError, "num_experts: expected a positive multiple of the EP size"),
    ('mok.MoE(128, 64, 8, 2, shared_expert=1, device="meta")', TypeError, "shared_expert: expected a bool"),
    ('mok.MoE(128, 64, 8, 2, fused_gate_up="no", device="meta")', TypeError, "fused_gate_up: expected a bool"),
    ('mok.MoE(128, 64, 8, 2, router=None, device="meta")', TypeError, "router: expected a bool"),
    ('mok.MoE(128, 64, 8, 2, normalize_router_weights=1, device="meta")', TypeError,
     "normalize_router_weights: expected a bool"),
    ('mok.MoE(128, 64, 8, 2, router=False, normalize_router_weights=True, device="meta")', ValueError,
     "normalize_router_weights: expected False with router=False"),
    ('mok.MoE(128, 64, 8, 2, main_grad=1, device="meta")', TypeError, "main_grad: expected a bool"),
    ('mok.MoE(128, 64, 8, 2, recompute=0, device="meta")', TypeError, "recompute: expected a bool"),
    ('mok.MoE(128, 64, 8, 2, swiglu_limit=float("nan"), device="meta")', ValueError,
     "swiglu_limit: expected a finite number >= 0"),
    ('mok.MoE(128, 64, 8, 2, config={}, device="meta")', TypeError, "config: expected a mok.Config (None: the "
                                                                     "defaults), got dict"),
    ('mok.MoE(128, 64, 8, 2, group=object(), device="meta")', TypeError,
     "group: expected a torch.distributed.ProcessGroup"),
    ('mok.MoE(128, 64, 8, 2, num_tokens=0, device="meta")', ValueError, "num_tokens: expected a positive int"),
    ('mok.MoE(128, 64, 8, 2, num_tokens=256.0, device="meta")', TypeError, "num_tokens: expected a positive int"),
    ('mok.MoE(128, 64, 8, 2, workspace=object())', TypeError, "workspace: expected a mok.Workspace"),
    ('mok.MoE(128, 128, 8, 2, workspace=ws)', ValueError, "workspace: made for (hidden, intermediate, num_experts, "
                                                          "top_k, shared_expert, swiglu_limit) = (128, 64, 8, 2"),
    ('mok.MoE(128, 64, 8, 2, workspace=ws, num_tokens=128)', ValueError,
     "num_tokens: expected None or the workspace's 256 tokens per call, got 128"),
    ('mok.MoE(128, 64, 8, 2, workspace=ws, config=mok.Config(tile_m=128))', ValueError,
     "config: expected None or the workspace's"),
    ('mok.MoE(128, 64, 8, 2, workspace=ws, device="cuda:0")', ValueError,
     "device: expected None or the workspace's meta, got cuda:0"),
    ('mok.MoE(128, 64, 8, 2, workspace=ws, context=object())', TypeError, "context: expected a mok.ForwardContext"),
    ('mok.MoE(128, 64, 8, 2, context=ctx, device="meta")', ValueError,
     "context: must be made by the workspace passed as workspace="),
    ('mok.MoE(128, 64, 8, 2, device="cpu")', ValueError, "device: expected a CUDA device (or meta), got cpu"),
    ('mok.MoE(128, 64, 8, 2, device=[0])', TypeError, "device: expected None, a str, an int or a torch.device"),
    ('mok.MoE(128, 64, 8, 2, device="meta").prepare(0)', ValueError, "num_tokens: expected a positive int"),
    ('mok.MoE(128, 64, 8, 2, device="meta")([[0.0]])', TypeError,
     "x: expected a bf16 tensor [..., H] with H = 128, got list"),
    ('mok.MoE(128, 64, 8, 2, device="meta")(torch.empty(0, 128, dtype=torch.bfloat16, device="meta"))', ValueError,
     "x: 0 tokens at the layer's first forward, which makes the workspace for its token count"),
    ('mok.MoE(128, 64, 8, 2, router=False, workspace=ws)(x, [[0, 1]], rw)', TypeError,
     "topk_idx: expected a tensor [..., k] with k = 2, got list"),
    ('mok.MoE(128, 64, 8, 2, router=False, workspace=ws)(x, idx[:-1], rw[:-1])', ValueError,
     "topk_idx: expected [..., k] with k = 2 and x's 256 tokens (512 values), got shape [255, 2]"),
    ('mok.MoE(128, 64, 8, 2, router=False, workspace=ws)(torch.zeros(256, 128, dtype=torch.bfloat16), '
     'torch.zeros(256, 2, dtype=torch.int32), torch.ones(256, 2))', ValueError,
     "x: on cpu, but this layer's workspace (passed as workspace=, or shared with the layer it was deep-copied "
     "from) is on meta"),
    # mok.Weights.of (the weights of forward, backward, recompute_forward_context, main_grads)
    ('mok.Weights.of([w.expert_gate])', TypeError, "weights: expected a mok.Weights or a dict, got list"),
    ('mok.Weights.of({"expert_gate": w.expert_gate})', TypeError,
     "weights: expert_gate and expert_down are required"),
    ('mok.Weights.of({"expert_gate": w.expert_gate, "expert_down": w.expert_down, "bias": None})', TypeError,
     "weights: unknown keys ['bias']"),
    ('mok.Weights.of(mok.Weights(w.expert_gate, w.expert_up, "down"))', TypeError,
     "weights.expert_down: expected a torch.Tensor, got str"),
    ('mok.Weights.of(mok.Weights(None, None, w.expert_down))', TypeError,
     "weights.expert_gate: expected a torch.Tensor, got NoneType"),
    ('mok.Weights.of(mok.Weights(w.expert_gate, w.expert_up, w.expert_down, shared_gate=1))', TypeError,
     "weights.shared_gate: expected a torch.Tensor or None, got int"),
    # forward and backward keywords; main_grads
    ('mok.forward(ws, x, idx, rw, w, schedule_ready=1)', TypeError, "schedule_ready: expected a bool"),
    ('mok.forward(ws, x, idx, rw, w, recompute="yes")', TypeError, "recompute: expected a bool"),
    ('mok.forward(ws, x, idx, rw, w, schedule_ready=True)', ValueError, "schedule_ready: True needs ctx"),
    ('mok.backward(ws, d_out, x, idx, rw, w, ctx, grad_dtype="float32")', TypeError,
     "grad_dtype: expected torch.bfloat16 or torch.float32"),
    ('mok.backward(ws, d_out, x, idx, rw, w, ctx, grad_dtype=torch.float16)', ValueError,
     "grad_dtype: expected torch.bfloat16 or torch.float32"),
    ('mok.backward(ws, d_out, x, idx, rw, w, ctx, main_grads=mok.main_grads(w), grad_dtype=torch.float32)',
     ValueError, "grad_dtype: expected the default torch.bfloat16 with main_grads="),
    ('mok.backward(ws, d_out, x, idx, rw, w, ctx, grads={}, main_grads={})', ValueError,
     "grads, main_grads: pass one of them"),
    ('mok.backward(ws, d_out, x, idx, rw, w, ctx, main_grads=[w.expert_gate])', TypeError,
     "main_grads: expected a mok.Weights or a dict, got list"),
    ('mok.backward(ws, d_out, x, idx, rw, w, ctx, grads={"expert_down": 0.0})', TypeError,
     "grads.expert_down: expected a torch.Tensor or None, got float"),
    ('mok.main_grads([w.expert_gate])', TypeError, "weights: expected a mok.Weights or a dict, got list"),
    ('mok.main_grads({"expert_gate": w.expert_gate, "expert_down": 1})', TypeError,
     "weights.expert_down: expected a torch.Tensor, got int"),
    # mok.require_hopper's own arguments (machine-independent; its findings are tested below)
    ('mok.require_hopper("cpu")', ValueError, "device: expected a CUDA device, got cpu"),
    ('mok.require_hopper("meta")', ValueError, "device: expected a CUDA device, got meta"),
    ('mok.require_hopper(True)', TypeError, "device: expected None, a str, an int or a torch.device, got bool"),
]


@pytest.mark.parametrize("call, exception, start", CASES, ids=[c[0] for c in CASES])
def test_bad_argument(call, exception, start):
    namespace = names()
    with pytest.raises(exception) as info:
        eval(call, namespace)
    assert type(info.value) is exception, f"{call}: {type(info.value).__name__}: {info.value}"
    assert str(info.value).startswith(start), f"{call}: the message\n  {info.value}\ndoes not start with\n  {start}"


def _doc_rows():
    """(call, exception name, message start) of each row of docs/bad_inputs.md's table under SECTION."""
    text = DOC.read_text()
    assert SECTION in text, f"{DOC} has no section {SECTION!r}"
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        if not line.startswith("| `"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        assert len(cells) == 3, f"{DOC}: a row of {len(cells)} cells: {line}"
        assert all(c.startswith("`") and c.endswith("`") for c in cells), f"{DOC}: cells not in backticks: {line}"
        rows.append(tuple(c[1:-1] for c in cells))
    return rows


def test_the_doc_table_is_the_test_table():
    rows = _doc_rows()
    cases = [(call, exception.__name__, start) for call, exception, start in CASES]
    assert len(set(rows)) == len(rows), "docs/bad_inputs.md: a row twice"
    assert len(set(cases)) == len(cases), "CASES: a case twice"
    only_doc, only_test = set(rows) - set(cases), set(cases) - set(rows)
    assert not only_doc and not only_test, (f"rows only in {DOC.name}: {sorted(only_doc)}\n"
                                            f"cases only in test_args.py: {sorted(only_test)}")
    assert rows == cases, "the same rows in another order"


def test_good_arguments_pass():
    """The other side of each rule: edge values that are valid are accepted (a check that refuses everything
    would pass the table)."""
    mok.Config(minibatch_rows=2**30)
    mok.LayerShape(1, 1, 1, 1, 2**20, 2**20)
    mok.Config(tile_m=128, minibatch_rows=128, macrobatch_rows=256, capacity_rows=1024, wait_timeout_s=86400,
               load_factor=float("inf"), comm_ctas=2, context_budget_bytes=0, path="unfused")
    mok.Config(backward_megakernel=True)
    mok.Config(backward_megakernel=True, precision="fp8")
    mok.Config(wait_timeout_s=1)  # an int of seconds
    mok.Config(setup_timeout_s=86400)
    shape = mok.LayerShape(1, 1, 1, 1, 64, 64, shared_expert=False, swiglu_limit=7)
    assert isinstance(shape.swiglu_limit, float) and shape.swiglu_limit == 7.0
    mok.LayerShape(72, 1, 72, 72, 64, 64)
    ws = mok.get_workspace(mok.Config(path="unfused", macrobatch_rows=1024), None, 256, 128, 64, 2, 8,
                           device=torch.device("meta"))
    assert ws.shape.top_k == 2
    moe = mok.MoE(128, 64, 8, 2, router=False, workspace=eval(WS, {"mok": mok}), num_tokens=256, device="meta",
                  config=mok.Config())
    assert moe.config == mok.Config()


# ---------------------------------------------------------------------------------------------------------------
# mok.require_hopper


def _no_hopper_here():
    return mok.device.hopper_problem() is not None


@pytest.mark.skipif(not _no_hopper_here(), reason="this machine has a Hopper GPU")
def test_without_a_hopper_gpu_the_layer_says_so():
    problem = mok.device.hopper_problem()
    for make in (lambda: mok.get_workspace(mok.Config(), None, 256, 128, 64, 2, 8),
                 lambda: mok.get_workspace(mok.Config(), None, 256, 128, 64, 2, 8, device="cuda:0"),
                 lambda: mok.MoE(128, 64, 8, 2),
                 lambda: mok.MoE(128, 64, 8, 2, num_tokens=256),
                 lambda: mok.require_hopper()):
        with pytest.raises(RuntimeError) as info:
            make()
        assert str(info.value) == HOPPER + problem, str(info.value)
    if not torch.cuda.is_available():
        assert problem.startswith("no CUDA device ("), problem


def test_no_cuda_device_message(monkeypatch):
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(RuntimeError) as info:
        mok.MoE(128, 64, 8, 2)
    assert str(info.value) == (HOPPER + "no CUDA device (torch.cuda.is_available() is False; "
                               "CUDA_VISIBLE_DEVICES='')")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    with pytest.raises(RuntimeError, match=re.escape("is False; CUDA_VISIBLE_DEVICES not set)")):
        mok.require_hopper()
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: False)
    with pytest.raises(RuntimeError) as info:
        mok.get_workspace(mok.Config(), None, 256, 128, 64, 2, 8)
    assert str(info.value) == HOPPER + "no CUDA device (PyTorch was built without CUDA)"


def _fake_gpus(monkeypatch, capability, name, count=1, current=0):
    """torch.cuda's queries answer for `count` devices of this capability and name, any other CUDA call fails."""
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: name)


def test_an_a100_is_refused_before_any_cuda_work(monkeypatch):
    _fake_gpus(monkeypatch, (8, 0), "NVIDIA A100-SXM4-80GB")
    found = HOPPER + "NVIDIA A100-SXM4-80GB (sm_80) on cuda:0"
    for make in (lambda: mok.require_hopper(), lambda: mok.require_hopper(0), lambda: mok.require_hopper("cuda"),
                 lambda: mok.get_workspace(mok.Config(), None, 256, 128, 64, 2, 8),
                 lambda: mok.get_workspace(mok.Config(), None, 256, 128, 64, 2, 8, device=torch.device("cuda", 0)),
                 lambda: mok.MoE(128, 64, 8, 2), lambda: mok.MoE(128, 64, 8, 2, device="cuda:0", num_tokens=64)):
        with pytest.raises(RuntimeError) as info:
            make()
        assert str(info.value) == found, str(info.value)
    # the arguments are checked first: a bad one is named, on any machine
    with pytest.raises(ValueError, match="hidden: expected a positive multiple of 64"):
        mok.MoE(100, 64, 8, 2)


def test_a_missing_device_index_is_named(monkeypatch):
    _fake_gpus(monkeypatch, (9, 0), "NVIDIA H200", count=1)
    with pytest.raises(RuntimeError) as info:
        mok.get_workspace(mok.Config(), None, 256, 128, 64, 2, 8, device="cuda:1")
    assert str(info.value) == HOPPER + "cuda:1 but only 1 CUDA device is visible"
    _fake_gpus(monkeypatch, (9, 0), "NVIDIA H200", count=2)
    with pytest.raises(RuntimeError, match=re.escape("found cuda:3 but only 2 CUDA devices are visible")):
        mok.MoE(128, 64, 8, 2, device=3)


def test_an_sm90_device_passes(monkeypatch):
    _fake_gpus(monkeypatch, (9, 0), "NVIDIA H100 80GB HBM3", count=2, current=1)
    assert mok.require_hopper() == torch.device("cuda", 1)
    assert mok.require_hopper(0) == torch.device("cuda", 0)
    assert mok.require_hopper("cuda:1") == torch.device("cuda", 1)
    assert mok.require_hopper(torch.device("cuda")) == torch.device("cuda", 1)
    assert mok.device.hopper_problem() is None
    from conftest import hopper_skip_reason
    assert hopper_skip_reason() is None
    # a second, non-Hopper device is refused by index
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0) if index == 0 else (10, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "NVIDIA B200")
    assert mok.require_hopper(0) == torch.device("cuda", 0)
    with pytest.raises(RuntimeError, match=re.escape(HOPPER + "NVIDIA B200 (sm_100) on cuda:1")):
        mok.require_hopper()


def test_conftest_skips_with_the_same_message(monkeypatch):
    from conftest import hopper_skip_reason
    _fake_gpus(monkeypatch, (8, 6), "NVIDIA RTX A6000")
    assert hopper_skip_reason() == HOPPER + "NVIDIA RTX A6000 (sm_86) on cuda:0"
