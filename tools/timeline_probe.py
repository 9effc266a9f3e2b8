"""Experiment (with 1bfbf1c, MOK_TIMELINE_PROBE): where a megakernel GEMM task's time goes, from a --timeline JSON. With a MOK_TIMELINE_PROBE build,
Usage: python3 tools/timeline_probe.py DIR/timeline_*.json (bench/layer_bench.py --no-backward --timeline DIR).
args rows / n_block hold ns from the task's start to its first full stage / its mainloop's end."""
import json, statistics, sys
from collections import defaultdict

for path in sys.argv[1:]:
    ev = [e for e in json.load(open(path))["traceEvents"] if e.get("ph") == "X"]
    gemm = [e for e in ev if e.get("tid", 0) % 2 == 0]
    copy = [e for e in ev if e.get("tid", 0) % 2 == 1]
    t0 = min(e["ts"] for e in ev); t1 = max(e["ts"] + e["dur"] for e in ev)
    print(f"{path.split('/')[-1]}: span {t1 - t0:.1f} us, {len(gemm)} gemm tasks, {len(copy)} copy tasks")
    by = defaultdict(list)
    for e in gemm:
        by[e["name"]].append(e)
    for name, es in by.items():
        d = sorted(e["dur"] for e in es)
        q = lambda f: d[min(len(d) - 1, int(f * len(d)))]
        line = (f"  {name:10s} n {len(es):6d} mean {statistics.mean(d):7.2f} us  p10 {q(.1):6.2f} p50 {q(.5):6.2f} "
                f"p90 {q(.9):6.2f} max {d[-1]:7.2f}  busy {sum(d)/1e3:8.1f} CTA-ms")
        full = [e for e in es if e["args"]["row"] >= 0]
        ok = [e for e in es if 0 <= e["args"]["rows"] <= e["args"]["n_block"] <= e["dur"] * 1e3 + 2000]
        if len(ok) > len(es) // 2:
            w = statistics.mean(e["args"]["rows"] for e in ok) / 1e3
            m = statistics.mean((e["args"]["n_block"] - e["args"]["rows"]) for e in ok) / 1e3
            ep = statistics.mean(e["dur"] - e["args"]["n_block"] / 1e3 for e in ok)
            line += f"\n  {'':10s} probed {len(ok)}: first stage {w:.2f}, mainloop {m:.2f}, epilogue {ep:.2f} us"
        print(line)
    cta = defaultdict(list)
    for e in gemm:
        cta[e["args"]["cta"]].append(e)
    gaps, first, tail = [], [], []
    for c, es in cta.items():
        es.sort(key=lambda e: e["ts"])
        gaps.append(sum(b["ts"] - (a["ts"] + a["dur"]) for a, b in zip(es, es[1:])))
        first.append(es[0]["ts"] - t0); tail.append(t1 - (es[-1]["ts"] + es[-1]["dur"]))
    print(f"  per CTA ({len(cta)}): gaps between tasks mean {statistics.mean(gaps):.1f} us, first task at "
          f"{statistics.mean(first):.1f} (max {max(first):.1f}), idle tail {statistics.mean(tail):.1f} (max {max(tail):.1f})")
    # gaps by the kind of the task that follows
    g2 = defaultdict(list)
    for c, es in cta.items():
        for a, b in zip(es, es[1:]):
            g2[(a["name"], b["name"])].append(b["ts"] - (a["ts"] + a["dur"]))
    for k, v in sorted(g2.items()):
        print(f"  gap {k[0]} -> {k[1]}: n {len(v)} mean {statistics.mean(v):.2f} us, p90 {sorted(v)[int(.9*len(v))]:.2f}")
