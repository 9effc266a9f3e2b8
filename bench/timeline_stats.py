"""Per-kind statistics of a fused kernel's timeline: the Chrome-trace JSON that MoeWorkspace::read_timeline and
chrome_trace_json write (bench/layer_bench.py --timeline DIR). Used by layer_bench.py --breakdown (the megakernels'
phases) and by tools/timeline_png.py (its summary lines).

A task is a row copy (communication) when its track id is odd (chrome_trace_json puts a CTA's copies on track
2 * CTA + 1; COMM names the copy kinds of traces without track ids), else a GEMM tile. A copy task's span includes
its wait for its rows (a combine waits for the down tiles, a push for the gate/up dgrads).
"""
import json

COMM = ("dispatch", "combine", "pull grad", "push grad")


def load_events(path):
    """The trace's task events (complete events; the track names are metadata events)."""
    with open(path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    if not events:
        raise SystemExit(f"{path}: no task records")
    return events


def is_copy(event):
    """A row copy (communication), not a GEMM tile."""
    return event["tid"] % 2 == 1 if "tid" in event else event["name"] in COMM


def span_us(events):
    """(start, end) of the trace in microseconds."""
    return min(e["ts"] for e in events), max(e["ts"] + e["dur"] for e in events)


def role_stats(events, copies):
    """The GEMM CTAs' (copies False) or the copiers' tasks: None when there are none, else a dict of ctas (how many
    CTAs ran one), busy_us (their summed durations), first_us and last_us (from the trace's start)."""
    start, _ = span_us(events)
    mine = [e for e in events if is_copy(e) == copies]
    if not mine:
        return None
    return {"ctas": len({e["args"]["cta"] for e in mine}), "busy_us": sum(e["dur"] for e in mine),
            "first_us": min(e["ts"] for e in mine) - start, "last_us": max(e["ts"] + e["dur"] for e in mine) - start}


def kind_stats(events, kinds, start=None):
    """Per kind of `kinds` that the events hold, in that order: (kind, tasks, busy_us, mean_us, first_us, last_us),
    times from `start` (default: the events' first start)."""
    start = span_us(events)[0] if start is None else start
    rows = []
    for name in kinds:
        mine = [e for e in events if e["name"] == name]
        if mine:
            busy = sum(e["dur"] for e in mine)
            rows.append((name, len(mine), busy, busy / len(mine), min(e["ts"] for e in mine) - start,
                         max(e["ts"] + e["dur"] for e in mine) - start))
    return rows


def kinds_in_order(events):
    """The events' kinds by first start."""
    first = {}
    for e in events:
        first[e["name"]] = min(first.get(e["name"], e["ts"]), e["ts"])
    return sorted(first, key=first.get)


def phase_table(events, what, capacity=None):
    """layer_bench.py --breakdown's lines for one kernel's trace: its span, the GEMM CTAs' time in tasks, per kind
    its tasks, CTA-ms and share of the GEMM CTAs' (or the copiers') time. With `capacity` (records per CTA), a note
    when a CTA filled it: later records were dropped and the sums undercount."""
    start, end = span_us(events)
    span = end - start
    lines = [f"    {what:16s} span {span / 1e3:.3f} ms; time per task kind summed over CTAs (timeline records)"]
    for copies, role in ((False, "GEMM"), (True, "copy")):
        stats = role_stats(events, copies)
        if stats is None:
            continue
        whole = stats["ctas"] * span
        lines.append(f"    {what:16s} {role} CTAs {stats['ctas']:4d}, in tasks {100 * stats['busy_us'] / whole:5.1f}% "
                     f"of their span")
        mine = [e for e in events if is_copy(e) == copies]
        for name, tasks, busy, mean, first, last in kind_stats(mine, kinds_in_order(mine), start):
            lines.append(f"    {what:16s}   {name:22s} {tasks:7d} tasks {busy / 1e3:9.2f} CTA-ms "
                         f"{100 * busy / whole:5.1f}%  mean {mean:8.2f} us  from {first / 1e3:7.3f} "
                         f"to {last / 1e3:7.3f} ms")
    if capacity:
        per_cta = {}
        for e in events:
            per_cta[e["args"]["cta"]] = per_cta.get(e["args"]["cta"], 0) + 1
        full = sum(1 for n in per_cta.values() if n >= capacity)
        if full:
            lines.append(f"    {what:16s} note: {full} CTAs filled their {capacity} records; later tasks are missing")
    return lines
