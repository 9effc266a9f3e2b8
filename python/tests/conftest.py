"""Shared helpers of the Python tests. CPU tests (test_cpu.py) need torch and the installed package, no GPU;
GPU tests (marker gpu) skip, with the reason, without a CUDA Hopper GPU."""
import pytest
import torch

import mok


def hopper_skip_reason():
    """None when torch's current CUDA device is a Hopper GPU (sm_90), else why not: mok.require_hopper's message
    (mok/device.py, the check get_workspace and mok.MoE make)."""
    problem = mok.device.hopper_problem()
    return None if problem is None else mok.device.HOPPER_REQUIRED + problem


def pytest_collection_modifyitems(config, items):
    reason = hopper_skip_reason()
    if reason is None:
        return
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=reason))


def make_weights(shape: mok.LayerShape, device, seed=0, fused_gate_up=False):
    """One rank's bf16 weights, randn / sqrt(fan_in)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    e, h, i = shape.local_experts, shape.hidden, shape.intermediate

    def weight(*dims):
        return (torch.randn(*dims, generator=gen) * dims[-1] ** -0.5).to(torch.bfloat16).to(device)

    gate, up = weight(e, i, h), weight(e, i, h)
    if fused_gate_up:
        gate, up = torch.cat([gate, up], dim=1).contiguous(), None
    shared = shape.shared_expert
    return mok.Weights(gate, up, weight(e, h, i), weight(i, h) if shared else None,
                       weight(i, h) if shared else None, weight(h, i) if shared else None)


def make_inputs(shape: mok.LayerShape, device, seed=0, index_dtype=torch.int32):
    """x bf16 [T, H], top-k ids of random logits, router weights = softmax over the chosen logits."""
    gen = torch.Generator(device="cpu").manual_seed(seed + 1000)
    t, k = shape.num_tokens, shape.top_k
    x = torch.randn(t, shape.hidden, generator=gen).to(torch.bfloat16)
    chosen, idx = torch.randn(t, shape.num_experts, generator=gen).topk(k, dim=1)
    return (x.to(device), idx.to(index_dtype).contiguous().to(device),
            torch.softmax(chosen, dim=1).contiguous().to(device))
