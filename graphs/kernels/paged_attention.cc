// The CPU paged attention of --use-experimental-kernels (graphs/cpu_attention.py): causal
// attention of each token over its row's KV pages, with GQA, a sliding window and softcapping.
//   q [T, H, hd] float32; k_pool, v_pool [L, N, KV, page, hd] float32, bfloat16 or float16;
//   page_table [R, P]; token_row [T] (-1: padding, output zeros, reads nothing); positions [T].
// A work item is (up to kTileTokens consecutive tokens of one row, one KV head): its
// tokens x G query heads share every K/V page load. Scores are dot products over hd (keys in
// the page), the softmax is online over pages in float32, P x V broadcasts each probability
// over a row of V. Large calls spread their items over helper threads (workers.h).
// One source, two instruction sets, picked at build time (graphs/cpu_kernels.py):
// -DMAXJAX_ISA=avx512 (AVX-512F, 16 float lanes, mask registers) or avx2 (AVX2 + FMA + F16C,
// 8 lanes, vector masks); struct V holds the vector ops, and the exported symbols carry the
// suffix (maxjax_paged_attention_avx2, ...), so both libraries load in one process.
#include <immintrin.h>
#include <sys/mman.h>
#include <unistd.h>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <thread>
#include <vector>
#include "workers.h"
#include "xla/ffi/api/ffi.h"
namespace ffi = xla::ffi;

#ifndef MAXJAX_ISA
#error "build with -DMAXJAX_ISA=avx512 or -DMAXJAX_ISA=avx2 (graphs/cpu_kernels.py)"
#endif
#define MAXJAX_PASTE(name, isa) name##_##isa
#define MAXJAX_NAMED(name, isa) MAXJAX_PASTE(name, isa)
#define MAXJAX_SYMBOL(name) MAXJAX_NAMED(name, MAXJAX_ISA)   // maxjax_write_kv_avx2, ...

namespace {

constexpr int kTileTokens = 16;
// Below this many multiply-adds a call stays on the calling thread (tools/bench_attention.py).
constexpr int64_t kThreadedWork = int64_t(1) << 20;

#if defined(__AVX512F__)
struct V {             // AVX-512F: 16 float lanes
  static constexpr int W = 16, kRegs = 32;
  using F = __m512;
  using M = __mmask16;
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static F load_bf16(const uint16_t* p) {
    __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  }
  static F load_f16(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
  static void store_f16(uint16_t* p, const float* x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        _mm512_cvtps_ph(_mm512_loadu_ps(x), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  static F zero() { return _mm512_setzero_ps(); }
  static F set1(float x) { return _mm512_set1_ps(x); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F max(F a, F b) { return _mm512_max_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F fnmadd(F a, F b, F c) { return _mm512_fnmadd_ps(a, b, c); }
  static F round(F a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static F scale2(F p, F n) { return _mm512_scalef_ps(p, n); }       // p * 2^n, n integral
  static float reduce_add(F a) { return _mm512_reduce_add_ps(a); }
  static float reduce_max(F a) { return _mm512_reduce_max_ps(a); }
  static M lanes(int64_t lo, int64_t hi, int64_t j) {    // lanes j + i with lo <= j + i < hi
    uint32_t below = hi - j >= 16 ? 0xFFFFu : hi - j <= 0 ? 0u : (1u << (hi - j)) - 1;
    uint32_t skip = lo - j <= 0 ? 0u : lo - j >= 16 ? 0xFFFFu : (1u << (lo - j)) - 1;
    return M(below & ~skip);
  }
  static F load_or(F fill, M m, const float* p) { return _mm512_mask_loadu_ps(fill, m, p); }
  static F keep(M m, F a) { return _mm512_maskz_mov_ps(m, a); }      // 0 outside m
  static void store(float* p, M m, F a) { _mm512_mask_storeu_ps(p, m, a); }
  // lane i: the sum of v[i]'s 16 lanes (pairs, then quads, then 128-bit lanes added up)
  static F sums(const F v[16]) {
    __m512 t[8], u[4];
    for (int k = 0; k < 8; ++k)
      t[k] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]),
                           _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]));
    for (int k = 0; k < 4; ++k) {
      __m512d c = _mm512_castps_pd(t[2 * k]), d = _mm512_castps_pd(t[2 * k + 1]);
      u[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(c, d)),
                           _mm512_castpd_ps(_mm512_unpackhi_pd(c, d)));
    }
    __m512 x0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(2, 0, 2, 0)),
                              _mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(3, 1, 3, 1)));
    __m512 x1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(2, 0, 2, 0)),
                              _mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(x0, x1, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(x0, x1, _MM_SHUFFLE(3, 1, 3, 1)));
  }
};
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
struct V {             // AVX2 + FMA + F16C: 8 float lanes, masks as all-ones lanes
  static constexpr int W = 8, kRegs = 16;
  using F = __m256;
  using M = __m256;
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static F load_bf16(const uint16_t* p) {
    __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  }
  static F load_f16(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
  static void store_f16(uint16_t* p, const float* x) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                     _mm256_cvtps_ph(_mm256_loadu_ps(x), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  static F zero() { return _mm256_setzero_ps(); }
  static F set1(float x) { return _mm256_set1_ps(x); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F max(F a, F b) { return _mm256_max_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F fnmadd(F a, F b, F c) { return _mm256_fnmadd_ps(a, b, c); }
  static F round(F a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static F scale2(F p, F n) {   // p * 2^n for integral -126 <= n <= 127 (others: lanes masked off)
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
  }
  static float reduce_add(F a) {
    __m128 t = _mm_add_ps(_mm256_extractf128_ps(a, 1), _mm256_castps256_ps128(a));
    t = _mm_add_ps(t, _mm_movehl_ps(t, t));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
  }
  static float reduce_max(F a) {
    __m128 t = _mm_max_ps(_mm256_extractf128_ps(a, 1), _mm256_castps256_ps128(a));
    t = _mm_max_ps(t, _mm_movehl_ps(t, t));
    return _mm_cvtss_f32(_mm_max_ss(t, _mm_movehdup_ps(t)));
  }
  static M lanes(int64_t lo, int64_t hi, int64_t j) {    // lanes j + i with lo <= j + i < hi
    __m256i i = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256i from = _mm256_set1_epi32(int32_t(std::clamp<int64_t>(lo - j, -1, 8)));
    __m256i to = _mm256_set1_epi32(int32_t(std::clamp<int64_t>(hi - j, -1, 8)));
    return _mm256_castsi256_ps(_mm256_andnot_si256(_mm256_cmpgt_epi32(from, i),
                                                   _mm256_cmpgt_epi32(to, i)));
  }
  static F load_or(F fill, M m, const float* p) {     // masked lanes are not read
    return _mm256_blendv_ps(fill, _mm256_maskload_ps(p, _mm256_castps_si256(m)), m);
  }
  static F keep(M m, F a) { return _mm256_and_ps(m, a); }            // 0 outside m
  static void store(float* p, M m, F a) { _mm256_maskstore_ps(p, _mm256_castps_si256(m), a); }
  // lane i: the sum of v[i]'s 8 lanes (pairs, then quads, then the 128-bit halves added up)
  static F sums(const F v[8]) {
    __m256 t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
    __m256 t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
    __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
  }
};
#else
#error "needs AVX-512F or AVX2 + FMA + F16C (graphs/cpu_kernels.py's build flags)"
#endif
using F = V::F;

struct F32 {
  using T = float;
  static F load(const float* p) { return V::load(p); }
};
struct BF16 {
  using T = uint16_t;
  static F load(const uint16_t* p) { return V::load_bf16(p); }
};
struct F16 {
  using T = uint16_t;
  static F load(const uint16_t* p) { return V::load_f16(p); }
};

// exp(x) for x <= 0: 2^n exp(r), r = x - n ln2 (Cody-Waite), exp(r) by its degree-7 Taylor
// polynomial (|r| <= ln2 / 2: relative error < 1e-7).
inline F vexp(F x) {
  x = V::max(x, V::set1(-87.0f));
  F n = V::round(V::mul(x, V::set1(1.44269504088896341f)));
  F r = V::fnmadd(n, V::set1(0.693145751953125f), x);
  r = V::fnmadd(n, V::set1(1.42860682030941723212e-6f), r);
  F p = V::set1(1.0f / 5040);
  p = V::fmadd(p, r, V::set1(1.0f / 720));
  p = V::fmadd(p, r, V::set1(1.0f / 120));
  p = V::fmadd(p, r, V::set1(1.0f / 24));
  p = V::fmadd(p, r, V::set1(1.0f / 6));
  p = V::fmadd(p, r, V::set1(0.5f));
  p = V::fmadd(p, r, V::set1(1.0f));
  p = V::fmadd(p, r, V::set1(1.0f));
  return V::scale2(p, n);
}

struct Item { int64_t t0, nt, kvh; };

struct Call {
  const float* q; const void* k; const void* v; const int32_t* page_table;
  const int32_t* token_row; const int32_t* pos; float* out;
  int64_t T, H, KV, hd, N, page, R, P, layer, window;
  float scale, softcap;
  std::vector<Item> items;
  int64_t scratch_floats() const {
    int64_t M = kTileTokens * (H / KV);
    return 2 * M * hd + M * page + 2 * M + 16;
  }
};

// One work item: M = nt x G queries against the row's visible pages of KV head `kvh`.
template <class E, int HD>
void attend_item(const Call& c, const Item& it, float* scratch) {
  using T = typename E::T;
  constexpr int hd = HD, W = V::W, HV = hd / W;               // HV vectors a head row
  constexpr int MB = std::max(1, std::min(8, 3 * V::kRegs / 4 / HV));   // P x V rows in registers
  const int64_t G = c.H / c.KV, M = it.nt * G, page = c.page;
  float* qs = scratch;              // [M, hd] scaled queries
  float* acc = qs + M * hd;         // [M, hd]
  float* s = acc + M * hd;          // [M, page] scores, then probabilities
  float* mx = s + M * page;         // [M] running max
  float* l = mx + M;                // [M] running sum
  int64_t lo_pos = std::numeric_limits<int64_t>::max(), hi_pos = -1;
  for (int64_t i = 0; i < it.nt; ++i) {
    int64_t p = c.pos[it.t0 + i];
    lo_pos = std::min(lo_pos, p);
    hi_pos = std::max(hi_pos, p);
    const float* src = c.q + ((it.t0 + i) * c.H + it.kvh * G) * hd;
    for (int64_t x = 0; x < G * hd; ++x) qs[i * G * hd + x] = src[x] * c.scale;
  }
  std::fill(acc, acc + M * hd, 0.0f);
  std::fill(l, l + M, 0.0f);
  std::fill(mx, mx + M, -std::numeric_limits<float>::infinity());
  const int64_t row = c.token_row[it.t0];
  const int32_t* pages = c.page_table + row * c.P;
  int64_t first = c.window ? std::max<int64_t>(0, lo_pos - c.window + 1) / page : 0;
  int64_t last = std::min(hi_pos / page, c.P - 1);
  const T* kbase = static_cast<const T*>(c.k);
  const T* vbase = static_cast<const T*>(c.v);
  const F neg_inf = V::set1(-std::numeric_limits<float>::infinity());
  for (int64_t pi = first; pi <= last; ++pi) {
    int64_t pg = pages[pi];
    if (pg < 0 || pg >= c.N) continue;
    const int64_t k0 = pi * page, nk = std::min(page, hi_pos - k0 + 1);
    const int64_t off = ((c.layer * c.N + pg) * c.KV + it.kvh) * page * hd;
    const T* kp = kbase + off;
    const T* vp = vbase + off;
    // A page is a few KB at another address: prefetch this page's V and the next page's K
    // while the scores are computed (the hardware prefetcher stops at each 4 KB boundary).
    const int64_t pn = pi < last ? pages[pi + 1] : -1;
    const T* kn = pn >= 0 && pn < c.N ? kbase + ((c.layer * c.N + pn) * c.KV + it.kvh) * page * hd
                                     : nullptr;
    for (int64_t j = 0; j < nk; ++j)
      for (int64_t b = 0; b < hd * int64_t(sizeof(T)); b += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(vp + j * hd) + b, _MM_HINT_T0);
        if (kn) _mm_prefetch(reinterpret_cast<const char*>(kn + j * hd) + b, _MM_HINT_T0);
      }
    for (int64_t j0 = 0; j0 < nk; j0 += W) {      // W keys' scores at once, per query
      const int64_t nw = std::min<int64_t>(W, nk - j0);
      for (int64_t m = 0; m < M; ++m) {
        F q[HV], d[W];
        for (int v = 0; v < HV; ++v) q[v] = V::load(qs + m * hd + W * v);
        for (int jj = 0; jj < W; ++jj) {
          d[jj] = V::zero();
          if (jj < nw)
            for (int v = 0; v < HV; ++v)
              d[jj] = V::fmadd(q[v], E::load(kp + (j0 + jj) * hd + W * v), d[jj]);
        }
        V::store(s + m * page + j0, V::lanes(0, nw, 0), V::sums(d));
      }
    }
    for (int64_t m = 0; m < M; ++m) {
      float* sr = s + m * page;
      const int64_t qp = c.pos[it.t0 + m / G];
      const int64_t hi = std::min(nk, qp - k0 + 1);
      const int64_t lo = c.window ? std::max<int64_t>(0, qp - c.window + 1 - k0) : 0;
      if (hi <= lo) {                // no key of this page is visible to this query
        std::fill(sr, sr + nk, 0.0f);
        continue;
      }
      if (c.softcap > 0)
        for (int64_t j = lo; j < hi; ++j) sr[j] = c.softcap * std::tanh(sr[j] / c.softcap);
      F vmax = neg_inf;
      for (int64_t j = 0; j < nk; j += W)
        vmax = V::max(vmax, V::load_or(neg_inf, V::lanes(lo, hi, j), sr + j));
      const float m_new = std::max(mx[m], V::reduce_max(vmax));
      const float corr = std::exp(mx[m] - m_new);
      const F mv = V::set1(m_new);
      F sum = V::zero();
      for (int64_t j = 0; j < nk; j += W) {
        const V::M keep = V::lanes(lo, hi, j);
        const F p = V::keep(keep, vexp(V::sub(V::load_or(V::zero(), keep, sr + j), mv)));
        sum = V::add(sum, p);
        V::store(sr + j, V::lanes(0, nk, j), p);
      }
      l[m] = l[m] * corr + V::reduce_add(sum);
      mx[m] = m_new;
      if (corr != 1.0f) {
        const F cv = V::set1(corr);
        for (float* a = acc + m * hd; a < acc + (m + 1) * hd; a += W)
          V::store(a, V::mul(V::load(a), cv));
      }
    }
    for (int64_t m0 = 0; m0 < M; m0 += MB) {
      const int64_t mb = std::min<int64_t>(MB, M - m0);
      F a[MB][HV];
      for (int b = 0; b < MB; ++b)
        if (b < mb)
          for (int v = 0; v < HV; ++v) a[b][v] = V::load(acc + (m0 + b) * hd + W * v);
      for (int64_t j = 0; j < nk; ++j) {
        F vv[HV];
        for (int v = 0; v < HV; ++v) vv[v] = E::load(vp + j * hd + W * v);
        for (int b = 0; b < MB; ++b) {
          if (b >= mb) break;
          const F p = V::set1(s[(m0 + b) * page + j]);
          for (int v = 0; v < HV; ++v) a[b][v] = V::fmadd(p, vv[v], a[b][v]);
        }
      }
      for (int b = 0; b < MB; ++b)
        if (b < mb)
          for (int v = 0; v < HV; ++v) V::store(acc + (m0 + b) * hd + W * v, a[b][v]);
    }
  }
  for (int64_t m = 0; m < M; ++m) {
    const float inv = l[m] > 0 ? 1.0f / l[m] : 0.0f;      // no visible key: zeros
    float* dst = c.out + ((it.t0 + m / G) * c.H + it.kvh * G + m % G) * hd;
    for (int64_t d = 0; d < hd; ++d) dst[d] = acc[m * hd + d] * inv;
  }
}

using ItemFn = void (*)(const Call&, const Item&, float*);

template <class E>
ItemFn item_fn(int64_t hd) {
  switch (hd) {      // graphs/cpu_attention.py HEAD_DIMS
    case 16: return attend_item<E, 16>;
    case 32: return attend_item<E, 32>;
    case 64: return attend_item<E, 64>;
    case 96: return attend_item<E, 96>;
    case 128: return attend_item<E, 128>;
    case 256: return attend_item<E, 256>;
    default: return nullptr;
  }
}

// Shared by the caller and the pool's tasks; a task that starts after every item is claimed
// (or never starts) touches nothing but this.
struct Work : Job {
  Call call;
  ItemFn fn;
  std::atomic<int64_t> next{0};
  void work() override {
    std::vector<float> scratch;
    const int64_t n = static_cast<int64_t>(call.items.size());
    for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < n;) {
      if (scratch.empty()) scratch.resize(call.scratch_floats());
      fn(call, call.items[i], scratch.data());
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

ffi::Error PagedAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k,
                          ffi::AnyBuffer v, ffi::Buffer<ffi::S32> page_table,
                          ffi::Buffer<ffi::S32> token_row, ffi::Buffer<ffi::S32> positions,
                          int64_t layer, int64_t window, float scale, float softcap,
                          ffi::ResultBuffer<ffi::F32> out) {
  auto qd = q.dimensions(), kd = k.dimensions(), pd = page_table.dimensions();
  if (qd.size() != 3 || kd.size() != 5 || pd.size() != 2)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "paged attention: ranks");
  auto work = std::make_shared<Work>();
  Call& c = work->call;
  c.T = qd[0]; c.H = qd[1]; c.hd = qd[2];
  c.N = kd[1]; c.KV = kd[2]; c.page = kd[3]; c.R = pd[0]; c.P = pd[1];
  c.layer = layer; c.window = window; c.scale = scale; c.softcap = softcap;
  if (kd[4] != c.hd || c.H % c.KV || layer < 0 || layer >= kd[0] ||
      k.element_type() != v.element_type())
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "paged attention: shapes");
  switch (k.element_type()) {
    case ffi::DataType::F32: work->fn = item_fn<F32>(c.hd); break;
    case ffi::DataType::BF16: work->fn = item_fn<BF16>(c.hd); break;
    case ffi::DataType::F16: work->fn = item_fn<F16>(c.hd); break;
    default: work->fn = nullptr;
  }
  if (work->fn == nullptr)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "paged attention: pool dtype or head_dim");
  c.q = q.typed_data(); c.k = k.untyped_data(); c.v = v.untyped_data();
  c.page_table = page_table.typed_data(); c.token_row = token_row.typed_data();
  c.pos = positions.typed_data(); c.out = out->typed_data();
  int64_t macs = 0;
  for (int64_t t = 0; t < c.T;) {
    const int64_t row = c.token_row[t];
    if (row < 0 || row >= c.R) {       // padding: zeros
      std::fill(c.out + t * c.H * c.hd, c.out + (t + 1) * c.H * c.hd, 0.0f);
      ++t;
      continue;
    }
    int64_t nt = 1;
    while (nt < kTileTokens && t + nt < c.T && c.token_row[t + nt] == row) ++nt;
    const int64_t keys = c.pos[t + nt - 1] + 1;
    for (int64_t h = 0; h < c.KV; ++h) c.items.push_back({t, nt, h});
    macs += 2 * keys * nt * c.H * c.hd;
    t += nt;
  }
  const int64_t n = static_cast<int64_t>(c.items.size());
  const int64_t tasks =
      macs >= kThreadedWork ? std::min(pool.num_threads() - 1, n - 1) : 0;
  work->total = n;
  run_shared(pool, work, tasks, 0);
  return ffi::Error::Success();
}

inline uint16_t to_bf16(float x) {     // round to nearest even, as XLA's convert
  uint32_t b;
  std::memcpy(&b, &x, 4);
  if ((b & 0x7FFFFFFFu) > 0x7F800000u) return uint16_t((b >> 16) | 0x40);   // NaN stays NaN
  return uint16_t((b + 0x7FFFu + ((b >> 16) & 1)) >> 16);
}

// pool[layer, slot / page, :, slot % page] = new[t] for each token t (the pool aliases the
// result: written in place). XLA:CPU writes 16-bit pools by converting the whole pool to
// float32 and back, per layer.
ffi::Error WriteKV(ffi::AnyBuffer pool, ffi::Buffer<ffi::S32> slots, ffi::Buffer<ffi::F32> fresh,
                   int64_t layer, ffi::Result<ffi::AnyBuffer> out) {
  auto pd = pool.dimensions(), nd = fresh.dimensions();
  if (pd.size() != 5 || nd.size() != 3 || nd[1] != pd[2] || nd[2] != pd[4] || pd[4] % 16 ||
      layer < 0 ||
      layer >= pd[0] || out->untyped_data() != pool.untyped_data())
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "write_kv: shapes or aliasing");
  const int64_t N = pd[1], KV = pd[2], page = pd[3], hd = pd[4], T = nd[0];
  const auto type = pool.element_type();
  const int32_t* sp = slots.typed_data();
  const float* src = fresh.typed_data();
  for (int64_t t = 0; t < T; ++t) {
    const int64_t slot = sp[t], pg = slot / page, off = slot % page;
    if (slot < 0 || pg >= N) continue;
    for (int64_t h = 0; h < KV; ++h) {
      const int64_t dst = (((layer * N + pg) * KV + h) * page + off) * hd;
      const float* x = src + (t * KV + h) * hd;
      switch (type) {
        case ffi::DataType::F32:
          std::memcpy(static_cast<float*>(out->untyped_data()) + dst, x, hd * 4);
          break;
        case ffi::DataType::BF16: {
          uint16_t* d = static_cast<uint16_t*>(out->untyped_data()) + dst;
          for (int64_t i = 0; i < hd; ++i) d[i] = to_bf16(x[i]);
          break;
        }
        case ffi::DataType::F16: {
          uint16_t* d = static_cast<uint16_t*>(out->untyped_data()) + dst;
          for (int64_t i = 0; i < hd; i += V::W) V::store_f16(d + i, x + i);   // hd % 16 == 0
          break;
        }
        default:
          return ffi::Error(ffi::ErrorCode::kInvalidArgument, "write_kv: pool dtype");
      }
    }
  }
  return ffi::Error::Success();
}

// A zero pool without writing it (graphs/cpu_attention.py zero_pool): the whole memory pages
// inside each buffer go back to the kernel (MADV_DONTNEED: a private anonymous page then reads
// as zero until written, as calloc's pages do), the partial pages at its ends are cleared. A
// 5.6 GiB pool costs no first-touch at start; its pages are faulted in as steps write them.
// Where madvise fails, or a sampled page does not read zero (memory that is not private
// anonymous), the buffer is cleared with memset.
void ZeroBuffer(char* p, size_t n) {
  const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t a = reinterpret_cast<uintptr_t>(p), b = a + n;
  const uintptr_t lo = (a + page - 1) / page * page, hi = b / page * page;
  if (hi <= lo + 16 * page) {
    std::memset(p, 0, n);
    return;
  }
  std::memset(p, 0, lo - a);
  std::memset(reinterpret_cast<char*>(hi), 0, b - hi);
  char* first = reinterpret_cast<char*>(lo);
  const size_t len = hi - lo;
  bool zero = madvise(first, len, MADV_DONTNEED) == 0;
  for (size_t at : {size_t(0), len / 2 / page * page, len - page}) {
    uint64_t word;
    std::memcpy(&word, first + at, sizeof(word));
    zero = zero && word == 0;
  }
  if (!zero) std::memset(first, 0, len);
}

ffi::Error ZeroPool(ffi::Result<ffi::AnyBuffer> k, ffi::Result<ffi::AnyBuffer> v) {
  ZeroBuffer(static_cast<char*>(k->untyped_data()), k->size_bytes());
  ZeroBuffer(static_cast<char*>(v->untyped_data()), v->size_bytes());
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MAXJAX_SYMBOL(maxjax_zero_pool), ZeroPool,
                              ffi::Ffi::Bind().Ret<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(MAXJAX_SYMBOL(maxjax_write_kv), WriteKV,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("layer")
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(MAXJAX_SYMBOL(maxjax_paged_attention), PagedAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("layer")
                                  .Attr<int64_t>("window")
                                  .Attr<float>("scale")
                                  .Attr<float>("softcap")
                                  .Ret<ffi::Buffer<ffi::F32>>());
