#!/usr/bin/env python3
"""The bad-input matrix (docs/bad_inputs.md) through bench/capi.cpp's C entry points, in a process that imported
torch FIRST: the regression test for the crash of issue 13 (a forward with one out-of-range expert id returned 0,
and the next mok_bench_layer_check_status crashed the process while formatting the message). It takes every error
path of every C entry point the matrix reaches, and after each bad call runs a good call on the same layer whose
output must equal a fresh layer's output bitwise (outputs are filled with a NaN before every run).
A crash (signal) fails the CTest; exit 0: every row as documented, 1: a row differs, 77: skipped (no torch, no
CUDA, no Hopper GPU).
Usage: python3 tests/python/test_capi_bad_inputs.py build/bench/libmok_bench_capi.so
"""
import sys

try:
    import torch  # first, before the library: the configuration that crashed
except ImportError as e:
    print(f"SKIP: torch is not importable ({e})")
    sys.exit(77)
import ctypes  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench"))
from capi import GRADS, grad_arrays, layer_options, load  # noqa: E402  (the C entry points' declarations)

E, H, I, K, T = 16, 256, 128, 4, 100
INT32_MIN, INT32_MAX = -2**31, 2**31 - 1
INT64_MIN, INT64_MAX = -2**63, 2**63 - 1
ERROR = ctypes.create_string_buffer(2048)
ROWS = []  # (case, path, expected, observed, next call, passed)


def message():
    return ERROR.value.decode(errors="replace")


class Layer:
    """One layer (EP=1) and its stream; every call goes through the C entry points."""

    def __init__(self, lib, fused, tokens=T, capacity_rows=0):
        self.lib, self.tokens = lib, tokens
        self.handle = lib.mok_bench_layer_create(None, 0, torch.cuda.current_device(),
                                                 *layer_options(**shape_options(tokens), path=path_of(fused),
                                                                capacity_rows=capacity_rows), ERROR, len(ERROR))
        if not self.handle:
            raise RuntimeError("mok_bench_layer_create: " + message())
        self.stream = torch.cuda.current_stream().cuda_stream

    def forward(self, d, out, x=None, topk=None, rw=None, gate=None):
        """rc and message of one forward; pointer arguments may be replaced by raw addresses."""
        ptr = lambda t, override: override if override is not None else t.data_ptr()  # noqa: E731
        topk_dtype = 1 if d["topk_idx"].dtype == torch.int64 else 0
        rc = self.lib.mok_bench_layer_forward(
            self.handle, ptr(d["x"], x), ptr(d["topk_idx"], topk), topk_dtype, ptr(d["router_weights"], rw),
            ptr(d["expert_gate"], gate), d["expert_up"].data_ptr(), d["expert_down"].data_ptr(),
            d["shared_gate"].data_ptr(), d["shared_up"].data_ptr(), d["shared_down"].data_ptr(), out.data_ptr(),
            self.stream, ERROR, len(ERROR))
        return rc, message() if rc else ""

    def status(self):
        rc = self.lib.mok_bench_layer_check_status(self.handle, self.stream, ERROR, len(ERROR))
        return rc, message() if rc else ""

    def reset(self):
        if self.lib.mok_bench_layer_reset_status(self.handle, self.stream, ERROR, len(ERROR)) != 0:
            raise RuntimeError("mok_bench_layer_reset_status: " + message())

    def run(self, d):
        """A good call: poisoned output, forward, status; returns the output or raises."""
        out = poisoned(self.tokens)
        rc, text = self.forward(d, out)
        if rc:
            raise RuntimeError("forward: " + text)
        rc, text = self.status()
        if rc:
            raise RuntimeError("status: " + text)
        torch.cuda.synchronize()
        return out

    def close(self):
        self.lib.mok_bench_layer_destroy(self.handle)


def shape_options(tokens=T, **changes):
    """The layer's shape (EP=1) as mok_bench_layer_create's named options, with `changes`."""
    return dict(dict(num_tokens=tokens, top_k=K, num_experts=E, hidden=H, intermediate=I, shared_expert=True),
                **changes)


def path_of(fused):
    return "fused" if fused else "unfused"


def poisoned(tokens):
    return torch.full((tokens, H), float("nan"), dtype=torch.bfloat16, device="cuda")


def make_inputs(tokens, seed, masked=0.05):
    g = torch.Generator(device="cuda").manual_seed(seed)
    bf16 = dict(device="cuda", dtype=torch.bfloat16)

    def weight(*shape):
        return (torch.randn(*shape, generator=g, **bf16) * shape[-1] ** -0.5).contiguous()

    logits = torch.randn(tokens, E, device="cuda", generator=g)
    chosen, idx = logits.topk(K, dim=1)
    idx = idx.to(torch.int32)
    idx[torch.rand(tokens, K, device="cuda", generator=g) < masked] = -1
    return dict(x=torch.randn(tokens, H, generator=g, **bf16), topk_idx=idx.contiguous(),
                router_weights=torch.softmax(chosen, dim=1).contiguous(), expert_gate=weight(E, I, H),
                expert_up=weight(E, I, H), expert_down=weight(E, H, I), shared_gate=weight(I, H),
                shared_up=weight(I, H), shared_down=weight(H, I))


def reference(d):
    """fp32 layer from the bf16 values; ids outside [0, E) contribute nothing."""
    x = d["x"].float()

    def mlp(v, gate, up, down):
        return (torch.nn.functional.silu(v @ gate.float().T) * (v @ up.float().T)) @ down.float().T

    out = mlp(x, d["shared_gate"], d["shared_up"], d["shared_down"])
    idx = d["topk_idx"].long()
    for e in range(E):
        for j in range(K):
            rows = (idx[:, j] == e).nonzero().flatten()
            if rows.numel():
                y = mlp(x[rows], d["expert_gate"][e], d["expert_up"][e], d["expert_down"][e])
                out[rows] += d["router_weights"][rows, j:j + 1] * y
    return out


def relative_error(got, want):
    return ((got.float() - want).norm() / want.norm().clamp_min(1e-30)).item()


def bitwise_equal(a, b):
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


def record(case, path, expected, ok, observed, next_call):
    ROWS.append((case, path, expected, observed, next_call, ok and next_call.startswith("bitwise ==")
                 or ok and next_call == "-"))


class Matrix:
    """The rows the C API can express, on one layer per path (EP=1: T=100, k=4, E=16, H=256, I=128)."""

    def __init__(self, lib, fused):
        self.lib, self.fused, self.path = lib, fused, "fused" if fused else "unfused"
        self.good = make_inputs(T, 7)
        self.fresh = self.fresh_output(self.good)
        self.layer = Layer(lib, fused)

    def fresh_output(self, d, **kwargs):
        layer = Layer(self.lib, self.fused, tokens=d["x"].shape[0], **kwargs)
        try:
            return layer.run(d)
        finally:
            layer.close()

    def next_call(self, layer=None, d=None, fresh=None):
        layer, d, fresh = layer or self.layer, d or self.good, self.fresh if fresh is None else fresh
        try:
            out = layer.run(d)
        except RuntimeError as e:
            return f"FAIL {e}"
        return "bitwise == fresh" if bitwise_equal(out, fresh) else "FAIL differs from a fresh layer"

    def bad_ids(self):
        masked = dict(self.good, topk_idx=self.good["topk_idx"].clone())
        masked["topk_idx"][60, 1] = -1
        masked_out = self.fresh_output(masked)
        err = relative_error(masked_out, reference(masked))
        record("masked route (the bad id's defined result) vs fp32 reference", self.path, "rel. error < 2e-2",
               err < 2e-2, f"{err:.2e}", "-")
        cases = [(v, torch.int32, v) for v in (E, E + 1, -2, INT32_MIN, INT32_MAX)]
        cases += [(v, torch.int64, r) for v, r in ((E, E), (-2, -2), (2**31, INT32_MAX), (2**32 + 3, INT32_MAX),
                                                   (-2**40, INT32_MIN), (INT64_MIN, INT32_MIN),
                                                   (INT64_MAX, INT32_MAX))]
        for value, dtype, reported in cases:
            d = dict(self.good, topk_idx=masked["topk_idx"].to(dtype).clone())
            d["topk_idx"][60, 1] = value
            out = poisoned(T)
            rc, text = self.layer.forward(d, out)
            src, status = self.layer.status()  # the call that crashed
            want = f"expert id {reported} out of range [-1, {E}) at route 241 (src rank 0, token 60, slot 1)"
            ok = rc == 0 and src == 1 and want in status
            torch.cuda.synchronize()
            same = bitwise_equal(out, masked_out)
            observed = (status or text or "no error") + ("; out == masked" if same else "; out differs from masked")
            self.layer.reset()
            record(f"expert id {value} ({str(dtype)[6:]})", self.path, "status names route 241 (token 60, slot 1); "
                   "out == route masked", ok and same, observed, self.next_call())

    def nonfinite(self):
        def case(name, edit, affected_rows):
            d = {key: value.clone() for key, value in self.good.items()}
            edit(d)
            out = poisoned(T)
            rc, text = self.layer.forward(d, out)
            src, status = self.layer.status()
            torch.cuda.synchronize()
            rows = torch.zeros(T, dtype=torch.bool, device="cuda")
            rows[affected_rows(d)] = True
            bits = out.view(torch.int16)
            poison = torch.tensor(0x7fc1, dtype=torch.int16, device="cuda")
            ok = (rc == 0 and src == 0 and bool(rows.any()) and bool((~torch.isfinite(out[rows].float())).all())
                  and not bool((bits[rows] == poison).any()) and bitwise_equal(out[~rows], self.fresh[~rows]))
            record(name, self.path, "defined: affected tokens non-finite, others == clean, no error", ok,
                   text or status or f"{int(rows.sum())} rows non-finite, rest == clean", self.next_call())

        case("NaN in x (token 7)", lambda d: d["x"].__setitem__((7, 3), float("nan")), lambda d: [7])
        case("+Inf in x (token 50)", lambda d: d["x"].__setitem__((50, 0), float("inf")), lambda d: [50])
        valid = (self.good["topk_idx"] >= 0).nonzero()
        t, j = valid[0].tolist()
        case("NaN router weight (valid route)", lambda d: d["router_weights"].__setitem__((t, j), float("nan")),
             lambda d: [t])
        case("NaN in weights.expert_gate (expert 10)", lambda d: d["expert_gate"].__setitem__((10, 5, 7), float("nan")),
             lambda d: (d["topk_idx"] == 10).any(dim=1).nonzero().flatten())

    def routing(self):
        masked = dict(self.good, topk_idx=torch.full_like(self.good["topk_idx"], -1))
        zero = dict(self.good, router_weights=torch.zeros_like(self.good["router_weights"]))
        one = dict(self.good, topk_idx=torch.full_like(self.good["topk_idx"], 3))
        outs = {}
        for name, d in (("all routes masked", masked), ("all router weights 0", zero),
                        ("every route to expert 3", one)):
            try:
                outs[name] = out = self.layer.run(d)
                err = relative_error(out, reference(d))
                ok, observed = err < 2e-2, f"rel. error {err:.2e}"
            except RuntimeError as e:
                ok, observed = False, str(e)
            record(name, self.path, "defined: correct (fp32 reference)", ok, observed, self.next_call())
        same = "all routes masked" in outs and "all router weights 0" in outs and bitwise_equal(
            outs["all routes masked"], outs["all router weights 0"])
        record("all router weights 0 == all routes masked", self.path, "bitwise (shared expert only)", same,
               "bitwise" if same else "differ", "-")

    def rejected(self):
        pinned = torch.empty(E * I * H, dtype=torch.bfloat16).pin_memory()
        g = self.good
        cases = [
            ("x + 2 bytes", dict(x=g["x"].data_ptr() + 2), "x: data must be 16-byte aligned"),
            ("topk_idx + 2 bytes", dict(topk=g["topk_idx"].data_ptr() + 2), "topk_idx: data must be 4-byte aligned"),
            ("router_weights + 2 bytes", dict(rw=g["router_weights"].data_ptr() + 2),
             "router_weights: data must be 4-byte aligned"),
            ("weights.expert_gate + 2 bytes", dict(gate=g["expert_gate"].data_ptr() + 2),
             "weights.expert_gate: data must be 16-byte aligned"),
            ("x in pinned host memory", dict(x=pinned.data_ptr()), "x: must be device memory"),
            ("weights.expert_gate in pinned host memory", dict(gate=pinned.data_ptr()),
             "weights.expert_gate: must be device memory"),
        ]
        for name, overrides, needle in cases:
            out = poisoned(T)
            rc, text = self.layer.forward(g, out, **overrides)
            torch.cuda.synchronize()
            untouched = bool(torch.isnan(out.float()).all())
            record(name, self.path, f"error naming the argument ({needle})", rc == 1 and needle in text and untouched,
                   text or "no error", self.next_call())
        out = poisoned(T)
        rc = self.lib.mok_bench_layer_forward(self.layer.handle, g["x"].data_ptr(), g["topk_idx"].data_ptr(), 7,
                                                  *[g[n].data_ptr() for n in ("router_weights", "expert_gate",
                                                                              "expert_up", "expert_down", "shared_gate",
                                                                              "shared_up", "shared_down")],
                                                  out.data_ptr(), self.layer.stream, ERROR, len(ERROR))
        record("topk_dtype 7", self.path, "error naming topk_dtype", rc == 1 and "topk_dtype" in message(),
               message() if rc else "no error", self.next_call())

    def tokens(self):
        for tokens in (1, 63, 65, 127, 129, 1000):
            d = make_inputs(tokens, 100 + tokens)
            layer = Layer(self.lib, self.fused, tokens=tokens)
            try:
                first = layer.run(d)
                err = relative_error(first, reference(d))
                ok, observed = err < 2e-2, f"rel. error {err:.2e}"
                again = layer.run(d)
                next_call = "bitwise == first call" if bitwise_equal(again, first) else "FAIL rerun differs"
            except RuntimeError as e:
                ok, observed, next_call = False, str(e), "-"
            finally:
                layer.close()
            record(f"T = {tokens}", self.path, "defined: correct (fp32 reference)", ok, observed, next_call)

    def capacity(self):
        layer = Layer(self.lib, self.fused, capacity_rows=128)
        out = poisoned(T)
        rc, text = layer.forward(self.good, out)
        src, status = layer.status()
        ok = (rc == 0 and src == 1 and "capacity overflow" in status and "holds 128" in status
              and "load_factor" in status)
        layer.reset()
        fits = dict(self.good, topk_idx=torch.full_like(self.good["topk_idx"], -1))
        fits["topk_idx"][:32, 0] = 0  # 32 rows of expert 0: one 64-row tile
        fresh = self.fresh_output(fits, capacity_rows=128)
        record("capacity too small (128 rows)", self.path, "status: capacity overflow", ok, status or text or "no error",
               self.next_call(layer, fits, fresh))
        layer.close()

    def other_entry_points(self):
        """The error paths of the remaining entry points: create (options by name), write_timeline, expert_gemm."""
        bad_creates = [
            ("create with hidden 200", dict(hidden=200), "MoeShape.hidden"),
            ("create with path 'megakernel'", dict(path="megakernel"),
             "option path (MoeOptions.path): expected one of fused, unfused, got 'megakernel'"),
            ("create with an unknown option", dict(fused=1), "unknown option 'fused'"),
            ("create with tile_m '64x'", dict(tile_m="64x"), "option tile_m (MoeOptions.schedule.tile_m): expected an int32"),
            ("create with wait_timeout_s inf", dict(wait_timeout_s=float("inf")),
             "ScheduleOptions.wait_timeout_s must be a finite number of seconds"),
            ("create with wait_timeout_s 1e30", dict(wait_timeout_s=1e30),
             "ScheduleOptions.wait_timeout_s must be a finite number of seconds"),
            ("create with swiglu_limit inf", dict(swiglu_limit=float("inf")),
             "MoeShape.swiglu_limit must be a finite number >= 0"),
            ("create with top_k 17 > num_experts 16", dict(top_k=17), "RoutingShape.top_k must be at most num_experts"),
            ("create with timeline_records 2^31 - 1", dict(timeline_records=2**31 - 1),
             "MoeOptions.fused.timeline_records must be in [0, 1048576]"),
            ("create with ep_size 2 and no NCCL id", dict(ep_size=2), "nccl_unique_id: null"),
            ("create with setup_timeout_s 0", dict(setup_timeout_s=0.0),
             "MoeOptions.setup_timeout_s must be a finite number of seconds in (0, 86400]"),
        ]
        if self.fused:
            bad_creates.append(("create with comm_ctas 100000", dict(comm_ctas=100000),
                                "MoeOptions.fused.comm_ctas must be a multiple of"))
        else:
            bad_creates.append(("create with backward_megakernel on the unfused path", dict(backward_megakernel="true"),
                                "MoeOptions.fused.backward_megakernel needs ForwardPath::kFused"))
        for name, changes, needle in bad_creates:
            options = dict(shape_options(), path=self.path)
            options.update(changes)
            handle = self.lib.mok_bench_layer_create(None, 0, 0, *layer_options(**options), ERROR, len(ERROR))
            record(name, self.path, f"NULL, error naming it ({needle})", not handle and needle in message(),
                   message() if not handle else "created", self.next_call())
            if handle:
                self.lib.mok_bench_layer_destroy(handle)
        rc = self.lib.mok_bench_layer_write_timeline(self.layer.handle, self.layer.stream, b"/nonexistent/t.json",
                                                     ERROR, len(ERROR))
        record("write_timeline without records", self.path, "error naming timeline_records",
               rc == 1 and "timeline_records" in message(), message() if rc else "no error", self.next_call())
        rc = self.lib.mok_bench_expert_gemm(0, None, 0, 0, None, None, 0, 0, 0, None, None, None, 64, None, 0.0, None,
                                            None, None, None, 1, None, None, None, 10.0, None, ERROR, len(ERROR))
        record("expert_gemm with null operands", self.path, "error (no crash)", rc == 1 and len(message()) > 0,
               message() if rc else "no error", self.next_call())
        # The FP8 GEMM's tile width: every pointer valid for the checks before it (one device buffer), block_n 100.
        buf = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda")
        p = buf.data_ptr()
        rc = self.lib.mok_bench_expert_gemm_fp8(0, p, p, 128, 128, p, p, None, None, 128, 1, p, p, p, 64, None, p,
                                                None, None, None, 0, 100, p, p, 10.0, self.layer.stream, ERROR,
                                                len(ERROR))
        record("expert_gemm_fp8 with block_n 100", self.path, "error naming block_n",
               rc == 1 and message().startswith("expert_gemm: block_n must be 0 (choose), or 128 or 256"),
               message() if rc else "no error", self.next_call())
        self.null_handles()

    def null_handles(self):
        """A null handle (or path, id, status) through every entry point that takes one: an error, never a crash."""
        lib, g, out = self.lib, self.good, poisoned(T)
        weights = [g[n].data_ptr() for n in ("expert_gate", "expert_up", "expert_down", "shared_gate", "shared_up",
                                             "shared_down")]
        calls = [
            ("layer_forward with a null handle", lambda: lib.mok_bench_layer_forward(
                None, g["x"].data_ptr(), g["topk_idx"].data_ptr(), 0, g["router_weights"].data_ptr(), *weights,
                out.data_ptr(), self.layer.stream, ERROR, len(ERROR)), 1, "handle: null"),
            ("layer_reset_status with a null handle", lambda: lib.mok_bench_layer_reset_status(
                None, self.layer.stream, ERROR, len(ERROR)), 1, "handle: null"),
            ("layer_check_status with a null handle", lambda: lib.mok_bench_layer_check_status(
                None, self.layer.stream, ERROR, len(ERROR)), 1, "handle: null"),
            ("layer_context_bytes with a null handle", lambda: lib.mok_bench_layer_context_bytes(
                None, ERROR, len(ERROR)), -1, "handle: null"),
            ("layer_write_timeline with a null path", lambda: lib.mok_bench_layer_write_timeline(
                self.layer.handle, self.layer.stream, None, ERROR, len(ERROR)), 1, "path: must not be null"),
            ("nccl_unique_id into a null buffer", lambda: lib.mok_bench_nccl_unique_id(None, ERROR, len(ERROR)), 1,
             "out: must point to 128 bytes"),
            ("status_check of a null status", lambda: lib.mok_bench_status_check(
                None, self.layer.stream, ERROR, len(ERROR)), 1, "status: null"),
            ("layer_comm_ctas with a null handle", lambda: lib.mok_bench_layer_comm_ctas(None), -1, ""),
            ("layer_destroy with a null handle", lambda: lib.mok_bench_layer_destroy(None), None, ""),
        ]
        for name, call, want_rc, needle in calls:
            ERROR.value = b""
            rc = call()
            ok = rc == want_rc and needle in message() and (needle != "" or message() == "")
            record(name, self.path, f"returns {want_rc}" + (f", error naming it ({needle})" if needle else ""), ok,
                   f"rc {rc}" + (f": {message()}" if message() else ""), self.next_call())

    def backward_arguments(self):
        """mok_bench_layer_backward's own argument checks (and context_bytes): an error naming the
        argument before anything is issued (outputs stay poisoned), then a good forward on the same layer."""
        g = self.good
        d_out = torch.randn(T, H, dtype=torch.bfloat16, device="cuda")
        d_x = poisoned(T)
        d_rw = torch.full((T, K), float("nan"), device="cuda")
        grads = {n: torch.full_like(g[n], float("nan")) for n in GRADS}
        self.layer.run(g)  # a context to read

        def call(topk_dtype=0, dtypes=None, modes=None, null_arrays=False, topk=None):
            arrays = grad_arrays(grads, {}, {})
            if dtypes is not None:
                arrays = (arrays[0], (ctypes.c_int32 * len(GRADS))(*dtypes), arrays[2])
            if modes is not None:
                arrays = (arrays[0], arrays[1], (ctypes.c_int32 * len(GRADS))(*modes))
            if null_arrays:
                arrays = (None, None, None)
            rc = self.lib.mok_bench_layer_backward(
                self.layer.handle, g["x"].data_ptr(), (g["topk_idx"] if topk is None else topk).data_ptr(), topk_dtype,
                *[g[n].data_ptr() for n in ("router_weights",) + GRADS], d_out.data_ptr(), d_x.data_ptr(),
                d_rw.data_ptr(), *arrays, self.layer.stream, ERROR, len(ERROR))
            torch.cuda.synchronize()
            untouched = bool(torch.isnan(d_x.float()).all() and torch.isnan(d_rw).all()
                             and all(torch.isnan(t.float()).all() for t in grads.values()))
            return rc, message() if rc else "no error", untouched

        cases = [("backward topk_dtype 7", dict(topk_dtype=7), "topk_dtype"),
                 ("backward grad dtype 5 (expert_down)", dict(dtypes=[0, 0, 5, 0, 0, 0]), "expert_down: grad dtype"),
                 ("backward grad mode 3 (shared_up)", dict(modes=[0, 0, 0, 0, 3, 0]), "shared_up: grad mode"),
                 ("backward null gradient arrays", dict(null_arrays=True), "grads, grad_dtypes, grad_modes")]
        for name, kwargs, needle in cases:
            rc, text, untouched = call(**kwargs)
            record(name, self.path, f"error naming the argument ({needle}), outputs untouched",
                   rc == 1 and needle in text and untouched, text, self.next_call())
        # Other ids than the forward's: issued (rc 0), then reported by the status word naming the first route.
        other = g["topk_idx"].clone()
        other[5, 1] = 0 if int(other[5, 1]) < 0 else (int(other[5, 1]) + 1) % E
        rc, text, _ = call(topk=other)
        status_rc, status_text = self.layer.status()
        self.layer.reset()
        needle = "topk_idx differ from the ids the context's schedule was built from, first at token 5, slot 1"
        record("backward with other ids than the forward's", self.path, f"issued, then a status report ({needle})",
               rc == 0 and status_rc == 1 and needle in status_text, f"rc {rc}; status: {status_text or 'ok'}",
               self.next_call())
        size = self.lib.mok_bench_layer_context_bytes(self.layer.handle, ERROR, len(ERROR))
        record("context_bytes", self.path, "bytes > 0", size > 0, f"{size} bytes" if size >= 0 else message(), "-")

    def fp8_backward_arguments(self):
        """mok_bench_layer_backward_fp8 on an FP8 layer with the backward (the shape's I 128 allows it): a transposed
        copy's pointer null, or its scales', each an error naming the tensor with the outputs untouched; then a good
        forward + backward on the same layer, whose d_x is bitwise a fresh FP8 layer's."""
        from fp8_layer_bench import fp8_weight_pointers
        g = self.good
        tensors, good = fp8_weight_pointers([g[n] for n in GRADS])  # the 20 pointers (tensors: kept alive here)
        d_out = torch.randn(T, H, dtype=torch.bfloat16, device="cuda", generator=torch.Generator(
            device="cuda").manual_seed(11))
        topk_dtype = 1 if g["topk_idx"].dtype == torch.int64 else 0

        def make():
            handle = self.lib.mok_bench_layer_create(None, 0, torch.cuda.current_device(), *layer_options(
                **shape_options(), path=self.path, precision="fp8"), ERROR, len(ERROR))
            if not handle:
                raise RuntimeError("mok_bench_layer_create (fp8): " + message())
            return handle

        def call(handle, weights):
            """rc, message, d_x, and whether every output stayed poisoned, of FP8 forward + backward."""
            out, d_x = poisoned(T), poisoned(T)
            d_rw = torch.full((T, K), float("nan"), device="cuda")
            grads = {n: torch.full_like(g[n], float("nan")) for n in GRADS}
            stream = torch.cuda.current_stream().cuda_stream
            rc = self.lib.mok_bench_layer_forward_fp8(handle, g["x"].data_ptr(), g["topk_idx"].data_ptr(), topk_dtype,
                                                      g["router_weights"].data_ptr(), (ctypes.c_void_p * 12)(*good[:12]),
                                                      out.data_ptr(), stream, ERROR, len(ERROR))
            if rc:
                return rc, "forward_fp8: " + message(), d_x, False
            rc = self.lib.mok_bench_layer_backward_fp8(
                handle, g["x"].data_ptr(), g["topk_idx"].data_ptr(), topk_dtype, g["router_weights"].data_ptr(),
                weights, d_out.data_ptr(), d_x.data_ptr(), d_rw.data_ptr(), *grad_arrays(grads, {}, {}), stream,
                ERROR, len(ERROR))
            text = message() if rc else "no error"
            if rc == 0 and self.lib.mok_bench_layer_check_status(handle, stream, ERROR, len(ERROR)) != 0:
                rc, text = 2, "status: " + message()
            torch.cuda.synchronize()
            untouched = bool(torch.isnan(d_x.float()).all() and torch.isnan(d_rw).all()
                             and all(torch.isnan(t.float()).all() for t in grads.values()))
            return rc, text, d_x, untouched

        fresh_handle = make()
        try:
            rc, text, fresh, _ = call(fresh_handle, good)
        finally:
            self.lib.mok_bench_layer_destroy(fresh_handle)
        if rc:
            record("fp8 backward (a good call)", self.path, "runs", False, text, "-")
            return
        handle = make()
        try:
            for name, slot, needle in (("fp8 backward without expert_gate_up_t", 12, "weights.expert_gate_up_t"),
                                       ("fp8 backward without expert_down_t's scales", 15,
                                        "weights.expert_down_t_scales")):
                bad = (ctypes.c_void_p * 20)(*good)
                bad[slot] = None
                rc, text, _, untouched = call(handle, bad)
                rc_next, text_next, d_x, _ = call(handle, good)
                next_call = f"FAIL {text_next}" if rc_next else \
                    "bitwise == fresh" if bitwise_equal(d_x, fresh) else "FAIL differs from a fresh layer"
                record(name, self.path, f"error naming the tensor ({needle}), outputs untouched",
                       rc == 1 and needle in text and untouched, text, next_call)
        finally:
            self.lib.mok_bench_layer_destroy(handle)

    def run(self):
        self.bad_ids()
        self.nonfinite()
        self.routing()
        self.rejected()
        self.tokens()
        self.capacity()
        self.other_entry_points()
        self.backward_arguments()
        self.fp8_backward_arguments()
        self.layer.close()


# A child process: rank 0 of an EP = 2 layer whose rank 1 never comes (setup_timeout_s 2), then a good EP = 1 layer
# in the same process. It prints the create's error, or HUNG is what the parent sees when it never returns.
MISSING_PEER = r'''
import ctypes, sys, time
sys.path.insert(0, sys.argv[2])
from capi import layer_options, load
lib = load(sys.argv[1])
error = ctypes.create_string_buffer(2048)
nccl_id = ctypes.create_string_buffer(128)
assert lib.mok_bench_nccl_unique_id(nccl_id, error, len(error)) == 0, error.value
shape = dict(num_tokens=64, top_k=2, num_experts=8, hidden=256, intermediate=128)
start = time.monotonic()
handle = lib.mok_bench_layer_create(nccl_id, 0, 0, *layer_options(ep_size=2, setup_timeout_s=2.0, **shape),
                                    error, len(error))
print(f"create: {'NULL' if not handle else 'a layer'} after {time.monotonic() - start:.1f} s: "
      f"{error.value.decode(errors='replace')}")
good = lib.mok_bench_layer_create(None, 0, 0, *layer_options(**shape), error, len(error))
print("next create:", "ok" if good else error.value.decode(errors="replace"))
if good:
    lib.mok_bench_layer_destroy(good)
'''


def missing_peer(lib_path):
    """A rank that never comes: the create gives up after setup_timeout_s (NULL, an error naming the wait), in
    bounded time, and the process makes a good layer next. In a child process, so that a hang fails this row only."""
    bench = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench")
    start = time.monotonic()
    try:
        child = subprocess.run([sys.executable, "-c", MISSING_PEER, lib_path, bench], capture_output=True, text=True,
                               timeout=120)
        observed = (child.stdout.strip() or child.stderr.strip()[-300:]).replace("\n", "; ")
    except subprocess.TimeoutExpired:
        observed = "HUNG (killed after 120 s)"
    ok = "create: NULL" in observed and "did not all arrive within 2 s" in observed and "next create: ok" in observed
    record("create, EP = 2, rank 1 never comes (setup_timeout_s 2)", "-",
           "NULL after about 2 s, error naming the wait; the next create in the process works", ok,
           f"{observed} ({time.monotonic() - start:.0f} s in all)", "-")


def main():
    if len(sys.argv) != 2:
        print(__doc__)
        return 2
    if not torch.cuda.is_available():
        print("SKIP: torch sees no CUDA device")
        return 77
    capability = torch.cuda.get_device_capability()
    if capability != (9, 0):
        print(f"SKIP: needs a Hopper (sm_90) GPU, device 0 is sm_{capability[0]}{capability[1]}")
        return 77
    lib = load(sys.argv[1])
    for fused in (True, False):
        try:
            Matrix(lib, fused).run()
        except Exception as e:  # a setup failure is a failed row, not a crash
            record("setup", "fused" if fused else "unfused", "runs", False, f"{type(e).__name__}: {e}", "-")
    missing_peer(sys.argv[1])
    print("case | path | expected | observed | next call")
    failed = 0
    for case, path, expected, observed, next_call, passed in ROWS:
        failed += not passed
        print(f"{case} | {path} | {expected} | {observed} | {next_call}{'' if passed else '   <-- MISMATCH'}")
    print(f"{len(ROWS) - failed} of {len(ROWS)} rows as documented")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
