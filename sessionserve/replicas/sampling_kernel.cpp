// The two per-row scans of sampling on x86 CPUs with AVX-512 or AVX2, as torch ops:
//
// `greedy_tokens`: each row's greedy token, the index of its largest logit, the first on a
// tie, NaN taken as larger than everything (the first NaN wins), as torch's
// `max(dim=-1).indices` and `argmax(-1)` give it; fp32 or bf16 logits [rows, V]. torch's CPU
// reduction with an index runs ~1.3 cycles a logit (inductor's code for it no faster), so a
// vocabulary of 262,144 (Gemma 3) took ~0.2 ms a row, ~5% of a decode step of 8 requests.
// Here two vector passes over a part of a row: its largest value (and whether it holds a
// NaN), then the first lane equal to it; the parts of all rows are spread over the threads
// and joined per row.
//
// `inverse_cdf`: each row's draw at its target, the first index whose running sum of the
// row's fp32 probabilities, accumulated in float64 in vocabulary order, exceeds u x the
// row's whole sum: `sampling.draw`'s `probs.double().cumsum(-1)` then `searchsorted(...,
// right=True)`, the same sums in the same order (so the same picks), without the [rows, V]
// float64 copy and its cumsum (~1.3 ms a row of 262,144 on 2 cores). The sums are serial, as
// the cumsum's; rows go to the threads.
//
// Built at run time by sampling_kernel.py (g++ with the CPU's vector flags), loaded with
// torch.ops.load_library.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "attention/cpu_vector.h"  // Vec, kLanes and their primitives, AVX-512 or AVX2

namespace {

constexpr int64_t kPart = 16384;  // logits a work item takes (64 KiB of fp32)

inline float value(float x) { return x; }
inline float value(c10::BFloat16 x) { return static_cast<float>(x); }

struct Best {
  float value;    // the part's largest logit (NaN if it holds one)
  int64_t index;  // where it first occurs, in the row
};

// x[begin, end) of one row: its largest value and first index, NaN first. `max_ps` drops a
// NaN, so NaN lanes are tracked apart and, where there is one, the first is searched for.
template <typename T>
Best best_of(const T* x, int64_t begin, int64_t end) {
  const int64_t whole = begin + (end - begin) / kLanes * kLanes;
  Vec acc = vset1(-std::numeric_limits<float>::infinity());
  uint32_t nan = 0;
  for (int64_t i = begin; i < whole; i += kLanes) {
    const Vec v = vload(x + i);
    acc = vmaximum(acc, v);
    nan |= vnan_lanes(v);
  }
  float m = vmax(acc);
  for (int64_t i = whole; i < end; ++i) {
    const float v = value(x[i]);
    if (std::isnan(v)) nan = 1;
    m = v > m ? v : m;
  }
  if (nan) {
    for (int64_t i = begin; i < end; ++i)
      if (std::isnan(value(x[i]))) return {std::numeric_limits<float>::quiet_NaN(), i};
  }
  const Vec target = vset1(m);
  for (int64_t i = begin; i < whole; i += kLanes) {
    const uint32_t hit = vequal_lanes(vload(x + i), target);
    if (hit) return {m, i + __builtin_ctz(hit)};
  }
  for (int64_t i = whole; i < end; ++i)
    if (value(x[i]) == m) return {m, i};
  return {m, begin};  // unreachable for a non-empty part: m is one of its values
}

// the better of two parts' results, `a` the earlier part: NaN wins, then the larger value,
// then (equal) the earlier index
inline Best join(Best a, Best b) {
  if (std::isnan(a.value)) return a;
  if (std::isnan(b.value)) return b;
  return b.value > a.value ? b : a;
}

template <typename T>
void run(const at::Tensor& logits, at::Tensor& out) {
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  const int64_t parts = (vocab + kPart - 1) / kPart;
  const T* x = logits.data_ptr<T>();
  const int64_t stride = logits.stride(0);
  std::vector<Best> found(rows * parts);
  // grain: a work item of 16K logits is ~5 us; fewer than 4 of them stay on one thread
  at::parallel_for(0, rows * parts, 4, [&](int64_t lo, int64_t hi) {
    for (int64_t w = lo; w < hi; ++w) {
      const int64_t row = w / parts, part = w % parts;
      const int64_t begin = part * kPart, end = std::min(vocab, begin + kPart);
      found[w] = best_of(x + row * stride, begin, end);
    }
  });
  int64_t* o = out.data_ptr<int64_t>();
  for (int64_t row = 0; row < rows; ++row) {
    Best best = found[row * parts];
    for (int64_t part = 1; part < parts; ++part) best = join(best, found[row * parts + part]);
    o[row] = best.index;
  }
}

at::Tensor greedy_tokens(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2, "greedy_tokens: logits [rows, vocab], got ", logits.sizes());
  TORCH_CHECK(logits.size(1) > 0, "greedy_tokens: an empty vocabulary");
  TORCH_CHECK(logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16,
              "greedy_tokens: fp32 or bf16 logits, got ", logits.scalar_type());
  TORCH_CHECK(logits.stride(1) == 1, "greedy_tokens: each row's logits contiguous");
  at::Tensor out = at::empty({logits.size(0)}, logits.options().dtype(at::kLong));
  if (logits.size(0) == 0) return out;
  if (logits.scalar_type() == at::kFloat)
    run<float>(logits, out);
  else
    run<c10::BFloat16>(logits, out);
  return out;
}

// one row: the first index whose float64 running sum exceeds u x the whole sum (V - 1 if
// none does: the target at the total itself, or NaN probabilities)
int64_t draw_row(const float* p, int64_t vocab, double u) {
  double total = 0.0;
  for (int64_t i = 0; i < vocab; ++i) total += static_cast<double>(p[i]);
  const double target = u * total;
  double running = 0.0;
  for (int64_t i = 0; i < vocab; ++i) {
    running += static_cast<double>(p[i]);
    if (running > target) return i;
  }
  return vocab - 1;
}

at::Tensor inverse_cdf(const at::Tensor& probs, const at::Tensor& u) {
  TORCH_CHECK(probs.dim() == 2 && probs.size(1) > 0,
              "inverse_cdf: probabilities [rows, vocab > 0], got ", probs.sizes());
  TORCH_CHECK(probs.scalar_type() == at::kFloat, "inverse_cdf: fp32 probabilities, got ",
              probs.scalar_type());
  TORCH_CHECK(probs.stride(1) == 1, "inverse_cdf: each row's probabilities contiguous");
  TORCH_CHECK(u.dim() == 1 && u.size(0) == probs.size(0) && u.scalar_type() == at::kDouble,
              "inverse_cdf: one float64 uniform a row, got ", u.sizes(), " ", u.scalar_type());
  const int64_t rows = probs.size(0), vocab = probs.size(1), stride = probs.stride(0);
  at::Tensor out = at::empty({rows}, probs.options().dtype(at::kLong));
  const float* p = probs.data_ptr<float>();
  const at::Tensor uc = u.contiguous();
  const double* up = uc.data_ptr<double>();
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) o[r] = draw_row(p + r * stride, vocab, up[r]);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(sessionserve, m) {
  m.def("greedy_tokens(Tensor logits) -> Tensor");
  m.def("inverse_cdf(Tensor probs, Tensor u) -> Tensor");
}

TORCH_LIBRARY_IMPL(sessionserve, CPU, m) {
  m.impl("greedy_tokens", &greedy_tokens);
  m.impl("inverse_cdf", &inverse_cdf);
}
