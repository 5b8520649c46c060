// y = x @ W^T for a few rows of x against a GGUF's block-quantized weights (Q4_0, Q4_1, Q8_0),
// with the rows taken per block of 32 as two int8 terms, on x86 CPUs with AVX-512 VNNI.
//
// Why a hand-written kernel: torch's int4 weight-only GEMM (`_weight_int4pack_mm_for_cpu`)
// unpacks the weights again for every 4 rows of x and computes in floats, so past 4 rows it
// lost to the bf16 GEMMs (docs/benchmarks.md, stop 99), and torch has no GEMM for Q8_0's
// per-block scales (the LM head). Here every weight is unpacked once for all the rows, and one
// VNNI instruction (`vpdpbusd`) multiplies 64 weights by 64 activations.
//
// Arithmetic: a weight is w = u * d + m with u an unsigned integer (4 bits: 0..15, 8 bits:
// 0..255) and d, m per block of 32 weights of one output (Q4_1 as stored; Q4_0 m = -8 d;
// Q8_0 stores q in -128..127, kept as u = q + 128 with m = -128 d). A row's block of 32 values
// is quantized in two terms: a coarse one as ggml's Q8 does, dx = max|x| / 127, c = round(x /
// dx), and the residual on a grid 254 times finer, f = round((x - c dx) * 254 / dx) (both to
// nearest even), so x . w over the block = d * dx * (u . c + (u . f) / 254) + m * sum(x), with
// sum(x) the block's exact sum. ggml's one term cost SmolLM2 5 points of top-1 agreement with
// the file's exact weights; two hold a row about as finely as bf16 (docs/benchmarks.md, stop
// 100). Accumulation is in fp32.
//
// Layout (`block_linear.pack`): outputs in panels of 16; for each panel and block one record
// of 64 bytes of scales (d then m for the 16 outputs, fp16, as the file stores them) and the
// weights as 4 (4 bits) or 8 (8 bits) vectors of 64 bytes: byte 4 j + i of vector g holds
// output j's weight k = 4 g + i of the block (4 bits: vector t's low nibbles k = 4 t + i, its
// high nibbles k = 16 + 4 t + i), so one `vpdpbusd` with 4 activations broadcast adds 4
// products to each of the 16 outputs' sums.
//
// Built at run time by block_linear.py (g++ -mavx512f -mavx512vnni ...), loaded with
// torch.ops.load_library; AOTInductor packages call it through the C function at the end.

// the ATen headers this file uses, not <ATen/ATen.h> (every op's declarations: 1-4 s more of
// g++ a kernel on a first start, docs/benchmarks.md stop 116)
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/inductor/aoti_torch/utils.h>
#include <torch/library.h>

#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>

namespace {

constexpr int kBlock = 32;     // weights per scale, activations per int8 scale
constexpr int kPanel = 16;     // outputs a panel holds: one vector of int32 or fp32 sums
constexpr int kScaleBytes = 64;  // a record's d and m for its 16 outputs, fp16
constexpr int kMaxRows = 16;   // rows of x a pass keeps in registers (16 sums + 8 weights)
constexpr int kPrefetchAhead = 2048;  // bytes of records fetched ahead (6-7 blocks of 4 bits)

constexpr int record_bytes(int bits) { return kScaleBytes + kPanel * kBlock * bits / 8; }

// 16 values of x as fp32: fp32 as they are, bf16 widened (its bits are fp32's upper half)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// 16 sums stored as fp32, or rounded to bf16 (to nearest even, as torch rounds)
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(at::BFloat16* p, __m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
}

// x [M, K] -> per row and block: qx (int8: the block's coarse term, then its residual's), dx
// (the coarse term's scale; the residual's is dx / 254) and the exact sum of x.
template <typename T>
void quantize_rows(const T* x, int64_t M, int64_t K, int8_t* qx, float* dx, float* sx) {
  const int64_t blocks = K / kBlock;
  for (int64_t r = 0; r < M; ++r) {
    for (int64_t b = 0; b < blocks; ++b) {
      const T* xb = x + r * K + b * kBlock;
      int8_t* qb = qx + (r * blocks + b) * 2 * kBlock;
      const __m512 a0 = load16(xb), a1 = load16(xb + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a0), _mm512_abs_ps(a1)));
      const float scale = amax / 127.f;
      const __m512 inverse = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
      const __m512 fine = _mm512_set1_ps(amax > 0.f ? 254.f * 127.f / amax : 0.f);
      const __m512 step = _mm512_set1_ps(scale);
      // rounding: the default MXCSR mode, to nearest even
      const __m512i c0 = _mm512_cvtps_epi32(_mm512_mul_ps(a0, inverse));
      const __m512i c1 = _mm512_cvtps_epi32(_mm512_mul_ps(a1, inverse));
      // the residual, |x - c dx| <= dx / 2, on a grid 254 times finer
      const __m512 e0 = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(c0), step, a0);
      const __m512 e1 = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(c1), step, a1);
      const __m512i f0 = _mm512_cvtps_epi32(_mm512_mul_ps(e0, fine));
      const __m512i f1 = _mm512_cvtps_epi32(_mm512_mul_ps(e1, fine));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(qb), _mm512_cvtsepi32_epi8(c0));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(qb + 16), _mm512_cvtsepi32_epi8(c1));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(qb + 32), _mm512_cvtsepi32_epi8(f0));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(qb + 48), _mm512_cvtsepi32_epi8(f1));
      dx[r * blocks + b] = scale;
      sx[r * blocks + b] = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
    }
  }
}

inline __m512i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return _mm512_set1_epi32(v);
}

// R rows against one panel's records (all K / 32 blocks) -> y [R, 16] (row stride ldy).
template <int R, int BITS, typename T>
inline void panel_rows(const uint8_t* records, int64_t blocks, const int8_t* qx, const float* dx,
                       const float* sx, T* y, int64_t ldy) {
  __m512 acc[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0F);
  const __m512 kFineStep = _mm512_set1_ps(1.f / 254.f);
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* record = records + b * record_bytes(BITS);
    // fetch ahead what the coming blocks read (past a panel's end: the next panel's, which
    // this thread takes next; past the weight's: nothing, a prefetch never faults). The
    // hardware prefetcher alone ran behind: 1.06x at one row, 1.11-1.15x at 4-16
    // (docs/benchmarks.md, stop 100)
#pragma GCC unroll 9
    for (int line = 0; line < record_bytes(BITS); line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(record + kPrefetchAhead + line), _MM_HINT_T0);
    const __m256i* halves = reinterpret_cast<const __m256i*>(record);
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(halves));
    const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(halves + 1));
    const uint8_t* packed = record + kScaleBytes;
    __m512i w[8];
    if constexpr (BITS == 4) {
#pragma GCC unroll 4
      for (int t = 0; t < 4; ++t) {
        const __m512i v = _mm512_loadu_si512(packed + 64 * t);
        w[t] = _mm512_and_si512(v, low);
        w[t + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      }
    } else {
#pragma GCC unroll 8
      for (int g = 0; g < 8; ++g) w[g] = _mm512_loadu_si512(packed + 64 * g);
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const int8_t* xq = qx + (r * blocks + b) * 2 * kBlock;
      // the coarse and the residual terms' dots: two chains, the instruction's latency is
      // several cycles
      __m512i coarse = _mm512_setzero_si512(), fine = _mm512_setzero_si512();
#pragma GCC unroll 8
      for (int g = 0; g < 8; ++g) {
        coarse = _mm512_dpbusd_epi32(coarse, w[g], broadcast4(xq + 4 * g));
        fine = _mm512_dpbusd_epi32(fine, w[g], broadcast4(xq + kBlock + 4 * g));
      }
      const int64_t at = r * blocks + b;
      const __m512 step = _mm512_mul_ps(d, _mm512_set1_ps(dx[at]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(coarse), step, acc[r]);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(fine), _mm512_mul_ps(step, kFineStep), acc[r]);
      acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(sx[at]), acc[r]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) store16(y + r * ldy, acc[r]);
}

template <int R, int BITS, typename T>
void rows_upto(int rows, const uint8_t* records, int64_t blocks, const int8_t* qx,
               const float* dx, const float* sx, T* y, int64_t ldy) {
  if constexpr (R > 0) {
    if (rows == R) return panel_rows<R, BITS>(records, blocks, qx, dx, sx, y, ldy);
    rows_upto<R - 1, BITS>(rows, records, blocks, qx, dx, sx, y, ldy);
  }
}

// All M rows against panels begin..end-1, in passes of at most kMaxRows rows, as even as
// possible; a panel's records are in cache for its later passes.
template <int BITS, typename T>
void panel_range(const uint8_t* records, int64_t blocks, const int8_t* qx, const float* dx,
                 const float* sx, int64_t M, int64_t K, T* y, int64_t N, int64_t begin,
                 int64_t end) {
  const int64_t passes = (M + kMaxRows - 1) / kMaxRows;
  for (int64_t p = begin; p < end; ++p) {
    const uint8_t* panel = records + p * blocks * record_bytes(BITS);
    int64_t row = 0;
    for (int64_t pass = 0; pass < passes; ++pass) {
      const int rows = static_cast<int>((M - row + passes - pass - 1) / (passes - pass));
      rows_upto<kMaxRows, BITS>(rows, panel, blocks, qx + row * 2 * K, dx + row * blocks,
                                sx + row * blocks, y + row * N + p * kPanel, N);
      row += rows;
    }
  }
}

// ---- bf16 rows on AMX tiles ------------------------------------------------------------------
//
// Past some 10 rows the two int8 terms' arithmetic (16 `vpdpbusd` a row a record) outweighs
// what reading the weights costs. On CPUs with AMX a record's 512 weights are instead expanded
// once to bf16, w = u d + m rounded to nearest even as a bf16 copy of the file's weights would
// be, into one 16 x 64-byte tile in the pair layout `tdpbf16ps` takes (tile row p holds, for
// each of the 16 outputs, its weights k = 2 p and 2 p + 1 of the block), and one instruction
// multiplies it by 16 bf16 rows of x (tile row r: row r's 32 values of the block), summing in
// fp32 across all of K: the dense bf16 linear's arithmetic on the file's weights, with no
// per-row cost but the tile instruction's. Its cost is a near-fixed 7-8.5 ms over a decode
// step's linears up to 16 rows, ~2.5 ms of it the expansion over the records' stream
// (docs/benchmarks.md, stops 101-102). fp32 rows never take it (bf16 would not hold them).

constexpr int kTileRows = 16;    // rows of x a tile holds
constexpr int kTileGroups = 4;   // row tiles a pass sums into (tmm0-3; tmm4, 6 x; tmm5 weights)
constexpr int kTileBytes = 1024; // 16 rows x 64 bytes

// the fewest bf16 rows that take the tiles: expanding a record costs about what 8-12 rows of
// int8 terms do (all of a decode step's linears: 8 rows 0.89x, 12 rows 1.21x, 16 rows 1.57x;
// docs/benchmarks.md, stop 101). SESSIONSERVE_BLOCK_TILE_ROWS overrides it, 0 turns them off
constexpr int kTileMinRowsDefault = 10;

bool cpu_has_amx_bf16() {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  const bool tile = d & (1u << 24), bf16 = d & (1u << 22);  // AMX-TILE, AMX-BF16
  if (!tile || !bf16 || !__get_cpuid_count(7, 1, &a, &b, &c, &d)) return false;
  if (!(a & (1u << 5))) return false;  // AVX512-BF16: the expansion's conversion
  // Linux hands a process the tiles' 8 KiB of state only when asked (ARCH_REQ_XCOMP_PERM for
  // XFEATURE_XTILEDATA); asking again is harmless
  return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
}

bool amx_here() {
  static const bool here = cpu_has_amx_bf16();
  return here;
}

std::atomic<int>& tile_rows_setting() {
  static std::atomic<int> rows{[] {
    if (!amx_here()) return 0;
    const char* env = std::getenv("SESSIONSERVE_BLOCK_TILE_ROWS");
    return env != nullptr ? std::max(0, std::atoi(env)) : kTileMinRowsDefault;
  }()};
  return rows;
}

int tile_min_rows() { return tile_rows_setting().load(std::memory_order_relaxed); }

// benchmarks and tests compare the two paths on the same rows; without AMX it stays 0
int64_t set_tile_min_rows(int64_t rows) {
  TORCH_CHECK(rows >= 0, "block_linear: the fewest rows for the tiles is >= 0, got ", rows);
  tile_rows_setting().store(amx_here() ? static_cast<int>(rows) : 0);
  return tile_min_rows();
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// tiles 0-6, 16 rows of 64 bytes each. Kept in memory as a whole: GCC's `_tile_loadconfig`
// tells the compiler it reads 8 bytes, so the other stores to a local config could be dropped
const TileConfig kTileConfig = [] {
  TileConfig config;
  for (int t = 0; t < 7; ++t) {
    config.colsb[t] = 64;
    config.rows[t] = kTileRows;
  }
  return config;
}();

__attribute__((target("amx-tile"))) void configure_tiles() { _tile_loadconfig(&kTileConfig); }

__attribute__((target("amx-tile"))) void release_tiles() { _tile_release(); }

// one record -> its weights as bf16 in the tile's pair layout (`tile`, 1 KiB, 64-byte aligned).
// Source group s (4 bits: vector s's low nibbles for s < 4, vector s - 4's high ones after; 8
// bits: vector s) holds output j's weights k = 4 s + i at byte 4 j + i, i.e. tile rows 2 s and
// 2 s + 1: a shuffle within each 16 bytes puts bytes i = 0, 1 of its 4 outputs before i = 2,
// 3, and a permute of the 8-byte halves makes the first 32 bytes row 2 s and the rest row
// 2 s + 1, each ordered (output 0: k, k + 1), (output 1: ...), as the tile takes them.
template <int BITS>
__attribute__((target("avx512bf16,avx512bw,avx512f"))) inline void expand_record(
    const uint8_t* record, uint8_t* tile) {
  const __m256i* halves = reinterpret_cast<const __m256i*>(record);
  const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(halves));
  const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(halves + 1));
  // element e of a 16-wide quarter is output 8 h + e / 2 (h: the quarter's half of a row)
  const __m512i first = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(8));
  const __m512 d0 = _mm512_permutexvar_ps(first, d), d1 = _mm512_permutexvar_ps(second, d);
  const __m512 m0 = _mm512_permutexvar_ps(first, m), m1 = _mm512_permutexvar_ps(second, m);
  const __m512i pairs = _mm512_broadcast_i32x4(
      _mm_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15));
  const __m512i halves_order = _mm512_setr_epi64(0, 2, 4, 6, 1, 3, 5, 7);
  const __m512i low = _mm512_set1_epi8(0x0F);
  const uint8_t* packed = record + kScaleBytes;
#pragma GCC unroll 8
  for (int s = 0; s < 8; ++s) {
    __m512i u;
    if constexpr (BITS == 4) {
      const __m512i v = _mm512_loadu_si512(packed + 64 * (s % 4));
      u = s < 4 ? _mm512_and_si512(v, low) : _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
    } else {
      u = _mm512_loadu_si512(packed + 64 * s);
    }
    u = _mm512_permutexvar_epi64(halves_order, _mm512_shuffle_epi8(u, pairs));
    __m512 w[4];
#pragma GCC unroll 4
    for (int q = 0; q < 4; ++q) {
      const __m512 uq = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(u, q)));
      w[q] = _mm512_fmadd_ps(uq, q % 2 ? d1 : d0, q % 2 ? m1 : m0);
    }
    // cvtne2ps puts its second operand in the low half; bf16 rounding to nearest even
    _mm512_store_si512(tile + 128 * s, (__m512i)_mm512_cvtne2ps_pbh(w[1], w[0]));
    _mm512_store_si512(tile + 128 * s + 64, (__m512i)_mm512_cvtne2ps_pbh(w[3], w[2]));
  }
}

// G row tiles (`tiles_of_x[g]`: 16 bf16 rows of stride K each) against one panel ->
// y [rows, 16]
template <int G, int BITS, typename T>
__attribute__((target("amx-tile,amx-bf16,avx512bf16,avx512bw,avx512f"))) void panel_tiles(
    const uint8_t* records, int64_t blocks, const at::BFloat16* const* tiles_of_x, int64_t K,
    int rows, T* y, int64_t ldy) {
  alignas(64) uint8_t tiles[2][kTileBytes];
  alignas(64) float sums[kTileRows * kPanel];
  _tile_zero(0);
  if constexpr (G > 1) _tile_zero(1);
  if constexpr (G > 2) _tile_zero(2);
  if constexpr (G > 3) _tile_zero(3);
  const int64_t stride = K * static_cast<int64_t>(sizeof(at::BFloat16));
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* record = records + b * record_bytes(BITS);
#pragma GCC unroll 9
    for (int line = 0; line < record_bytes(BITS); line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(record + kPrefetchAhead + line), _MM_HINT_T0);
    uint8_t* tile = tiles[b % 2];  // two buffers: expanding the next does not wait on this one
    expand_record<BITS>(record, tile);
    _tile_loadd(5, tile, 64);
    const int64_t k0 = b * kBlock;  // the block's first column
    _tile_loadd(4, tiles_of_x[0] + k0, stride);
    _tile_dpbf16ps(0, 4, 5);
    if constexpr (G > 1) {  // rows in tmm4 and tmm6 by turns: a load need not wait for the
      // previous product to have read its tile
      _tile_loadd(6, tiles_of_x[1] + k0, stride);
      _tile_dpbf16ps(1, 6, 5);
    }
    if constexpr (G > 2) {
      _tile_loadd(4, tiles_of_x[2] + k0, stride);
      _tile_dpbf16ps(2, 4, 5);
    }
    if constexpr (G > 3) {
      _tile_loadd(6, tiles_of_x[3] + k0, stride);
      _tile_dpbf16ps(3, 6, 5);
    }
  }
  for (int g = 0; g < G; ++g) {  // GCC's tile intrinsics take register numbers as literals
    if (g == 0) _tile_stored(0, sums, 64);
    if constexpr (G > 1) if (g == 1) _tile_stored(1, sums, 64);
    if constexpr (G > 2) if (g == 2) _tile_stored(2, sums, 64);
    if constexpr (G > 3) if (g == 3) _tile_stored(3, sums, 64);
    const int valid = std::min(kTileRows, rows - g * kTileRows);
    for (int r = 0; r < valid; ++r)
      store16(y + (g * kTileRows + r) * ldy, _mm512_load_ps(sums + r * kPanel));
  }
}

template <int BITS, typename T>
void tile_range(const uint8_t* records, int64_t blocks, const at::BFloat16* const* tiles_of_x,
                int64_t M, int64_t K, T* y, int64_t N, int64_t begin, int64_t end) {
  configure_tiles();
  for (int64_t p = begin; p < end; ++p) {
    const uint8_t* panel = records + p * blocks * record_bytes(BITS);
    for (int64_t row = 0; row < M; row += kTileRows * kTileGroups) {
      const int rows = static_cast<int>(std::min<int64_t>(M - row, kTileRows * kTileGroups));
      const at::BFloat16* const* xr = tiles_of_x + row / kTileRows;
      T* yr = y + row * N + p * kPanel;
      switch ((rows + kTileRows - 1) / kTileRows) {
        case 1: panel_tiles<1, BITS>(panel, blocks, xr, K, rows, yr, N); break;
        case 2: panel_tiles<2, BITS>(panel, blocks, xr, K, rows, yr, N); break;
        case 3: panel_tiles<3, BITS>(panel, blocks, xr, K, rows, yr, N); break;
        default: panel_tiles<4, BITS>(panel, blocks, xr, K, rows, yr, N); break;
      }
    }
  }
  release_tiles();
}

void run_tiles(const at::Tensor& rows, const at::Tensor& records, int64_t bits, at::Tensor& y) {
  const int64_t M = rows.size(0), K = rows.size(1), blocks = records.size(1);
  const int64_t N = y.size(1);
  // where each row tile's 16 rows start: in x itself, but for a last tile of fewer than 16
  // rows (a tile load reads 16), copied with zeros after them. Per calling thread, kept
  // between calls (before, every row was copied on every call)
  static thread_local std::vector<at::BFloat16> tail;
  static thread_local std::vector<const at::BFloat16*> tiles_of_x;
  const at::BFloat16* x = rows.data_ptr<at::BFloat16>();
  const int64_t whole = M / kTileRows, left = M % kTileRows;
  tiles_of_x.resize(whole + (left > 0));
  for (int64_t g = 0; g < whole; ++g) tiles_of_x[g] = x + g * kTileRows * K;
  if (left > 0) {
    tail.assign(kTileRows * K, at::BFloat16(0.f));
    std::memcpy(tail.data(), x + whole * kTileRows * K, left * K * sizeof(at::BFloat16));
    tiles_of_x[whole] = tail.data();
  }
  const uint8_t* rp = records.data_ptr<uint8_t>();
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();
  const at::BFloat16* const* xs = tiles_of_x.data();
  at::parallel_for(0, records.size(0), 1, [&](int64_t begin, int64_t end) {
    if (bits == 4)
      tile_range<4>(rp, blocks, xs, M, K, yp, N, begin, end);
    else
      tile_range<8>(rp, blocks, xs, M, K, yp, N, begin, end);
  });
}

template <typename T>
void run(const at::Tensor& rows, const at::Tensor& records, int64_t bits, at::Tensor& y) {
  const int64_t M = rows.size(0), K = rows.size(1), blocks = records.size(1);
  const int64_t N = y.size(1);
  // the rows' int8 terms and scales: per calling thread, kept between calls (no allocation
  // on a step's ~200 calls)
  static thread_local std::vector<int8_t> qx;
  static thread_local std::vector<float> scales;
  qx.resize(M * 2 * K);
  scales.resize(2 * M * blocks);
  float* dx = scales.data();
  float* sx = dx + M * blocks;
  quantize_rows(rows.data_ptr<T>(), M, K, qx.data(), dx, sx);
  const uint8_t* rp = records.data_ptr<uint8_t>();
  T* yp = y.data_ptr<T>();
  const int8_t* q = qx.data();
  at::parallel_for(0, records.size(0), 1, [&](int64_t begin, int64_t end) {
    if (bits == 4)
      panel_range<4>(rp, blocks, q, dx, sx, M, K, yp, N, begin, end);
    else
      panel_range<8>(rp, blocks, q, dx, sx, M, K, yp, N, begin, end);
  });
}

at::Tensor block_linear(const at::Tensor& x, const at::Tensor& records, int64_t bits) {
  TORCH_CHECK(bits == 4 || bits == 8, "block_linear: 4 or 8 bits, got ", bits);
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "block_linear: fp32 or bf16 rows, got ", x.scalar_type());
  const int64_t bytes = record_bytes(static_cast<int>(bits));
  TORCH_CHECK(records.scalar_type() == at::kByte && records.dim() == 3 &&
                  records.size(2) == bytes && records.is_contiguous(),
              "block_linear: the weight must be packed by block_linear.pack as [panels, blocks, ",
              bytes, "] uint8, got ", records.sizes(), " ", records.scalar_type());
  const int64_t K = x.size(-1), blocks = records.size(1);
  TORCH_CHECK(K == blocks * kBlock, "block_linear: x has ", K, " features, the weight ",
              blocks * kBlock);
  const int64_t N = records.size(0) * kPanel;
  const at::Tensor rows = x.reshape({-1, K}).contiguous();
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = N;
  at::Tensor y = at::empty({rows.size(0), N}, x.options());
  if (rows.size(0) > 0) {
    const int tiles_from = tile_min_rows();
    if (x.scalar_type() == at::kBFloat16 && tiles_from > 0 && rows.size(0) >= tiles_from)
      run_tiles(rows, records, bits, y);
    else if (x.scalar_type() == at::kFloat)
      run<float>(rows, records, bits, y);
    else
      run<at::BFloat16>(rows, records, bits, y);
  }
  return y.view(sizes);
}

}  // namespace

extern "C" AOTI_TORCH_EXPORT AOTITorchError aoti_torch_cpu_block_linear(AtenTensorHandle x,
                                                                       AtenTensorHandle records,
                                                                       int64_t bits,
                                                                       AtenTensorHandle* ret) {
  using torch::aot_inductor::resolve_tensor_dispatch_flags;
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    at::Tensor out = block_linear(resolve_tensor_dispatch_flags(x),
                                  resolve_tensor_dispatch_flags(records), bits);
    *ret = torch::aot_inductor::new_tensor_handle(std::move(out));
  });
}

TORCH_LIBRARY_FRAGMENT(sessionserve, m) {
  m.def("block_linear(Tensor x, Tensor records, int bits) -> Tensor");
  // the fewest bf16 rows the op takes on AMX tiles; 0: never (no AMX here, or turned off)
  m.def("block_linear_tile_rows() -> int", []() -> int64_t { return tile_min_rows(); });
  m.def("block_linear_set_tile_rows(int rows) -> int", &set_tile_min_rows);
}

TORCH_LIBRARY_IMPL(sessionserve, CPU, m) { m.impl("block_linear", &block_linear); }
