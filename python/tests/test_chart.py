"""CPU tests of the benchmark's pictures: bench/png_canvas.py (PNG writer and reader, bitmap font),
bench/chart_png.py (layer_bench.py's tables as a bar chart, built-in renderer and matplotlib), bench/layer_bench.py's
--json rows against its printed table, bench/timeline_stats.py (--breakdown's phase table), tools/timeline_png.py
(a trace with task kinds it does not know) and bench/gemm_trace_stats.py (task times by their rows).
Fresh random values per run; the seed is in every failure message. matplotlib tests skip without matplotlib."""
import argparse
import importlib.util
import io
import json
import math
import random
import re
import sys
from contextlib import redirect_stdout
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import chart_png  # noqa: E402
import gemm_trace_stats  # noqa: E402
import png_canvas  # noqa: E402
import timeline_stats  # noqa: E402

SHAPES = ["Kimi-K2.7", "GLM-5.2", "DeepSeek-V4-Pro E/2"]
MATPLOTLIB_MISSING = "matplotlib is not installed (the built-in renderer is tested without it)"


def load_tool(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def seed():
    return random.randrange(2**32)


def fake_rows(seed, shapes=SHAPES, tables=("fwd", "f+b")):
    """Rows as layer_bench.py --json writes them, distinct random TFLOP/s values (at least 8% apart)."""
    rng = random.Random(seed)
    pool = rng.sample(range(40, 900, 9), len(shapes) * len(tables) * len(chart_png.SERIES))
    rows = []
    for table in tables:
        for shape in shapes:
            values = {column: float(pool.pop()) + rng.random() for column, _, _ in chart_png.SERIES}
            rows.append(dict(table=table, shape=shape, EP=1, **values,
                             **{"fused/base": values["fused_TF"] / values["base_TF"]}))
    return rows


# ---- helpers reading a decoded RGB image

def colour_runs(width, height, pixels):
    """{(r, g, b): [(y, x0, x1)]}: each row's runs of one colour."""
    runs = {}
    for y in range(height):
        row = pixels[3 * width * y:3 * width * (y + 1)]
        x0 = 0
        for x in range(1, width + 1):
            if x == width or row[3 * x:3 * x + 3] != row[3 * x0:3 * x0 + 3]:
                runs.setdefault(tuple(row[3 * x0:3 * x0 + 3]), []).append((y, x0, x))
                x0 = x
    return runs


def rectangles(runs):
    """(x0, y0, x1, y1) of the solid rectangles that a colour's runs form (the same span on consecutive rows)."""
    open_rects, done = {}, []
    for y, x0, x1 in sorted(runs):
        rect = open_rects.pop((x0, x1, y), None)
        rect = (x0, rect[1] if rect else y, x1, y + 1)
        open_rects[(x0, x1, y + 1)] = rect
    for (x0, x1, _), rect in open_rects.items():
        done.append(rect)
    return sorted(done)


def bars_of(runs, colour, legend_top):
    """A colour's rectangles above the legend band, grouped by their bottom edge (one group per panel), each group
    sorted left to right; and the rectangles in the legend band."""
    by_bottom, legend = {}, []
    for rect in rectangles(runs.get(png_canvas.parse_colour(colour), [])):
        if rect[1] >= legend_top:
            legend.append(rect)
        else:
            by_bottom.setdefault(rect[3], []).append(rect)
    return [sorted(by_bottom[b]) for b in sorted(by_bottom)], legend


def dark_pixels(width, pixels, x0, y0, x1, y1):
    return sum(1 for y in range(max(0, y0), y1) for x in range(max(0, x0), x1)
               if sum(pixels[3 * (y * width + x):3 * (y * width + x) + 3]) < 3 * 96)


# ---- png_canvas

def test_font_covers_printable_ascii():
    for code in range(32, 127):
        rows = png_canvas._GLYPHS.get(chr(code))
        assert rows is not None, f"no glyph for {chr(code)!r}"
        lines = rows.split()
        assert len(lines) in (png_canvas.CAP_HEIGHT, png_canvas.GLYPH_HEIGHT), f"{chr(code)!r}: {len(lines)} rows"
        assert all(len(line) == png_canvas.GLYPH_WIDTH and set(line) <= {"#", "."} for line in lines), repr(chr(code))
        assert (code == 32) == (not png_canvas.FONT[chr(code)]), f"{chr(code)!r}: blank iff space"


def test_png_round_trip_and_bad_files(tmp_path, seed):
    rng = random.Random(seed)
    width, height = rng.randrange(1, 40), rng.randrange(1, 40)
    pixels = bytes(rng.randrange(256) for _ in range(3 * width * height))
    path = tmp_path / "random.png"
    path.write_bytes(png_canvas.encode_png(width, height, pixels))
    assert png_canvas.png_size(path) == (width, height), f"seed {seed}"
    assert png_canvas.read_png(path) == (width, height, pixels), f"seed {seed}"
    data = bytearray(path.read_bytes())
    data[-20] ^= 0xFF  # inside the IDAT payload: its CRC no longer matches
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="CRC"):
        png_canvas.read_png(path)
    path.write_bytes(b"GIF89a" + bytes(20))
    with pytest.raises(ValueError, match="signature"):
        png_canvas.png_size(path)
    with pytest.raises(ValueError, match="bytes of pixels"):
        png_canvas.encode_png(width, height, pixels[:-1])


def test_canvas_text_and_rects(seed):
    rng = random.Random(seed)
    scale, x, y = rng.randrange(1, 4), rng.randrange(0, 20), rng.randrange(0, 20)
    canvas = png_canvas.Canvas(200, 60)
    canvas.text(x, y, "AgH", "#000000", scale)
    inked = {(px, py) for py in range(60) for px in range(200) if canvas.pixel(px, py) != png_canvas.WHITE}
    expected = set()
    for i, c in enumerate("AgH"):
        for col, row in png_canvas.FONT[c]:
            left, top = x + (i * png_canvas.ADVANCE + col) * scale, y + row * scale
            expected |= {(left + dx, top + dy) for dx in range(scale) for dy in range(scale)}
    assert inked == expected, f"seed {seed}: scale {scale} at ({x}, {y})"
    assert max(px for px, _ in inked) - x + 1 == png_canvas.text_width("AgH", scale), f"seed {seed}"
    canvas.fill_rect(-5, -5, 3, 2, "#123456")  # clipped to the canvas
    assert canvas.pixel(0, 0) == canvas.pixel(2, 1) == (0x12, 0x34, 0x56) and canvas.pixel(3, 1) != (0x12, 0x34, 0x56)


# ---- chart_png, built-in renderer

def test_builtin_chart_draws_every_bar(tmp_path, seed):
    rows = fake_rows(seed)
    rows[1]["base_TF"] = None  # fwd GLM-5.2: not measured, no bar
    rows[4]["fused/base"] = None  # f+b GLM-5.2: no speed-up label
    path = tmp_path / "chart.png"
    assert chart_png.draw_layer_chart({"run": {}, "rows": rows}, path, "title", renderer="builtin") == "builtin"
    width, height, pixels = png_canvas.read_png(path)
    assert (width, height) == chart_png.chart_size(2), f"seed {seed}"
    runs = colour_runs(width, height, pixels)
    white = sum(x1 - x0 for _, x0, x1 in runs[png_canvas.WHITE])
    assert white < 0.9 * width * height, f"seed {seed}: the chart is {white / (width * height):.0%} white"
    legend_top = height - chart_png.LEGEND_PX
    assert dark_pixels(width, pixels, 0, 0, width, chart_png.TITLE_PX) > 100, f"seed {seed}: no title"

    n = len(SHAPES)
    heights, values = [], []
    fused_bars = None
    for series_idx, (column, _, colour) in enumerate(chart_png.SERIES):
        panels, legend = bars_of(runs, colour, legend_top)
        assert len(legend) == 1, f"seed {seed}: {column}: {len(legend)} legend swatches"
        assert len(panels) == 2, f"seed {seed}: {column}: bars on {len(panels)} baselines, expected 2 panels"
        for panel_idx, bars in enumerate(panels):
            want = [r[column] for r in rows[panel_idx * n:(panel_idx + 1) * n]]
            present = [v for v in want if v is not None]
            assert len(bars) == len(present), f"seed {seed}: {column} panel {panel_idx}: {len(bars)} bars"
            heights += [r[3] - r[1] for r in bars]
            values += present
            slot = (width - chart_png.PLOT_LEFT_PX - chart_png.PLOT_RIGHT_PX) / n
            shape_idx = [i for i, v in enumerate(want) if v is not None]
            for rect, i in zip(bars, shape_idx):  # left to right = table order, bar series_idx within its slot
                centre = (rect[0] + rect[2]) / 2 - chart_png.PLOT_LEFT_PX
                assert int(centre // slot) == i, f"seed {seed}: {column} bar of shape {i} at x {rect[0]}"
                assert int(centre % slot // (slot * chart_png.bar_width())) == series_idx + 1, f"seed {seed}"
        if column == "fused_TF":
            fused_bars = panels
    # one scale for every bar of both panels: height = value * px_per_tflops, to a pixel
    px_per_tflops = max(heights) / max(values)
    for h, v in zip(heights, values):
        assert abs(h - v * px_per_tflops) <= 1.5, f"seed {seed}: bar of {v:.1f} TFLOP/s is {h} px, expected " \
                                                  f"{v * px_per_tflops:.1f}"
    # the speed-up labels: ink just above each fused bar that has one, none above the one without
    for panel_idx, bars in enumerate(fused_bars):
        for i, rect in enumerate(bars):
            row = rows[panel_idx * n + i]
            unfused_top = bars_of(runs, chart_png.SERIES[1][2], legend_top)[0][panel_idx][i][1]
            band_top = min(rect[1], unfused_top) - 40
            ink = dark_pixels(width, pixels, rect[0] - 10, band_top, rect[2] + 10, rect[1])
            if row["fused/base"] is None:
                assert ink == 0, f"seed {seed}: a label above {row['shape']} {row['table']} without a speed-up"
            else:
                assert ink > 20, f"seed {seed}: no speed-up label above {row['shape']} {row['table']}"


def test_builtin_chart_forward_only(tmp_path, seed):
    path = tmp_path / "forward.png"
    chart_png.draw_layer_chart(fake_rows(seed, tables=("fwd",)), path, "forward only", renderer="builtin")
    width, height, pixels = png_canvas.read_png(path)
    assert (width, height) == chart_png.chart_size(1)
    panels, _ = bars_of(colour_runs(width, height, pixels), chart_png.SERIES[0][2], height - chart_png.LEGEND_PX)
    assert [len(bars) for bars in panels] == [len(SHAPES)], f"seed {seed}"


def test_auto_renderer_falls_back_without_matplotlib(tmp_path, monkeypatch, seed):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    path = tmp_path / "auto.png"
    assert chart_png.draw_layer_chart(fake_rows(seed), path, "t") == "builtin"
    assert png_canvas.png_size(path) == chart_png.chart_size(2)
    with pytest.raises(ImportError):
        chart_png.draw_layer_chart(fake_rows(seed), path, "t", renderer="matplotlib")


@pytest.mark.parametrize("change, message", [
    (lambda rows: rows.clear(), "no rows"),
    (lambda rows: rows[2].update(fused_TF=float("nan")), "fwd DeepSeek-V4-Pro E/2: fused_TF is NaN"),
    (lambda rows: rows[4].update({"fused/base": float("nan")}), "f\\+b GLM-5.2: fused/base is NaN"),
    (lambda rows: rows[0].update(dense_TF=float("inf")), "dense_TF is inf"),
    (lambda rows: rows[0].update(base_TF=-1.0), "must be finite and >= 0"),
    (lambda rows: rows[0].update(unfused_TF="612"), "not a number"),
    (lambda rows: rows[0].update(fused_TF=True), "not a number"),
    (lambda rows: rows[0].pop("table"), "needs table"),
    (lambda rows: rows[0].update(table="bwd"), "needs table"),
    (lambda rows: rows.append(dict(rows[0])), "a second fwd row of Kimi-K2.7"),
    (lambda rows: [r.update({c: None for c, _, _ in chart_png.SERIES}) for r in rows], "no bar to draw"),
])
@pytest.mark.parametrize("renderer", ["builtin", "auto"])
def test_chart_rejects_bad_results(tmp_path, seed, change, message, renderer):
    rows = fake_rows(seed)
    change(rows)
    path = tmp_path / "bad.png"
    with pytest.raises(ValueError, match=message):
        chart_png.draw_layer_chart(rows, path, "t", renderer=renderer)
    assert not path.exists()


def test_chart_rejects_unknown_renderer(tmp_path, seed):
    with pytest.raises(ValueError, match="renderer"):
        chart_png.draw_layer_chart(fake_rows(seed), tmp_path / "x.png", "t", renderer="svg")


def test_chart_cli(tmp_path, seed, capsys):
    results = tmp_path / "results.json"
    results.write_text(json.dumps({"run": {"commit": "abc1234", "gpu": "NVIDIA H200", "ep": 2,
                                           "tokens_per_rank": 8192, "iters": 20}, "rows": fake_rows(seed)}))
    assert chart_png.main([str(results), "--renderer", "builtin"]) == 0
    assert png_canvas.png_size(tmp_path / "results.png") == chart_png.chart_size(2)
    assert "results.png (builtin)" in capsys.readouterr().out
    results.write_text(json.dumps({"rows": []}))
    assert chart_png.main([str(results), "-o", str(tmp_path / "empty.png")]) == 1
    assert "no rows" in capsys.readouterr().err
    title = chart_png.chart_title({"commit": "abc1234", "gpu": "NVIDIA H200", "ep": 2, "tokens_per_rank": 8192})
    assert all(s in title for s in ("abc1234", "NVIDIA H200", "EP=2", "8192 tokens"))


# ---- chart_png, matplotlib

def test_matplotlib_chart(tmp_path, seed):
    pytest.importorskip("matplotlib", reason=MATPLOTLIB_MISSING)
    import matplotlib.image
    path = tmp_path / "chart.png"
    rows = fake_rows(seed)
    assert chart_png.draw_layer_chart(rows, path, "title", renderer="matplotlib") == "matplotlib"
    assert chart_png.draw_layer_chart(rows, tmp_path / "auto.png", "title") == "matplotlib"
    assert png_canvas.png_size(path) == chart_png.chart_size(2), f"seed {seed}"
    image = matplotlib.image.imread(path)
    assert image.shape[:2] == chart_png.chart_size(2)[::-1]
    for column, _, colour in chart_png.SERIES:
        rgb = [c / 255 for c in png_canvas.parse_colour(colour)]
        count = int((abs(image[..., :3] - rgb) < 1.5 / 255).all(axis=-1).sum())
        assert count > 2000, f"seed {seed}: {column}: {count} pixels of {colour}"
    with pytest.raises(ValueError, match="NaN"):
        rows[0]["fused_TF"] = float("nan")
        chart_png.draw_layer_chart(rows, tmp_path / "nan.png", "t", renderer="matplotlib")


# ---- layer_bench.py: --json rows are the printed table's numbers

def last_digit(token):
    """Half a unit of a printed number's last digit (1.23 -> 0.005, 1.2e-02 -> 0.0005, 612 -> 0.5)."""
    mantissa, _, exponent = token.partition("e")
    decimals = len(mantissa.partition(".")[2])
    return 0.5 * 10 ** (-decimals + (int(exponent) if exponent else 0))


def test_layer_bench_json_matches_its_table(tmp_path, seed, monkeypatch):
    pytest.importorskip("torch", reason="layer_bench.py imports torch")
    import layer_bench
    rng = random.Random(seed)
    times = {k: rng.uniform(0.5, 20) for k in ("fused", "unfused", "base", "dense", "fb_fused", "fb_unfused",
                                                 "bwd_fused", "bwd_unfused", "fb_base", "fb_dense")}
    del times["bwd_unfused"]  # a "-" cell
    result = layer_bench.ShapeResult(
        label="GLM-5.2", ep=2, tokens=8192, experts=256, top_k=8, hidden=6144, inter=2048, shared=True, backward=True,
        times=times, fwd=dict(relerr=rng.uniform(1e-3, 1e-2), bitwise=True),
        bwd=dict(dx=rng.uniform(1e-3, 1e-2), drw=rng.uniform(1e-3, 1e-2), dw=rng.uniform(1e-3, 1e-2), worst="",
                 bitwise=False, error=None), ctx_mib=rng.uniform(10, 900), comm_ctas=4, liger=None, notes=[],
        breakdown={}, phases=["    fused backward   phase line"])
    lines, records = [], []
    printed = io.StringIO()
    with redirect_stdout(printed):
        result.rows(lines, records)
    assert printed.getvalue().endswith("    fused backward   phase line\n"), "the phases are printed last"
    assert [r["table"] for r in records] == ["fwd", "f+b"]
    assert all(r["dims"] == dict(T=8192, H=6144, I=2048, E=256, k=8, shared=2048) for r in records)
    for line, record, columns in zip(lines, records, (layer_bench.FORWARD_COLUMNS, layer_bench.TRAIN_COLUMNS)):
        tokens = line.split()
        assert tokens[0] == record["table"] and len(tokens) == len(columns) + 1, f"seed {seed}: {line}"
        for column, token in zip(columns, tokens[1:]):
            value = record[column]
            if token == "-":
                assert value is None, f"seed {seed}: {column} printed '-', recorded {value}"
            elif isinstance(value, bool):
                assert token == ("yes" if value else "NO"), f"seed {seed}: {column}"
            elif isinstance(value, str):
                assert token == value, f"seed {seed}: {column}"
            else:
                assert abs(float(token) - value) <= last_digit(token) * (1 + 1e-9), \
                    f"seed {seed}: {record['table']} {column} printed {token}, recorded {value}"
    for record, key in zip(records, ("unfused", "fb_unfused")):  # the chart's unfused bar, as the others' TF
        assert math.isclose(record["unfused_TF"] * times[key], record["fused_TF"] * times[key.replace("unfused",
                                                                                                       "fused")])
    # main()'s outputs: the JSON of exactly these records, the chart drawn from them, both paths printed
    out = tmp_path / "out"
    args = argparse.Namespace(json=str(out / "layer_bench.json"), chart=str(out / "chart.png"))
    printed = io.StringIO()
    with redirect_stdout(printed):
        layer_bench.write_outputs(args, {"ep": 2, "gpu": "NVIDIA H200"}, records, ["a failure"])
    loaded = json.loads((out / "layer_bench.json").read_text())
    assert loaded["rows"] == records and loaded["failed"] == ["a failure"]
    assert loaded["columns"] == {"fwd": layer_bench.FORWARD_COLUMNS, "f+b": layer_bench.TRAIN_COLUMNS}
    assert png_canvas.png_size(out / "chart.png") == chart_png.chart_size(2)
    assert f"json: {args.json}" in printed.getvalue() and f"chart: {args.chart} (" in printed.getvalue()
    redrawn = tmp_path / "redrawn.png"  # the JSON alone draws the same chart
    assert chart_png.draw_layer_chart(loaded, redrawn, chart_png.chart_title(loaded["run"]), "builtin") == "builtin"
    assert png_canvas.png_size(redrawn) == chart_png.chart_size(2)
    def failing_matplotlib(results, path, title, renderer="auto"):
        chart_png.chart_panels(results)  # bad results fail first, as in draw_layer_chart
        if renderer != "builtin":
            raise RuntimeError("no fonts")
        return chart_png.draw_layer_chart(results, path, title, renderer)

    monkeypatch.setattr(layer_bench, "draw_layer_chart", failing_matplotlib)
    (out / "chart.png").unlink()
    with redirect_stdout(printed):  # matplotlib imports but fails: the built-in renderer draws it
        layer_bench.write_outputs(argparse.Namespace(json="", chart=str(out / "chart.png")), {}, records, [])
    assert png_canvas.png_size(out / "chart.png") == chart_png.chart_size(2)
    assert "(builtin; matplotlib failed: RuntimeError: no fonts)" in printed.getvalue()
    with redirect_stdout(printed):  # no rows (--only, or every shape failed): a note, no chart
        layer_bench.write_outputs(argparse.Namespace(json="", chart=str(tmp_path / "none.png")), {}, [], [])
    assert "chart: no rows to draw (empty results); no PNG written" in printed.getvalue()
    assert not (tmp_path / "none.png").exists()


# ---- tools/timeline_png.py

def fake_trace(seed):
    """Chrome-trace events as chrome_trace_json writes them: 4 CTAs; per CTA a GEMM task and, on the copy track,
    a copy task at the same time; known forward kinds and the backward's (unknown to COLOURS)."""
    rng = random.Random(seed)
    kinds = [("expert gate/up", False), ("expert down dgrad", False), ("expert gate/up wgrad", False),
             ("pull grad", True), ("push grad", True), ("combine", True)]
    events = [{"name": "thread_name", "ph": "M", "pid": 0, "tid": 0, "args": {"name": "CTA 0 GEMM"}}]
    for cta in range(4):
        for slot in range(2):
            gemm = kinds[rng.randrange(3)][0] if slot else kinds[cta % 3][0]
            copy = kinds[3 + rng.randrange(3)][0] if slot else kinds[3 + cta % 3][0]
            ts = slot * 500.0 + rng.uniform(0, 20)
            for name, copies in ((gemm, False), (copy, True)):
                events.append({"name": name, "ph": "X", "pid": 0, "tid": 2 * cta + int(copies), "ts": ts,
                               "dur": 400.0, "args": {"cta": cta, "sm": cta, "row": 0, "rows": 64, "n_block": 0,
                                                      "expert": 0}})
    return {"traceEvents": events}


def test_timeline_colours_cover_unknown_kinds():
    timeline = load_tool("timeline_png")
    names = ["combine", "pull grad", "expert down dgrad", "expert gate/up"] + [f"kind {i}" for i in range(20)]
    traces = [("a.json", [{"name": n} for n in names])]
    colours = timeline.kind_colours(traces)
    assert list(colours)[:2] == ["expert gate/up", "combine"], "COLOURS' kinds first, in its order"
    assert set(colours) == set(names)
    unknown = sorted(set(names) - set(timeline.COLOURS))
    assert [colours[k] for k in unknown[:len(timeline.DEFAULT_PALETTE)]] == list(timeline.DEFAULT_PALETTE)
    assert not set(timeline.DEFAULT_PALETTE) & set(timeline.COLOURS.values())
    assert timeline.is_copy({"name": "expert down", "tid": 7}) and not timeline.is_copy({"name": "pull", "tid": 6})
    assert timeline.is_copy({"name": "combine"}) and timeline.is_copy({"name": "pull grad"})  # no track id: COMM
    assert not timeline.is_copy({"name": "expert down wgrad"})


def test_timeline_builtin_png(tmp_path, seed, capsys):
    timeline = load_tool("timeline_png")
    trace = fake_trace(seed)
    path, out = tmp_path / "timeline_rank0.json", tmp_path / "timeline.png"
    path.write_text(json.dumps(trace))
    assert timeline.main([str(path), "-o", str(out), "--renderer", "builtin"]) == 0
    printed = capsys.readouterr().out
    tasks = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    colours = timeline.kind_colours([(str(path), tasks)])
    for name in colours:
        assert f"  {name} " in printed, f"seed {seed}: no summary line of {name}"
    width, height, pixels = png_canvas.read_png(out)
    assert (width, height) == timeline.builtin_size(1, colours), f"seed {seed}"
    runs = colour_runs(width, height, pixels)
    for name, colour in colours.items():  # in the panel, and a swatch in the legend below it
        rows = {y for y, _, _ in runs.get(png_canvas.parse_colour(colour), [])}
        assert rows and min(rows) < timeline.PANEL_PX <= max(rows), \
            f"seed {seed}: {name} ({colour}) in rows {sorted(rows)}"
    # at the middle of each task's time, a quarter of the CTA's row above its middle: the GEMM task's colour;
    # a quarter below: the copy task's (two tasks of a CTA run at the same time, one on each track)
    start = min(e["ts"] for e in tasks)
    span = max(e["ts"] + e["dur"] for e in tasks) - start
    top, bottom = timeline.PLOT_TOP_PX, timeline.PANEL_PX - timeline.PLOT_BOTTOM_PX
    left, right = timeline.PLOT_LEFT_PX, width - timeline.PLOT_RIGHT_PX
    row = (bottom - top) / 4

    def x_of(us):
        return round(left + (us - start) / span * (right - left))

    def covered(e, us):  # a task on e's track runs at time us
        return any(o["tid"] == e["tid"] and o["ts"] <= us <= o["ts"] + o["dur"] for o in tasks)

    for e in tasks:
        y = round(top + (e["args"]["cta"] + 0.5 + (0.25 if timeline.is_copy(e) else -0.25)) * row)
        colour = png_canvas.parse_colour(colours[e["name"]])
        where = f"seed {seed}: CTA {e['args']['cta']} {e['name']} from {e['ts']:.1f} us"
        x = x_of(e["ts"] + e["dur"] / 2)
        assert tuple(pixels[3 * (y * width + x):3 * (y * width + x) + 3]) == colour, f"{where}: not at ({x}, {y})"
        for x, us in ((x_of(e["ts"]) - 3, e["ts"] - 3 * span / (right - left)),  # just before it, just after it
                      (x_of(e["ts"] + e["dur"]) + 3, e["ts"] + e["dur"] + 3 * span / (right - left))):
            if left < x < right and not covered(e, us):
                assert tuple(pixels[3 * (y * width + x):3 * (y * width + x) + 3]) != colour, \
                    f"{where}: its colour at ({x}, {y}), outside its time"


def test_timeline_matplotlib_png(tmp_path, seed):
    pytest.importorskip("matplotlib", reason=MATPLOTLIB_MISSING)
    timeline = load_tool("timeline_png")
    path, out = tmp_path / "t.json", tmp_path / "t.png"
    path.write_text(json.dumps(fake_trace(seed)))
    with redirect_stdout(io.StringIO()):
        assert timeline.main([str(path), str(path), "-o", str(out)]) == 0
    assert png_canvas.png_size(out) == (16 * 110, 2 * 5 * 110), f"seed {seed}"  # figsize (16, 5 per trace), dpi 110


# ---- bench/timeline_stats.py: layer_bench.py --breakdown's phase table

def test_phase_table_sums_each_kind_per_role(seed):
    """Every kind's tasks and CTA-ms are its events' (random durations), on the GEMM or copy role it ran in;
    a CTA that filled its records gets the truncation note."""
    rng = random.Random(seed)
    events = fake_trace(seed)["traceEvents"][1:]
    for e in events:
        e["dur"] = rng.uniform(10, 400)
    lines = timeline_stats.phase_table(events, "fused backward")
    span = max(e["ts"] + e["dur"] for e in events) - min(e["ts"] for e in events)
    for copies, role in ((False, "GEMM"), (True, "copy")):
        mine = [e for e in events if timeline_stats.is_copy(e) == copies]
        ctas = len({e["args"]["cta"] for e in mine})
        header = [i for i, line in enumerate(lines) if f" {role} CTAs {ctas:4d}, in tasks" in line]
        assert len(header) == 1, f"seed {seed}: {role} header in {lines}"
        for name in {e["name"] for e in mine}:
            busy = sum(e["dur"] for e in mine if e["name"] == name)
            tasks = sum(1 for e in mine if e["name"] == name)
            pattern = rf"   {re.escape(name)} +\d+ tasks"
            row = [line for line in lines[header[0]:] if re.search(pattern, line)][0].split()
            at = row.index("tasks")
            assert int(row[at - 1]) == tasks, f"seed {seed}: {name}: {row}"
            assert abs(float(row[at + 1]) - busy / 1e3) <= 0.005, f"seed {seed}: {name}: {row}"
            assert abs(float(row[at + 3].rstrip("%")) - 100 * busy / (ctas * span)) <= 0.05, f"seed {seed}: {row}"
    assert not any("note" in line for line in lines)
    per_cta = max(sum(1 for e in events if e["args"]["cta"] == c) for c in range(4))
    assert "filled their" in timeline_stats.phase_table(events, "x", capacity=per_cta)[-1]
    assert not any("filled" in line for line in timeline_stats.phase_table(events, "x", capacity=per_cta + 1))


def test_gemm_trace_rows_tell_full_tiles_from_short_ones(seed):
    """gemm_bench.py --trace records (start, end, SM | cycles, expert << 48 | group << 32 | row) per CTA; with the
    segment offsets a task's rows are min(segment end - row, 128): the medians of each kind, and empty records
    (start 0) left out."""
    import torch
    gen = random.Random(seed)
    experts = gen.randint(2, 6)
    segments = [gen.choice((64, 192, 320)) for _ in range(experts)]
    offsets = torch.tensor([0] + [sum(segments[: e + 1]) for e in range(experts)], dtype=torch.int32)
    records, full, short = [], [], []
    for e in range(experts):
        for row in range(int(offsets[e]), int(offsets[e + 1]), 128):
            rows = min(int(offsets[e + 1]) - row, 128)
            start = gen.randint(1, 10**6)
            dur = gen.randint(1000, 10**6)
            (full if rows == 128 else short).append(dur)
            records.append([start, start + dur, 3, (e << 48) | (gen.randint(0, 7) << 32) | row])
    records.append([0, 0, 0, 0])  # a slot no CTA took
    line = gemm_trace_stats.rows_line(torch.tensor(records, dtype=torch.int64), offsets)
    for label, durations in (("128-row", full), ("shorter", short)):
        if durations:
            median = float(torch.tensor(durations, dtype=torch.float64).median()) / 1e3
            assert f"{label} tasks {len(durations)}: median {median:.1f} us" in line, f"seed {seed}: {line}"
        else:
            assert label not in line, f"seed {seed}: {line}"
