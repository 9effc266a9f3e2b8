"""ctypes declarations of bench/capi.cpp's C entry points: the one place Python spells their signatures
(bench/layer_bench.py, bench/gemm_bench.py and tests/python/test_capi_bad_inputs.py load the library here).
Every entry point but destroy, status_free, comm_ctas and context_bytes returns 0, or 1 (NULL for create) with a
NUL-terminated message in its `error` buffer (context_bytes: the bytes, or -1 with the message)."""
import ctypes

_p, _i32, _i64, _f32, _f64, _s = (ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float, ctypes.c_double,
                                  ctypes.c_char_p)
SIGNATURES = {  # name: (argument types, result type), in capi.cpp's order
    "mok_bench_nccl_unique_id": ([_p, _s, _i32], _i32),
    # nccl_unique_id, rank, device, num_options, names (char*[]), values (char*[]), error, error_len: the shape and
    # options by name (layer_options below)
    "mok_bench_layer_create": ([_p, _i32, _i32, _i32, _p, _p, _s, _i32], _p),
    # handle, x, topk_idx, topk_dtype (0 int32, 1 int64), router_weights, expert_gate, expert_up, expert_down,
    # shared_gate, shared_up, shared_down, out, stream, error, error_len
    "mok_bench_layer_forward": ([_p, _p, _p, _i32] + [_p] * 9 + [_s, _i32], _i32),
    # handle, x, topk_idx, topk_dtype, router_weights, the six weights as in forward, d_out, d_x, d_router_weights,
    # grads, grad_dtypes, grad_modes (GRADS entries each: void*[], int32[], int32[]), stream, error, error_len
    "mok_bench_layer_backward": ([_p, _p, _p, _i32] + [_p] * 14 + [_s, _i32], _i32),
    # handle, x, topk_idx, topk_dtype, router_weights, weights (void*[12]: each weight, then its scales), out,
    # stream, error, error_len
    "mok_bench_layer_forward_fp8": ([_p, _p, _p, _i32, _p, _p, _p, _p, _s, _i32], _i32),
    # handle, x, topk_idx, topk_dtype, router_weights, weights (void*[20]: forward_fp8's 12, then the transposed
    # copies expert_gate_up_t, expert_down_t, shared_gate_up_t, shared_down_t, each then its scales), d_out, d_x,
    # d_router_weights, grads, grad_dtypes, grad_modes, stream, error, error_len
    "mok_bench_layer_backward_fp8": ([_p, _p, _p, _i32, _p, _p, _p, _p, _p, _p, _p, _p, _p, _s, _i32], _i32),
    # handle, source (int* out: 1 from ForwardContext::bytes(), 0 from make_context's layout), error, error_len
    "mok_bench_layer_context_bytes": ([_p, _s, _i32], _i64),
    "mok_bench_layer_reset_status": ([_p, _p, _s, _i32], _i32),
    "mok_bench_layer_check_status": ([_p, _p, _s, _i32], _i32),
    "mok_bench_layer_write_timeline": ([_p, _p, _s, _s, _i32], _i32),
    "mok_bench_layer_comm_ctas": ([_p], _i32),
    "mok_bench_layer_destroy": ([_p], None),
    # out (void**), error, error_len: a status word for the GEMMs' waits; status, stream, error, error_len
    "mok_bench_status_new": ([_p, _s, _i32], _i32),
    "mok_bench_status_check": ([_p, _p, _s, _i32], _i32),
    "mok_bench_status_free": ([_p], None),
    # epilogue, a, a_rows, k, b, b_up, b_major, n, local_experts, expert_counts, expert_row_offsets,
    # scheduled_rows, tile_m, row_scale, swiglu_limit, out, gate_up_out, gate_up, row_partials, cluster_n, ticket,
    # trace, status, wait_timeout_s, stream, error, error_len
    "mok_bench_expert_gemm": ([_i32, _p, _i64, _i32, _p, _p, _i32, _i32, _i32, _p, _p, _p, _i32, _p, _f32, _p, _p, _p,
                               _p, _i32, _p, _p, _p, _f64, _p, _s, _i32], _i32),
    # epilogue (0 store, 1 SwiGLU), a, a_scales, a_rows, k, b, b_scales, b_up, b_up_scales, n, local_experts,
    # expert_counts, expert_row_offsets, scheduled_rows, tile_m, row_scale, out, out_scales, gate_up_out, hidden_out,
    # cluster_n, block_n, ticket, status, wait_timeout_s, stream, error, error_len
    "mok_bench_expert_gemm_fp8": ([_i32, _p, _p, _i64, _i32, _p, _p, _p, _p, _i32, _i32, _p, _p, _p, _i32, _p, _p, _p,
                                   _p, _p, _i32, _i32, _p, _p, _f64, _p, _s, _i32], _i32),
    # a, b, rows_allocated, m, n, local_experts, expert_row_offsets, scheduled_rows, tile_m, output (0 bf16,
    # 1 fp32, 2 fp32 accumulate), out, out_split, m_split, ticket, status, wait_timeout_s, stream, error, error_len
    "mok_bench_weight_grad_gemm": ([_p, _p, _i64, _i32, _i32, _i32, _p, _p, _i32, _i32, _p, _p, _i32, _p, _p, _f64, _p,
                                    _s, _i32], _i32),
    # rows_allocated, local_experts -> the rows of mok_bench_quantize_columns_fp8's output
    "mok_bench_fp8_column_rows": ([_i64, _i32], _i64),
    # in, rows_allocated, k, local_experts, expert_counts, expert_row_offsets, out_row_offsets, out, scales,
    # power_of_two, block_scales, stream, error, error_len
    "mok_bench_quantize_columns_fp8": ([_p, _i64, _i32, _i32, _p, _p, _p, _p, _p, _i32, _i32, _p, _s, _i32], _i32),
    # a, a_scales, b, b_scales, rows_allocated, m, n, local_experts, expert_row_offsets, scheduled_rows, output, out,
    # out_split, m_split, b_block_scales, ticket, status, wait_timeout_s, stream, error, error_len
    "mok_bench_weight_grad_gemm_fp8": ([_p, _p, _p, _p, _i64, _i32, _i32, _i32, _p, _p, _i32, _p, _p, _i32, _i32, _p,
                                        _p, _f64, _p, _s, _i32], _i32),
}
# mok_bench_layer_create as builds before the option table (ac8b306) have it, d0b3fa0's among them (bench/bits.py
# drives such a build): nccl_unique_id, ep_size, rank, device, num_tokens, top_k, num_experts, hidden, intermediate,
# shared_expert, fused (0 unfused, 1 fused, 2 fused with the backward megakernel), comm_ctas, minibatch_rows,
# timeline_records, capacity_rows, load_factor, wait_timeout_s (0: the default), error, error_len. The other layer
# entry points (forward, backward, check_status, destroy) have not changed since.
POSITIONAL_CREATE = ([_p] + [_i32] * 13 + [_i64, _f64, _f64, _s, _i32], _p)


# mok_bench_layer_backward's gradient arrays, in MoeWeightGrads' order (and mok_bench_layer_forward's weights')
GRADS = ("expert_gate", "expert_up", "expert_down", "shared_gate", "shared_up", "shared_down")
GRAD_DTYPES = {"bf16": 0, "fp32": 1}  # a gradient's dtype code
GRAD_MODES = {"write": 0, "accumulate": 1}  # mok::GradMode


def grad_arrays(grads, dtypes, modes):
    """mok_bench_layer_backward's three arrays from dicts keyed by GRADS: grads a tensor (or None: not
    computed), dtypes 'bf16'/'fp32' and modes 'write'/'accumulate' (entries of None grads are ignored)."""
    pointers = (ctypes.c_void_p * len(GRADS))(*[0 if grads.get(n) is None else grads[n].data_ptr() for n in GRADS])
    dtype_codes = (ctypes.c_int32 * len(GRADS))(*[GRAD_DTYPES[dtypes.get(n, "bf16")] for n in GRADS])
    mode_codes = (ctypes.c_int32 * len(GRADS))(*[GRAD_MODES[modes.get(n, "write")] for n in GRADS])
    return pointers, dtype_codes, mode_codes


def layer_options(**options):
    """mok_bench_layer_create's num_options, names and values from keywords named as the option table's rows
    (src/host/option_table.h: Python LayerShape's and Config's fields, and timeline_records), values as Python
    spells them: bools, ints, floats, the path's name ("fused" or "unfused")."""
    def text(value):
        return ("true" if value else "false") if isinstance(value, bool) else repr(value) if isinstance(
            value, float) else str(value)
    names = (ctypes.c_char_p * len(options))(*[name.encode() for name in options])
    values = (ctypes.c_char_p * len(options))(*[text(value).encode() for value in options.values()])
    return len(options), names, values


def load(lib_path, names=tuple(SIGNATURES)):
    """The library at lib_path with the argument and result types of the entry points `names` set (default: all;
    an older build lacks some, see POSITIONAL_CREATE)."""
    lib = ctypes.CDLL(lib_path)
    for name in names:
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = SIGNATURES[name]
    return lib
