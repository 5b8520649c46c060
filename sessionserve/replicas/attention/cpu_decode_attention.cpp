// Decode attention over the paged KV pool in place, for x86 CPUs with AVX-512 or AVX2.
//
// What it computes is `inplace_decode.decode_attention` with a row's own new token (one new
// query token per row, its context read through its slot table, plus the token's own K/V,
// which is not in the pool yet). Why a hand-written kernel: inductor compiles that formula
// into loops that end every context token's dot product in a horizontal sum per query head
// and run the softmax as separate passes over stored scores; over multi-turn contexts
// (~1,500 tokens) the attention was 40-50% of a decode step (docs/benchmarks.md, stop 57).
// Here a block of kLanes tokens (one vector's lanes) is scored, its softmax is taken on one
// vector (online, as flash decoding does), and its V rows are accumulated while hot, each K
// and V row loaded once for up to kHeadsAPass of the query heads that share it (their
// queries and sums in registers). Long contexts are split into parts that run on separate
// threads and are merged at the end, so one row keeps every thread busy.
//
// Built at run time by cpu_decode_kernel.py (g++ -mavx512f ..., or -mavx2 -mfma where the
// CPU has no AVX-512: the vector primitives, cpu_vector.h, are the only code that differs), loaded
// with torch.ops.load_library; its fake (shape) implementation is registered there, in
// Python. AOTInductor packages call it through the C function at the end (its "C shim"),
// not the dispatcher: a package run through its C entry points (aoti_call.py) has no proxy
// executor to dispatch custom ops with.

// the ATen headers this file uses, not <ATen/ATen.h> (every op's declarations: 1-4 s more of
// g++ a kernel on a first start, docs/benchmarks.md stop 116)
#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/inductor/aoti_torch/utils.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "cpu_vector.h"

namespace {

constexpr int kMaxGroup = 32;      // query heads per KV head x query tokens per row
// query heads a pass over a part scores, their count known at compile time so that their
// queries and sums stay in registers: a (row, KV head)'s group takes passes of up to 5, its
// K/V rows read again from cache by each. Against one pass for the whole group, its count
// known at run time: 10-18% faster at 1 and 5 tokens a row (3 and 15 query heads a KV head;
// 8 and 32 rows over 300 and 800 tokens; 3 tried: as fast at 3, slower at 15; 6: between)
constexpr int kHeadsAPass = 5;
// At head_dim 256 (Gemma 3) a head's query and sums take 32 vectors: 2 heads a pass spill
// less than 4 and re-read each K/V row less often than 1 (Gemma 3 270M's 4 heads a KV
// head, bf16, alone: 1.14-2.5x the compiled formula over 512-2,000 tokens with 2, against
// 1.03-1.96x with 4 and 1.19-1.69x with 1)
template <int D>
constexpr int heads_a_pass() {
  return D > 128 ? 2 : kHeadsAPass;
}
constexpr int64_t kMinPart = 64;   // context tokens below which a part is not split further
constexpr int64_t kPartsPerThread = 4;
constexpr int64_t kKeyAhead = 64;  // tokens: how far ahead K rows are prefetched
constexpr int64_t kValueAhead = 32;

template <typename T>
inline void prefetch_row(const T* p, int n) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int b = 0; b < n * static_cast<int>(sizeof(T)); b += 64) _mm_prefetch(c + b, _MM_HINT_T0);
}

// A piece of work: context positions start..start+len-1 of one row, for one KV head.
struct Part {
  int64_t row, kv_head, start, len;
};

// One part for G of the query heads sharing its KV head: per head, the running maximum `m`,
// the sum of exp(score - m) `l` and the weighted sum of V `acc`, written to `out` as [m, l,
// acc].
template <typename T, int D, int G>
void attend_heads(const float* q,  // [G, D], already scaled
                  const T* k_head, const T* v_head, int64_t slot_stride,
                  const int64_t* slots, int64_t len, float* out) {  // [G, 2 + D]
  constexpr int group = G;
  constexpr int DV = D / kLanes;  // vectors a head's row takes
  Vec qv[G][DV];
  Vec acc[G][DV];
  Vec lv[G];  // the softmax's sums, lane by lane: one horizontal sum at the end, not a block
  float m[G];
  alignas(64) float s[G][kLanes];
  alignas(64) float dots[G][kLanes][kLanes];  // per query head and token: lanes to sum
  for (int g = 0; g < group; ++g) {
    // a short last block sums lanes of rows no token wrote: defined, then masked out
    std::fill(&dots[g][0][0], &dots[g][0][0] + kLanes * kLanes, 0.f);
    for (int i = 0; i < DV; ++i) {
      qv[g][i] = vload(q + g * D + i * kLanes);
      acc[g][i] = vzero();
    }
    lv[g] = vzero();
    m[g] = -std::numeric_limits<float>::infinity();
  }
  for (int64_t t0 = 0; t0 < len; t0 += kLanes) {
    const int n = static_cast<int>(std::min<int64_t>(kLanes, len - t0));
    for (int t = 0; t < n; ++t) {
      // memory latency, not arithmetic, bounds this loop over a pool larger than the
      // caches: fetch the keys kKeyAhead tokens ahead and the values kValueAhead
      if (t0 + t + kKeyAhead < len)
        prefetch_row(k_head + slots[t0 + t + kKeyAhead] * slot_stride, D);
      if (t0 + t + kValueAhead < len)
        prefetch_row(v_head + slots[t0 + t + kValueAhead] * slot_stride, D);
      const T* k = k_head + slots[t0 + t] * slot_stride;
      Vec kv[DV];
      for (int i = 0; i < DV; ++i) kv[i] = vload(k + i * kLanes);
      for (int g = 0; g < group; ++g) {
        Vec dot = vmul(qv[g][0], kv[0]);
        for (int i = 1; i < DV; ++i) dot = vfmadd(qv[g][i], kv[i], dot);
        vstore(dots[g][t], dot);
      }
    }
    constexpr float neg_inf = -std::numeric_limits<float>::infinity();
    for (int g = 0; g < group; ++g) {
      // a short last block's other lanes hold what earlier blocks left: masked out here
      const Vec sv = vfirst(sum_lanes(dots[g]), n, neg_inf);
      const float top = std::max(m[g], vmax(sv));
      if (top > m[g]) {  // rescale what came before; once the maximum settles, most blocks
        // skip this (alpha would be exp(0) = 1: the same sums, bit for bit)
        // alpha: 0 for the first block (m = -inf)
        const Vec a = vset1(std::exp(m[g] - top));
        m[g] = top;
        lv[g] = vmul(lv[g], a);
        for (int i = 0; i < DV; ++i) acc[g][i] = vmul(acc[g][i], a);
      }
      const Vec p = vfirst(vexp(vsub(sv, vset1(top))), n, 0.f);
      lv[g] = vadd(lv[g], p);
      vstore(s[g], p);
    }
    for (int t = 0; t < n; ++t) {
      const T* v = v_head + slots[t0 + t] * slot_stride;
      Vec vv[DV];
      for (int i = 0; i < DV; ++i) vv[i] = vload(v + i * kLanes);
      for (int g = 0; g < group; ++g) {
        const Vec w = vset1(s[g][t]);
        for (int i = 0; i < DV; ++i) acc[g][i] = vfmadd(w, vv[i], acc[g][i]);
      }
    }
  }
  for (int g = 0; g < group; ++g) {
    float* o = out + g * (2 + D);
    o[0] = m[g];
    o[1] = vsum(lv[g]);
    for (int i = 0; i < DV; ++i) vstore(o + 2 + i * kLanes, acc[g][i]);
  }
}

// One part for all `group` query heads sharing its KV head, heads_a_pass<D>() heads a pass
template <typename T, int D>
void attend_part(const float* q,  // [group, D], already scaled
                 int group, const T* k_head, const T* v_head, int64_t slot_stride,
                 const int64_t* slots, int64_t len, float* out) {  // [group, 2 + D]
  static_assert(kHeadsAPass == 5, "the cases below go up to 5");
  for (int g0 = 0; g0 < group;) {
    const int n = std::min(heads_a_pass<D>(), group - g0);
    const float* qg = q + g0 * D;
    float* og = out + g0 * (2 + D);
    switch (n) {
      case 1: attend_heads<T, D, 1>(qg, k_head, v_head, slot_stride, slots, len, og); break;
      case 2: attend_heads<T, D, 2>(qg, k_head, v_head, slot_stride, slots, len, og); break;
      case 3: attend_heads<T, D, 3>(qg, k_head, v_head, slot_stride, slots, len, og); break;
      case 4: attend_heads<T, D, 4>(qg, k_head, v_head, slot_stride, slots, len, og); break;
      default: attend_heads<T, D, 5>(qg, k_head, v_head, slot_stride, slots, len, og); break;
    }
    g0 += n;
  }
}

// A row's T query tokens (T = 1 for decode, k + 1 for a chain verify) attend over its
// context: all of them over the common part (context positions 0..common-1), then each
// causally over the T tail tokens (the row's own: token t sees tail tokens 0..t). A row may
// have fewer real tokens than T (rows padded to one width): its first `width` are computed,
// the padding's outputs are zeros, and no real token sees the padding (it comes after them).
struct Rows {
  int64_t batch, tokens;             // B rows of T query tokens each
  std::vector<int64_t> common;       // per row, the context all its tokens see
  std::vector<int64_t> width;        // per row, its real tokens (1..T), the first of its T
  bool tail_given;                   // the tail's K/V are new_key/new_value, not in the pool
};

template <typename T, int D>
void run(const at::Tensor& q,        // [B, KVH, T * G, D] float, scaled
         const at::Tensor& k_pool,   // [S, KVH, D] T
         const at::Tensor& v_pool,
         const at::Tensor& slots,    // [B, W] int64, contiguous
         const Rows& rows,
         const at::Tensor& new_key,  // [B * T, KVH, D] float, or empty (the tail is in the pool)
         const at::Tensor& new_value,
         at::Tensor& out) {          // [B * T, H, D] float
  constexpr int DV = D / kLanes;
  const int64_t batch = rows.batch, tokens = rows.tokens, kv_heads = k_pool.size(1);
  const int width_group = static_cast<int>(q.size(2));  // T * G query heads per KV head
  const int group = static_cast<int>(width_group / tokens);
  const int64_t heads = kv_heads * group;
  const int64_t width = slots.size(1);
  const int64_t slot_stride = k_pool.stride(0);
  const int64_t head_stride = k_pool.stride(1);
  TORCH_CHECK(slot_stride == v_pool.stride(0) && head_stride == v_pool.stride(1),
              "decode_attend: K and V pools must share a layout");

  int64_t total = 0;
  for (int64_t b = 0; b < batch; ++b) total += rows.common[b];
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t want = threads * kPartsPerThread;
  const int64_t part_len = std::max<int64_t>(kMinPart, (total * kv_heads + want - 1) / want);
  std::vector<Part> parts;
  std::vector<int64_t> first(batch * kv_heads + 1, 0);  // parts of (row, kv head) i
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t h = 0; h < kv_heads; ++h) {
      for (int64_t s = 0; s < rows.common[b]; s += part_len) {
        parts.push_back({b, h, s, std::min(part_len, rows.common[b] - s)});
      }
      first[b * kv_heads + h + 1] = static_cast<int64_t>(parts.size());
    }
  }
  const int64_t n_parts = static_cast<int64_t>(parts.size());
  const int64_t stride_part = width_group * (2 + D);
  std::vector<float> partial(static_cast<size_t>(std::max<int64_t>(n_parts, 1)) * stride_part);

  const float* qp = q.data_ptr<float>();
  const T* kp = k_pool.data_ptr<T>();
  const T* vp = v_pool.data_ptr<T>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  at::parallel_for(0, n_parts, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const Part& p = parts[i];
      // a row's real tokens' query heads come first in its group (token-major)
      const int real_group = static_cast<int>(rows.width[p.row] * group);
      attend_part<T, D>(qp + (p.row * kv_heads + p.kv_head) * width_group * D, real_group,
                         kp + p.kv_head * head_stride, vp + p.kv_head * head_stride,
                         slot_stride, sp + p.row * width + p.start, p.len,
                         partial.data() + i * stride_part);
    }
  });

  // merge each (row, KV head)'s parts with its tail, causally
  const float* nk = new_key.data_ptr<float>();
  const float* nv = new_value.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, batch * kv_heads, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t b = i / kv_heads, h = i % kv_heads;
      float tail_scores[kMaxGroup];
      for (int64_t t = rows.width[b]; t < tokens; ++t)  // padding: zeros
        for (int g = 0; g < group; ++g)
          std::fill_n(op + ((b * tokens + t) * heads + h * group + g) * D, D, 0.f);
      for (int64_t t = 0; t < rows.width[b]; ++t) {
        for (int g = 0; g < group; ++g) {
          const int idx = static_cast<int>(t * group + g);
          const float* qg = qp + ((b * kv_heads + h) * width_group + idx) * D;
          float top = -std::numeric_limits<float>::infinity();
          for (int64_t j = 0; j <= t; ++j) {  // the tail tokens this one sees
            Vec dot = vzero();
            if (rows.tail_given) {
              const float* k = nk + ((b * tokens + j) * kv_heads + h) * D;
              for (int d = 0; d < D; d += kLanes)
                dot = vfmadd(vload(qg + d), vload(k + d), dot);
            } else {
              const T* k =
                  kp + sp[b * width + rows.common[b] + j] * slot_stride + h * head_stride;
              for (int d = 0; d < D; d += kLanes)
                dot = vfmadd(vload(qg + d), vload(k + d), dot);
            }
            tail_scores[j] = vsum(dot);
            top = std::max(top, tail_scores[j]);
          }
          for (int64_t j = first[i]; j < first[i + 1]; ++j)
            top = std::max(top, partial[j * stride_part + idx * (2 + D)]);
          Vec sum[DV];
          for (int v = 0; v < DV; ++v) sum[v] = vzero();
          float total_w = 0.f;
          for (int64_t j = 0; j <= t; ++j) {
            const float w = std::exp(tail_scores[j] - top);
            total_w += w;
            const Vec wv = vset1(w);
            if (rows.tail_given) {
              const float* v = nv + ((b * tokens + j) * kv_heads + h) * D;
              for (int d = 0; d < DV; ++d)
                sum[d] = vfmadd(wv, vload(v + d * kLanes), sum[d]);
            } else {
              const T* v =
                  vp + sp[b * width + rows.common[b] + j] * slot_stride + h * head_stride;
              for (int d = 0; d < DV; ++d)
                sum[d] = vfmadd(wv, vload(v + d * kLanes), sum[d]);
            }
          }
          for (int64_t j = first[i]; j < first[i + 1]; ++j) {
            const float* pj = partial.data() + j * stride_part + idx * (2 + D);
            const float w = std::exp(pj[0] - top);
            total_w += pj[1] * w;
            const Vec wv = vset1(w);
            for (int d = 0; d < DV; ++d)
              sum[d] = vfmadd(wv, vload(pj + 2 + d * kLanes), sum[d]);
          }
          const Vec inv = vset1(1.f / total_w);
          float* o = op + ((b * tokens + t) * heads + h * group + g) * D;
          for (int d = 0; d < DV; ++d)
            vstore(o + d * kLanes, vmul(sum[d], inv));
        }
      }
    }
  });
}

template <typename T>
void dispatch_width(int64_t head_dim, const at::Tensor& q, const at::Tensor& k,
                    const at::Tensor& v, const at::Tensor& slots, const Rows& rows,
                    const at::Tensor& nk, const at::Tensor& nv, at::Tensor& out) {
  switch (head_dim) {
    case 16: return run<T, 16>(q, k, v, slots, rows, nk, nv, out);
    case 32: return run<T, 32>(q, k, v, slots, rows, nk, nv, out);
    case 64: return run<T, 64>(q, k, v, slots, rows, nk, nv, out);
    case 80: return run<T, 80>(q, k, v, slots, rows, nk, nv, out);
    case 96: return run<T, 96>(q, k, v, slots, rows, nk, nv, out);
    case 128: return run<T, 128>(q, k, v, slots, rows, nk, nv, out);
    case 256: return run<T, 256>(q, k, v, slots, rows, nk, nv, out);
    default: TORCH_CHECK(false, "decode_attend: head_dim ", head_dim, " is not supported");
  }
}

// query [B * T, H, D]: B rows (slots [B, W] int64, of which row b reads its first lens[b])
// of T query tokens each, consecutive; k_pool, v_pool [S, KVH, D] (any slot and head
// strides, D contiguous). new_key, new_value [B * T, KVH, D]: the rows' own new tokens, not
// in the pool yet, attended causally after the row's lens[b] context slots (lens >= 0); or
// empty: the rows' tokens are the last T of their contexts already (lens >= T). Token t of a
// row sees its context and its own tokens 0..t. widths [B] (int64, 1..T): how many of a row's
// T tokens are real, the rest padding after them (outputs zeros, not computed); empty: all
// T. Returns [B * T, H, D] in the query's dtype.
at::Tensor decode_attend(const at::Tensor& query, const at::Tensor& k_pool,
                         const at::Tensor& v_pool, const at::Tensor& slots,
                         const at::Tensor& lens, const at::Tensor& new_key,
                         const at::Tensor& new_value, double scale, const at::Tensor& widths) {
  TORCH_CHECK(query.dim() == 3 && k_pool.dim() == 3 && v_pool.dim() == 3,
              "decode_attend: query [B * T, H, D] and pools [S, KVH, D] expected");
  TORCH_CHECK(k_pool.scalar_type() == v_pool.scalar_type(), "decode_attend: K/V dtypes differ");
  TORCH_CHECK(k_pool.stride(2) == 1 && v_pool.stride(2) == 1,
              "decode_attend: the pools' last dimension must be contiguous");
  const int64_t heads = query.size(1), kv_heads = k_pool.size(1), head_dim = k_pool.size(2);
  TORCH_CHECK(query.size(2) == head_dim, "decode_attend: query and pool head_dim differ");
  TORCH_CHECK(slots.dim() == 2 && lens.numel() == slots.size(0) && slots.size(0) > 0 &&
                  query.size(0) % slots.size(0) == 0,
              "decode_attend: slots [B, W] and lens [B] expected, with B dividing the query's ",
              query.size(0), " rows");
  const int64_t batch = slots.size(0), tokens = query.size(0) / batch;
  TORCH_CHECK(heads % kv_heads == 0 && (heads / kv_heads) * tokens <= kMaxGroup,
              "decode_attend: query heads must be a multiple of KV heads, and (query heads per KV "
              "head) x (tokens per row) at most ", kMaxGroup);
  const int64_t group = heads / kv_heads;
  const at::Tensor q = (query.to(at::kFloat) * scale)
                           .view({batch, tokens, kv_heads, group, head_dim})
                           .permute({0, 2, 1, 3, 4})
                           .contiguous()
                           .view({batch, kv_heads, tokens * group, head_dim});
  const at::Tensor nk = new_key.to(at::kFloat).contiguous();
  const at::Tensor nv = new_value.to(at::kFloat).contiguous();
  const at::Tensor s = slots.to(at::kLong).contiguous();
  const at::Tensor l = lens.to(at::kLong).contiguous();
  Rows rows{batch, tokens, {}, {}, nk.numel() > 0};
  TORCH_CHECK(!rows.tail_given ||
                  (nk.sizes() == at::IntArrayRef({batch * tokens, kv_heads, head_dim}) &&
                   nv.sizes() == nk.sizes()),
              "decode_attend: new_key and new_value must be [B * T, KVH, D] or empty");
  TORCH_CHECK(widths.numel() == 0 || (widths.dim() == 1 && widths.size(0) == batch),
              "decode_attend: widths must be [B] or empty");
  const at::Tensor w = widths.to(at::kLong).contiguous();
  const int64_t pool_slots = std::min(k_pool.size(0), v_pool.size(0));
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t real = w.numel() ? w.data_ptr<int64_t>()[b] : tokens;
    TORCH_CHECK(real >= 1 && real <= tokens, "decode_attend: widths must lie in 1..", tokens,
                " (the tokens a row has), not ", real);
    rows.width.push_back(real);
    const int64_t n = l.data_ptr<int64_t>()[b], least = rows.tail_given ? 0 : real;
    TORCH_CHECK(n >= least && n <= s.size(1), "decode_attend: lens must lie in ", least,
                "..slots.size(1) (under the row's tokens only with its own new_key/new_value)");
    rows.common.push_back(rows.tail_given ? n : n - real);
    // the rows are read through these without further checks: a bad slot is an error here,
    // not a read outside the pool (~1 ns a slot)
    const int64_t* row = s.data_ptr<int64_t>() + b * s.size(1);
    for (int64_t j = 0; j < n; ++j)
      TORCH_CHECK(row[j] >= 0 && row[j] < pool_slots, "decode_attend: slot ", row[j],
                  " of row ", b, " is outside the pool's ", pool_slots, " slots");
  }
  at::Tensor out = at::empty({batch * tokens, heads, head_dim}, q.options());
  if (k_pool.scalar_type() == at::kBFloat16) {
    dispatch_width<c10::BFloat16>(head_dim, q, k_pool, v_pool, s, rows, nk, nv, out);
  } else {
    TORCH_CHECK(k_pool.scalar_type() == at::kFloat, "decode_attend: pools must be fp32 or bf16");
    dispatch_width<float>(head_dim, q, k_pool, v_pool, s, rows, nk, nv, out);
  }
  return out.to(query.scalar_type());
}

}  // namespace

extern "C" AOTI_TORCH_EXPORT AOTITorchError aoti_torch_cpu_decode_attend(
    AtenTensorHandle query, AtenTensorHandle k_pool, AtenTensorHandle v_pool,
    AtenTensorHandle slots, AtenTensorHandle lens, AtenTensorHandle new_key,
    AtenTensorHandle new_value, double scale, AtenTensorHandle widths, AtenTensorHandle* ret) {
  using torch::aot_inductor::resolve_tensor_dispatch_flags;
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    at::Tensor out = decode_attend(
        resolve_tensor_dispatch_flags(query), resolve_tensor_dispatch_flags(k_pool),
        resolve_tensor_dispatch_flags(v_pool), resolve_tensor_dispatch_flags(slots),
        resolve_tensor_dispatch_flags(lens), resolve_tensor_dispatch_flags(new_key),
        resolve_tensor_dispatch_flags(new_value), scale, resolve_tensor_dispatch_flags(widths));
    *ret = torch::aot_inductor::new_tensor_handle(std::move(out));
  });
}

TORCH_LIBRARY_FRAGMENT(sessionserve, m) {
  m.def(
      "decode_attend(Tensor query, Tensor k_pool, Tensor v_pool, Tensor slots, Tensor lens, "
      "Tensor new_key, Tensor new_value, float scale, Tensor widths) -> Tensor");
}

TORCH_LIBRARY_IMPL(sessionserve, CPU, m) { m.impl("decode_attend", &decode_attend); }
