"""CPU tests of examples/train_moe.py that need no GPU: --help (every option has a help text and shows its default),
the stop with mok.require_hopper's message on a machine without a Hopper GPU, and the loss curves' PNG drawn by the
repository's built-in renderer (bench/png_canvas.py) when matplotlib does not import."""
import importlib.util
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import mok

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "train_moe.py"
sys.path.insert(0, str(ROOT / "bench"))
import png_canvas  # noqa: E402


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("train_moe", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_example(*args, env=None):
    """The example in a new process, with this package on PYTHONPATH; (exit status, stdout, stderr)."""
    environ = dict(os.environ, **(env or {}))
    environ["PYTHONPATH"] = os.pathsep.join([str(Path(mok.__file__).parents[1]), environ.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, str(EXAMPLE), *args], capture_output=True, text=True, env=environ,
                          timeout=300)
    return done.returncode, done.stdout, done.stderr


def fake_curves(steps=120, bitwise=True):
    """Three falling loss curves like the example's (ln 64 down to about 1.4), the torch one a little off."""
    ours = [1.4 + 2.76 * math.exp(-s / 25) + 0.05 * math.sin(s) for s in range(steps)]
    ref = [v + 0.03 * math.cos(s / 3) for s, v in enumerate(ours)]
    return [("plain PyTorch MoE", ref, "#e6550d", False), ("mok.MoE, run 1", ours, "#3182bd", False),
            ("mok.MoE, run 2 (bitwise equal)" if bitwise else "mok.MoE, run 2", list(ours), "#08306b", True)]


def colours_in(path):
    width, height, pixels = png_canvas.read_png(path)
    return width, height, {tuple(pixels[i:i + 3]) for i in range(0, len(pixels), 3)}


def test_help_lists_every_option_with_its_default(example):
    status, out, err = run_example("--help")
    assert status == 0, err
    parser_options = re.findall(r"^\s+(--[a-z0-9-]+)", out, flags=re.M)
    assert "--steps" in parser_options and "--main-grad" in parser_options, out
    for option in ("--steps", "--layers", "--out", "--batch", "--seq", "--hidden", "--intermediate", "--heads",
                   "--experts", "--top-k", "--lr", "--seed", "--load-factor", "--main-grad", "--precision",
                   "--bf16-weight-gradients", "--fp8-weight-gradient-columns"):
        assert option in parser_options, f"{option} missing from --help:\n{out}"
    flat = " ".join(out.split())
    assert "(default: 300)" in flat and "(default: train_moe_out)" in flat and "(default: 0.002)" in flat, out
    # every option has a help text: the parser's actions, not only the printed page
    missing = sorted(a.dest for a in example.make_parser()._actions if not a.help)
    assert not missing, f"options without a help text: {missing}"


@pytest.mark.parametrize("argv, message", [
    (["--steps", "0"], "argument --steps: expected a positive int, got 0"),
    (["--batch", "-4"], "argument --batch: expected a positive int, got -4"),
    (["--lr", "nan"], "argument --lr: expected a positive number, got nan"),
    (["--heads", "3"], "--heads 3 must divide --hidden 256"),
    (["--top-k", "9"], "--top-k 9 must be at most --experts 8"),
    (["--load-factor", "0.5"], "--load-factor must be 0 (the EP size) or a number >= 1, got 0.5"),
    (["--precision", "fp16"], "argument --precision: invalid choice: 'fp16'"),
    (["--precision", "fp8", "--intermediate", "192"], "--precision fp8 needs --intermediate a multiple of 128"),
    (["--bf16-weight-gradients"], "--bf16-weight-gradients needs --precision fp8"),
    (["--fp8-weight-gradient-columns"], "--fp8-weight-gradient-columns needs --precision fp8"),
    (["--precision", "fp8", "--bf16-weight-gradients", "--fp8-weight-gradient-columns"],
     "--fp8-weight-gradient-columns needs --precision fp8 and FP8 weight gradients"),
])
def test_bad_options_are_usage_errors(example, capsys, argv, message):
    """A bad option stops the example at parsing (argparse's usage error, status 2) naming it, before any work."""
    with pytest.raises(SystemExit) as stop:
        example.parse_args(argv)
    assert stop.value.code == 2
    assert message in capsys.readouterr().err


def test_stops_with_the_hopper_message_without_a_hopper_gpu():
    if mok.device.hopper_problem() is None:
        pytest.skip("this machine has a Hopper GPU: the example would train")
    status, out, err = run_example("--steps", "2", env={"CUDA_VISIBLE_DEVICES": ""})
    assert status != 0
    assert "train_moe: mok needs an NVIDIA Hopper GPU (sm_90); found no CUDA device (" in err, err
    assert "Traceback" not in err, err


def test_loss_curves_without_matplotlib(example, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    curves = fake_curves()
    path = tmp_path / "loss_curves.png"
    assert example.plot_losses(str(path), curves, "4-layer MoE transformer, EP = 1, E = 8, k = 2") == "builtin"
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", data[:8]
    assert len(data) > 5000, f"{len(data)} bytes: an empty picture?"
    width, height, colours = colours_in(path)
    assert (width, height) == (example.PLOT_WIDTH_PX, example.PLOT_HEIGHT_PX)
    for _, _, colour, _ in curves:  # each curve (and its legend swatch) is drawn in its colour
        assert png_canvas.parse_colour(colour) in colours, colour
    with pytest.raises(ImportError):
        example.plot_losses(str(tmp_path / "forced.png"), curves, "title", renderer="matplotlib")


def test_checks_and_losses_csv(example, tmp_path):
    """The examples' shared report helpers: PASS / FAIL lines and the failed texts; losses.csv's columns."""
    lines = []
    failed = example.print_checks([(True, "first"), (False, "second"), (False, "third")], lines.append)
    assert failed == ["second", "third"] and lines == ["PASS  first", "FAIL  second", "FAIL  third"]
    example.write_losses(str(tmp_path / "out"), ["a", "b"], [[1.5, 2.5], [3.0, 4.0]])
    assert (tmp_path / "out" / "losses.csv").read_text().splitlines() == ["step,a,b", "0,1.5,3.0", "1,2.5,4.0"]


def test_loss_curves_builtin_draws_the_data(example, tmp_path):
    """The curves land where the data says: a curve of one constant loss is a horizontal line of its colour at one
    height; a NaN step leaves a gap instead of failing; a run 2 that differs is labelled so."""
    flat = [("flat", [2.0] * 50, "#3182bd", False)]
    path = tmp_path / "flat.png"
    assert example.plot_losses(str(path), flat, "flat", renderer="builtin") == "builtin"
    width, height, pixels = png_canvas.read_png(str(path))
    blue = bytes(png_canvas.parse_colour("#3182bd"))
    rows = {y for y in range(height) for x in range(example.PLOT_LEFT_PX + 5, width // 2)
            if pixels[3 * (y * width + x):3 * (y * width + x) + 3] == blue}
    assert len(rows) == example.LINE_PX, rows
    broken = fake_curves(60, bitwise=False)
    broken[1][1][30] = float("nan")
    assert example.plot_losses(str(tmp_path / "nan.png"), broken, "nan", renderer="builtin") == "builtin"
    assert png_canvas.png_size(str(tmp_path / "nan.png")) == (example.PLOT_WIDTH_PX, example.PLOT_HEIGHT_PX)
    with pytest.raises(ValueError, match="renderer"):
        example.plot_losses(str(tmp_path / "x.png"), flat, "x", renderer="svg")


# examples/torchtitan_moe.py (its training needs torchtitan and a Hopper GPU; these need neither)
TITAN_EXAMPLE = ROOT / "examples" / "torchtitan_moe.py"


def run_titan_example(*args, env=None):
    environ = dict(os.environ, **(env or {}))
    environ["PYTHONPATH"] = os.pathsep.join([str(Path(mok.__file__).parents[1]), environ.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, str(TITAN_EXAMPLE), *args], capture_output=True, text=True, env=environ,
                          timeout=300)
    return done.returncode, done.stdout, done.stderr


def test_torchtitan_example_help_lists_every_option():
    status, out, err = run_titan_example("--help")
    assert status == 0, err
    options = re.findall(r"^\s+(--[a-z-]+)", out, flags=re.M)
    for option in ("--steps", "--batch", "--seq", "--lr", "--seed", "--shared-experts", "--attention", "--compile",
                   "--out"):
        assert option in options, f"{option} missing from --help:\n{out}"
    assert "(default: 300)" in " ".join(out.split())


def test_torchtitan_example_stops_with_the_hopper_message_without_a_hopper_gpu():
    if mok.device.hopper_problem() is None:
        pytest.skip("this machine has a Hopper GPU: the example would train")
    status, out, err = run_titan_example("--steps", "2", env={"CUDA_VISIBLE_DEVICES": ""})
    assert status != 0
    assert "torchtitan_moe: mok needs an NVIDIA Hopper GPU (sm_90); found no CUDA device (" in err, err
    assert "Traceback" not in err, err


def test_fp8_report_checks_the_gap_to_bf16(example, tmp_path):
    """--precision fp8's report: the 20-step moving-average gap between the fp8 and bf16 runs is a check (0.02
    nats), printed with the bf16-vs-torch gap; losses.csv gets the bf16 column, the PNG its curve."""
    class Env:
        rank, size = 0, 1
        lines = []

        def print(self, *a):
            self.lines.append(" ".join(str(x) for x in a))

    args = example.parse_args(["--precision", "fp8", "--steps", "40", "--out", str(tmp_path)])
    base = torch.linspace(4.0, 3.0, 40)
    params = [torch.zeros(2)]
    for shift, passed in ((0.01, True), (0.03, False)):
        env = Env()
        runs = {"ours run 1": (base + shift, 1.0, params), "ours run 2": (base + shift, 1.0, params),
                "ours bf16": (base, 1.0, params), "torch": (base, 1.0, params)}
        failures = example.report(args, env, runs)
        assert any("fp8 - bf16: " in line and "bf16 - torch" in line for line in env.lines), env.lines
        assert any(f.startswith("fp8 against bf16") for f in failures) != passed, failures
    header = (tmp_path / "losses.csv").read_text().splitlines()[0]
    assert header == "step,ours_run_1,ours_run_2,torch,ours_bf16", header
