// Prefill ("extend") attention over the paged KV pool in place, for x86 CPUs: bf16 with
// AVX512-BF16, float32 with AVX-512 or AVX2.
//
// What it computes is the torch backend's attention for a group of rows that each add T new
// tokens after their cached context (a session's next turn, a prompt after a radix hit, a
// chunk of a long prompt): token t of row b sits at position lens[b] - T + t and sees the
// row's positions 0..itself, or on a sliding-window layer only the last `window` of those
// (itself included), its K/V read through the row's slot table (the new tokens' K/V are in
// the pool already). In bf16, as torch's CPU flash attention computes it: scores from
// the bf16 query and keys summed in fp32, the softmax in fp32, its weights rounded to bf16 for
// the weighted sum of V (summed in fp32), the output rounded to bf16.
//
// Why a hand-written kernel: torch's flash attention ran a 128-token turn over 600 tokens of
// history at ~110 GFLOP/s on 2 cores of an EPYC Zen 4, a third of a prefill step there, where
// the step's GEMMs run at ~280 (docs/benchmarks.md, stop 104); before it, each layer gathered
// the context's K/V out of the pool into a copy and built a mask. Here each (row, KV head)'s
// context is packed once per layer into the layouts AVX512-BF16's dot product (`vdpbf16ps`,
// two bf16 products summed into each fp32 lane) takes: keys as blocks of 16 tokens, each
// vector one pair of dimensions for 16 tokens, so one instruction scores 16 tokens for one
// query row; values as pairs of tokens, each vector 16 dimensions of two tokens, so one
// instruction adds two tokens' weighted values. A block's scores take their softmax on one
// vector (online, as flash attention does); each packed vector is loaded once for rows_a_pass
// query rows, whose queries are broadcast and whose sums stay in registers.
//
// In float32 (`F32`: CPUs without bf16 arithmetic serve fp32 models) the same plan with fp32
// FMAs on the vectors of cpu_vector.h: keys as blocks of kLanes tokens, one vector a
// dimension; values a token's row; the weights and sums in fp32, nothing rounded.
//
// Built at run time by cpu_extend_kernel.py (g++ -mavx512f [-mavx512bf16] ..., or -mavx2 -mfma)
// and loaded with torch.ops.load_library; its fake (shape) implementation is registered there,
// in Python.

// the ATen headers this file uses, not <ATen/ATen.h> (every op's declarations: 1-4 s more of
// g++ a kernel on a first start, docs/benchmarks.md stop 116)
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "cpu_vector.h"

namespace {

constexpr int kTileTokens = 16;  // query tokens a work item (times the query heads a KV head)
constexpr int64_t kPackBlocks = 8;  // blocks a thread packs at a time

// One block of a row's online softmax (both paths): its scaled scores `s`, of which lanes
// lo..hi - 1 count (lo < hi). Rescales what the row has summed (`lv`, `acc`) when the block
// raises its max `m` (alpha 0 for the first block), adds the block's weights to `lv`, and
// returns them (0 outside lo..hi - 1).
template <int DV>
inline Vec softmax_block(Vec s, int lo, int hi, float& m, Vec& lv, Vec (&acc)[DV]) {
  const Vec sv = vbetween(s, lo, hi, -std::numeric_limits<float>::infinity());
  const float top = std::max(m, vmax(sv));
  if (top > m) {
    const Vec a = vset1(std::exp(m - top));
    m = top;
    lv = vmul(lv, a);
    for (int i = 0; i < DV; ++i) acc[i] = vmul(acc[i], a);
  }
  const Vec w = vbetween(vexp(vsub(sv, vset1(top))), lo, hi, 0.f);
  lv = vadd(lv, w);
  return w;
}

// The lanes lo..hi - 1 of the block starting at position `base` (kBlock positions) that a row
// seeing positions first..last takes; lo >= hi where it takes none.
template <int kBlock>
inline void lanes_seen(int64_t first, int64_t last, int64_t base, int& lo, int& hi) {
  lo = static_cast<int>(std::clamp<int64_t>(first - base, 0, kBlock));
  hi = static_cast<int>(std::clamp<int64_t>(last - base + 1, 0, kBlock));
}

#if defined(__AVX512BF16__)
// bf16: torch's bf16 flash attention's arithmetic, with AVX512-BF16's dot products (built
// with AVX-512 only, so `Vec` is an __m512 here)
struct Bf16 {
  using Elem = uint16_t;  // a bf16's bits
  using Word = uint32_t;  // two bf16, as `vdpbf16ps` takes them
  static constexpr int kBlock = 16;      // context tokens a block: one fp32 vector's lanes
  // query rows a pass (at D 256 their sums spill, and more rows still pay: each block's 128
  // key vectors are loaded once for more rows; one layer of Gemma 3 270M, 128 tokens over
  // 2,000 on the Zen 4 box, ran at 162 GFLOP/s with 2 rows a pass, 201 with 4, 234 with 8,
  // 214 with 12; with the weighted sum in chunks, `pv_chunk`, 8 rows 276-339 over Gemma 3's
  // cases and 16 rows 302-355, within the spread. At D 64, 8 rows were no faster than 4)
  template <int D>
  static constexpr int rows_a_pass() {
    return D <= 128 ? 4 : 8;
  }
  // output vectors a row's weighted sum keeps in registers at a time (R x C of them, beside
  // C value vectors and a weight: at most 21 of 32)
  template <int DV, int R>
  static constexpr int pv_chunk() {
    constexpr int most = R > 4 ? 2 : 4;
    return DV % most == 0 ? most : DV % 2 == 0 ? 2 : 1;
  }
  static constexpr int kPerWord = 2;     // elements a packed word holds

  // The layouts `vdpbf16ps` takes, for one (row, KV head)'s context of n tokens, zero past n
  // (whole blocks): keys [blocks][D / 2][kBlock] and values [blocks * kBlock / 2][D], each a
  // uint32 holding two bf16 (the lower one the first: dimension 2p, or token 2j). This packs
  // blocks lo..hi - 1 of them (a piece: a long context is packed by several threads).
  template <int D>
  static void pack(const uint16_t* k_head, const uint16_t* v_head, int64_t slot_stride,
                   const int64_t* slots, int64_t n, int64_t lo, int64_t hi, uint32_t* kp,
                   uint32_t* vp) {
    for (int64_t blk = lo; blk < hi; ++blk) {
      uint32_t* kb = kp + blk * (D / 2) * kBlock;
      for (int t = 0; t < kBlock; ++t) {
        const int64_t j = blk * kBlock + t;
        if (j < n) {
          uint32_t k[D / 2];
          std::memcpy(k, k_head + slots[j] * slot_stride, sizeof(k));
          for (int p = 0; p < D / 2; ++p) kb[p * kBlock + t] = k[p];
        } else {
          for (int p = 0; p < D / 2; ++p) kb[p * kBlock + t] = 0;
        }
      }
    }
    static const uint16_t zeros[D] = {};
    for (int64_t jp = lo * kBlock / 2; jp < hi * kBlock / 2; ++jp) {
      const int64_t j = 2 * jp;
      const uint16_t* a = j < n ? v_head + slots[j] * slot_stride : zeros;
      const uint16_t* b = j + 1 < n ? v_head + slots[j + 1] * slot_stride : zeros;
      uint32_t* out = vp + jp * D;
      for (int d = 0; d < D; ++d) out[d] = uint32_t(a[d]) | (uint32_t(b[d]) << 16);
    }
  }

  // R query rows over one (row, KV head)'s packed context: row r (its query q[r], D bf16 as
  // D / 2 pairs) sees positions first[r]..pos[r]; its output, D bf16, goes to out[r].
  template <int D, int R>
  static void attend_rows(const uint32_t* const* q, const int64_t* first, const int64_t* pos,
                          const uint32_t* kp, const uint32_t* vp, float scale,
                          uint16_t* const* out) {
    constexpr int DV = D / kBlock;  // fp32 vectors an output row takes
    __m512 acc[R][DV];
    __m512 lv[R];  // the softmax's sums, lane by lane
    float m[R];
    alignas(64) uint16_t weights[R][kBlock];  // a block's softmax weights, bf16
    int64_t last = 0, start = pos[0];
    for (int r = 0; r < R; ++r) {
      for (int i = 0; i < DV; ++i) acc[r][i] = _mm512_setzero_ps();
      lv[r] = _mm512_setzero_ps();
      m[r] = -std::numeric_limits<float>::infinity();
      last = std::max(last, pos[r]);
      start = std::min(start, first[r]);
    }
    const __m512 scale_v = _mm512_set1_ps(scale);
    for (int64_t blk = start / kBlock; blk * kBlock <= last; ++blk) {
      // two sums a row, over even and odd pairs of dimensions: a row's dot products form a
      // chain (each waits for the last, ~6 cycles on Zen 4), and R chains did not keep the unit
      // busy (2R: ~7% faster a layer, 128 tokens over 600, R = 4)
      __m512 s[R], odd[R];
      for (int r = 0; r < R; ++r) s[r] = odd[r] = _mm512_setzero_ps();
      const uint32_t* kb = kp + blk * (D / 2) * kBlock;
      for (int p = 0; p < D / 2; p += 2) {  // D / 2 is even: D is a multiple of 16
        const __m512bh k = (__m512bh)_mm512_loadu_si512(kb + p * kBlock);
        const __m512bh k_odd = (__m512bh)_mm512_loadu_si512(kb + (p + 1) * kBlock);
        for (int r = 0; r < R; ++r) {
          s[r] = _mm512_dpbf16_ps(s[r], k, (__m512bh)_mm512_set1_epi32(int(q[r][p])));
          odd[r] = _mm512_dpbf16_ps(odd[r], k_odd, (__m512bh)_mm512_set1_epi32(int(q[r][p + 1])));
        }
      }
      for (int r = 0; r < R; ++r) s[r] = _mm512_add_ps(s[r], odd[r]);
      const int64_t base = blk * kBlock;
      for (int r = 0; r < R; ++r) {
        int lo, hi;  // the lanes this row sees
        lanes_seen<kBlock>(first[r], pos[r], base, lo, hi);
        if (lo >= hi) {
          std::memset(weights[r], 0, sizeof(weights[r]));
          continue;
        }
        const __m512 w =
            softmax_block<DV>(_mm512_mul_ps(s[r], scale_v), lo, hi, m[r], lv[r], acc[r]);
        _mm256_store_si256(reinterpret_cast<__m256i*>(weights[r]), (__m256i)_mm512_cvtneps_pbh(w));
      }
      // the weighted sum C output vectors at a time over the block's pairs of tokens (as
      // F32's): spilled sums loaded and stored once a block, not once a pair; each sum adds
      // the same terms in the same order
      constexpr int C = pv_chunk<DV, R>();
      for (int i0 = 0; i0 < DV; i0 += C) {
        __m512 a[R][C];
        for (int r = 0; r < R; ++r)
          for (int c = 0; c < C; ++c) a[r][c] = acc[r][i0 + c];
        for (int jp = 0; jp < kBlock / 2; ++jp) {
          const uint32_t* vb = vp + (blk * kBlock / 2 + jp) * D + i0 * kBlock;
          __m512bh v[C];
          for (int c = 0; c < C; ++c) v[c] = (__m512bh)_mm512_loadu_si512(vb + c * kBlock);
          for (int r = 0; r < R; ++r) {
            uint32_t pair;
            std::memcpy(&pair, weights[r] + 2 * jp, sizeof(pair));
            const __m512bh wp = (__m512bh)_mm512_set1_epi32(int(pair));
            for (int c = 0; c < C; ++c) a[r][c] = _mm512_dpbf16_ps(a[r][c], v[c], wp);
          }
        }
        for (int r = 0; r < R; ++r)
          for (int c = 0; c < C; ++c) acc[r][i0 + c] = a[r][c];
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(lv[r]));
      for (int i = 0; i < DV; ++i) {
        const __m256bh o = _mm512_cvtneps_pbh(_mm512_mul_ps(acc[r][i], inv));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out[r] + i * kBlock), (__m256i)o);
      }
    }
  }
};
#endif

// fp32, on AVX-512 or AVX2 (cpu_vector.h): plain fp32 attention, FMAs on kLanes-wide vectors.
// For CPUs without bf16 arithmetic, where `model.dtype: auto` serves fp32 (AVX2, and AVX-512
// before AVX512-BF16): there torch's attention gathered the context out of the pool too.
struct F32 {
  using Elem = float;
  using Word = float;
  static constexpr int kBlock = kLanes;  // context tokens a block: one vector's lanes
  // query rows a pass, sharing each vector of the context it loads. On the Zen 4 box held to
  // AVX2 (16 registers) the build ran at 56-61 GFLOP/s with 1 row a pass, 72-79 with 2,
  // 84-104 with 3; with the weighted sum in chunks (`pv_chunk`) 4 rows read 0.88-1.06x
  // torch's AVX2 path over a history where 3 read 0.76-0.84x (runs minutes apart). At D 256
  // on AVX-512 4 rows beat 2 (110 against 84 GFLOP/s, 128 tokens over 2,000) and 8 did not
  // beat 4
  template <int D>
  static constexpr int rows_a_pass() {
    return 4;
  }
  // output vectors the weighted sum keeps in registers at a time: C of them a row, beside
  // their V vectors and the rows' weights (AVX-512: 4 x 4 + 4 + 4 of 32; AVX2: 4 x 2 + 2 + 4
  // of 16)
  template <int DV>
  static constexpr int pv_chunk() {
    constexpr int most = kLanes == 16 ? 4 : 2;
    return DV % most == 0 ? most : DV % 2 == 0 ? 2 : 1;
  }
  static constexpr int kPerWord = 1;

  // One (row, KV head)'s context of n tokens, zero past n (whole blocks): keys
  // [blocks][D][kBlock] (a vector is one dimension of a block's tokens), values
  // [blocks * kBlock][D] (a token's row: copied all the same, since every pass reads it, and
  // from the pool's scattered slots that was up to 2x slower over 2,000 tokens); blocks
  // lo..hi - 1 of them.
  template <int D>
  static void pack(const float* k_head, const float* v_head, int64_t slot_stride,
                   const int64_t* slots, int64_t n, int64_t lo, int64_t hi, float* kp,
                   float* vp) {
    for (int64_t blk = lo; blk < hi; ++blk) {
      float* kb = kp + blk * D * kBlock;
      for (int t = 0; t < kBlock; ++t) {
        const int64_t j = blk * kBlock + t;
        float* vrow = vp + j * D;
        if (j < n) {
          const float* k = k_head + slots[j] * slot_stride;
          for (int d = 0; d < D; ++d) kb[d * kBlock + t] = k[d];
          std::memcpy(vrow, v_head + slots[j] * slot_stride, D * sizeof(float));
        } else {
          for (int d = 0; d < D; ++d) kb[d * kBlock + t] = 0.f;
          std::memset(vrow, 0, D * sizeof(float));
        }
      }
    }
  }

  // R query rows over one (row, KV head)'s packed context: row r (its query q[r], D floats)
  // sees positions first[r]..pos[r]; its output, D floats, goes to out[r].
  template <int D, int R>
  static void attend_rows(const float* const* q, const int64_t* first, const int64_t* pos,
                          const float* kp, const float* vp, float scale, float* const* out) {
    constexpr int DV = D / kLanes;  // vectors an output row takes
    Vec acc[R][DV];
    Vec lv[R];  // the softmax's sums, lane by lane
    float m[R];
    alignas(64) float weights[R][kBlock];
    int64_t last = 0, start = pos[0];
    for (int r = 0; r < R; ++r) {
      for (int i = 0; i < DV; ++i) acc[r][i] = vzero();
      lv[r] = vzero();
      m[r] = -std::numeric_limits<float>::infinity();
      last = std::max(last, pos[r]);
      start = std::min(start, first[r]);
    }
    const Vec scale_v = vset1(scale);
    for (int64_t blk = start / kBlock; blk * kBlock <= last; ++blk) {
      // two sums a row (even and odd dimensions), so that 2R FMA chains are in flight
      Vec s[R], odd[R];
      for (int r = 0; r < R; ++r) s[r] = odd[r] = vzero();
      const float* kb = kp + blk * D * kBlock;
      for (int d = 0; d < D; d += 2) {
        const Vec k = vload(kb + d * kBlock), k_odd = vload(kb + (d + 1) * kBlock);
        for (int r = 0; r < R; ++r) {
          s[r] = vfmadd(vset1(q[r][d]), k, s[r]);
          odd[r] = vfmadd(vset1(q[r][d + 1]), k_odd, odd[r]);
        }
      }
      const int64_t base = blk * kBlock;
      for (int r = 0; r < R; ++r) {
        int lo, hi;  // the lanes this row sees
        lanes_seen<kBlock>(first[r], pos[r], base, lo, hi);
        if (lo >= hi) {
          std::memset(weights[r], 0, sizeof(weights[r]));
          continue;
        }
        const Vec sv = vmul(vadd(s[r], odd[r]), scale_v);
        vstore(weights[r], softmax_block<DV>(sv, lo, hi, m[r], lv[r], acc[r]));
      }
      const int upto = static_cast<int>(std::min<int64_t>(kBlock, last - base + 1));
      // the weighted sum C vectors of the output at a time, over the block's tokens: where
      // the rows' sums do not fit the registers (R * DV > 16), each is loaded and stored once
      // a block, not once a token
      constexpr int C = pv_chunk<DV>();
      for (int i0 = 0; i0 < DV; i0 += C) {
        Vec a[R][C];
        for (int r = 0; r < R; ++r)
          for (int c = 0; c < C; ++c) a[r][c] = acc[r][i0 + c];
        for (int t = 0; t < upto; ++t) {
          const float* vrow = vp + (base + t) * D + i0 * kLanes;
          Vec v[C];
          for (int c = 0; c < C; ++c) v[c] = vload(vrow + c * kLanes);
          for (int r = 0; r < R; ++r) {
            const Vec w = vset1(weights[r][t]);
            for (int c = 0; c < C; ++c) a[r][c] = vfmadd(w, v[c], a[r][c]);
          }
        }
        for (int r = 0; r < R; ++r)
          for (int c = 0; c < C; ++c) acc[r][i0 + c] = a[r][c];
      }
    }
    for (int r = 0; r < R; ++r) {
      const Vec inv = vset1(1.f / vsum(lv[r]));
      for (int i = 0; i < DV; ++i) vstore(out[r] + i * kLanes, vmul(acc[r][i], inv));
    }
  }
};

// n (1..P::rows_a_pass<D>()) query rows a pass, their count known at compile time
template <class P, int D, int R = P::template rows_a_pass<D>()>
void attend_pass(int n, const typename P::Word* const* q, const int64_t* first,
                 const int64_t* pos, const typename P::Word* kp, const typename P::Word* vp,
                 float scale, typename P::Elem* const* out) {
  if constexpr (R > 1) {
    if (n < R) return attend_pass<P, D, R - 1>(n, q, first, pos, kp, vp, scale, out);
  }
  P::template attend_rows<D, R>(q, first, pos, kp, vp, scale, out);
}

// A piece of work: query tokens t0..t0 + n - 1 of one row, for one KV head's query heads.
struct Item {
  int64_t row, kv_head, t0, n, cost;
};

template <class P, int D>
void run(const at::Tensor& query,   // [B * T, H, D], contiguous
         const at::Tensor& k_pool,  // [S, KVH, D]
         const at::Tensor& v_pool,
         const at::Tensor& slots,   // [B, W] int64, contiguous
         const std::vector<int64_t>& lens, int64_t window, double scale, at::Tensor& out) {
  const int64_t batch = slots.size(0), tokens = query.size(0) / batch;
  const int64_t heads = query.size(1), kv_heads = k_pool.size(1), group = heads / kv_heads;
  const int64_t width = slots.size(1), slot_stride = k_pool.stride(0);
  const int64_t head_stride = k_pool.stride(1);
  using Elem = typename P::Elem;
  using Word = typename P::Word;
  constexpr int kBlock = P::kBlock, kRowsAPass = P::template rows_a_pass<D>();
  const auto* kpool = static_cast<const Elem*>(k_pool.data_ptr());
  const auto* vpool = static_cast<const Elem*>(v_pool.data_ptr());
  const auto* qp = static_cast<const Elem*>(query.data_ptr());
  auto* op = static_cast<Elem*>(out.data_ptr());
  const int64_t* sp = slots.data_ptr<int64_t>();

  // each (row, KV head)'s packed context: keys, then values from `keys_words[row]` on
  std::vector<int64_t> blocks(batch), keys_words(batch);  // per row: whole blocks, their keys
  std::vector<int64_t> offset(batch * kv_heads + 1, 0);
  for (int64_t b = 0; b < batch; ++b) {
    blocks[b] = (lens[b] + kBlock - 1) / kBlock;
    keys_words[b] = blocks[b] * kBlock * D / P::kPerWord;
    for (int64_t h = 0; h < kv_heads; ++h)
      offset[b * kv_heads + h + 1] = offset[b * kv_heads + h] + 2 * keys_words[b];
  }
  // not zeroed first: `pack` writes every word of it
  const std::unique_ptr<Word[]> packed(new Word[static_cast<size_t>(offset.back())]);
  const int threads = std::max(1, at::get_num_threads());
  struct Piece {
    int64_t row, kv_head, lo, hi;  // blocks lo..hi - 1 of a (row, KV head)'s context
  };
  std::vector<Piece> pieces;  // about as many as the threads can share evenly
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t h = 0; h < kv_heads; ++h)
      for (int64_t lo = 0; lo < blocks[b]; lo += kPackBlocks)
        pieces.push_back({b, h, lo, std::min(blocks[b], lo + kPackBlocks)});
  const int64_t n_pieces = static_cast<int64_t>(pieces.size());
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (int64_t i = 0; i < n_pieces; ++i) {
    const Piece& c = pieces[i];
    Word* kp = packed.get() + offset[c.row * kv_heads + c.kv_head];
    P::template pack<D>(kpool + c.kv_head * head_stride, vpool + c.kv_head * head_stride,
                        slot_stride, sp + c.row * width, lens[c.row], c.lo, c.hi, kp,
                        kp + keys_words[c.row]);
  }

  std::vector<Item> items;
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t h = 0; h < kv_heads; ++h)
      for (int64_t t0 = 0; t0 < tokens; t0 += kTileTokens) {
        const int64_t n = std::min<int64_t>(kTileTokens, tokens - t0);
        const int64_t seen = lens[b] - tokens + t0 + n;  // the positions its last token sees
        items.push_back({b, h, t0, n, window > 0 ? std::min(seen, window + n) : seen});
      }
  // the longest first, so the threads' last items are short ones
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& x, const Item& y) { return x.cost > y.cost; });
  const int64_t n_items = static_cast<int64_t>(items.size());
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (int64_t i = 0; i < n_items; ++i) {
    const Item& it = items[i];
    const Word* kp = packed.get() + offset[it.row * kv_heads + it.kv_head];
    const Word* vp = kp + keys_words[it.row];
    const int64_t rows = it.n * group;  // token-major: row j is token j / group, head j % group
    for (int64_t j0 = 0; j0 < rows; j0 += kRowsAPass) {
      const int n = static_cast<int>(std::min<int64_t>(kRowsAPass, rows - j0));
      const Word* q[kRowsAPass];
      Elem* o[kRowsAPass];
      int64_t first[kRowsAPass], pos[kRowsAPass];
      for (int r = 0; r < n; ++r) {
        const int64_t t = it.t0 + (j0 + r) / group, g = (j0 + r) % group;
        const int64_t at = ((it.row * tokens + t) * heads + it.kv_head * group + g) * D;
        q[r] = reinterpret_cast<const Word*>(qp + at);
        o[r] = op + at;
        pos[r] = lens[it.row] - tokens + t;
        first[r] = window > 0 ? std::max<int64_t>(0, pos[r] - window + 1) : 0;
      }
      attend_pass<P, D>(n, q, first, pos, kp, vp, static_cast<float>(scale), o);
    }
  }
}

template <class P>
void dispatch(int64_t head_dim, const at::Tensor& q, const at::Tensor& k_pool,
              const at::Tensor& v_pool, const at::Tensor& slots,
              const std::vector<int64_t>& lens, int64_t window, double scale, at::Tensor& out) {
  switch (head_dim) {
    case 16: return run<P, 16>(q, k_pool, v_pool, slots, lens, window, scale, out);
    case 32: return run<P, 32>(q, k_pool, v_pool, slots, lens, window, scale, out);
    case 64: return run<P, 64>(q, k_pool, v_pool, slots, lens, window, scale, out);
    case 80: return run<P, 80>(q, k_pool, v_pool, slots, lens, window, scale, out);
    case 96: return run<P, 96>(q, k_pool, v_pool, slots, lens, window, scale, out);
    case 128: return run<P, 128>(q, k_pool, v_pool, slots, lens, window, scale, out);
    case 256: return run<P, 256>(q, k_pool, v_pool, slots, lens, window, scale, out);
    default: TORCH_CHECK(false, "extend_attend: head_dim ", head_dim, " is not supported");
  }
}

// query [B * T, H, D]: B rows of T new tokens each, consecutive, each row's the last T of its
// lens[b] context positions, whose slots are slots[b, :lens[b]] (int64 [B, W]); k_pool, v_pool
// [S, KVH, D] (any slot and head strides, D contiguous); all three float32, or all bf16 where
// built with AVX512-BF16. Token t of row b sees positions 0..lens[b] - T + t, or with a
// `window` > 0 (a sliding-window layer) only the last `window` of those. Returns
// [B * T, H, D] in their dtype.
at::Tensor extend_attend(const at::Tensor& query, const at::Tensor& k_pool,
                         const at::Tensor& v_pool, const at::Tensor& slots,
                         const at::Tensor& lens, double scale, int64_t window) {
  TORCH_CHECK(query.dim() == 3 && k_pool.dim() == 3 && v_pool.dim() == 3,
              "extend_attend: query [B * T, H, D] and pools [S, KVH, D] expected");
  const auto dtype = query.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && k_pool.scalar_type() == dtype &&
                  v_pool.scalar_type() == dtype,
              "extend_attend: query and pools must all be float32, or all bf16");
#if !defined(__AVX512BF16__)
  TORCH_CHECK(dtype == at::kFloat,
              "extend_attend: bf16 needs a CPU with AVX512-BF16 (this build has float32 only)");
#endif
  TORCH_CHECK(k_pool.stride(2) == 1 && v_pool.stride(2) == 1 &&
                  k_pool.stride(0) == v_pool.stride(0) && k_pool.stride(1) == v_pool.stride(1),
              "extend_attend: the pools must share a layout, their last dimension contiguous");
  const int64_t heads = query.size(1), kv_heads = k_pool.size(1), head_dim = k_pool.size(2);
  TORCH_CHECK(query.size(2) == head_dim && heads % kv_heads == 0,
              "extend_attend: query heads must be a multiple of KV heads, of the pools' head_dim");
  TORCH_CHECK(slots.dim() == 2 && lens.numel() == slots.size(0) && slots.size(0) > 0 &&
                  query.size(0) % slots.size(0) == 0 && query.size(0) > 0,
              "extend_attend: slots [B, W] and lens [B] expected, with B dividing the query's ",
              query.size(0), " rows");
  TORCH_CHECK(window >= 0, "extend_attend: window must be 0 (none) or a positive width, not ",
              window);
  const int64_t batch = slots.size(0), tokens = query.size(0) / batch;
  const at::Tensor s = slots.to(at::kLong).contiguous();
  const at::Tensor l = lens.to(at::kLong).contiguous();
  const int64_t pool_slots = std::min(k_pool.size(0), v_pool.size(0));
  std::vector<int64_t> row_lens;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t n = l.data_ptr<int64_t>()[b];
    TORCH_CHECK(n >= tokens && n <= s.size(1), "extend_attend: lens must lie in ", tokens,
                "..", s.size(1), " (a row's new tokens are the last of its context), not ", n);
    // the rows are read through these without further checks: a bad slot is an error here
    const int64_t* row = s.data_ptr<int64_t>() + b * s.size(1);
    for (int64_t j = 0; j < n; ++j)
      TORCH_CHECK(row[j] >= 0 && row[j] < pool_slots, "extend_attend: slot ", row[j],
                  " of row ", b, " is outside the pool's ", pool_slots, " slots");
    row_lens.push_back(n);
  }
  const at::Tensor q = query.contiguous();
  at::Tensor out = at::empty_like(q);
#if defined(__AVX512BF16__)
  if (dtype == at::kBFloat16) {
    dispatch<Bf16>(head_dim, q, k_pool, v_pool, s, row_lens, window, scale, out);
    return out;
  }
#endif
  dispatch<F32>(head_dim, q, k_pool, v_pool, s, row_lens, window, scale, out);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(sessionserve, m) {
  m.def(
      "extend_attend(Tensor query, Tensor k_pool, Tensor v_pool, Tensor slots, Tensor lens, "
      "float scale, int window=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(sessionserve, CPU, m) { m.impl("extend_attend", &extend_attend); }
