#!/usr/bin/env python3
"""The layer's output bits from one build, saved and checked against another build (issue 26 item 3: a refactor
keeps today's bits). One GPU, EP = 1, through the C API (bench/capi.cpp), which any build since d0b3fa0 has:
  python3 bench/bits.py --lib BASE/bench/libmok_bench_capi.so --save bits.json [--shapes A,B] [--shape SPEC]
                        [--tokens 8192] [--seed 0] [--paths fused,unfused,fused-bmk,...]
  python3 bench/bits.py --lib NEW/bench/libmok_bench_capi.so --check bits.json [--shapes A,B]
--save runs every shape (default: the model shapes at --tokens per rank; --shapes / --shape as in layer_bench.py,
bench/shapes.py) on each path: "fused" (the megakernel forward, the stage-kernel backward), "unfused" (its
stage-by-stage twin) and "fused-bmk" (fused, backward megakernel); per path one forward (out) and one backward
(d_x, d_router_weights and every weight gradient, bf16 written), every output poisoned with NaN first. The paths
with a suffix run the same backward with fp32 weight gradients: "-fp32" written (outputs grad32_*), "-acc" added
into fp32 buffers that start at fixed values (gradacc_*): "unfused-fp32", "unfused-acc" (the stage kernels'
weight-gradient epilogues) and "fused-bmk-fp32", "fused-bmk-acc" (the backward megakernel's). It writes per
shape its dimensions, a digest of each input and per path and output a digest, the count of non-finite values and a
few sample values (JSON). --check reads the file, reruns its shapes (their T, the seed and the paths from the file)
with --lib and compares: exit 1 naming each shape, path and output whose bits differ (and the samples, saved and
now), an input that differs (nothing of that shape is compared then: other inputs, e.g. another torch), a path whose
call failed in either run. Both modes also fail when the paths disagree with each other in one run (fused and
unfused are bitwise twins).

Inputs (fixed, from --seed): x ~ randn bf16 [T, H]; router weights = softmax of randn [T, k] (fp32); weights ~ randn
/ sqrt(fan_in) bf16 (expert gate, up, down, shared gate, up, down); d_out ~ randn bf16 [T, H]; all from one CUDA
generator seeded with --seed, in that order (make_inputs). The
routing is given, not drawn: token t's k experts are (first(t) + j * (E // k)) mod E, j < k, first(t) = mix(t) mod E
(distinct per token; about T*k/E rows per expert).

Digest (DIGEST_SCHEME): the tensor's bytes read as 16-bit (bf16) or 32-bit (fp32, int32) words w_i, cut into chunks
of 2^26 words; per chunk sum_i w_i * m_i mod 2^64 with m_i = mix(i) | 1 (odd, so any single changed word changes the
sum); the digest is the sha256 of those sums (int64, little-endian). Computed on the GPU: a sha256 of the bytes on the
host would take minutes for the weight gradients of all shapes (about 125 GB per path). mix: a splitmix64-style
integer hash in torch int64 arithmetic (wrapping multiply, arithmetic shift), so digests do not depend on torch's RNG.

Why a script of its own and not layer_bench.py: the baseline build's layer_bench.py (d0b3fa0) has no such option,
and its C API creates a layer by positional arguments where today's takes options by name (ac8b306). This script
uses only the entry points both have (create, forward, backward, check_status, destroy) and picks the create
convention: --capi auto (default) takes "named" when the library exports mok_bench_status_new (added in f206537,
just before ac8b306) and "positional" otherwise; builds from f206537 up to ac8b306 need --capi positional.
"""
import argparse
import ctypes
import hashlib
import json
import os
import struct
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import capi  # noqa: E402
from shapes import SPEC, Shape, check_shape, select_shapes  # noqa: E402

FORMAT = "mok-bits 1"
CHUNK = 1 << 26  # words per chunk of the digest
DIGEST_SCHEME = "wsum64-chunk2^26-sha256"
PATHS = ("fused", "unfused", "fused-bmk", "unfused-fp32", "unfused-acc", "fused-bmk-fp32", "fused-bmk-acc")
# A path's weight gradients: (output name prefix, dtype, GradMode) by its suffix (none: bf16 written).
GRAD_VARIANTS = {"": ("grad", "bf16", "write"), "fp32": ("grad32", "fp32", "write"),
                 "acc": ("gradacc", "fp32", "accumulate")}
DEVICE = "cuda"  # where the inputs and outputs live (the CPU tests drive a fake library on "cpu")
SAMPLES = 4  # values kept per output: the first, at 1/3, at 2/3, the last
ENTRY_POINTS = ("mok_bench_layer_forward", "mok_bench_layer_backward", "mok_bench_layer_check_status",
                "mok_bench_layer_destroy")
ERROR = ctypes.create_string_buffer(1024)
WORDS = {torch.bfloat16: (torch.int16, 0x7F80), torch.float32: (torch.int32, 0x7F800000),
         torch.int32: (torch.int32, None)}  # dtype: (word, exponent mask: all ones = not finite)
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float32: "fp32", torch.int32: "int32"}


def signed64(value):
    return (value + 2**63) % 2**64 - 2**63


GOLDEN, MIX1, MIX2 = (signed64(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))


def mix(i):
    """A splitmix64-style hash of an int64 tensor, elementwise, in torch's int64 arithmetic (multiplication wraps,
    >> is arithmetic)."""
    z = (i + 1) * GOLDEN
    z = (z ^ (z >> 30)) * MIX1
    z = (z ^ (z >> 27)) * MIX2
    return z ^ (z >> 31)


_multipliers = {}


def multipliers(device):
    """m_i = mix(i) | 1 for i < CHUNK, int64, made once per device."""
    key = (str(device), CHUNK)
    if key not in _multipliers:
        _multipliers[key] = mix(torch.arange(CHUNK, dtype=torch.int64, device=device)) | 1
    return _multipliers[key]


def describe(tensor):
    """{dtype, shape, digest, chunks, nonfinite, samples} of a contiguous bf16, fp32 or int32 tensor (see the
    module's docstring): chunks the per-chunk sums (hex; where two runs differ, compare names the first chunk that
    does), samples as text (repr of the float or int), so NaN and inf stay plain JSON."""
    word, exponent = WORDS[tensor.dtype]
    words = tensor.contiguous().view(word).flatten()
    m = multipliers(words.device)
    sums, nonfinite = [], []
    for begin in range(0, words.numel(), CHUNK):
        chunk = words[begin:begin + CHUNK]
        sums.append((chunk.to(torch.int64) * m[:chunk.numel()]).sum())
        if exponent is not None:
            nonfinite.append(((chunk & exponent) == exponent).sum())
    sums = torch.stack(sums).cpu() if sums else torch.zeros(0, dtype=torch.int64)
    flat = tensor.flatten()
    n = flat.numel()
    picks = sorted({0, n // 3, 2 * n // 3, n - 1}) if n else []
    values = flat[torch.tensor(picks, dtype=torch.int64, device=flat.device)].tolist() if picks else []
    return dict(dtype=DTYPE_NAMES[tensor.dtype], shape=list(tensor.shape),
                digest=hashlib.sha256(struct.pack(f"<{sums.numel()}q", *sums.tolist())).hexdigest(),
                chunks=[f"{s % 2**64:016x}" for s in sums.tolist()],
                nonfinite=int(torch.stack(nonfinite).sum().item()) if nonfinite else 0,
                samples=[repr(v) for v in values])


def given_routing(tokens, num_experts, top_k, device):
    """int32 [T, k]: token t's experts (first(t) + j * (E // k)) mod E, first(t) = mix(t) mod E; distinct per token
    ((k - 1) * (E // k) < E)."""
    t = torch.arange(tokens, dtype=torch.int64, device=device)
    first = torch.remainder(mix(t), num_experts)
    step = num_experts // top_k
    return torch.remainder(first[:, None] + step * torch.arange(top_k, dtype=torch.int64, device=device),
                           num_experts).to(torch.int32).contiguous()


def make_inputs(shape, tokens, seed, device=None):
    """The fixed inputs of one shape (module docstring) on device (None: DEVICE), by name: x, topk_idx,
    router_weights, the six weights (None where absent) in capi.GRADS' order, d_out."""
    device = device or DEVICE
    gen = torch.Generator(device=device).manual_seed(seed)
    bf16 = dict(device=device, dtype=torch.bfloat16)
    e, h, i, k = shape.num_experts, shape.hidden, shape.inter, shape.top_k

    def weight(*dims):
        return torch.randn(*dims, generator=gen, **bf16).mul_(dims[-1] ** -0.5)

    x = torch.randn(tokens, h, generator=gen, **bf16)
    inputs = dict(x=x, topk_idx=given_routing(tokens, e, k, device))
    inputs["router_weights"] = torch.softmax(torch.randn(tokens, k, generator=gen, device=device), dim=1).contiguous()
    inputs.update(expert_gate=weight(e, i, h), expert_up=weight(e, i, h), expert_down=weight(e, h, i))
    for name, dims in (("shared_gate", (i, h)), ("shared_up", (i, h)), ("shared_down", (h, i))):
        inputs[name] = weight(*dims) if shape.shared else None
    inputs["d_out"] = torch.randn(tokens, h, generator=gen, **bf16)
    return inputs


def check(rc):
    if rc != 0:
        raise RuntimeError(ERROR.value.decode(errors="replace"))


def create_layer(lib, convention, shape, tokens, path):
    """A one-rank layer of the shape on the current device for a path of PATHS, created by the library's
    convention ("named" or "positional", see the module's docstring); everything else the library's defaults."""
    base = base_path(path)
    fused, megakernel = base != "unfused", base == "fused-bmk"
    device = torch.cuda.current_device() if DEVICE == "cuda" else 0
    if convention == "named":
        options = dict(num_tokens=tokens, top_k=shape.top_k, num_experts=shape.num_experts, hidden=shape.hidden,
                       intermediate=shape.inter, shared_expert=bool(shape.shared),
                       path="fused" if fused else "unfused")
        if fused:
            options["backward_megakernel"] = megakernel
        layer = lib.mok_bench_layer_create(None, 0, device, *capi.layer_options(**options), ERROR, len(ERROR))
    else:
        layer = lib.mok_bench_layer_create(None, 1, 0, device, tokens, shape.top_k, shape.num_experts, shape.hidden,
                                           shape.inter, int(shape.shared), 2 if megakernel else int(fused), 0, 0, 0,
                                           0, 0.0, 0.0, ERROR, len(ERROR))
    if not layer:
        raise RuntimeError(ERROR.value.decode(errors="replace"))
    return layer


def base_path(path):
    """The forward/backward path of a PATHS entry, without its weight-gradient suffix."""
    return path.rsplit("-", 1)[0] if path.endswith(("-fp32", "-acc")) else path


def grad_variant(path):
    """(output name prefix, dtype, mode) of a PATHS entry's weight gradients (GRAD_VARIANTS)."""
    return GRAD_VARIANTS[path.rsplit("-", 1)[1] if path.endswith(("-fp32", "-acc")) else ""]


def accumulate_start(shape, device):
    """The fixed values an "-acc" path's fp32 gradient buffer holds before the backward adds into it: multiples of
    1/8 in [-1, 1) repeating with period 136, the same in every run and build (made without a buffer of indices:
    the largest gradients have billions of elements)."""
    pattern = (((torch.arange(136, dtype=torch.int64) * 7919) % 17) - 8).to(torch.float32).mul_(0.125).to(device)
    buffer = torch.empty(shape, dtype=torch.float32, device=device)
    flat = buffer.view(-1)
    whole = flat.numel() // pattern.numel() * pattern.numel()
    flat[:whole].view(-1, pattern.numel()).copy_(pattern)
    flat[whole:].copy_(pattern[:flat.numel() - whole])
    return buffer


def run_path(lib, convention, shape, tokens, path, inputs):
    """{output name: describe(...)} of one forward and one backward on a fresh layer of this path."""
    on_gpu = inputs["x"].is_cuda
    stream = torch.cuda.current_stream().cuda_stream if on_gpu else None
    weights = {n: inputs[n] for n in capi.GRADS}
    pointers = [inputs["x"].data_ptr(), inputs["topk_idx"].data_ptr(), 0, inputs["router_weights"].data_ptr()]
    pointers += [0 if w is None else w.data_ptr() for w in weights.values()]
    def poisoned(shape, dtype=torch.bfloat16):
        return torch.full(shape, float("nan"), device=inputs["x"].device, dtype=dtype)

    out, d_x, d_rw = poisoned((tokens, shape.hidden)), poisoned((tokens, shape.hidden)), poisoned(
        (tokens, shape.top_k), torch.float32)
    prefix, grad_dtype, grad_mode = grad_variant(path)
    if grad_mode == "accumulate":
        grads = {n: accumulate_start(w.shape, inputs["x"].device) for n, w in weights.items() if w is not None}
    else:
        grads = {n: poisoned(w.shape, torch.float32 if grad_dtype == "fp32" else torch.bfloat16)
                 for n, w in weights.items() if w is not None}
    layer = create_layer(lib, convention, shape, tokens, path)
    try:
        check(lib.mok_bench_layer_forward(layer, *pointers, out.data_ptr(), stream, ERROR, len(ERROR)))
        check(lib.mok_bench_layer_check_status(layer, stream, ERROR, len(ERROR)))
        arrays = capi.grad_arrays(grads, {n: grad_dtype for n in grads}, {n: grad_mode for n in grads})
        check(lib.mok_bench_layer_backward(layer, *pointers, inputs["d_out"].data_ptr(), d_x.data_ptr(),
                                           d_rw.data_ptr(), *arrays, stream, ERROR, len(ERROR)))
        check(lib.mok_bench_layer_check_status(layer, stream, ERROR, len(ERROR)))
    finally:
        if on_gpu:
            torch.cuda.synchronize()
        lib.mok_bench_layer_destroy(layer)
    outputs = dict(out=describe(out), d_x=describe(d_x), d_router_weights=describe(d_rw))
    outputs.update({f"{prefix}_{n}": describe(g) for n, g in grads.items()})
    return outputs


def run_shape(lib, convention, shape, tokens, seed, paths):
    """One shape's record: dims, inputs (digests), outputs {path: {output: describe}}, errors {path: message}."""
    inputs = make_inputs(shape, tokens, seed)
    record = dict(dims=dict(T=tokens, H=shape.hidden, I=shape.inter, E=shape.num_experts, k=shape.top_k,
                            shared=shape.inter if shape.shared else 0),
                  inputs={n: describe(t) for n, t in inputs.items() if t is not None}, outputs={}, errors={})
    for path in paths:
        try:
            record["outputs"][path] = run_path(lib, convention, shape, tokens, path, inputs)
        except (RuntimeError, torch.cuda.OutOfMemoryError) as e:
            record["errors"][path] = f"{type(e).__name__}: {e}"
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    return record


def shape_of(name, record):
    """The Shape a record was made from (its dims)."""
    d = record["dims"]
    return Shape(name, d["T"], d["E"], d["H"], d["I"], d["k"], d["shared"] != 0)


def path_disagreements(name, record):
    """Texts of the outputs where this run's paths differ from its first path (they are bitwise twins)."""
    outputs = record["outputs"]
    if len(outputs) < 2:
        return []
    first, *others = outputs
    return [f"{name}: {other} {output} differs from {first} {output} in the same run"
            for other in others for output, entry in outputs[other].items()
            if output in outputs[first] and entry["digest"] != outputs[first][output]["digest"]]


def compare(name, saved, now):
    """Texts of every difference between a saved shape record and this run's (empty: the same bits)."""
    if saved["dims"] != now["dims"]:
        return [f"{name}: dims differ: saved {saved['dims']}, now {now['dims']}"]
    changed = [n for n in saved["inputs"] if saved["inputs"][n]["digest"] != now["inputs"].get(n, {}).get("digest")]
    changed += [n for n in now["inputs"] if n not in saved["inputs"]]
    if changed:
        return [f"{name}: inputs differ ({', '.join(changed)}): other inputs than the saved run's (another torch or "
                f"GPU?); nothing of this shape compared"]
    problems = []
    for path in sorted(set(saved["outputs"]) | set(saved["errors"]), key=PATHS.index):
        if path in saved["errors"]:
            problems.append(f"{name} {path}: the saved run failed ({saved['errors'][path]}); not compared")
            continue
        if path in now["errors"]:
            problems.append(f"{name} {path}: failed now: {now['errors'][path]}")
            continue
        then_outputs, now_outputs = saved["outputs"][path], now["outputs"][path]
        for output in sorted(set(then_outputs) | set(now_outputs)):
            a, b = then_outputs.get(output), now_outputs.get(output)
            if a is None or b is None:
                problems.append(f"{name} {path} {output}: {'saved' if b is None else 'now'} only")
            elif (a["dtype"], a["shape"], a["digest"]) != (b["dtype"], b["shape"], b["digest"]):
                problems.append(f"{name} {path} {output}: bits differ{first_difference(a, b)} (saved {a['dtype']} "
                                f"{a['shape']} samples {a['samples']} non-finite {a['nonfinite']}; now {b['dtype']} "
                                f"{b['shape']} samples {b['samples']} non-finite {b['nonfinite']})")
    return problems


def first_difference(a, b):
    """Where two entries of one shape and dtype first differ, as text: the first differing chunk's elements and
    their range of the leading index (e.g. the experts of a weight gradient); "" when that cannot be told."""
    if (a["dtype"], a["shape"]) != (b["dtype"], b["shape"]) or len(a["chunks"]) != len(b["chunks"]):
        return ""
    differing = [c for c, (x, y) in enumerate(zip(a["chunks"], b["chunks"])) if x != y]
    if not differing:
        return ""
    total = 1
    for size in a["shape"]:
        total *= size
    begin, end = differing[0] * CHUNK, min((differing[0] + 1) * CHUNK, total)
    row = max(total // a["shape"][0], 1) if a["shape"] else 1
    return (f" in {len(differing)} of {len(a['chunks'])} chunks, first: elements [{begin}, {end}), index 0 "
            f"{begin // row}..{(end - 1) // row}")


def commit_of(lib_path):
    """MOK_COMMIT, else the short commit of the git checkout holding the library, else None."""
    if os.environ.get("MOK_COMMIT"):
        return os.environ["MOK_COMMIT"]
    run = subprocess.run(["git", "-C", os.path.dirname(lib_path), "rev-parse", "--short", "HEAD"],
                         capture_output=True, text=True)
    return run.stdout.strip() or None


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lib", default="build/bench/libmok_bench_capi.so")
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--save", metavar="FILE", help="run the shapes and write their bits to FILE (JSON)")
    mode.add_argument("--check", metavar="FILE", help="rerun FILE's shapes and compare their bits with FILE's")
    parser.add_argument("--shapes", default="", help=f"--save: names of model shapes or custom shapes {SPEC} "
                        "(default: every model shape unless --shape is given); --check: names of FILE's shapes to "
                        "check (default: all)")
    parser.add_argument("--shape", action="append", default=[], metavar=SPEC, help="--save: a custom shape "
                        "(repeatable), as layer_bench.py's")
    parser.add_argument("--tokens", type=int, default=8192, help="--save: tokens per rank of the model shapes")
    parser.add_argument("--seed", type=int, default=0, help="--save: the inputs' seed")
    parser.add_argument("--paths", default=",".join(PATHS), help=f"--save: some of {', '.join(PATHS)}")
    parser.add_argument("--capi", default="auto", choices=["auto", "named", "positional"],
                        help="how the library creates a layer (module docstring); auto: from its exports")
    args = parser.parse_args(argv)
    args.path_list = [p for p in args.paths.split(",") if p]
    if not args.path_list or any(p not in PATHS for p in args.path_list):
        parser.error(f"--paths: expected some of {', '.join(PATHS)} (comma-separated), got {args.paths!r}")
    if args.check and (args.shape or args.paths != ",".join(PATHS) or args.tokens != 8192 or args.seed != 0):
        parser.error("--check takes the shapes' T, the seed and the paths from FILE; --shapes picks among its shapes")
    if args.save:
        try:
            args.shape_list = [(s, args.tokens if s.tokens is None else s.tokens)
                               for s in select_shapes(args.shapes, args.shape)]
            for shape, tokens in args.shape_list:
                check_shape(shape, tokens, 1)
        except ValueError as e:
            parser.error(str(e))
    return args


def main(argv=None):
    args = parse_args(argv)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise SystemExit("bits.py runs one process, EP = 1 (not under torch.distributed.run)")
    saved = None
    if args.check:
        with open(args.check) as f:
            saved = json.load(f)
        if saved.get("format") != FORMAT or saved.get("digest") != DIGEST_SCHEME:
            raise SystemExit(f"{args.check}: format {saved.get('format')!r}, digest {saved.get('digest')!r}; this "
                             f"script writes {FORMAT!r}, {DIGEST_SCHEME!r}")
        wanted = [n for n in args.shapes.split(",") if n] or list(saved["shapes"])
        unknown = [n for n in wanted if n not in saved["shapes"]]
        if unknown:
            raise SystemExit(f"--shapes: {unknown} not in {args.check} (it has {', '.join(saved['shapes'])})")
        todo = [(shape_of(n, saved["shapes"][n]), saved["shapes"][n]["dims"]["T"]) for n in wanted]
        seed, paths = saved["run"]["seed"], saved["run"]["paths"]
    else:
        todo, seed, paths = args.shape_list, args.seed, args.path_list

    lib_path = os.path.abspath(args.lib)
    lib = capi.load(lib_path, ENTRY_POINTS)
    convention = args.capi
    if convention == "auto":
        convention = "named" if hasattr(lib, "mok_bench_status_new") else "positional"
    lib.mok_bench_layer_create.argtypes, lib.mok_bench_layer_create.restype = (
        capi.SIGNATURES["mok_bench_layer_create"] if convention == "named" else capi.POSITIONAL_CREATE)
    gpu = torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE
    run = dict(commit=commit_of(lib_path), lib=lib_path, capi=convention, gpu=gpu,
               torch=torch.__version__, seed=seed, paths=paths)
    print(f"bits ({'check against ' + args.check if args.check else 'save to ' + args.save}): commit "
          f"{run['commit'] or 'unknown'}, {run['gpu']}, torch {run['torch']}, C API {convention}, seed {seed}, "
          f"paths {', '.join(paths)}", flush=True)
    if saved:
        print(f"saved: commit {saved['run']['commit'] or 'unknown'}, {saved['run']['gpu']}, torch "
              f"{saved['run']['torch']}", flush=True)

    records, problems = {}, []
    for shape, tokens in todo:
        begin = time.time()
        record = run_shape(lib, convention, shape, tokens, seed, paths)
        records[shape.name] = record
        found = [f"{shape.name} {p}: failed: {e}" for p, e in record["errors"].items()] if not saved else []
        found += path_disagreements(shape.name, record)
        if saved:
            found += compare(shape.name, saved["shapes"][shape.name], record)
        outputs = sum(len(o) for o in record["outputs"].values())
        verdict = "same bits" if saved else "saved"
        print(f"{shape.name:20s} T={tokens} {outputs} outputs on {len(record['outputs'])} paths: "
              f"{'DIFFERENT' if found else verdict} ({time.time() - begin:.1f} s)", flush=True)
        for line in found:
            print(f"    {line}", flush=True)
        problems += found
    if args.save:
        os.makedirs(os.path.dirname(os.path.abspath(args.save)), exist_ok=True)
        with open(args.save, "w") as f:
            json.dump(dict(format=FORMAT, digest=DIGEST_SCHEME, run=run, shapes=records), f, indent=1)
            f.write("\n")
        print(f"bits: {args.save}", flush=True)
    if problems:
        print(f"FAILED: {len(problems)} problem{'s' * (len(problems) != 1)} (above)", flush=True)
        sys.exit(1)
    if saved:
        print(f"same bits as {args.check}: {len(records)} shapes", flush=True)


if __name__ == "__main__":
    main()
