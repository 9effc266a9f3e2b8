"""CPU tests of bench/bits.py (the layer's output bits saved from one build, checked against another): the digest
against a plain-Python twin over the raw bytes (several chunks), that one flipped bit changes it, the non-finite
count and samples; the given routing; the fixed inputs; the comparison's verdicts; the arguments. No extension, no
GPU (the GPU run itself is not tested here). Fresh random values per run; the seed is in every failure message."""
import copy
import ctypes
import hashlib
import json
import random
import struct
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import bits  # noqa: E402
from shapes import Shape, named_shapes  # noqa: E402

MASK = 2**64 - 1


@pytest.fixture
def seed():
    return random.randrange(2**32)


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 37 words, so small tensors span several."""
    monkeypatch.setattr(bits, "CHUNK", 37)
    return 37


def signed(value):
    value &= MASK
    return value - 2**64 if value >> 63 else value


def mix_reference(i):
    """bits.mix in plain Python: wrapping 64-bit multiplies, arithmetic shifts of the signed value."""
    z = signed((i + 1) * bits.GOLDEN)
    z = signed((z ^ (z >> 30)) * bits.MIX1)
    z = signed((z ^ (z >> 27)) * bits.MIX2)
    return signed(z ^ (z >> 31))


def digest_reference(tensor, chunk):
    """The digest from the tensor's raw bytes: little-endian signed words, per chunk sum w_i * (mix(i) | 1) mod 2^64,
    sha256 of the sums as little-endian int64."""
    raw = bytes(tensor.contiguous().flatten().view(torch.uint8).tolist())  # no numpy: CI's venv has none
    size = tensor.element_size()
    words = struct.unpack(f"<{len(raw) // size}{'h' if size == 2 else 'i'}", raw)
    sums = []
    for begin in range(0, len(words), chunk):
        total = sum(w * (mix_reference(i) | 1) for i, w in enumerate(words[begin:begin + chunk]))
        sums.append(signed(total))
    return hashlib.sha256(struct.pack(f"<{len(sums)}q", *sums)).hexdigest()


def test_mix_matches_plain_python(seed):
    rng = random.Random(seed)
    values = [0, 1, 2, 2**31, 2**40 + 7, 2**62] + [rng.randrange(2**62) for _ in range(50)]
    got = bits.mix(torch.tensor(values, dtype=torch.int64)).tolist()
    assert got == [mix_reference(v) for v in values], f"seed {seed}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int32])
def test_digest_matches_the_bytes_twin(dtype, small_chunks, seed):
    gen = torch.Generator().manual_seed(seed)
    tensor = (torch.randn(5, 29, generator=gen) * 100).to(dtype)  # 145 words: 4 chunks of 37
    entry = bits.describe(tensor)
    assert entry["digest"] == digest_reference(tensor, small_chunks), f"seed {seed}"
    assert entry["dtype"] == bits.DTYPE_NAMES[dtype] and entry["shape"] == [5, 29] and entry["nonfinite"] == 0
    flat = tensor.flatten()
    assert entry["samples"] == [repr(flat[i].item()) for i in (0, 48, 96, 144)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int32])
def test_one_flipped_bit_changes_the_digest(dtype, small_chunks, seed):
    rng = random.Random(seed)
    tensor = torch.randn(3, 50, generator=torch.Generator().manual_seed(seed)).to(dtype)
    before = bits.describe(tensor)["digest"]
    words = tensor.view({2: torch.int16, 4: torch.int32}[tensor.element_size()]).flatten()
    for _ in range(20):
        i, bit = rng.randrange(words.numel()), rng.randrange(8 * tensor.element_size())
        flipped = words.clone()
        flipped[i] ^= torch.tensor(1 << bit, dtype=torch.int64).to(words.dtype)  # 1 << 15: int16's sign bit
        assert bits.describe(flipped.view(tensor.dtype).view(tensor.shape))["digest"] != before, \
            f"seed {seed}: word {i} bit {bit}"
    swapped = words.clone()
    i, j = 3, 77
    if swapped[i] != swapped[j]:
        swapped[i], swapped[j] = words[j].clone(), words[i].clone()
        assert bits.describe(swapped.view(tensor.dtype).view(tensor.shape))["digest"] != before, f"seed {seed}"


def test_nonfinite_count_and_special_values(small_chunks):
    tensor = torch.zeros(100, dtype=torch.bfloat16)
    tensor[[0, 5, 50, 99]] = torch.tensor([float("nan"), float("inf"), -float("inf"), float("nan")],
                                          dtype=torch.bfloat16)
    entry = bits.describe(tensor)
    assert entry["nonfinite"] == 4 and entry["samples"] == ["nan", "0.0", "0.0", "nan"]
    assert bits.describe(torch.full((3,), float("nan")))["nonfinite"] == 3
    negative_zero = bits.describe(torch.tensor([-0.0]))["digest"]
    assert negative_zero != bits.describe(torch.tensor([0.0]))["digest"], "-0 and 0 differ in bits"
    assert bits.describe(torch.zeros(0, dtype=torch.bfloat16))["samples"] == []


def test_given_routing(seed):
    rng = random.Random(seed)
    for _ in range(30):
        experts = rng.randrange(1, 600)
        top_k = rng.randrange(1, min(experts, 16) + 1)
        tokens = rng.randrange(1, 3000)
        idx = bits.given_routing(tokens, experts, top_k, "cpu")
        assert idx.dtype == torch.int32 and idx.shape == (tokens, top_k) and idx.is_contiguous()
        assert int(idx.min()) >= 0 and int(idx.max()) < experts, f"seed {seed}"
        assert all(len(set(row)) == top_k for row in idx.tolist()), f"seed {seed}: an expert twice in a row"
        assert torch.equal(idx, bits.given_routing(tokens, experts, top_k, "cpu")), "the routing is given"
    loads = torch.bincount(bits.given_routing(8192, 128, 8, "cpu").flatten().long(), minlength=128)
    assert int(loads.min()) > 0.5 * 512 and int(loads.max()) < 1.5 * 512, f"not about T*k/E rows each: {loads}"


def test_inputs_are_fixed_by_the_seed():
    shape = Shape("s", 16, 4, 64, 128, 2, False)
    a, b = bits.make_inputs(shape, 16, 7, "cpu"), bits.make_inputs(shape, 16, 7, "cpu")
    assert [n for n, t in a.items() if t is None] == ["shared_gate", "shared_up", "shared_down"]
    assert all(t is None or torch.equal(t, b[n]) for n, t in a.items())
    assert a["x"].dtype == torch.bfloat16 and a["x"].shape == (16, 64)
    assert a["expert_gate"].shape == (4, 128, 64) and a["expert_down"].shape == (4, 64, 128)
    assert a["router_weights"].dtype == torch.float32 and torch.allclose(a["router_weights"].sum(1), torch.ones(16))
    assert not torch.equal(bits.make_inputs(shape, 16, 8, "cpu")["x"], a["x"])
    shared = bits.make_inputs(shape._replace(shared=True), 16, 7, "cpu")
    assert shared["shared_gate"].shape == (128, 64) and shared["shared_down"].shape == (64, 128)


def fake_record(seed, paths=("fused", "unfused")):
    rng = random.Random(seed)

    def entry():
        return dict(dtype="bf16", shape=[4, 64], digest=f"{rng.getrandbits(256):064x}", chunks=["0" * 16] * 7,
                    nonfinite=0, samples=["0.5", "1.0"])

    outputs = {name: entry() for name in ("out", "d_x", "d_router_weights", "grad_expert_gate")}
    return dict(dims=dict(T=4, H=64, I=64, E=4, k=2, shared=0), inputs={"x": entry(), "topk_idx": entry()},
                outputs={p: copy.deepcopy(outputs) for p in paths}, errors={})


def test_compare_names_what_differs(seed, small_chunks):
    saved = fake_record(seed)
    assert bits.compare("s", saved, copy.deepcopy(saved)) == []
    assert bits.path_disagreements("s", saved) == []
    now = copy.deepcopy(saved)
    now["outputs"]["unfused"]["grad_expert_gate"]["digest"] = "0" * 64
    now["outputs"]["unfused"]["grad_expert_gate"]["samples"] = ["0.5", "2.0"]
    now["outputs"]["unfused"]["grad_expert_gate"]["chunks"][3:5] = ["1" * 16] * 2
    problems = bits.compare("s", saved, now)
    assert len(problems) == 1 and problems[0].startswith(
        "s unfused grad_expert_gate: bits differ in 2 of 7 chunks, first: elements [111, 148), index 0 1..2 (saved "
        "bf16 [4, 64] samples ['0.5', '1.0']"), problems
    assert "now bf16 [4, 64] samples ['0.5', '2.0']" in problems[0]
    assert bits.path_disagreements("s", now) == ["s: unfused grad_expert_gate differs from fused grad_expert_gate in "
                                                 "the same run"]
    now = copy.deepcopy(saved)
    now["inputs"]["x"]["digest"] = "0" * 64
    now["outputs"]["fused"]["out"]["digest"] = "0" * 64
    assert bits.compare("s", saved, now) == [
        "s: inputs differ (x): other inputs than the saved run's (another torch or GPU?); nothing of this shape "
        "compared"]
    now = copy.deepcopy(saved)
    now["dims"]["T"] = 8
    assert bits.compare("s", saved, now)[0].startswith("s: dims differ")
    now = copy.deepcopy(saved)
    del now["outputs"]["fused"]
    now["errors"]["fused"] = "RuntimeError: boom"
    assert bits.compare("s", saved, now) == ["s fused: failed now: RuntimeError: boom"]
    assert bits.compare("s", now, saved) == ["s fused: the saved run failed (RuntimeError: boom); not compared"]
    now = copy.deepcopy(saved)
    del now["outputs"]["fused"]["d_x"]
    assert bits.compare("s", saved, now) == ["s fused d_x: saved only"]


def test_arguments(tmp_path, capsys):
    args = bits.parse_args(["--save", str(tmp_path / "b.json"), "--shapes", "Kimi-K2.7", "--shape",
                            "fine:32768:4096:512:128:8", "--tokens", "4096", "--paths", "fused,unfused"])
    assert [(s.name, t) for s, t in args.shape_list] == [("Kimi-K2.7", 4096), ("fine", 32768)]
    assert args.path_list == ["fused", "unfused"]
    assert [s.name for s, _ in bits.parse_args(["--save", "b.json"]).shape_list] == [s.name for s in named_shapes()]
    refused = [
        ([], "one of the arguments --save --check is required"),
        (["--save", "a", "--check", "b"], "not allowed with argument"),
        (["--save", "a", "--paths", "fused,fast"], "--paths: expected some of fused, unfused, fused-bmk"),
        (["--save", "a", "--shape", "x:8:64:64:4:5"], "top_k: expected a positive int <= num_experts = 4, got 5"),
        (["--check", "a", "--shape", "x:8:64:64:4:2"], "--check takes the shapes' T, the seed and the paths from FILE"),
        (["--check", "a", "--seed", "1"], "--check takes"),
    ]
    for argv, message in refused:
        with pytest.raises(SystemExit):
            bits.parse_args(argv)
        assert message in capsys.readouterr().err, argv


# ---- the whole flow, --save then --check, through a fake library on the CPU

class FakeLib:
    """The C entry points bits.py calls, in Python on CPU tensors: out = x, d_x = d_out, d_rw = 0, gradient n filled
    with byte n + 1. named: the library exports mok_bench_status_new (today's create by name; else d0b3fa0's
    positional one). flip: (path, gradient index): that path's gradient gets one byte changed (a build whose bits
    differ)."""

    def __init__(self, shape, tokens, named=True, flip=None):
        self.creates, self.paths = [], {}
        t, h, i, e, k = tokens, shape.hidden, shape.inter, shape.num_experts, shape.top_k
        grad_bytes = [2 * e * i * h] * 3 + [2 * i * h] * 3

        def create(*args):
            self.creates.append(args)
            if named:
                count, names, values = args[3:6]
                options = {names[j].decode(): values[j].decode() for j in range(count)}
                path = options["path"] + ("-bmk" if options.get("backward_megakernel") == "true" else "")
            else:
                path = {0: "unfused", 1: "fused", 2: "fused-bmk"}[args[10]]
            self.paths[len(self.creates)] = path
            return len(self.creates)

        def forward(layer, x, *rest):
            ctypes.memmove(rest[-4], x, 2 * t * h)
            return 0

        def backward(layer, x, idx, dtype, rw, *rest):
            d_out, d_x, d_rw, grads, dtypes, modes = rest[6:12]
            ctypes.memmove(d_x, d_out, 2 * t * h)
            ctypes.memset(d_rw, 0, 4 * t * k)
            for n, pointer in enumerate(grads):
                if pointer:
                    fp32 = dtypes[n] == bits.capi.GRAD_DTYPES["fp32"]
                    accumulate = modes[n] == bits.capi.GRAD_MODES["accumulate"]
                    path = self.paths[layer] + ("-acc" if accumulate else "-fp32" if fp32 else "")
                    ctypes.memset(pointer, n + (17 if accumulate else 1), grad_bytes[n] * (2 if fp32 else 1))
                    if flip == (path, n):
                        ctypes.memset(pointer + 10, 0, 1)
            return 0

        self.mok_bench_layer_create, self.mok_bench_layer_forward = create, forward
        self.mok_bench_layer_backward = backward
        self.mok_bench_layer_check_status = lambda *args: 0
        self.mok_bench_layer_destroy = lambda layer: None
        if named:
            self.mok_bench_status_new = lambda *args: 0


def run_bits(monkeypatch, lib, argv):
    monkeypatch.setattr(bits, "DEVICE", "cpu")
    monkeypatch.setattr(bits.capi, "load", lambda path, names: lib)
    monkeypatch.setenv("MOK_COMMIT", "fake")
    try:
        bits.main(["--lib", "fake.so", *argv])
    except SystemExit as e:
        return e.code
    return 0


def test_save_then_check(tmp_path, monkeypatch, capsys, small_chunks):
    shape, tokens = Shape("tiny", 16, 4, 64, 128, 2, True), 16
    spec = "tiny:16:64:128:4:2:128"
    saved = tmp_path / "bits.json"
    assert run_bits(monkeypatch, FakeLib(shape, tokens), ["--save", str(saved), "--shape", spec]) == 0
    record = json.loads(saved.read_text())
    assert record["format"] == bits.FORMAT and record["run"]["capi"] == "named" and record["run"]["commit"] == "fake"
    tiny = record["shapes"]["tiny"]
    assert tiny["dims"] == dict(T=16, H=64, I=128, E=4, k=2, shared=128) and tiny["errors"] == {}
    assert list(tiny["outputs"]) == list(bits.PATHS)
    for path, outputs in tiny["outputs"].items():
        prefix = {"fp32": "grad32", "acc": "gradacc"}.get(path.rsplit("-", 1)[1], "grad") if "-" in path else "grad"
        names = ["out", "d_x", "d_router_weights"] + [f"{prefix}_{n}" for n in bits.capi.GRADS]
        assert sorted(outputs) == sorted(names), path
        grad = outputs[f"{prefix}_expert_gate"]
        assert grad["dtype"] == ("bf16" if prefix == "grad" else "fp32"), path
    assert tiny["outputs"]["fused"]["grad_expert_up"]["samples"][0] == repr(
        torch.tensor([0x0202], dtype=torch.int16).view(torch.bfloat16).item())
    capsys.readouterr()

    positional = FakeLib(shape, tokens, named=False)  # d0b3fa0's create: same bits
    assert run_bits(monkeypatch, positional, ["--check", str(saved)]) == 0
    assert "same bits as" in capsys.readouterr().out
    assert [args[10] for args in positional.creates] == [1, 0, 2, 0, 0, 2, 2], "fused, unfused, megakernel (PATHS)"
    assert positional.creates[0][1:10] == (1, 0, 0, 16, 2, 4, 64, 128, 1)

    changed = FakeLib(shape, tokens, flip=("unfused", 1))
    assert run_bits(monkeypatch, changed, ["--check", str(saved), "--shapes", "tiny"]) == 1
    out = capsys.readouterr().out
    assert "tiny unfused grad_expert_up: bits differ" in out
    assert "tiny: unfused grad_expert_up differs from fused grad_expert_up in the same run" in out
    assert out.count("bits differ") == 1 and "FAILED: 2 problems" in out
    assert run_bits(monkeypatch, FakeLib(shape, tokens), ["--check", str(saved), "--shapes", "nope"]) != 0
