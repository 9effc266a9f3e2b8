// Routings for tests and benchmarks: softmax top-k of random logits (balanced in expectation) and a skewed
// variant whose expert popularity falls off like a Zipf law. Also the benchmarks' model shapes (docs/design.md,
// "CPU reference").
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace mok::reference {

struct Routing {
  std::vector<int32_t> topk_idx;        // [num_tokens][top_k] global expert ids, distinct per token
  std::vector<float> router_weights;    // [num_tokens][top_k] softmax of the chosen logits
};

// `skew` = 0: logits ~ N(0, 1). `skew` > 0: expert e's logit gets -skew * ln(1 + e') where e' is a
// seed-dependent permutation of e, so popular experts are spread over ranks.
Routing random_routing(int num_tokens, int top_k, int num_experts, double skew, uint64_t seed);

// The top-k ids of `ep_size` ranks, rank r's from random_routing(..., first_seed + r).
std::vector<std::vector<int32_t>> random_topk_per_rank(int ep_size, int num_tokens, int top_k, int num_experts,
                                                       double skew, uint64_t first_seed);

struct ModelShape {
  std::string name;
  int num_experts;
  int hidden;
  int intermediate;
  int top_k;
  bool shared_expert = true;  // one shared expert of width `intermediate`
};

// The benchmarks' shapes: Kimi-K2.7, GLM-5.2, Qwen3.5-397B, DeepSeek-V4-Pro (one shared expert each),
// then gpt-oss-120b (H = I = 2880: partial GEMM tiles) and Qwen3-30B-A3B, which have no shared expert.
const std::vector<ModelShape>& model_shapes();
// The shape of that name; throws std::out_of_range for an unknown one.
const ModelShape& model_shape(const std::string& name);

}  // namespace mok::reference
