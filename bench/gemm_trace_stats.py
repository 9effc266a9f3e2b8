"""Summary of gemm_bench.py --trace DIR (clusters of 2): tile times, consumer busy fraction, SM clock, and
how far apart in time the m-tiles that share one weight block start (in task lengths; beyond ~0.15 the
block has left L2 when the last of them reads it). Where the file holds the schedule's segment offsets too (traces
saved since round 21), one more line: the median time of the tasks of a full 128-row tile against the shorter
ones (an expert's last tile), per CTA record: whether a 64-row task costs half a tile or a whole one.
Usage: gemm_trace_stats.py DIR"""
import glob
import os
import sys

import torch



def rows_line(records, offsets, block_m=128):
    """Median task time by the task's rows: min(segment end - first row, block_m), from each record's key."""
    records = records[records[:, 1] > 0]
    dur = (records[:, 1] - records[:, 0]).double()
    key = records[:, 3]
    expert, row = key >> 48, key & 0xFFFFFFFF
    rows = torch.clamp(offsets.long()[expert + 1] - row, max=block_m)
    parts = []
    for label, mask in (("128-row", rows == block_m), ("shorter", rows < block_m)):
        if int(mask.sum()) > 0:
            parts.append(f"{label} tasks {int(mask.sum())}: median {float(dur[mask].median()) / 1e3:.1f} us")
    return "; ".join(parts)


def main(folder):
    for f in sorted(glob.glob(os.path.join(folder, "*.pt"))):
        saved = torch.load(f)
        offsets = saved["offsets"] if isinstance(saved, dict) else None
        raw = saved["trace"] if isinstance(saved, dict) else saved
        if offsets is not None:
            print(f"{os.path.basename(f)}: {rows_line(raw.view(-1, 4), offsets)}")
        t = raw.view(-1, 2, 4)
        t = t[t[:, 0, 1] > 0]
        start, end, sm, key = (t[:, 0, i] for i in range(4))
        cycles = (sm >> 16).double()
        sm = sm & 0xFFFF
        t0 = start.min()
        start, end = start - t0, end - t0
        dur = (end - start).double()
        expert, group = key >> 48, (key >> 32) & 0xFFFF
        block = expert * 1024 + group
        total = float(end.max())
        ctas = t.shape[0]
        med = float(dur.median())
        spreads = []
        for b in torch.unique(block):
            s = start[block == b]
            if s.numel() > 1:
                spreads.append(float(s.max() - s.min()))
        sp = torch.tensor(spreads)
        busy = float(dur.sum()) * 1.0 / (len(torch.unique(sm)) * total)
        pair = (t[:, 1, 0] - t[:, 0, 0]).abs().double()
        print(f"{os.path.basename(f)}: tiles {ctas} (cluster pairs), kernel {total/1e3:.0f} us, "
              f"task median {med/1e3:.1f} us (p10 {float(dur.quantile(0.1))/1e3:.1f}, "
              f"p90 {float(dur.quantile(0.9))/1e3:.1f}), consumer busy {busy:.3f}; "
              f"start spread of blocks sharing weights: median {float(sp.median())/med:.3f} "
              f"p90 {float(sp.quantile(0.9))/med:.3f} max {float(sp.max())/med:.3f} tasks; "
              f">0.1 task: {float((sp > 0.1 * med).double().mean()):.2f}; "
              f"cluster pair start delta median {float(pair.median())/1e3:.2f} us, "
              f"SM clock median {float((cycles / dur).median()) * 1e3:.0f} MHz")


if __name__ == "__main__":
    main(sys.argv[1])
