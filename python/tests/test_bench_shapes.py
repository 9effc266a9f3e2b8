"""CPU tests of the layer benchmark's shapes and FLOP conventions (bench/shapes.py, bench/layer_bench.py): custom
shapes name:T:H:I:E:k[:shared] parsed, refused with the field named (the library's rules, mok.LayerShape), selected
with the named ones; the two TFLOP/s conventions (ours: the shared expert counts as a route; SonicMoE's: routed
experts only) and the table's sonic columns. No extension, no GPU. Fresh random values per run; the seed is in
every failure message."""
import io
import random
import subprocess
import sys
from contextlib import redirect_stdout
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import layer_bench  # noqa: E402
import shapes  # noqa: E402
from shapes import Shape, check_shape, flops, parse_shape, select_shapes  # noqa: E402

NAMED = [s.name for s in shapes.named_shapes()]


@pytest.fixture
def seed():
    return random.randrange(2**32)


def test_parse_custom_shapes():
    assert parse_shape("fine512:32768:4096:512:128:8") == Shape("fine512", 32768, 128, 4096, 512, 8, False)
    assert parse_shape("fine512:32768:4096:512:128:8:0") == Shape("fine512", 32768, 128, 4096, 512, 8, False)
    assert parse_shape("s.1_a+b-c:64:128:192:4:2:192") == Shape("s.1_a+b-c", 64, 4, 128, 192, 2, True)


def test_parse_round_trips_random_specs(seed):
    rng = random.Random(seed)
    for _ in range(200):
        dims = dict(T=rng.randrange(1, 1 << 16), H=64 * rng.randrange(1, 160), I=64 * rng.randrange(1, 80),
                    E=rng.randrange(1, 600))
        dims["k"] = rng.randrange(1, dims["E"] + 1)
        shared = rng.choice([None, 0, dims["I"]])
        text = "s{}:{T}:{H}:{I}:{E}:{k}".format(rng.randrange(1000), **dims) + ("" if shared is None else f":{shared}")
        shape = parse_shape(text)
        assert (shape.tokens, shape.hidden, shape.inter, shape.num_experts, shape.top_k, shape.shared) == (
            dims["T"], dims["H"], dims["I"], dims["E"], dims["k"], bool(shared)), f"seed {seed}: {text}"
        check_shape(shape, shape.tokens, 1)  # valid by construction: no error


@pytest.mark.parametrize("text, message", [
    ("a:1:64:64:4", "expected name:T:H:I:E:k[:shared] (6 or 7 fields separated by ':'), got 5 fields"),
    ("a:1:64:64:4:2:0:0", "got 8 fields"),
    ("fine512", "got 1 field"),
    (":1:64:64:4:2", "name '': expected 1 to 20 letters"),
    ("a b:1:64:64:4:2", "name 'a b'"),
    ("abcdefghijklmnopqrstu:1:64:64:4:2", "1 to 20 letters"),
    ("-a:1:64:64:4:2", "starting with a letter or digit"),
    ("a:-1:64:64:4:2", "T: expected a non-negative decimal integer, got '-1'"),
    ("a:1:6.4e1:64:4:2", "H: expected a non-negative decimal integer, got '6.4e1'"),
    ("a:1:64:x:4:2", "I: expected a non-negative decimal integer, got 'x'"),
    ("a:1:64:64::2", "E: expected a non-negative decimal integer, got ''"),
    ("a:1:64:64:4:two", "k: expected"),
    ("a:1:64:128:4:2:64", "shared: expected 0 (no shared expert) or I = 128"),
    ("a:1:64:128:4:2:yes", "shared: expected a non-negative decimal integer"),
])
def test_parse_refuses_bad_specs(text, message):
    with pytest.raises(ValueError) as info:
        parse_shape(text)
    assert message in str(info.value) and repr(text) in str(info.value), str(info.value)


@pytest.mark.parametrize("dims, ep, message", [
    ((8, 100, 64, 4, 2), 1, "hidden: expected a positive multiple of 64, got 100"),
    ((8, 64, 96, 4, 2), 1, "intermediate: expected a positive multiple of 64, got 96"),
    ((8, 0, 64, 4, 2), 1, "hidden: expected a positive multiple of 64, got 0"),
    ((8, 64, 64, 4, 5), 1, "top_k: expected a positive int <= num_experts = 4, got 5"),
    ((8, 64, 64, 4, 0), 1, "top_k: expected a positive int <= num_experts = 4, got 0"),
    ((0, 64, 64, 4, 2), 1, "num_tokens: expected a positive int (tokens per rank), got 0"),
    ((8, 64, 64, 6, 2), 4, "num_experts: expected a positive multiple of the EP size 4, got 6"),
    ((1 << 27, 64, 64, 16, 8), 1, "num_tokens: expected ep_size * num_tokens * top_k below 2^30"),
])
def test_check_shape_applies_the_library_rules(dims, ep, message):
    tokens, hidden, inter, experts, top_k = dims
    shape = Shape("bad", tokens, experts, hidden, inter, top_k, False)
    with pytest.raises(ValueError) as info:
        check_shape(shape, tokens, ep)
    assert message in str(info.value) and str(info.value).startswith(f"shape bad (T={tokens}, H={hidden}"), \
        str(info.value)


def test_named_shapes_pass_the_library_rules():
    for shape in shapes.named_shapes():
        check_shape(shape, 8192, 1)
        check_shape(shape, 8192, 2)


def test_select_shapes():
    assert [s.name for s in select_shapes()] == NAMED
    assert [s.name for s in select_shapes("", ["a:8:64:64:4:2"])] == ["a"], "--shape alone: only the custom shapes"
    picked = select_shapes("Qwen3-30B-A3B,b:16:128:64:8:2:64,Kimi-K2.7", ["a:8:64:64:4:2"])
    assert [s.name for s in picked] == ["Qwen3-30B-A3B", "b", "Kimi-K2.7", "a"]
    assert picked[0].tokens is None and picked[1] == Shape("b", 16, 8, 128, 64, 2, True)
    with pytest.raises(ValueError, match="unknown shape 'Kimi'; known: Kimi-K2.7, "):
        select_shapes("Kimi")
    with pytest.raises(ValueError, match="shape Kimi-K2.7: named twice"):
        select_shapes("Kimi-K2.7", ["Kimi-K2.7:8:64:64:4:2"])
    with pytest.raises(ValueError, match="shape a: named twice"):
        select_shapes("a:8:64:64:4:2", ["a:8:64:64:4:2"])


def test_flop_conventions(seed):
    rng = random.Random(seed)
    for _ in range(100):
        t, k = rng.randrange(1, 40000), rng.randrange(1, 17)
        h, i = 64 * rng.randrange(1, 128), 64 * rng.randrange(1, 64)
        routed = t * k * h * i
        for shared in (False, True):
            for kind, factor in (("fwd", 6), ("bwd", 12), ("f+b", 18)):
                assert flops(kind, "sonic", t, k, h, i, shared) == factor * routed, f"seed {seed}"
                ours = factor * (t * k + t * shared) * h * i  # the shared expert: one more route per token
                assert flops(kind, "ours", t, k, h, i, shared) == ours, f"seed {seed}"
    with pytest.raises(ValueError, match="kind: expected one of"):
        flops("train", "ours", 1, 1, 64, 64, False)
    with pytest.raises(ValueError, match="convention: expected one of"):
        flops("fwd", "megablocks", 1, 1, 64, 64, False)


def shape_result(shared, times, tokens=32768, top_k=8, hidden=4096, inter=512, experts=128):
    return layer_bench.ShapeResult(
        label="fine512", ep=1, tokens=tokens, experts=experts, top_k=top_k, hidden=hidden, inter=inter, shared=shared,
        backward=True, times=times, fwd=dict(relerr=1e-3, bitwise=True),
        bwd=dict(dx=1e-3, drw=1e-3, dw=1e-3, worst="", bitwise=True, error=None), ctx_mib=100.0, comm_ctas=0,
        liger=None, notes=[], breakdown={}, phases=[])


def test_tflops_both_conventions():
    # issue 26's first shape: 6 * 32768*8 * 4096 * 512 = 3.30e12 flops forward; 7.53 ms -> 438 TF/s
    times = dict(fused=7.53, unfused=8.0, base=20.0, dense=5.0, fb_fused=20.0, fb_unfused=21.0, bwd_fused=13.46,
                 bwd_unfused=14.0, fb_base=60.0, fb_dense=15.0)
    routed = shape_result(False, times).tflops()
    # Without --sonic-timing both sonic columns count SonicMoE's flops over our times: the backward called alone,
    # 12 * 32768*8 * 4096 * 512 / 13.46 ms, not fb_fused - fused (20.0 - 7.53 would give 529)
    assert round(routed["sonic_fused"]) == 438 and round(routed["sonic_bwd_fused"]) == 490
    assert round(routed["bwd_fused"]) == 490, "ours: the backward timed alone"
    assert routed["sonic_fused"] == routed["fused"], "without a shared expert the counts agree"
    assert routed["sonic_bwd_fused"] == routed["bwd_fused"]
    assert routed["fb_fused"] == pytest.approx(18 * 32768 * 8 * 4096 * 512 / 20.0 / 1e9)
    with_shared = shape_result(True, times).tflops()
    assert with_shared["sonic_fused"] == routed["sonic_fused"], "SonicMoE's count ignores the shared expert"
    assert with_shared["fused"] == pytest.approx(routed["fused"] * 9 / 8), "ours counts it as a ninth route"
    assert with_shared["bwd_fused"] == pytest.approx(routed["bwd_fused"] * 9 / 8)
    assert with_shared["sonic_bwd_fused"] == routed["sonic_bwd_fused"]
    assert "sonic_bwd_fused" not in shape_result(False, dict(fused=1.0, fb_fused=3.0)).tflops(), "no backward time"
    no_difference = dict(fused=2.0, fb_fused=3.0, bwd_fused=1.0, sonic_fused=2.0, sonic_fb_fused=2.0)
    assert "sonic_bwd_fused" not in shape_result(False, no_difference).tflops(), "no positive time"


def test_sonic_timing_times_replace_ours_in_the_sonic_columns():
    # --sonic-timing: the back-to-back times (sonic_fused, sonic_fb_fused) give both sonic columns; ours stay ours
    times = dict(fused=7.53, fb_fused=20.0, bwd_fused=13.46, sonic_fused=6.6, sonic_fb_fused=18.6)
    rates = shape_result(False, times).tflops()
    assert rates["sonic_fused"] == pytest.approx(6 * 32768 * 8 * 4096 * 512 / 6.6 / 1e9)
    assert rates["sonic_bwd_fused"] == pytest.approx(12 * 32768 * 8 * 4096 * 512 / (18.6 - 6.6) / 1e9)
    assert round(rates["fused"]) == 438 and round(rates["bwd_fused"]) == 490, "our columns keep our times"
    forward_only = shape_result(False, dict(fused=7.53, sonic_fused=6.6)).tflops()
    assert forward_only["sonic_fused"] == pytest.approx(rates["sonic_fused"])
    assert "sonic_bwd_fused" not in forward_only, "no forward + backward timed: no backward rate"


def test_table_prints_the_sonic_columns():
    times = dict(fused=7.53, unfused=8.0, base=20.0, dense=5.0, fb_fused=20.0, fb_unfused=21.0, bwd_fused=13.46,
                 bwd_unfused=14.0, fb_base=60.0, fb_dense=15.0)
    result = shape_result(True, times)
    lines, records = [], []
    with redirect_stdout(io.StringIO()):
        result.rows(lines, records)
    fwd, train = records
    assert round(fwd["sonic_TF"]) == 438 and round(train["sonic_bwd_TF"]) == 490
    assert fwd["fused_TF"] == pytest.approx(438 * 9 / 8, rel=1e-2)
    assert lines[0].split()[1 + layer_bench.FORWARD_COLUMNS.index("sonic_TF")] == "438"
    assert lines[1].split()[1 + layer_bench.TRAIN_COLUMNS.index("sonic_bwd_TF")] == "490"
    assert fwd["dims"] == dict(T=32768, H=4096, I=512, E=128, k=8, shared=512)


@pytest.mark.parametrize("args, message", [
    (["--shape", "x:8192:4096:500:128:8"], "intermediate: expected a positive multiple of 64, got 500"),
    (["--shapes", "Kimi-K2.7,nope"], "unknown shape 'nope'"),
    (["--shape", "x:8192:4096:512:128:8:256"], "shared: expected 0 (no shared expert) or I = 512"),
])
def test_layer_bench_refuses_bad_shapes_before_the_gpu(args, message):
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "layer_bench.py"), *args], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 2 and message in run.stderr, run.stderr
