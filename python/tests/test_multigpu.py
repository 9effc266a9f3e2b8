"""EP = 2 through torch.distributed (marker gpu; skipped with fewer than two Hopper GPUs): two processes, one
GPU each, an NCCL process group; get_workspace builds the library's communicator from rank 0's unique id.
Every rank makes the same global weights (each passes its experts' slice) and checks its output against the
float64 reference of its tokens."""
import dataclasses
import os
import socket

import pytest
import torch

import mok
from conftest import make_inputs, make_weights
from test_gpu import TOLERANCE, reference, relative_error

pytestmark = pytest.mark.gpu

EP = 2
GLOBAL = mok.LayerShape(1, num_tokens=256, top_k=2, num_experts=8, hidden=256, intermediate=128)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank, port, results):
    import torch.distributed as dist
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # no NVLink multicast (docs/design.md)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=EP,
                            device_id=torch.device("cuda", rank))
    try:
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
        del ctx, ws
        torch.cuda.synchronize()
    finally:
        dist.destroy_process_group()


def test_ep2_forward_through_a_process_group():
    if torch.cuda.device_count() < EP:
        pytest.skip(f"needs {EP} GPUs, {torch.cuda.device_count()} visible")
    import torch.multiprocessing as mp
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_rank_main, args=(_free_port(), results), nprocs=EP, join=True)
        results = dict(results)
    for rank in range(EP):
        error, rerun_equal, versions = results[rank]
        print(f"rank {rank}: relative error {error:.3e}, NCCL (compiled, loaded) {versions}")
        assert error < TOLERANCE, f"rank {rank}: relative Frobenius error {error:.3e} (seeds 21/{30 + rank})"
        assert rerun_equal, f"rank {rank}: a rerun differs bitwise"
