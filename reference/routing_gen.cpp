#include "reference/routing_gen.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <stdexcept>

namespace mok::reference {

Routing random_routing(int num_tokens, int top_k, int num_experts, double skew, uint64_t seed) {
  if (top_k > num_experts) throw std::invalid_argument("random_routing: top_k > num_experts");
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<float> bias(num_experts, 0.f);
  if (skew > 0) {
    std::vector<int> popularity(num_experts);
    std::iota(popularity.begin(), popularity.end(), 0);
    std::shuffle(popularity.begin(), popularity.end(), rng);
    for (int e = 0; e < num_experts; ++e) bias[e] = static_cast<float>(-skew * std::log1p(double(popularity[e])));
  }
  Routing routing;
  routing.topk_idx.resize(size_t(num_tokens) * top_k);
  routing.router_weights.resize(size_t(num_tokens) * top_k);
  std::vector<float> logits(num_experts);
  std::vector<int> order(num_experts);
  for (int t = 0; t < num_tokens; ++t) {
    for (int e = 0; e < num_experts; ++e) logits[e] = normal(rng) + bias[e];
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + top_k, order.end(),
                      [&](int a, int b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); });
    double sum = 0;
    for (int j = 0; j < top_k; ++j) sum += std::exp(double(logits[order[j]] - logits[order[0]]));
    for (int j = 0; j < top_k; ++j) {
      routing.topk_idx[size_t(t) * top_k + j] = order[j];
      routing.router_weights[size_t(t) * top_k + j] =
          static_cast<float>(std::exp(double(logits[order[j]] - logits[order[0]])) / sum);
    }
  }
  return routing;
}

std::vector<std::vector<int32_t>> random_topk_per_rank(int ep_size, int num_tokens, int top_k, int num_experts,
                                                       double skew, uint64_t first_seed) {
  std::vector<std::vector<int32_t>> ids;
  for (int r = 0; r < ep_size; ++r)
    ids.push_back(random_routing(num_tokens, top_k, num_experts, skew, first_seed + r).topk_idx);
  return ids;
}

const std::vector<ModelShape>& model_shapes() {
  static const std::vector<ModelShape> shapes = {
      {"Kimi-K2.7", 384, 7168, 2048, 8},
      {"GLM-5.2", 256, 6144, 2048, 8},
      {"Qwen3.5-397B", 512, 4096, 1024, 10},
      {"DeepSeek-V4-Pro", 384, 7168, 3072, 6},
      {"gpt-oss-120b", 128, 2880, 2880, 4, false},  // H and I not multiples of the GEMM tiles
      {"Qwen3-30B-A3B", 128, 2048, 768, 8, false},
  };
  return shapes;
}

const ModelShape& model_shape(const std::string& name) {
  for (const ModelShape& m : model_shapes())
    if (m.name == name) return m;
  throw std::out_of_range("no model shape named " + name);
}

}  // namespace mok::reference
