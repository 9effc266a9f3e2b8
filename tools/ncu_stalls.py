#!/usr/bin/env python3
"""Where one kernel's warps stall, from an Nsight Compute report with the SourceCounters section.

Run ON THE GPU MACHINE, e.g. (the GPU's own clock, caches as the workload leaves them):
  ncu -f --clock-control none --cache-control none --kernel-name-base mangled --kernel-name regex:SwiGLUBackward \\
      --launch-skip 2 --launch-count 1 --section SpeedOfLight --section SourceCounters -o /tmp/r \\
      python3 bench/gemm_bench.py --gemm expert --shapes Qwen3-30B-A3B --iters 2
  ncu -i /tmp/r.ncu-rep --page source --csv --print-source sass > /tmp/r.csv
  python3 tools/ncu_stalls.py /tmp/r.csv [--top 12] [--compare /tmp/other.csv]

Prints the kernel's SASS size, its stall samples by reason (share of all samples; with --compare, both reports side by
side and the difference), and the instructions with the most samples. Why: perf_notes round 17 found a kernel whose
warps waited on instruction fetch (stall_no_inst) once its code outgrew the instruction cache; the reason totals, not
the top instructions, showed it.
"""
import argparse
import csv
import gzip
import re
import sys

SAMPLES = "Warp Stall Sampling (All Samples)"


def number(cell):
    cell = (cell or "").replace(",", "")
    return float(cell) if re.fullmatch(r"[0-9]+(\.[0-9]*)?", cell) else 0.0


def load(path):
    """(header, rows) of the per-instruction table of an `ncu --page source --csv --print-source sass` file."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", errors="replace") as f:
        rows = list(csv.reader(f))
    head = next((i for i, r in enumerate(rows) if SAMPLES in r), None)
    if head is None:
        sys.exit(f"{path}: no '{SAMPLES}' column (was the report taken with --section SourceCounters?)")
    header = rows[head]
    return header, [r for r in rows[head + 1:] if len(r) == len(header)]


def summary(path):
    """SASS lines, total samples, samples per stall reason, and the rows themselves."""
    header, rows = load(path)
    reasons = [c for c in header if c.startswith("stall_") and "Not Issued" not in c]
    totals = {c: sum(number(r[header.index(c)]) for r in rows) for c in reasons}
    total = sum(number(r[header.index(SAMPLES)]) for r in rows)
    return {"lines": len(rows), "total": total, "reasons": totals, "header": header, "rows": rows}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv", help="ncu --page source --csv --print-source sass output (.gz allowed)")
    parser.add_argument("--compare", default="", help="a second report of the same kind, printed beside the first")
    parser.add_argument("--top", type=int, default=12, help="instructions with the most samples to print")
    args = parser.parse_args()
    runs = [summary(args.csv)] + ([summary(args.compare)] if args.compare else [])
    print("reports: " + ", ".join(f"{p}: {s['lines']} SASS lines, {s['total']:.0f} samples"
                                  for p, s in zip([args.csv, args.compare], runs)))
    names = sorted(runs[0]["reasons"], key=lambda c: -runs[0]["reasons"][c])
    for name in names:
        cells = [f"{s['reasons'].get(name, 0):9.0f} ({s['reasons'].get(name, 0) / (s['total'] or 1) * 100:5.1f} %)"
                 for s in runs]
        if max(s["reasons"].get(name, 0) for s in runs) < 0.005 * max(s["total"] for s in runs):
            continue
        diff = ""
        if len(runs) > 1:
            diff = f"  diff {runs[1]['reasons'].get(name, 0) - runs[0]['reasons'].get(name, 0):+9.0f}"
        print(f"  {name:24s} " + "  ".join(cells) + diff)
    header, rows = runs[0]["header"], runs[0]["rows"]
    source = next((header.index(c) for c in ("Source", "# Source") if c in header), 1)
    column = header.index(SAMPLES)
    print(f"top {args.top} instructions of {args.csv} by samples (index in the listing, share, SASS):")
    ranked = sorted(range(len(rows)), key=lambda i: -number(rows[i][column]))[:args.top]
    for i in ranked:
        print(f"  {i:6d} {number(rows[i][column]) / (runs[0]['total'] or 1) * 100:5.1f} %  {rows[i][source][:90]}")


if __name__ == "__main__":
    main()
