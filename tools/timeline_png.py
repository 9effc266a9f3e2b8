#!/usr/bin/env python3
"""Draws a fused forward's or backward's timeline (Chrome-trace JSON from MoeWorkspace::read_timeline /
chrome_trace_json, e.g. bench/layer_bench.py --timeline DIR) as a PNG: one row per CTA, its GEMM tiles in the upper
half and its row copies in the lower half, one bar per task, coloured by task kind; one panel per file (rank). Also
prints, per file, the kernel's span and, per role, how much of the span its CTAs spent in tasks (a copy task's span
includes its wait for its rows: a combine waits for the down tiles).

Which tasks are copies, and the summary's sums: bench/timeline_stats.py (also layer_bench.py --breakdown's). Kinds
COLOURS does not name (the backward's: pull, recompute, dgrad,
push, weight gradients, ...) take DEFAULT_PALETTE's colours in sorted order. Renderers: matplotlib when it
imports, else the built-in one (bench/png_canvas.py); --renderer picks one.

Usage: tools/timeline_png.py TIMELINE.json [MORE.json ...] -o timeline.png [--renderer auto|matplotlib|builtin]
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
from png_canvas import Canvas, fit_scale, nice_step, text_height, text_width  # noqa: E402
from timeline_stats import is_copy, kind_stats, role_stats, span_us  # noqa: E402
from timeline_stats import load_events as load  # noqa: E402

# Names as src/host/timeline.cpp's task_kind_name writes them.
COLOURS = {"shared gate/up": "#9ecae1", "shared down": "#3182bd", "expert gate/up": "#a1d99b",
           "expert down": "#31a354", "dispatch": "#fdae6b", "combine": "#e6550d",
           "shared recompute": "#c6dbef", "shared down dgrad": "#6baed6", "shared gate/up dgrad": "#2171b5",
           "shared down wgrad": "#bcbddc", "shared gate/up wgrad": "#807dba",
           "expert recompute": "#c7e9c0", "expert down dgrad": "#74c476", "expert gate/up dgrad": "#238b45",
           "expert down wgrad": "#fcbba1", "expert gate/up wgrad": "#cb181d",
           "pull grad": "#fdae6b", "push grad": "#e6550d"}
DEFAULT_PALETTE = ("#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf", "#d62728", "#393b79",
                   "#637939", "#8c6d31", "#843c39", "#7b4173", "#5254a3", "#ad494a", "#c5b0d5", "#c49c94")
RENDERERS = ("auto", "matplotlib", "builtin")

# The built-in renderer's layout in pixels.
WIDTH_PX = 1600
PANEL_PX = 520  # one trace
PLOT_LEFT_PX, PLOT_RIGHT_PX = 80, 30
PLOT_TOP_PX, PLOT_BOTTOM_PX = 36, 56  # the panel's title above the plot; tick labels and the axis' name below
LEGEND_ROW_PX = 28
LEGEND_PAD_PX = 12
SWATCH_PX, SWATCH_GAP_PX, LEGEND_ITEM_GAP_PX = 16, 6, 28
TARGET_TICKS = 10
TASK_HALF = 0.45  # of a CTA's row: its GEMM tiles above the middle, its copies below
TEXT_SCALE = 2
TEXT_COLOUR, AXIS_COLOUR, GRID_COLOUR = "#000000", "#404040", "#e8e8e8"


def kind_colours(traces):
    """{kind: colour} of every kind in the traces: COLOURS' kinds in its order, then the others sorted, coloured
    from DEFAULT_PALETTE (cycled when there are more)."""
    kinds = {e["name"] for _, events in traces for e in events}
    known = [k for k in COLOURS if k in kinds]
    unknown = sorted(kinds - set(COLOURS))
    colours = {k: COLOURS[k] for k in known}
    colours.update({k: DEFAULT_PALETTE[i % len(DEFAULT_PALETTE)] for i, k in enumerate(unknown)})
    return colours


def summary(path, events, kinds):
    """Lines: span, busy fraction of communication and compute CTAs, time per kind."""
    start, end = span_us(events)
    span = end - start
    lines = [f"{path}: {len(events)} tasks, span {span / 1e3:.3f} ms"]
    for role, copies in (("communication", True), ("compute", False)):
        stats = role_stats(events, copies)
        if stats is not None:
            lines.append(f"  {role:13s} {stats['ctas']:3d} CTAs, in tasks "
                         f"{100 * stats['busy_us'] / (stats['ctas'] * span):5.1f}% of the span, first task at "
                         f"{stats['first_us'] / 1e3:.3f} ms, last ends at {stats['last_us'] / 1e3:.3f} ms")
    for name, tasks, busy, _, first, last in kind_stats(events, kinds):
        lines.append(f"  {name:20s} {tasks:6d} tasks, {busy / 1e3:9.3f} CTA-ms, from {first / 1e3:7.3f} to "
                     f"{last / 1e3:7.3f} ms")
    return lines


def draw_matplotlib(traces, colours, output):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch
    fig, axes = plt.subplots(len(traces), 1, figsize=(16, 5 * len(traces)), squeeze=False)
    for ax, (path, events) in zip(axes[:, 0], traces):
        start = min(e["ts"] for e in events)
        for name, colour in colours.items():
            for copies in (False, True):
                by_cta = {}
                for e in events:
                    if e["name"] == name and is_copy(e) == copies:
                        by_cta.setdefault(e["args"]["cta"], []).append(((e["ts"] - start) / 1e3, e["dur"] / 1e3))
                low = 0.0 if copies else -TASK_HALF  # copies in the lower half of the CTA's row, GEMM tiles above
                for cta, bars in by_cta.items():
                    ax.broken_barh(bars, (cta + low, TASK_HALF), facecolors=colour, linewidth=0)
        ax.set_title(path.rsplit("/", 1)[-1])
        ax.set_xlabel("ms since the kernel's first task")
        ax.set_ylabel("CTA")
        ax.invert_yaxis()
        ax.legend(handles=[Patch(color=c, label=n) for n, c in colours.items()], loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(output, dpi=110)
    plt.close(fig)


def legend_rows(colours):
    """The built-in legend's lines: [[(kind, colour, x offset)]], as many items a line as fit WIDTH_PX."""
    rows, x = [[]], 0
    for name, colour in colours.items():
        width = SWATCH_PX + SWATCH_GAP_PX + text_width(name, TEXT_SCALE)
        if rows[-1] and x + width > WIDTH_PX - PLOT_LEFT_PX - PLOT_RIGHT_PX:
            rows.append([])
            x = 0
        rows[-1].append((name, colour, x))
        x += width + LEGEND_ITEM_GAP_PX
    return rows


def builtin_size(num_traces, colours):
    """(width, height) in pixels of the built-in renderer's image."""
    return WIDTH_PX, num_traces * PANEL_PX + len(legend_rows(colours)) * LEGEND_ROW_PX + LEGEND_PAD_PX


def draw_builtin(traces, colours, output):
    canvas = Canvas(*builtin_size(len(traces), colours))
    for panel_idx, (path, events) in enumerate(traces):
        draw_builtin_panel(canvas, panel_idx * PANEL_PX, path, events, colours)
    top = len(traces) * PANEL_PX + LEGEND_PAD_PX // 2
    for row_idx, row in enumerate(legend_rows(colours)):
        y = top + row_idx * LEGEND_ROW_PX + (LEGEND_ROW_PX - SWATCH_PX) / 2
        for name, colour, x in row:
            x += PLOT_LEFT_PX
            canvas.fill_rect(x, y, x + SWATCH_PX, y + SWATCH_PX, colour)
            canvas.text(x + SWATCH_PX + SWATCH_GAP_PX, y + (SWATCH_PX - text_height(TEXT_SCALE)) / 2, name,
                        TEXT_COLOUR, TEXT_SCALE)
    canvas.save(output)


def draw_builtin_panel(canvas, panel_top, path, events, colours):
    """One trace: its title, time ticks, CTA ticks, one bar per task."""
    left, right = PLOT_LEFT_PX, WIDTH_PX - PLOT_RIGHT_PX
    top, bottom = panel_top + PLOT_TOP_PX, panel_top + PANEL_PX - PLOT_BOTTOM_PX
    start = min(e["ts"] for e in events)
    span_ms = max(max(e["ts"] + e["dur"] for e in events) - start, 1e-3) / 1e3
    num_ctas = max(e["args"]["cta"] for e in events) + 1
    row_px = (bottom - top) / num_ctas

    def x_of(ms):
        return left + ms / span_ms * (right - left)

    name = path.rsplit("/", 1)[-1]
    canvas.text((left + right) / 2, panel_top + (PLOT_TOP_PX - text_height(TEXT_SCALE)) / 2, name, TEXT_COLOUR,
                fit_scale(name, right - left, TEXT_SCALE), "centre")
    step = nice_step(span_ms, TARGET_TICKS)
    for i in range(int(span_ms / step + 1e-9) + 1):
        x = round(x_of(i * step))
        canvas.vline(x, top, bottom, GRID_COLOUR)
        canvas.text(x, bottom + 8, f"{i * step:g}", TEXT_COLOUR, TEXT_SCALE, "centre")
    canvas.text((left + right) / 2, bottom + 8 + 2 * text_height(TEXT_SCALE), "ms since the kernel's first task",
                TEXT_COLOUR, TEXT_SCALE, "centre")
    cta_step = max(1, int(nice_step(num_ctas, TARGET_TICKS)))
    for cta in range(0, num_ctas, cta_step):
        y = top + (cta + 0.5) * row_px
        canvas.text(left - 8, y - text_height(TEXT_SCALE) / 2, str(cta), TEXT_COLOUR, TEXT_SCALE, "right")
    canvas.text(8, top - text_height(TEXT_SCALE) - 4, "CTA", TEXT_COLOUR, TEXT_SCALE)
    for e in events:
        middle = top + (e["args"]["cta"] + 0.5) * row_px
        y0, y1 = (middle, middle + TASK_HALF * row_px) if is_copy(e) else (middle - TASK_HALF * row_px, middle)
        x0 = x_of((e["ts"] - start) / 1e3)
        x1 = max(x_of((e["ts"] + e["dur"] - start) / 1e3), x0 + 1)  # at least a pixel wide and tall
        canvas.fill_rect(x0, round(y0), x1, max(round(y1), round(y0) + 1), colours[e["name"]])
    canvas.vline(left, top, bottom + 1, AXIS_COLOUR)
    canvas.hline(left, right, bottom, AXIS_COLOUR)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("traces", nargs="+")
    parser.add_argument("-o", "--output", default="timeline.png")
    parser.add_argument("--renderer", default="auto", choices=RENDERERS)
    args = parser.parse_args(argv)
    traces = [(path, load(path)) for path in args.traces]
    colours = kind_colours(traces)
    for path, events in traces:
        print("\n".join(summary(path, events, colours)))
    renderer = args.renderer
    if renderer == "auto":
        try:
            import matplotlib  # noqa: F401
            renderer = "matplotlib"
        except ImportError:
            renderer = "builtin"
    (draw_matplotlib if renderer == "matplotlib" else draw_builtin)(traces, colours, args.output)
    print(f"wrote {args.output} ({renderer})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
