// y = x @ W^T + b for a few rows of x (a decode step's, a verify's), fp32, on x86 CPUs with
// AVX-512 or AVX2.
//
// Why a hand-written kernel: a decode step of a small model on a CPU is its GEMMs, and at 1-40
// rows neither library reaches the cores' FMA rate. MKL (`F.linear`) ran SmolLM2-135M's weights
// at 8-33 GFLOP/s at 1-8 rows on two Zen 3 cores; inductor's C++ GEMM template, compiled by
// gcc, stores every accumulator after each FMA (docs/benchmarks.md, stop 72). Here W is packed
// once (`cpu_linear.pack`) into panels of one vector's output columns laid out K-major, so a
// panel streams from memory once, contiguous, and a block of rows of x keeps its accumulators
// in registers over the whole of K: each weight vector loaded feeds a FMA per row, each x
// element is one broadcast, for two panels at a time (`panel_range` says when one). Rows past
// a block take further passes over the panels, which are in L2 by then. Threads split the
// panels.
//
// Built at run time by cpu_linear.py (g++ -mavx512f ..., or -mavx2 -mfma), loaded with
// torch.ops.load_library; AOTInductor packages call it through the C function at the end.

// the ATen headers this file uses, not <ATen/ATen.h> (every op's declarations: 1-4 s more of
// g++ a kernel on a first start, docs/benchmarks.md stop 116)
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/inductor/aoti_torch/utils.h>
#include <torch/library.h>

#include <immintrin.h>

namespace {

#if defined(__AVX512F__)
constexpr int kLanes = 16;
constexpr int kPairRows = 12;    // 24 accumulators + 2 weight vectors + 1 broadcast of 32 registers
constexpr int kSingleRows = 24;  // 24 accumulators + 1 weight vector + 1 broadcast
using Vec = __m512;
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vbroadcast(const float* p) { return _mm512_set1_ps(*p); }
inline Vec vfmadd(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
#else
constexpr int kLanes = 8;
constexpr int kPairRows = 6;     // 12 accumulators + 2 weight vectors + 1 broadcast of 16 registers
constexpr int kSingleRows = 12;  // 12 accumulators + 1 weight vector + 1 broadcast
using Vec = __m256;
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vbroadcast(const float* p) { return _mm256_broadcast_ss(p); }
inline Vec vfmadd(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
#endif
constexpr int kPanel = kLanes;  // output columns a panel holds: one vector

// Software prefetching of the weights a lone pass streams from memory: how far ahead, in
// steps of K, and from how many rows of x on. Below that a pass waits on memory with or
// without it; from there its FMAs kept the hardware prefetcher from running far enough ahead,
// and the linears of a step of 8 rows ran 1.16-1.22x faster with it (docs/benchmarks.md,
// stop 87: `benchmarks/few_row_linear.py`).
constexpr int64_t kPrefetchAhead = 256;  // 8 KiB of a panel on AVX2, 16 KiB on AVX-512
constexpr int kPrefetchRows = 4;
constexpr int kStepsPerLine = 64 / (kPanel * static_cast<int>(sizeof(float)));

// R rows of x [R, K] (row stride lda) against V consecutive panels starting at w (each
// [K, kPanel], K * kPanel apart) -> y [R, V * kPanel]. Each x element broadcast feeds V FMAs.
// `from_memory`: the only pass over these panels, which fetches them ahead.
template <int R, int V>
inline void panel_rows(const float* x, int64_t lda, const float* w, int64_t K, float* y,
                       int64_t ldy, const float* bias, bool from_memory) {
  Vec acc[R][V];
#pragma GCC unroll 24
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 2
    for (int v = 0; v < V; ++v) acc[r][v] = bias ? vload(bias + v * kPanel) : vzero();
  }
  const bool prefetch = R >= kPrefetchRows && from_memory;
  for (int64_t k = 0; k < K; ++k) {
    if (prefetch && k % kStepsPerLine == 0) {
      // near a panel's end this fetches the next panel's start (or past the weights: a
      // prefetch never faults)
      const float* ahead = w + (k + kPrefetchAhead) * kPanel;
#pragma GCC unroll 2
      for (int v = 0; v < V; ++v)
        _mm_prefetch(reinterpret_cast<const char*>(ahead + v * K * kPanel), _MM_HINT_T0);
    }
    Vec wv[V];
#pragma GCC unroll 2
    for (int v = 0; v < V; ++v) wv[v] = vload(w + v * K * kPanel + k * kPanel);
#pragma GCC unroll 24
    for (int r = 0; r < R; ++r) {
      const Vec xr = vbroadcast(x + r * lda + k);
#pragma GCC unroll 2
      for (int v = 0; v < V; ++v) acc[r][v] = vfmadd(xr, wv[v], acc[r][v]);
    }
  }
#pragma GCC unroll 24
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 2
    for (int v = 0; v < V; ++v) vstore(y + r * ldy + v * kPanel, acc[r][v]);
  }
}

template <int R, int V>
void rows_upto(int rows, const float* x, int64_t lda, const float* w, int64_t K, float* y,
               int64_t ldy, const float* bias, bool from_memory) {
  if constexpr (R > 0) {
    if (rows == R) return panel_rows<R, V>(x, lda, w, K, y, ldy, bias, from_memory);
    rows_upto<R - 1, V>(rows, x, lda, w, K, y, ldy, bias, from_memory);
  }
}

// All M rows against V consecutive panels: blocks of at most kRows rows, as even as possible
// (20 rows on AVX2 are 10 + 10, not 12 + 8: the same weight loads, fewer idle FMA slots)
template <int V, int kRows>
void panels(const float* x, int64_t M, const float* w, int64_t K, float* y, int64_t N,
            const float* bias) {
  const int64_t blocks = (M + kRows - 1) / kRows;
  int64_t m = 0;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t left = blocks - b;
    const int rows = static_cast<int>((M - m + left - 1) / left);
    // a lone pass streams the panels from memory while it computes: it fetches ahead (the
    // first of several passes did too, but those steps are compute-bound: no clear gain)
    rows_upto<kRows, V>(rows, x + m * K, K, w, K, y + m * N, N, bias, blocks == 1);
    m += rows;
  }
}

// Panels begin..end-1, two at a time (the weights stream as two sequences, each broadcast
// feeds two FMAs), in passes of up to kPairRows rows; except that kPairRows + 1 to
// kSingleRows rows go one panel at a time, in one pass: two panels at a time they would take
// two passes, a memory-bound one and a compute-bound one from cache, which do not overlap
// (docs/benchmarks.md, stop 86). Past kSingleRows the steps are compute-bound anyway, and
// pairs load less per FMA.
void panel_range(const float* x, int64_t M, const float* w, int64_t K, float* y, int64_t N,
                 const float* bias, int64_t begin, int64_t end) {
  int64_t p = begin;
  if (M <= kPairRows || M > kSingleRows) {
    for (; p + 1 < end; p += 2)
      panels<2, kPairRows>(x, M, w + p * K * kPanel, K, y + p * kPanel, N,
                           bias ? bias + p * kPanel : nullptr);
  }
  for (; p < end; ++p)
    panels<1, kSingleRows>(x, M, w + p * K * kPanel, K, y + p * kPanel, N,
                           bias ? bias + p * kPanel : nullptr);
}

at::Tensor cpu_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& bias) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && packed.scalar_type() == at::kFloat,
              "cpu_linear: fp32 only, got ", x.scalar_type(), " and ", packed.scalar_type());
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kPanel && packed.is_contiguous(),
              "cpu_linear: the weight must be packed for this CPU's panels of ", kPanel,
              " columns (cpu_linear.pack), got ", packed.sizes());
  const int64_t K = x.size(-1);
  TORCH_CHECK(packed.size(1) == K, "cpu_linear: x has ", K, " features, the weight ",
              packed.size(1));
  const int64_t panels = packed.size(0), N = panels * kPanel;
  TORCH_CHECK(bias.numel() == 0 || (bias.numel() == N && bias.scalar_type() == at::kFloat &&
                                    bias.is_contiguous()),
              "cpu_linear: the bias must be empty or ", N, " contiguous fp32 values");
  const at::Tensor rows = x.reshape({-1, K}).contiguous();
  const int64_t M = rows.size(0);
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = N;
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y.view(sizes);
  const float* xp = rows.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  const float* bp = bias.numel() ? bias.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  // grain 2: no thread gets a lone panel where a pair would do (a range of odd length runs
  // its last panel alone, which is correct, only without the pair's shared broadcasts)
  at::parallel_for(0, panels, 2, [&](int64_t begin, int64_t end) {
    panel_range(xp, M, wp, K, yp, N, bp, begin, end);
  });
  return y.view(sizes);
}

}  // namespace

extern "C" AOTI_TORCH_EXPORT AOTITorchError aoti_torch_cpu_cpu_linear(AtenTensorHandle x,
                                                                     AtenTensorHandle packed,
                                                                     AtenTensorHandle bias,
                                                                     AtenTensorHandle* ret) {
  using torch::aot_inductor::resolve_tensor_dispatch_flags;
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    at::Tensor out = cpu_linear(resolve_tensor_dispatch_flags(x),
                                resolve_tensor_dispatch_flags(packed),
                                resolve_tensor_dispatch_flags(bias));
    *ret = torch::aot_inductor::new_tensor_handle(std::move(out));
  });
}

TORCH_LIBRARY_FRAGMENT(sessionserve, m) {
  m.def("cpu_linear(Tensor x, Tensor packed, Tensor bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(sessionserve, CPU, m) { m.impl("cpu_linear", &cpu_linear); }
