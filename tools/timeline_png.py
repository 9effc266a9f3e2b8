#!/usr/bin/env python3
"""Draws a fused forward's or backward's timeline (Chrome-trace JSON from MoeWorkspace::read_timeline /
chrome_trace_json, e.g. bench/layer_bench.py --timeline DIR) as a PNG: one row per CTA, its GEMM tiles in the upper
half and its row copies in the lower half, one bar per task, coloured by task kind; one panel per file (rank). Also
prints, per file, the kernel's span and, per role, how much of the span its CTAs spent in tasks (a copy task's span
includes its wait for its rows: a combine waits for the down tiles).

Usage: tools/timeline_png.py TIMELINE.json [MORE.json ...] -o timeline.png   (needs matplotlib)
"""
import argparse
import json
import sys

# Names as src/host/timeline.cpp's task_kind_name writes them.
COLOURS = {"shared gate/up": "#9ecae1", "shared down": "#3182bd", "expert gate/up": "#a1d99b",
           "expert down": "#31a354", "dispatch": "#fdae6b", "combine": "#e6550d",
           "shared recompute": "#c6dbef", "shared down dgrad": "#6baed6", "shared gate/up dgrad": "#2171b5",
           "shared down wgrad": "#bcbddc", "shared gate/up wgrad": "#807dba",
           "expert recompute": "#c7e9c0", "expert down dgrad": "#74c476", "expert gate/up dgrad": "#238b45",
           "expert down wgrad": "#fcbba1", "expert gate/up wgrad": "#cb181d",
           "pull grad": "#fdae6b", "push grad": "#e6550d"}
COMM = ("dispatch", "combine", "pull grad", "push grad")


def load(path):
    with open(path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]  # tasks, not track names
    if not events:
        raise SystemExit(f"{path}: no task records")
    return events


def summary(path, events):
    """Lines: span, busy fraction of communication and compute CTAs, time per kind."""
    start = min(e["ts"] for e in events)
    end = max(e["ts"] + e["dur"] for e in events)
    span = end - start
    lines = [f"{path}: {len(events)} tasks, span {span / 1e3:.3f} ms"]
    for role, names in (("communication", COMM), ("compute", tuple(n for n in COLOURS if n not in COMM))):
        mine = [e for e in events if e["name"] in names]
        ctas = {e["args"]["cta"] for e in mine}
        if not ctas:
            continue
        busy = sum(e["dur"] for e in mine)
        first = min(e["ts"] for e in mine)
        last = max(e["ts"] + e["dur"] for e in mine)
        lines.append(f"  {role:13s} {len(ctas):3d} CTAs, in tasks {100 * busy / (len(ctas) * span):5.1f}% of the span, "
                     f"first task at {(first - start) / 1e3:.3f} ms, last ends at {(last - start) / 1e3:.3f} ms")
    for name in COLOURS:
        mine = [e for e in events if e["name"] == name]
        if mine:
            lines.append(f"  {name:15s} {len(mine):6d} tasks, {sum(e['dur'] for e in mine) / 1e3:9.3f} CTA-ms, "
                         f"from {(min(e['ts'] for e in mine) - start) / 1e3:7.3f} to "
                         f"{(max(e['ts'] + e['dur'] for e in mine) - start) / 1e3:7.3f} ms")
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("traces", nargs="+")
    parser.add_argument("-o", "--output", default="timeline.png")
    args = parser.parse_args()
    traces = [(path, load(path)) for path in args.traces]
    for path, events in traces:
        print("\n".join(summary(path, events)))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError:
        print("timeline_png: matplotlib is missing (python3 -m pip install matplotlib); no PNG drawn", file=sys.stderr)
        return 1
    fig, axes = plt.subplots(len(traces), 1, figsize=(16, 5 * len(traces)), squeeze=False)
    for ax, (path, events) in zip(axes[:, 0], traces):
        start = min(e["ts"] for e in events)
        for name, colour in COLOURS.items():
            mine = [e for e in events if e["name"] == name]
            by_cta = {}
            for e in mine:
                by_cta.setdefault(e["args"]["cta"], []).append(((e["ts"] - start) / 1e3, e["dur"] / 1e3))
            low = 0.0 if name in COMM else -0.45  # copies in the lower half of the CTA's row, GEMM tiles above
            for cta, bars in by_cta.items():
                ax.broken_barh(bars, (cta + low, 0.45), facecolors=colour, linewidth=0)
        ax.set_title(path.rsplit("/", 1)[-1])
        ax.set_xlabel("ms since the kernel's first task")
        ax.set_ylabel("CTA")
        ax.invert_yaxis()
        ax.legend(handles=[Patch(color=c, label=n) for n, c in COLOURS.items()], loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(args.output, dpi=110)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
