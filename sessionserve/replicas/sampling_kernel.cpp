// The per-row scans of sampling on x86 CPUs with AVX-512 or AVX2, as torch ops:
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
// `temperature_draw`: a draw from softmax(logits / T) with min-p, the filters of a row that
// asks for neither top-k nor top-p (the OpenAI default, T 1, is one), from the logits as they
// are. torch makes three [rows, V] copies of it (fp32, divided, the softmax) before the draw:
// ~3-6 ms a step of 8 rows of 262,144. Here three passes over parts of the rows, spread over
// the threads: the largest logit; the weights e^((x - max) / T) (0 under min-p, the largest
// weighing 1) summed per part in float64; then, in the part the target falls in, the first
// token whose running sum exceeds it. The weights are recomputed, never stored. The picks
// are those of torch's path but where u falls within float32 rounding of a token's edge.
//
// `nucleus_candidates`: what a top-k / top-p row's filter needs, without sorting or `topk`
// over the vocabulary (`topk` of 1,024 took ~0.5 ms a row of 262,144): the largest logit,
// then in one pass the tokens and weight at each of eight levels e^-d under it, and the
// whole row's weight (its logsumexp); the first level that holds the k largest and the
// nucleus is gathered, in vocabulary order. Every token past a level is smaller than all in
// it, so `filter_logits` applied to the level alone keeps what it keeps over the whole row.
//
// Built at run time by sampling_kernel.py (g++ with the CPU's vector flags), loaded with
// torch.ops.load_library.

// the ATen headers this file uses, not <ATen/ATen.h> (every op's declarations: 1-4 s more of
// g++ a kernel on a first start, docs/benchmarks.md stop 116)
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
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

struct Largest {
  float value;  // the largest value that is not NaN (-inf if none is)
  bool nan;     // whether a NaN is among them
};

// x[begin, end) of one row: its largest value, and whether it holds a NaN (`max_ps` drops a
// NaN, so NaN lanes are tracked apart)
template <typename T>
Largest largest(const T* x, int64_t begin, int64_t end) {
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
  return {m, nan != 0};
}

// x[begin, end) of one row: its largest value and first index, NaN first
template <typename T>
Best best_of(const T* x, int64_t begin, int64_t end) {
  const auto [m, nan] = largest(x, begin, end);
  const int64_t whole = begin + (end - begin) / kLanes * kLanes;
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

// a row's parts of kPart logits: work items for the threads, the same whatever their number
struct Parts {
  int64_t vocab, count;
  explicit Parts(int64_t vocab) : vocab(vocab), count((vocab + kPart - 1) / kPart) {}
  int64_t begin(int64_t part) const { return part * kPart; }
  int64_t end(int64_t part) const { return std::min(vocab, (part + 1) * kPart); }
};

template <typename T>
void run(const at::Tensor& logits, at::Tensor& out) {
  const int64_t rows = logits.size(0);
  const Parts split(logits.size(1));
  const int64_t parts = split.count;
  const T* x = logits.data_ptr<T>();
  const int64_t stride = logits.stride(0);
  std::vector<Best> found(rows * parts);
  // grain: a work item of 16K logits is ~5 us; fewer than 4 of them stay on one thread
  at::parallel_for(0, rows * parts, 4, [&](int64_t lo, int64_t hi) {
    for (int64_t w = lo; w < hi; ++w)
      found[w] = best_of(x + (w / parts) * stride, split.begin(w % parts), split.end(w % parts));
  });
  int64_t* o = out.data_ptr<int64_t>();
  for (int64_t row = 0; row < rows; ++row) {
    Best best = found[row * parts];
    for (int64_t part = 1; part < parts; ++part) best = join(best, found[row * parts + part]);
    o[row] = best.index;
  }
}

// the logits the ops read: [rows, V > 0], fp32 or bf16, each row contiguous
void check_logits(const char* op, const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2, op, ": logits [rows, vocab], got ", logits.sizes());
  TORCH_CHECK(logits.size(1) > 0, op, ": an empty vocabulary");
  TORCH_CHECK(logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16, op,
              ": fp32 or bf16 logits, got ", logits.scalar_type());
  TORCH_CHECK(logits.stride(1) == 1, op, ": each row's logits contiguous");
}

// 1 / temperature of each row, which must be > 0 and finite
at::Tensor scales(const char* op, const at::Tensor& temperature) {
  at::Tensor scale = temperature.reciprocal();
  const float* s = scale.data_ptr<float>();
  for (int64_t r = 0; r < scale.size(0); ++r)
    TORCH_CHECK(std::isfinite(s[r]) && s[r] > 0.f, op, ": temperatures > 0, got ",
                temperature[r].item<float>(), " in row ", r);
  return scale;
}

at::Tensor greedy_tokens(const at::Tensor& logits) {
  check_logits("greedy_tokens", logits);
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

// ---- temperature_draw: a draw from softmax(logits / T), min-p applied, without its copies ----

constexpr int64_t kChunk = 256;  // weights computed into a buffer at a time (1 KiB)
// e^z under this is taken as 0: fp32's softmax underflows there too (cpu_vector_exp.h clamps
// its argument at kExpLowest and would give ~1e-38)
constexpr float kWeightLowest = sessionserve_exp::kExpLowest;

struct RowWeights {
  float top;    // the row's largest logit
  float scale;  // 1 / temperature
  float floor;  // min-p: weights under it are 0 (the top's weight is 1)
};

// the weights w = e^((x - top) * scale) of x[begin, end) (at most kChunk) into w, 0 under the
// floor, and their sum. The one place weights are computed, so the sums a row is searched by
// and the weights it is searched in agree bit for bit.
template <typename T>
float chunk_weights(const T* x, int64_t begin, int64_t end, const RowWeights& r, float* w) {
  const int64_t n = end - begin, whole = n / kLanes * kLanes;
  const Vec top = vset1(r.top), scale = vset1(r.scale), floor = vset1(r.floor);
  const Vec lowest = vset1(kWeightLowest);
  Vec acc = vzero();
  for (int64_t i = 0; i < whole; i += kLanes) {
    const Vec z = vmul(vsub(vload(x + begin + i), top), scale);
    Vec e = vzero_unless_ge(vexp(z), z, lowest);
    e = vzero_unless_ge(e, e, floor);
    vstore(w + i, e);
    acc = vadd(acc, e);
  }
  float sum = vsum(acc);
  for (int64_t i = whole; i < n; ++i) {
    const float z = (value(x[begin + i]) - r.top) * r.scale;
    float e = z >= kWeightLowest ? std::exp(z) : 0.f;
    e = e >= r.floor ? e : 0.f;
    w[i] = e;
    sum += e;
  }
  return sum;
}

// the sum of x[begin, end)'s weights: its chunks' sums added in float64, in order
template <typename T>
double part_weight(const T* x, int64_t begin, int64_t end, const RowWeights& r) {
  float w[kChunk];
  double total = 0.0;
  for (int64_t c = begin; c < end; c += kChunk)
    total += chunk_weights(x, c, std::min(end, c + kChunk), r, w);
  return total;
}

// the token at `target` in x[begin, end), whose chunks' sums start at `before`: the first
// whose float64 running sum exceeds it; where rounding leaves the target past them (within a
// chunk the weights add one by one, not as their sum did), the last token with a weight
template <typename T>
int64_t token_at(const T* x, int64_t begin, int64_t end, const RowWeights& r, double before,
                 double target) {
  float w[kChunk];
  int64_t last = -1;  // the last token with a weight so far
  for (int64_t c = begin; c < end; c += kChunk) {
    const int64_t stop = std::min(end, c + kChunk);
    const double sum = chunk_weights(x, c, stop, r, w);
    if (sum > 0.0 && target < before + sum) {
      double running = before;
      for (int64_t i = 0; i < stop - c; ++i) {
        if (w[i] <= 0.f) continue;
        running += w[i];
        last = c + i;
        if (running > target) return last;
      }
      return last;
    }
    if (sum > 0.0)
      for (int64_t i = stop - c - 1; i >= 0; --i)
        if (w[i] > 0.f) {
          last = c + i;
          break;
        }
    before += sum;
  }
  return last;
}

// each row's largest logit (NaN flagged), its parts read on the threads
template <typename T>
std::vector<Largest> row_tops(const T* x, int64_t rows, int64_t stride, const Parts& parts) {
  const int64_t n = parts.count;
  std::vector<Largest> tops(rows * n);
  at::parallel_for(0, rows * n, 4, [&](int64_t lo, int64_t hi) {
    for (int64_t w = lo; w < hi; ++w)
      tops[w] = largest(x + (w / n) * stride, parts.begin(w % n), parts.end(w % n));
  });
  std::vector<Largest> row(rows);
  for (int64_t r = 0; r < rows; ++r) {
    row[r] = tops[r * n];
    for (int64_t p = 1; p < n; ++p) {
      row[r].nan |= tops[r * n + p].nan;
      row[r].value = std::max(row[r].value, tops[r * n + p].value);
    }
  }
  return row;
}

// whether a row's weights can be computed: no NaN, a finite top
inline bool weighable(const Largest& top) { return !top.nan && std::isfinite(top.value); }

template <typename T>
void draw_weighted(const at::Tensor& logits, const float* scale, const float* floor,
                   const double* u, int64_t* out) {
  const int64_t rows = logits.size(0);
  const Parts split(logits.size(1));
  const int64_t parts = split.count;
  const T* x = logits.data_ptr<T>();
  const int64_t stride = logits.stride(0);
  const std::vector<Largest> tops = row_tops(x, rows, stride, split);
  std::vector<RowWeights> row(rows);
  for (int64_t r = 0; r < rows; ++r) {
    row[r] = {tops[r].value, scale[r], floor[r]};
    out[r] = -1;
  }
  // each part's weight (a work item: ~16K exponentials, a few microseconds)
  std::vector<double> weight(rows * parts, 0.0);
  at::parallel_for(0, rows * parts, 2, [&](int64_t lo, int64_t hi) {
    for (int64_t w = lo; w < hi; ++w) {
      const int64_t r = w / parts, part = w % parts;
      if (weighable(tops[r]))
        weight[w] = part_weight(x + r * stride, split.begin(part), split.end(part), row[r]);
    }
  });
  at::parallel_for(0, rows, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      if (!weighable(tops[r])) continue;
      const double* pw = weight.data() + r * parts;
      double total = 0.0;
      for (int64_t p = 0; p < parts; ++p) total += pw[p];
      const double target = u[r] * total;
      // the part the target falls in (its weights start at `at`), else, where rounding puts
      // the target at the total, the last part with a weight
      int64_t part = -1;
      double before = 0.0, at = 0.0;
      bool reached = false;
      for (int64_t p = 0; p < parts && !reached; ++p) {
        if (pw[p] > 0.0) {
          part = p;
          at = before;
          reached = target < before + pw[p];
        }
        before += pw[p];
      }
      if (part < 0) continue;  // unreachable: the top's weight is 1
      const double aim = reached ? target : std::numeric_limits<double>::infinity();
      out[r] = token_at(x + r * stride, split.begin(part), split.end(part), row[r], at, aim);
    }
  });
}

at::Tensor temperature_draw(const at::Tensor& logits, const at::Tensor& temperature,
                            const at::Tensor& min_p, const at::Tensor& u) {
  check_logits("temperature_draw", logits);
  const int64_t rows = logits.size(0);
  for (const auto* t : {&temperature, &min_p})
    TORCH_CHECK(t->dim() == 1 && t->size(0) == rows && t->scalar_type() == at::kFloat,
                "temperature_draw: one fp32 temperature and min-p a row, got ", t->sizes(), " ",
                t->scalar_type());
  TORCH_CHECK(u.dim() == 1 && u.size(0) == rows && u.scalar_type() == at::kDouble,
              "temperature_draw: one float64 uniform a row, got ", u.sizes(), " ",
              u.scalar_type());
  const at::Tensor scale = scales("temperature_draw", temperature), f = min_p.contiguous(),
                   uc = u.contiguous();
  const float* s = scale.data_ptr<float>();
  at::Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
  if (rows == 0) return out;
  if (logits.scalar_type() == at::kFloat)
    draw_weighted<float>(logits, s, f.data_ptr<float>(), uc.data_ptr<double>(),
                         out.data_ptr<int64_t>());
  else
    draw_weighted<c10::BFloat16>(logits, s, f.data_ptr<float>(), uc.data_ptr<double>(),
                                 out.data_ptr<int64_t>());
  return out;
}

// ---- nucleus_candidates: the few tokens a top-k / top-p row keeps, without a sort ----

constexpr int kLevels = 8;
// level j holds the tokens whose weight e^((x - top) / T) is at least e^-kLevelDepth[j]
constexpr float kLevelDepth[kLevels] = {2.f, 4.f, 6.f, 8.f, 11.f, 14.f, 18.f, 24.f};
// the share of a top-p's mass a level must hold past it: float32 rounding of the softmax that
// `filter_logits` cumsums
constexpr double kMassMargin = 1e-4;

struct LevelSums {
  int64_t count[kLevels] = {};  // tokens in each level
  double mass[kLevels] = {};    // and their weight
  double total = 0.0;           // the weight of all
};

// x[begin, end)'s tokens and weights by level, added to `sums` (chunks of fp32 lanes added in
// float64, as `chunk_weights`)
template <typename T>
void add_levels(const T* x, int64_t begin, int64_t end, float top, float scale,
                LevelSums& sums) {
  const Vec vtop = vset1(top), vscale = vset1(scale), lowest = vset1(kWeightLowest);
  Vec depth[kLevels];
  for (int j = 0; j < kLevels; ++j) depth[j] = vset1(-kLevelDepth[j]);
  for (int64_t c = begin; c < end; c += kChunk) {
    const int64_t stop = std::min(end, c + kChunk);
    const int64_t whole = c + (stop - c) / kLanes * kLanes;
    Vec total = vzero(), mass[kLevels];
    for (int j = 0; j < kLevels; ++j) mass[j] = vzero();
    for (int64_t i = c; i < whole; i += kLanes) {
      const Vec z = vmul(vsub(vload(x + i), vtop), vscale);
      const Vec e = vzero_unless_ge(vexp(z), z, lowest);
      total = vadd(total, e);
      for (int j = 0; j < kLevels; ++j) {
        sums.count[j] += __builtin_popcount(vge_lanes(z, depth[j]));
        mass[j] = vadd(mass[j], vzero_unless_ge(e, z, depth[j]));
      }
    }
    sums.total += vsum(total);
    for (int j = 0; j < kLevels; ++j) sums.mass[j] += vsum(mass[j]);
    for (int64_t i = whole; i < stop; ++i) {
      const float z = (value(x[i]) - top) * scale;
      const float e = z >= kWeightLowest ? std::exp(z) : 0.f;
      sums.total += e;
      for (int j = 0; j < kLevels; ++j)
        if (z >= -kLevelDepth[j]) sums.count[j] += 1, sums.mass[j] += e;
    }
  }
}

// x[begin, end)'s tokens at least `depth` under the top (z >= -depth), in vocabulary order,
// with their logits: the same comparisons as `add_levels`, so as many as it counted
template <typename T>
int64_t gather_level(const T* x, int64_t begin, int64_t end, float top, float scale,
                     float depth, int64_t* tokens, float* values) {
  const Vec vtop = vset1(top), vscale = vset1(scale), vdepth = vset1(-depth);
  const int64_t whole = begin + (end - begin) / kLanes * kLanes;
  int64_t n = 0;
  for (int64_t i = begin; i < whole; i += kLanes) {
    uint32_t in = vge_lanes(vmul(vsub(vload(x + i), vtop), vscale), vdepth);
    for (; in; in &= in - 1) {
      const int64_t t = i + __builtin_ctz(in);
      tokens[n] = t, values[n++] = value(x[t]);
    }
  }
  for (int64_t i = whole; i < end; ++i)
    if ((value(x[i]) - top) * scale >= -depth) tokens[n] = i, values[n++] = value(x[i]);
  return n;
}

template <typename T>
std::vector<at::Tensor> find_candidates(const at::Tensor& logits, const float* scale,
                                        const int64_t* top_k, const float* top_p,
                                        int64_t limit) {
  const int64_t rows = logits.size(0);
  const Parts split(logits.size(1));
  const int64_t parts = split.count;
  const T* x = logits.data_ptr<T>();
  const int64_t stride = logits.stride(0);
  const std::vector<Largest> tops = row_tops(x, rows, stride, split);
  std::vector<LevelSums> sums(rows * parts);
  at::parallel_for(0, rows * parts, 2, [&](int64_t lo, int64_t hi) {
    for (int64_t w = lo; w < hi; ++w) {
      const int64_t r = w / parts;
      if (!weighable(tops[r])) continue;
      add_levels(x + r * stride, split.begin(w % parts), split.end(w % parts), tops[r].value,
                 scale[r], sums[w]);
    }
  });
  // each row's level: the first that holds its k largest and its nucleus, within the limit
  at::Tensor counts = at::full({rows}, -1, logits.options().dtype(at::kLong));
  at::Tensor log_total = at::zeros({rows}, logits.options().dtype(at::kDouble));
  int64_t* count = counts.data_ptr<int64_t>();
  std::vector<int> level(rows, -1);
  int64_t widest = 0;
  for (int64_t r = 0; r < rows; ++r) {
    if (!weighable(tops[r]) || (top_k[r] <= 0 && top_p[r] >= 1.f)) continue;
    LevelSums row;
    for (int64_t p = 0; p < parts; ++p) {
      const LevelSums& part = sums[r * parts + p];
      row.total += part.total;
      for (int j = 0; j < kLevels; ++j)
        row.count[j] += part.count[j], row.mass[j] += part.mass[j];
    }
    const double nucleus = top_p[r] < 1.f ? top_p[r] * row.total * (1.0 + kMassMargin) : 0.0;
    for (int j = 0; j < kLevels && row.count[j] <= limit; ++j) {
      if (row.count[j] >= top_k[r] && row.mass[j] >= nucleus) {
        level[r] = j, count[r] = row.count[j];
        break;
      }
    }
    log_total.data_ptr<double>()[r] = double(tops[r].value) * scale[r] + std::log(row.total);
    widest = std::max(widest, count[r]);
  }
  // (a row's entries past its count are left as they are: a flat row's level may hold most
  // of the vocabulary, and the other rows are not filled to its width)
  at::Tensor tokens = at::empty({rows, widest}, logits.options().dtype(at::kLong));
  at::Tensor values = at::empty({rows, widest}, logits.options().dtype(at::kFloat));
  at::parallel_for(0, rows * parts, 4, [&](int64_t lo, int64_t hi) {
    for (int64_t w = lo; w < hi; ++w) {
      const int64_t r = w / parts, part = w % parts;
      const int j = level[r];
      if (j < 0) continue;
      int64_t at = 0;  // where this part's tokens go: after the earlier parts'
      for (int64_t p = 0; p < part; ++p) at += sums[r * parts + p].count[j];
      gather_level(x + r * stride, split.begin(part), split.end(part), tops[r].value, scale[r],
                   kLevelDepth[j], tokens.data_ptr<int64_t>() + r * widest + at,
                   values.data_ptr<float>() + r * widest + at);
    }
  });
  return {tokens, values, counts, log_total};
}

std::vector<at::Tensor> nucleus_candidates(const at::Tensor& logits,
                                           const at::Tensor& temperature,
                                           const at::Tensor& top_k, const at::Tensor& top_p,
                                           int64_t limit) {
  check_logits("nucleus_candidates", logits);
  const int64_t rows = logits.size(0);
  TORCH_CHECK(temperature.dim() == 1 && temperature.size(0) == rows &&
                  top_p.dim() == 1 && top_p.size(0) == rows &&
                  temperature.scalar_type() == at::kFloat && top_p.scalar_type() == at::kFloat,
              "nucleus_candidates: one fp32 temperature and top-p a row");
  TORCH_CHECK(top_k.dim() == 1 && top_k.size(0) == rows && top_k.scalar_type() == at::kLong,
              "nucleus_candidates: one int64 top-k a row (0: none)");
  const at::Tensor scale = scales("nucleus_candidates", temperature), k = top_k.contiguous(),
                   p = top_p.contiguous();
  const float* s = scale.data_ptr<float>();
  if (logits.scalar_type() == at::kFloat)
    return find_candidates<float>(logits, s, k.data_ptr<int64_t>(), p.data_ptr<float>(), limit);
  return find_candidates<c10::BFloat16>(logits, s, k.data_ptr<int64_t>(), p.data_ptr<float>(),
                                        limit);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(sessionserve, m) {
  m.def("greedy_tokens(Tensor logits) -> Tensor");
  m.def("inverse_cdf(Tensor probs, Tensor u) -> Tensor");
  m.def("temperature_draw(Tensor logits, Tensor temperature, Tensor min_p, Tensor u) -> Tensor");
  m.def(
      "nucleus_candidates(Tensor logits, Tensor temperature, Tensor top_k, Tensor top_p, "
      "int limit) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(sessionserve, CPU, m) {
  m.impl("greedy_tokens", &greedy_tokens);
  m.impl("inverse_cdf", &inverse_cdf);
  m.impl("temperature_draw", &temperature_draw);
  m.impl("nucleus_candidates", &nucleus_candidates);
}
