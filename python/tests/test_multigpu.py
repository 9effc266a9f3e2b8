"""EP = 2 through torch.distributed (marker gpu; skipped with fewer than two Hopper GPUs): two processes, one
GPU each, an NCCL process group; get_workspace builds the library's communicator from rank 0's unique id.
Every rank makes the same global weights (each passes its experts' slice) and checks its output and its
gradients against the float64 reference (its tokens; its experts' gradients over both ranks' tokens), and
mok.MoE over the group against the same layer run whole on one GPU."""
import contextlib
import dataclasses
import os
import socket

import pytest
import torch

import mok
from conftest import make_inputs, make_weights
from test_autograd import WEIGHT_NAMES, as_dict, make_d_out, reference_grads
from test_gpu import TOLERANCE, reference, relative_error

pytestmark = pytest.mark.gpu

EP = 2
GLOBAL = mok.LayerShape(1, num_tokens=256, top_k=2, num_experts=8, hidden=256, intermediate=128)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _process_group(rank, port):
    """This process's NCCL process group of EP ranks on GPU `rank` (no NVLink multicast: docs/design.md), yielding
    torch.distributed; destroyed on the way out."""
    import torch.distributed as dist
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=EP,
                            device_id=torch.device("cuda", rank))
    try:
        yield dist
    finally:
        dist.destroy_process_group()


def _spawn(rank_main):
    """{rank: result} of rank_main(rank, port, results) run in EP processes, one GPU each; skips with fewer GPUs."""
    if torch.cuda.device_count() < EP:
        pytest.skip(f"needs {EP} GPUs, {torch.cuda.device_count()} visible")
    import torch.multiprocessing as mp
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(rank_main, args=(_free_port(), results), nprocs=EP, join=True)
        return dict(results)


def _rank_main(rank, port, results):
    with _process_group(rank, port) as dist:
        shape = dataclasses.replace(GLOBAL, ep_size=EP)
        ws = mok.get_workspace(mok.Config(), dist.group.WORLD, shape.num_tokens, shape.hidden, shape.intermediate,
                               shape.top_k, shape.num_experts)
        full = make_weights(GLOBAL, "cuda", seed=21)  # every rank: all experts
        e = shape.local_experts
        mine = dataclasses.replace(full, expert_gate=full.expert_gate[rank * e:(rank + 1) * e].contiguous(),
                                   expert_up=full.expert_up[rank * e:(rank + 1) * e].contiguous(),
                                   expert_down=full.expert_down[rank * e:(rank + 1) * e].contiguous())
        x, idx, rw = make_inputs(shape, "cuda", seed=30 + rank)
        out, ctx = mok.forward(ws, x, idx, rw, mine)
        mok.check_status(ws)
        again, _ = mok.forward(ws, x, idx, rw, mine, ctx)
        mok.check_status(ws)
        error = relative_error(out, reference(GLOBAL, x, idx, rw, full))
        results[rank] = (error, torch.equal(out, again), mok.nccl_versions())
        ws.close()  # collective: every rank, here (docs/design.md, "Lifetimes")


def test_ep2_forward_through_a_process_group():
    results = _spawn(_rank_main)
    for rank in range(EP):
        error, rerun_equal, versions = results[rank]
        print(f"rank {rank}: relative error {error:.3e}, NCCL (compiled, loaded) {versions}")
        assert error < TOLERANCE, f"rank {rank}: relative Frobenius error {error:.3e} (seeds 21/{30 + rank})"
        assert rerun_equal, f"rank {rank}: a rerun differs bitwise"


def _slice_experts(full, rank, e):
    return dataclasses.replace(full, expert_gate=full.expert_gate[rank * e:(rank + 1) * e].contiguous(),
                               expert_up=full.expert_up[rank * e:(rank + 1) * e].contiguous(),
                               expert_down=full.expert_down[rank * e:(rank + 1) * e].contiguous())


def _backward_rank_main(rank, port, results):
    with _process_group(rank, port) as dist:
        shape = dataclasses.replace(GLOBAL, ep_size=EP)
        ws = mok.get_workspace(mok.Config(), dist.group.WORLD, shape.num_tokens, shape.hidden, shape.intermediate,
                               shape.top_k, shape.num_experts)
        full = make_weights(GLOBAL, "cuda", seed=41)
        e = shape.local_experts
        mine = _slice_experts(full, rank, e)
        inputs = [make_inputs(shape, "cuda", seed=50 + r) for r in range(EP)]  # every rank's, for the reference
        d_outs = [make_d_out(shape, 60 + r) for r in range(EP)]
        x, idx, rw = inputs[rank]
        _, ctx = mok.forward(ws, x, idx, rw, mine)
        got = as_dict(*mok.backward(ws, d_outs[rank], x, idx, rw, mine, ctx))
        again = as_dict(*mok.backward(ws, d_outs[rank], x, idx, rw, mine, ctx))
        mok.check_status(ws)
        # Reference: the layer over both ranks' tokens; the shared expert's gradient is this rank's tokens' only.
        cat = [torch.cat([inputs[r][i] for r in range(EP)]) for i in range(3)]
        every = reference_grads(GLOBAL, *cat, full, torch.cat(d_outs))
        own = reference_grads(GLOBAL, x, idx, rw, full, d_outs[rank])
        t = shape.num_tokens
        want = {"d_x": every["d_x"][rank * t:(rank + 1) * t],
                "d_router_weights": every["d_router_weights"][rank * t:(rank + 1) * t]}
        want.update({n: every[n][rank * e:(rank + 1) * e] for n in ("expert_gate", "expert_up", "expert_down")})
        want.update({n: own[n] for n in ("shared_gate", "shared_up", "shared_down")})
        errors = {n: relative_error(got[n], want[n]) for n in want}
        finite = all(bool(torch.isfinite(g).all()) for g in got.values())
        rerun = all(torch.equal(got[n], again[n]) for n in got)
        # Autograd over the group: the same bits as mok.backward.
        leaves = [t_.detach().clone().requires_grad_(True) for t_ in (x, rw, *mine.tensors())]
        out, _ = mok.forward(ws, leaves[0], idx, leaves[1], mok.Weights(*leaves[2:]))
        (out.float() * d_outs[rank].float()).sum().backward()
        autograd = {"d_x": leaves[0].grad, "d_router_weights": leaves[1].grad,
                    **{n: leaves[2 + i].grad for i, n in enumerate(WEIGHT_NAMES)}}
        autograd_equal = all(torch.equal(autograd[n], got[n]) for n in got)
        # mok.MoE over the group: replicated router and shared expert (broadcast from rank 0), this rank's experts.
        torch.manual_seed(100 + rank)  # different on each rank: the broadcast must make the replicas equal
        moe = mok.MoE(shape.hidden, shape.intermediate, shape.num_experts, shape.top_k, group=dist.group.WORLD,
                      num_tokens=shape.num_tokens)
        router = moe.router.weight.detach().clone()
        dist.all_reduce(router, op=dist.ReduceOp.MAX)
        replicas_equal = torch.equal(router, moe.router.weight)
        y = moe(x)
        (y.float() * d_outs[rank].float()).sum().backward()
        mok.check_status(moe.workspace)
        module_finite = all(bool(torch.isfinite(p.grad).all()) for p in moe.parameters())
        results[rank] = (errors, finite, rerun, autograd_equal, replicas_equal, module_finite)
        ws.close()  # collective: every rank, in the same order
        moe.workspace.close()


def test_ep2_backward_through_a_process_group():
    results = _spawn(_backward_rank_main)
    for rank in range(EP):
        errors, finite, rerun, autograd_equal, replicas_equal, module_finite = results[rank]
        print(f"rank {rank}: relative errors " + ", ".join(f"{n} {v:.2e}" for n, v in errors.items()))
        assert finite, f"rank {rank}: non-finite gradients"
        for name, error in errors.items():
            assert error < TOLERANCE, f"rank {rank}: {name} relative Frobenius error {error:.3e} (seeds 41/50/60)"
        assert rerun, f"rank {rank}: a second backward differs bitwise"
        assert autograd_equal, f"rank {rank}: autograd's gradients differ from mok.backward's"
        assert replicas_equal, f"rank {rank}: the router differs across ranks after the module's broadcast"
        assert module_finite, f"rank {rank}: mok.MoE over the group gave non-finite gradients"


def _fp8_rank_main(rank, port, results):
    with _process_group(rank, port) as dist:
        shape = dataclasses.replace(GLOBAL, ep_size=EP)
        make = lambda config: mok.get_workspace(config, dist.group.WORLD, shape.num_tokens, shape.hidden,
                                                shape.intermediate, shape.top_k, shape.num_experts)
        ws8, ws16 = make(mok.Config(precision="fp8")), make(mok.Config())  # the fused path, its default ring
        mine = _slice_experts(make_weights(GLOBAL, "cuda", seed=71), rank, shape.local_experts)
        x, idx, rw = make_inputs(shape, "cuda", seed=80 + rank)
        d_out = make_d_out(shape, 90 + rank)
        qw = mok.quantize_weights(mine, transposed=True)

        def autograd(forward):
            leaves = [t_.detach().clone().requires_grad_(True) for t_ in (x, rw, *mine.tensors())]
            out = forward(leaves[0], leaves[1], mok.Weights(*leaves[2:]))
            (out.float() * d_out.float()).sum().backward()
            return {"d_x": leaves[0].grad, "d_router_weights": leaves[1].grad,
                    **{n: leaves[2 + i].grad for i, n in enumerate(WEIGHT_NAMES)}}

        fp8 = autograd(lambda x_, rw_, w_: mok.forward_fp8(ws8, x_, idx, rw_, qw, master_weights=w_)[0])
        again = autograd(lambda x_, rw_, w_: mok.forward_fp8(ws8, x_, idx, rw_, qw, master_weights=w_)[0])
        bf16 = autograd(lambda x_, rw_, w_: mok.forward(ws16, x_, idx, rw_, w_)[0])
        _, ctx = mok.forward_fp8(ws8, x, idx, rw, qw)
        explicit = as_dict(*mok.backward_fp8(ws8, d_out, x, idx, rw, qw, ctx))
        mok.check_status(ws8)
        mok.check_status(ws16)
        errors = {n: relative_error(fp8[n], bf16[n].float()) for n in fp8}
        rerun = all(torch.equal(fp8[n], again[n]) for n in fp8)
        explicit_equal = all(torch.equal(fp8[n], explicit[n]) for n in fp8)
        # mok.MoE(precision="fp8") over the group trains: finite gradients on every parameter.
        moe = mok.MoE(shape.hidden, shape.intermediate, shape.num_experts, shape.top_k, group=dist.group.WORLD,
                      num_tokens=shape.num_tokens, config=mok.Config(precision="fp8"))
        (moe(x).float() * d_out.float()).sum().backward()
        mok.check_status(moe.workspace)
        module_finite = all(bool(torch.isfinite(p.grad).all()) for p in moe.parameters())
        results[rank] = (errors, rerun, explicit_equal, module_finite)
        for w in (ws8, ws16, moe.workspace):
            w.close()  # collective: every rank, in the same order


def test_ep2_fp8_training_through_a_process_group():
    """Config(precision="fp8") at EP = 2 on the fused path's default ring (every capacity row): autograd through
    mok.forward_fp8 within the FP8 recipe's error of the BF16 layer's gradients (about 0.065, as at EP = 1),
    reruns and the explicit mok.backward_fp8 bitwise, and mok.MoE(precision="fp8") over the group trains."""
    results = _spawn(_fp8_rank_main)
    for rank in range(EP):
        errors, rerun, explicit_equal, module_finite = results[rank]
        print(f"rank {rank}: FP8 vs BF16 normwise " + ", ".join(f"{n} {v:.4f}" for n, v in errors.items()))
        for name, error in errors.items():
            assert error < 0.12, f"rank {rank}: {name} FP8 vs BF16 normwise error {error:.4f} (seeds 71/80/90)"
        assert rerun, f"rank {rank}: an FP8 rerun differs bitwise"
        assert explicit_equal, f"rank {rank}: mok.backward_fp8 differs from autograd"
        assert module_finite, f"rank {rank}: mok.MoE(precision='fp8') over the group gave non-finite gradients"


def test_two_ranks_on_one_gpu():
    pytest.skip("not supported by the package: it drives one rank per process through an NCCL communicator, and "
                "NCCL refuses two ranks on one GPU (ncclInvalidUsage, duplicate GPU); EP > 1 on one GPU runs in C++ "
                "with PeerGroup::virtual_ranks (tests/gpu, e.g. test_moe_forward at EP = 2, 4, 8)")
