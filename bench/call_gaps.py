#!/usr/bin/env python3
"""Where a layer call's time beyond its kernels goes: one GPU, EP = 1, our fused (and unfused) path.

layer_bench.py times each call alone (the GPU idle before it); a backward called alone has measured about 2.5 ms
more than its kernels add up to, and more than the same backward right after a forward (docs/perf_notes.md,
rounds 24-25). Per shape and path, for the forward and for the backward (each backward after an untimed forward):
  alone        CUDA events around one call after a synchronize (layer_bench's way), the median of --iters
  in stream    the backward right after a forward, events around the backward only, no synchronize between: its
               host enqueue overlaps the forward's kernels (how a training step runs it); the forward's row is
               the same forward back to back after another forward
  host         the host's time inside the call (perf_counter around it, no synchronize), the median
  kernels      from a torch.profiler trace of --profile calls alone: kernels per call, their summed time (busy),
               first kernel start to last kernel end (span), and the gaps before each kernel (the largest listed
               with the kernel they precede), so that "alone - busy" splits into the wait for the first kernel
               and idle time between kernels; plus the runtime API calls of the call longer than --slow-us.
Usage (one GPU, the build's bench library):
  python3 bench/call_gaps.py --shape sonic1024:32768:4096:1024:128:8 [--shape ...] [--unfused] [--iters 20]
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from shapes import SPEC, check_shape, select_shapes  # noqa: E402


def events_between(events, begin_us, end_us):
    """The events ([(start_us, end_us, name)], sorted) that start in [begin_us, end_us): one profiled call's, from
    its host entry to the return of the synchronize after it."""
    return [e for e in events if begin_us <= e[0] < end_us]


def call_summary(call, launched_at_us=None):
    """One call's GPU events (sorted by start): dict of kernels, busy_us (their summed durations), span_us (first
    start to last end), gaps [(us, name of the event after the gap)] from the latest end so far to each next start
    (0 where they overlap), and, given when the call was entered on the host (launched_at_us, the trace's clock),
    lead_us: from then to the first kernel's start."""
    gaps, reached = [], call[0][1]
    for start, end, name in call[1:]:
        gaps.append((max(0.0, start - reached), name))
        reached = max(reached, end)
    summary = dict(kernels=len(call), busy_us=sum(e[1] - e[0] for e in call), span_us=call[-1][1] - call[0][0],
                   gaps=gaps)
    if launched_at_us is not None:
        summary["lead_us"] = call[0][0] - launched_at_us
    return summary


def short_name(name, width=28):
    """A kernel's name without its template arguments and parameters, at most width characters (its end)."""
    return name.split("(")[0].split("<")[0][-width:]


CALL_MARK, SYNC_MARK = "call_gaps_call", "call_gaps_sync"  # record_function names around a call, its synchronize


def trace_events(path):
    """(GPU events [(start, end, name)] sorted, CUDA runtime and driver API events likewise, {mark name: [(start,
    end)] sorted} of CALL_MARK and SYNC_MARK) of a Chrome trace that torch.profiler wrote (microseconds)."""
    with open(path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    gpu = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events
                 if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    api = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events
                 if e.get("cat") in ("cuda_runtime", "cuda_driver"))
    # the host's ranges ("user_annotation"); the profiler also puts a "gpu_user_annotation" copy of each on the GPU
    marks = {name: sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                          if e.get("name") == name and e.get("cat") == "user_annotation")
             for name in (CALL_MARK, SYNC_MARK)}
    return gpu, api, marks


def main():
    import torch
    from torch.profiler import ProfilerActivity, profile

    import layer_bench as lb
    from capi import GRADS, grad_arrays, load

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lib", default="build/bench/libmok_bench_capi.so")
    parser.add_argument("--shape", action="append", default=[], metavar=SPEC, help="a custom shape (repeatable)")
    parser.add_argument("--shapes", default="", help="comma-separated model shape names")
    parser.add_argument("--tokens", type=int, default=8192, help="tokens of the named shapes")
    parser.add_argument("--unfused", action="store_true", help="also the unfused path")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--profile", type=int, default=5, help="profiled calls of each kind")
    parser.add_argument("--slow-us", type=float, default=50.0, help="list runtime API calls longer than this")
    args = parser.parse_args()
    if not args.shape and not args.shapes:
        parser.error("name a shape: --shape or --shapes")
    try:  # the library's rules before the GPU is touched (layer_bench's check)
        shapes = select_shapes(args.shapes, args.shape)
        for shape in shapes:
            check_shape(shape, args.tokens if shape.tokens is None else shape.tokens, 1)
    except ValueError as e:
        parser.error(str(e))

    lib = load(os.path.abspath(args.lib))
    torch.cuda.set_device(0)
    stream = torch.cuda.current_stream().cuda_stream
    med = statistics.median
    print(f"call_gaps: {torch.cuda.get_device_name()}; ms unless marked", flush=True)
    for shape in shapes:
        tokens = args.tokens if shape.tokens is None else shape.tokens
        for path in ("fused", "unfused") if args.unfused else ("fused",):
            layer = lb.create_layer(lib, 0, ep_size=1, num_tokens=tokens, top_k=shape.top_k,
                                    num_experts=shape.num_experts, hidden=shape.hidden, intermediate=shape.inter,
                                    shared_expert=bool(shape.shared), path=path)
            inputs = lb.make_inputs(shape.num_experts, shape.hidden, shape.inter, shape.top_k, shape.shared, tokens,
                                    1, 0, 0.0, 0)
            pointers = [0 if t is None else t.data_ptr() for t in inputs.values()]
            pointers.insert(2, 0)  # int32 ids
            out = torch.empty(tokens, shape.hidden, device="cuda", dtype=torch.bfloat16)
            d_out = lb.make_grad_output(tokens, shape.hidden, 0, 0)
            d_x = torch.empty_like(out)
            d_rw = torch.empty(tokens, shape.top_k, device="cuda", dtype=torch.float32)
            grads = {n: torch.empty_like(inputs[n]) for n in GRADS if inputs.get(n) is not None}
            arrays = grad_arrays(grads, {n: "bf16" for n in grads}, {n: "write" for n in grads})

            def forward():
                lb.check(lib.mok_bench_layer_forward(layer, *pointers, out.data_ptr(), stream, lb.ERROR,
                                                     len(lb.ERROR)))

            def backward():
                lb.check(lib.mok_bench_layer_backward(layer, *pointers, d_out.data_ptr(), d_x.data_ptr(),
                                                      d_rw.data_ptr(), *arrays, stream, lb.ERROR, len(lb.ERROR)))

            def event_ms(fn, host=None):
                """fn's time between CUDA events around it (ms); host: the list that gets the host's ms inside fn."""
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                h0 = time.perf_counter()
                fn()
                if host is not None:
                    host.append((time.perf_counter() - h0) * 1e3)
                b.record()
                b.synchronize()
                return a.elapsed_time(b)

            for _ in range(3):
                forward()
                backward()
            torch.cuda.synchronize()
            for kind, call in (("forward", forward), ("backward", backward)):
                alone, host, in_stream = [], [], []
                for _ in range(args.iters):
                    forward()  # the context a backward reads; before a forward, the same work
                    torch.cuda.synchronize()
                    alone.append(event_ms(call, host))
                for _ in range(args.iters):
                    forward()
                    in_stream.append(event_ms(call))
                with tempfile.TemporaryDirectory() as tmp:
                    trace = os.path.join(tmp, "trace.json")
                    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                        for _ in range(args.profile):
                            forward()
                            torch.cuda.synchronize()
                            with torch.profiler.record_function(CALL_MARK):
                                call()
                            with torch.profiler.record_function(SYNC_MARK):
                                torch.cuda.synchronize()
                    prof.export_chrome_trace(trace)
                    gpu, api, marks = trace_events(trace)
                summaries = []
                for (t0, _), (_, t1) in zip(marks[CALL_MARK], marks[SYNC_MARK]):
                    mine = events_between(gpu, t0, t1)
                    if mine:
                        summaries.append((call_summary(mine, t0), t0, t1))
                if not summaries:
                    print(f"  {shape.name} {path} {kind}: no profiled call found", flush=True)
                    continue
                s, t0, t1 = summaries[len(summaries) // 2]
                idle = sum(g for g, _ in s["gaps"])
                print(f"{shape.name:12s} {path:8s} {kind:8s} alone {med(alone):7.3f}  in stream {med(in_stream):7.3f}"
                      f"  host {med(host):6.3f}  kernels {s['kernels']:3d}  busy {s['busy_us'] / 1e3:7.3f}  span "
                      f"{s['span_us'] / 1e3:7.3f}  first kernel after {s['lead_us'] / 1e3:6.3f}  idle between "
                      f"{idle / 1e3:6.3f}", flush=True)
                largest = sorted(s["gaps"], key=lambda g: -g[0])[:6]
                print("    largest gaps (us, before): " + ", ".join(f"{g:.0f} {short_name(n)}" for g, n in largest))
                slow = [(e - b, n) for b, e, n in events_between(api, t0, t1) if e - b > args.slow_us]
                if slow:
                    print("    runtime calls over {:.0f} us: ".format(args.slow_us) +
                          ", ".join(f"{n} {d:.0f}" for d, n in slow[:8]), flush=True)
            lib.mok_bench_layer_destroy(layer)
            del inputs, out, d_out, d_x, d_rw, grads
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
