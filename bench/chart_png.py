#!/usr/bin/env python3
"""Draws bench/layer_bench.py's tables as one PNG bar chart: a panel per table (forward; forward + backward),
in each a group of bars per model shape: ours fused, ours unfused, the torchtitan-style baseline and the dense-GEMM
ceiling, in TFLOP/s per GPU (the tables' FLOP counts, docs/perf_notes.md), one axis scale for both panels, and
our fused path's speed-up over the baseline (the table's fused/base) above its bar.

Input: the rows layer_bench.py --json writes ({"run": {...}, "rows": [...]}, or the list of rows alone): each row
has "table" ("fwd" or "f+b"), "shape", and the columns fused_TF, unfused_TF, base_TF, dense_TF and fused/base
(null where the table prints "-": that bar is left out). Empty results, a row without table or shape, and a
value that is NaN, infinite, negative or not a number are errors (ValueError, naming the row and column).

Renderers: matplotlib (Agg) when it imports; else the built-in one (bench/png_canvas.py: zlib + struct PNG,
bitmap font), with the same content and the same pixel size (chart_size). renderer="builtin" forces the latter.

Usage: bench/chart_png.py RESULTS.json [-o CHART.png] [--title TEXT] [--renderer auto|matplotlib|builtin]
"""
import argparse
import json
import math
import os
import sys
from typing import List, NamedTuple, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from png_canvas import Canvas, fit_scale, nice_step, text_height, text_width  # noqa: E402

SERIES = (  # (row column, legend label, colour): a shape's bars, left to right
    ("fused_TF", "ours, fused", "#1f4e9c"),
    ("unfused_TF", "ours, unfused", "#8cb6e6"),
    ("base_TF", "torchtitan-style baseline", "#e8743b"),
    ("dense_TF", "dense GEMM ceiling", "#a6a6a6"),
)
SPEEDUP_COLUMN = "fused/base"
TABLES = (("fwd", "forward"), ("f+b", "forward + backward (the baseline under autograd)"))
AXIS_LABEL = "TFLOP/s per GPU"
SPEEDUP_NOTE = "N.NNx: baseline time / ours fused"
RENDERERS = ("auto", "matplotlib", "builtin")
NOT_MEASURED = "not measured"  # written in a shape's slot where the table has no value for any of its bars
NOT_MEASURED_AT = 0.05  # of the axis' height

# Layout in pixels, both renderers (matplotlib: a figure of WIDTH_PX / DPI inches, axes placed at these boxes).
DPI = 100
WIDTH_PX = 1600
TITLE_PX = 60  # the chart's title band
PANEL_PX = 420  # one table's panel
LEGEND_PX = 60  # the legend band at the bottom
PLOT_LEFT_PX = 100  # inside a panel: room for the tick labels left of the plot
PLOT_RIGHT_PX = 30
PLOT_TOP_PX = 50  # the panel's title above the plot
PLOT_BOTTOM_PX = 44  # the shape names below it
GROUP_FILL = 0.8  # fraction of a shape's slot its bars fill
HEADROOM = 1.12  # the axis' top over the tallest bar: room for the speed-up labels
TARGET_TICKS = 6  # about this many tick intervals on the value axis
LABEL_GAP_PX = 4  # between a bar's top and its speed-up label
LARGE_TEXT = 2  # the built-in font's scale for every text
TEXT_COLOUR, AXIS_COLOUR, GRID_COLOUR = "#000000", "#404040", "#e0e0e0"


class Panel(NamedTuple):
    title: str
    values: List[List[Optional[float]]]  # [shape][series] TFLOP/s, None: not measured
    speedups: List[Optional[float]]  # [shape] fused/base


def chart_size(num_panels):
    """(width, height) in pixels of a chart with num_panels panels."""
    return WIDTH_PX, TITLE_PX + num_panels * PANEL_PX + LEGEND_PX


def plot_box(panel_idx):
    """(left, top, right, bottom) pixels of a panel's plot area."""
    top = TITLE_PX + panel_idx * PANEL_PX
    return PLOT_LEFT_PX, top + PLOT_TOP_PX, WIDTH_PX - PLOT_RIGHT_PX, top + PANEL_PX - PLOT_BOTTOM_PX


def bar_width():
    """A bar's width in slot units (a shape's slot is 1 wide)."""
    return GROUP_FILL / len(SERIES)


def bar_left(series_idx):
    """A bar's left edge within its shape's slot, in slot units."""
    return (1 - GROUP_FILL) / 2 + series_idx * bar_width()


def value_axis(largest):
    """(top, step): a round step giving about TARGET_TICKS intervals, top a multiple of it above largest*HEADROOM."""
    want = largest * HEADROOM
    step = nice_step(want, TARGET_TICKS)
    return math.ceil(want / step) * step, step


def _number(row, column, where):
    """The row's value of column: None when absent or null, else a finite non-negative float (else ValueError)."""
    value = row.get(column)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"chart: {where}: {column} is {value!r}, not a number")
    if math.isnan(value):
        raise ValueError(f"chart: {where}: {column} is NaN")
    if math.isinf(value) or value < 0:
        raise ValueError(f"chart: {where}: {column} is {value}: must be finite and >= 0")
    return float(value)


def chart_panels(results):
    """(shapes, panels) of layer_bench.py's rows: shapes in the order they first appear, a Panel per table that
    has rows. ValueError for empty results, bad rows or values, or no bar to draw."""
    rows = results.get("rows") if isinstance(results, dict) else results
    if not rows:
        raise ValueError("chart: no rows to draw (empty results)")
    tables = dict(TABLES)
    shapes, by_key = [], {}
    for i, row in enumerate(rows):
        if not isinstance(row, dict) or row.get("table") not in tables or not isinstance(row.get("shape"), str):
            raise ValueError(f"chart: row {i}: needs table (one of {list(tables)}) and shape, got {row!r:.120}")
        key = row["table"], row["shape"]
        if key in by_key:
            raise ValueError(f"chart: row {i}: a second {key[0]} row of {key[1]}")
        by_key[key] = row
        if row["shape"] not in shapes:
            shapes.append(row["shape"])
    panels = []
    for table, title in TABLES:
        if not any(t == table for t, _ in by_key):
            continue
        values, speedups = [], []
        for shape in shapes:
            row, where = by_key.get((table, shape), {}), f"{table} {shape}"
            values.append([_number(row, column, where) for column, _, _ in SERIES])
            speedups.append(_number(row, SPEEDUP_COLUMN, where))
        panels.append(Panel(title, values, speedups))
    if not any(v for p in panels for bars in p.values for v in bars):
        raise ValueError("chart: no bar to draw: every TFLOP/s value is missing or 0 (a --check-only run?)")
    return shapes, panels


def speedup_text(speedup):
    return f"{speedup:.2f}x"


def draw_layer_chart(results, path, title, renderer="auto"):
    """Draws the chart of layer_bench.py's rows (see the module comment) to the PNG path; returns the renderer
    used ("matplotlib" or "builtin"). renderer: auto (matplotlib when it imports), matplotlib, builtin."""
    if renderer not in RENDERERS:
        raise ValueError(f"chart: renderer {renderer!r}, expected one of {RENDERERS}")
    shapes, panels = chart_panels(results)
    top, step = value_axis(max(v for p in panels for bars in p.values for v in bars if v is not None))
    if renderer != "builtin":
        try:
            import matplotlib
        except ImportError:
            if renderer == "matplotlib":
                raise
        else:
            matplotlib.use("Agg")
            _draw_matplotlib(shapes, panels, top, step, path, title)
            return "matplotlib"
    _draw_builtin(shapes, panels, top, step, path, title)
    return "builtin"


def _draw_matplotlib(shapes, panels, top, step, path, title):
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch
    width, height = chart_size(len(panels))
    fig = plt.figure(figsize=(width / DPI, height / DPI), dpi=DPI)
    fig.suptitle(title, y=1 - TITLE_PX / 2 / height, va="center", fontsize=13)
    for panel_idx, panel in enumerate(panels):
        left, box_top, right, bottom = plot_box(panel_idx)
        ax = fig.add_axes((left / width, 1 - bottom / height, (right - left) / width, (bottom - box_top) / height))
        ax.set_xlim(0, len(shapes))
        ax.set_ylim(0, top)
        ax.set_yticks([i * step for i in range(round(top / step) + 1)])
        ax.grid(axis="y", color=GRID_COLOUR)
        ax.set_axisbelow(True)
        for series_idx, (_, _, colour) in enumerate(SERIES):
            bars = [(i + bar_left(series_idx), bars[series_idx]) for i, bars in enumerate(panel.values)
                    if bars[series_idx] is not None]
            if bars:
                ax.bar(*zip(*bars), width=bar_width(), align="edge", color=colour, linewidth=0)
        for i, (bars, speedup) in enumerate(zip(panel.values, panel.speedups)):
            if all(v is None for v in bars):
                ax.text(i + 0.5, top * NOT_MEASURED_AT, NOT_MEASURED, ha="center", va="bottom", color=AXIS_COLOUR)
            if speedup is not None and bars[0] is not None:
                ax.text(i + bar_left(0) + bar_width() / 2, bars[0], speedup_text(speedup), ha="center",
                        va="bottom", fontsize=9)
        ax.set_xticks([i + 0.5 for i in range(len(shapes))], shapes)
        ax.tick_params(axis="x", length=0)
        ax.set_ylabel(AXIS_LABEL)
        ax.set_title(panel.title, loc="left", fontsize=12)
    handles = [Patch(color=colour, label=label) for _, label, colour in SERIES]
    handles.append(Patch(color="none", label=SPEEDUP_NOTE))
    fig.legend(handles=handles, loc="center", bbox_to_anchor=(0.5, LEGEND_PX / 2 / height), ncol=len(handles),
               frameon=False)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


def _draw_builtin(shapes, panels, top, step, path, title):
    width, height = chart_size(len(panels))
    canvas = Canvas(width, height)
    scale = fit_scale(title, width - 2 * PLOT_RIGHT_PX, LARGE_TEXT)
    canvas.text(width / 2, (TITLE_PX - text_height(scale)) / 2, title, TEXT_COLOUR, scale, "centre")
    for panel_idx, panel in enumerate(panels):
        _draw_builtin_panel(canvas, panel_idx, panel, shapes, top, step)
    _draw_builtin_legend(canvas, height - LEGEND_PX)
    canvas.save(path)


def _draw_builtin_panel(canvas, panel_idx, panel, shapes, top, step):
    """Title, grid and tick labels, the bars, the speed-up labels, the shape names."""
    left, box_top, right, bottom = plot_box(panel_idx)
    slot_px = (right - left) / len(shapes)

    def y_of(value):
        return bottom - value / top * (bottom - box_top)

    canvas.text(left, box_top - PLOT_TOP_PX / 2 - text_height(LARGE_TEXT) / 2, f"{panel.title}: {AXIS_LABEL}",
                TEXT_COLOUR, LARGE_TEXT)
    for i in range(round(top / step) + 1):
        y = round(y_of(i * step))
        canvas.hline(left, right, y, GRID_COLOUR)
        canvas.text(left - 8, y - text_height(LARGE_TEXT) / 2, f"{i * step:g}", TEXT_COLOUR, LARGE_TEXT, "right")
    for i, bars in enumerate(panel.values):
        for series_idx, value in enumerate(bars):
            if value is None:
                continue
            x0 = left + (i + bar_left(series_idx)) * slot_px
            y0 = min(y_of(value), bottom - 1) if value > 0 else bottom  # a bar above 0 shows at least one pixel
            canvas.fill_rect(x0, y0, x0 + bar_width() * slot_px, bottom, SERIES[series_idx][2])
        if all(v is None for v in bars):
            canvas.text(left + (i + 0.5) * slot_px, y_of(top * NOT_MEASURED_AT) - text_height(LARGE_TEXT),
                        NOT_MEASURED, AXIS_COLOUR, fit_scale(NOT_MEASURED, slot_px - 8, LARGE_TEXT), "centre")
        fused, speedup = bars[0], panel.speedups[i]
        if speedup is not None and fused is not None:
            text = speedup_text(speedup)
            scale = fit_scale(text, 1.5 * bar_width() * slot_px, LARGE_TEXT)
            centre = left + (i + bar_left(0) + bar_width() / 2) * slot_px
            # a label wider than its bar reaches over the unfused bar: above both then
            wide = text_width(text, scale) > bar_width() * slot_px
            label_on = max(fused, bars[1] or 0) if wide else fused
            canvas.text(centre, y_of(label_on) - LABEL_GAP_PX - text_height(scale), text, TEXT_COLOUR, scale,
                        "centre")
        name_scale = fit_scale(shapes[i], slot_px - 8, LARGE_TEXT)
        canvas.text(left + (i + 0.5) * slot_px, bottom + (PLOT_BOTTOM_PX - text_height(name_scale)) / 2,
                    shapes[i], TEXT_COLOUR, name_scale, "centre")
    canvas.vline(left, box_top, bottom + 1, AXIS_COLOUR)
    canvas.hline(left, right, bottom, AXIS_COLOUR)


def _draw_builtin_legend(canvas, band_top):
    """Swatches and labels in one centred line, then the speed-up note."""
    swatch, gap, item_gap = 18, 8, 36
    items = [(label, colour) for _, label, colour in SERIES] + [(SPEEDUP_NOTE, None)]
    total = sum((swatch + gap if colour else 0) + text_width(label, LARGE_TEXT) for label, colour in items)
    x = (canvas.width - total - item_gap * (len(items) - 1)) / 2
    y = band_top + (LEGEND_PX - swatch) / 2
    for label, colour in items:
        if colour:
            canvas.fill_rect(x, y, x + swatch, y + swatch, colour)
            x += swatch + gap
        canvas.text(x, y + (swatch - text_height(LARGE_TEXT)) / 2, label, TEXT_COLOUR, LARGE_TEXT)
        x += text_width(label, LARGE_TEXT) + item_gap


def chart_title(run):
    """The title of a run's chart from layer_bench.py's "run" record."""
    return (f"MoE layer benchmark, commit {run.get('commit') or 'unknown'}, {run.get('gpu', '?')}, "
            f"EP={run.get('ep', '?')}, {run.get('tokens_per_rank', '?')} tokens/rank, "
            f"median of {run.get('iters', '?')}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", help="the JSON file of layer_bench.py --json")
    parser.add_argument("-o", "--output", default="", help="the PNG (default: RESULTS with .png)")
    parser.add_argument("--title", default="", help="default: from the results' run record")
    parser.add_argument("--renderer", default="auto", choices=RENDERERS)
    args = parser.parse_args(argv)
    with open(args.results) as f:
        results = json.load(f)
    output = args.output or os.path.splitext(args.results)[0] + ".png"
    run = results.get("run", {}) if isinstance(results, dict) else {}
    try:
        used = draw_layer_chart(results, output, args.title or chart_title(run), args.renderer)
    except ValueError as e:
        print(f"{args.results}: {e}", file=sys.stderr)
        return 1
    print(f"wrote {output} ({used})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
