// The CPU int8 linear of --use-experimental-kernels (graphs/cpu_kernels.py), the arithmetic of
// graphs/quant.py's int8 linear: each activation row in two int8 digits, x ~ s1 * x1 + s2 * x2
// (x2 quantizing x - s1 * x1), times int8 weights with one scale per output column, summed in
// int32 by AVX-512 VNNI (vpdpbusd: unsigned x signed bytes, 4 inputs per 32-bit lane).
// Weights are stored as w + 128 (unsigned) and packed [out / 64, in / 4, 64, 4] so each 64-column
// tile streams contiguous memory; sum_i x[i] * (w[i] + 128) - 128 * sum_i x[i] gives the product.
// Large calls share their column tiles with XLA's intra-op threads. On this Zen 4 it does 2.2x
// the multiply-adds per second of a float32 FMA kernel on int8 weights (tools/bench_int8_kernel.py).
// An XLA FFI handler: jax.ffi.ffi_call("maxjax_int8_linear", ...).
#include <immintrin.h>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <memory>
#include <vector>
#include "xla/ffi/api/ffi.h"
namespace ffi = xla::ffi;

// Digit rows of a call: row r's digit d is digit row 2r + d.
struct Digits {
  std::vector<int8_t> x;        // [2R, in]
  std::vector<float> scale;     // [2R]
  std::vector<int32_t> sum;     // [2R] 128 * sum_i x: the offset the unsigned weights add
};

static void quantize(const float* x, int64_t R, int64_t in, Digits& d) {
  d.x.resize(2 * R * in); d.scale.resize(2 * R); d.sum.resize(2 * R);
  std::vector<float> rest(in);
  for (int64_t r = 0; r < R; ++r) {
    std::copy(x + r * in, x + (r + 1) * in, rest.begin());
    for (int digit = 0; digit < 2; ++digit) {
      __m512 m = _mm512_setzero_ps();
      for (int64_t i = 0; i < in; i += 16)
        m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(&rest[i])));
      float amax = _mm512_reduce_max_ps(m);
      float s = amax > 0 ? amax / 127.0f : 1.0f;
      __m512 sv = _mm512_set1_ps(s), lim = _mm512_set1_ps(127.0f);
      int8_t* xq = d.x.data() + (2 * r + digit) * in;
      __m512i sum = _mm512_setzero_si512();
      for (int64_t i = 0; i < in; i += 16) {
        __m512 v = _mm512_loadu_ps(&rest[i]);
        __m512 n = _mm512_roundscale_ps(_mm512_div_ps(v, sv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        n = _mm512_min_ps(lim, _mm512_max_ps(_mm512_sub_ps(_mm512_setzero_ps(), lim), n));
        __m512i ni = _mm512_cvtps_epi32(n);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + i), _mm512_cvtepi32_epi8(ni));
        sum = _mm512_add_epi32(sum, ni);
        _mm512_storeu_ps(&rest[i], _mm512_fnmadd_ps(n, sv, v));
      }
      d.scale[2 * r + digit] = s;
      d.sum[2 * r + digit] = 128 * _mm512_reduce_add_epi32(sum);
    }
  }
}

#define UNROLL _Pragma("GCC unroll 16")

// acc += unsigned bytes of a x signed bytes of b, 4 per 32-bit lane. Written in asm: g++ 12
// copies the accumulator around each _mm512_dpbusd_epi32.
static inline void dpbusd(__m512i& acc, __m512i a, __m512i b) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
}

template <int RB>   // RB real rows = 2 * RB digit rows, x 64 output columns
__attribute__((noinline))   // inlined into run_cols, g++ 12 runs it at half speed
static void tile(const Digits& d, const uint8_t* q, const float* wscale, float* y,
                 int64_t r0, int64_t in, int64_t out, int64_t o0) {
  constexpr int D = 2 * RB;
  __m512i acc[D][4];
  UNROLL for (int r = 0; r < D; ++r)
    UNROLL for (int k = 0; k < 4; ++k) acc[r][k] = _mm512_setzero_si512();
  const uint8_t* qp = q + o0 * in;                 // packed [out/64, in/4, 64, 4]
  const int8_t* xp = d.x.data() + 2 * r0 * in;
  for (int64_t g = 0; g < in; g += 4, qp += 256) {
    UNROLL for (int k = 0; k < 4; ++k) _mm_prefetch((const char*)(qp + 2048 + 64 * k), _MM_HINT_T0);
    __m512i w[4];
    UNROLL for (int k = 0; k < 4; ++k) w[k] = _mm512_loadu_si512(qp + 64 * k);
    UNROLL for (int r = 0; r < D; ++r) {
      __m512i a = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(xp + r * in + g));
      UNROLL for (int k = 0; k < 4; ++k) dpbusd(acc[r][k], w[k], a);
    }
  }
  UNROLL for (int k = 0; k < 4; ++k) {
    __m512 ws = _mm512_loadu_ps(wscale + o0 + 16 * k);
    UNROLL for (int r = 0; r < RB; ++r) {
      __m512 v = _mm512_setzero_ps();
      UNROLL for (int digit = 0; digit < 2; ++digit) {
        int64_t dr = 2 * (r0 + r) + digit;
        __m512i n = _mm512_sub_epi32(acc[2 * r + digit][k], _mm512_set1_epi32(d.sum[dr]));
        v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(n), _mm512_set1_ps(d.scale[dr]), v);
      }
      _mm512_storeu_ps(y + (r0 + r) * out + o0 + 16 * k, _mm512_mul_ps(v, ws));
    }
  }
}

static void run_cols(const Digits& d, const uint8_t* q, const float* s, float* y,
                     int64_t R, int64_t in, int64_t out, int64_t c0, int64_t c1) {
  for (int64_t o0 = c0; o0 < c1; o0 += 64) {
    int64_t r = 0;
    for (; r + 2 <= R; r += 2) tile<2>(d, q, s, y, r, in, out, o0);
    if (R - r == 1) tile<1>(d, q, s, y, r, in, out, o0);
  }
}

// A call shares its column tiles with XLA's intra-op threads when one thread would take at least
// this long (weights read at ~17 GB/s or ~110 G multiply-adds/s per thread, measured here):
// shorter calls lose more waiting for a pool thread to wake than they gain.
static constexpr double kThreadedMicros = 100;

static bool worth_threads(int64_t R, int64_t in, int64_t out) {
  double bytes_us = double(in) * out / 17e3, macs_us = double(R) * in * out / 110e3;
  return std::max(bytes_us, macs_us) >= kThreadedMicros;
}

struct Shared {        // heap-held: a pool task may start after the call has returned
  Digits d;
  const uint8_t* q; const float* s; float* y;
  int64_t R, in, out, tiles, chunk;
  std::atomic<int64_t> next{0}, done{0};
  void work() {
    for (int64_t c; (c = next.fetch_add(1)) * chunk < tiles;) {
      int64_t c0 = c * chunk * 64, c1 = std::min(tiles, (c + 1) * chunk) * 64;
      run_cols(d, q, s, y, R, in, out, c0, c1);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

// Only the first `live` rows of x are computed (the rest, a bucket's padding, come out 0).
static ffi::Error Int8Linear(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                             ffi::Buffer<ffi::U8> q, ffi::Buffer<ffi::F32> scale,
                             ffi::Buffer<ffi::S32> live, ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(), qd = q.dimensions();
  int64_t rows = xd[0], in = xd[1], out = qd[0] * qd[2];
  int64_t R = std::clamp<int64_t>(live.typed_data()[0], 0, rows);
  std::fill(y->typed_data() + R * out, y->typed_data() + rows * out, 0.0f);
  if (R == 0) return ffi::Error::Success();
  if (qd.size() != 4 || qd[1] * 4 != in || qd[2] != 64 || qd[3] != 4 || in % 16)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "weights not packed [out/64, in/4, 64, 4]");
  int64_t tiles = out / 64;
  auto sh = std::make_shared<Shared>();
  quantize(x.typed_data(), R, in, sh->d);
  sh->q = q.typed_data(); sh->s = scale.typed_data(); sh->y = y->typed_data();
  sh->R = R; sh->in = in; sh->out = out; sh->tiles = tiles;
  int64_t threads = worth_threads(R, in, out) ? std::min(pool.num_threads(), tiles) : 1;
  if (threads < 2) {
    run_cols(sh->d, sh->q, sh->s, sh->y, R, in, out, 0, out);
    return ffi::Error::Success();
  }
  int64_t chunks = std::min(tiles, threads * 4);
  sh->chunk = (tiles + chunks - 1) / chunks;
  int64_t total = (tiles + sh->chunk - 1) / sh->chunk;
  for (int64_t t = 1; t < threads; ++t) pool.Schedule([sh] { sh->work(); });
  sh->work();
  while (sh->done.load(std::memory_order_acquire) < total) _mm_pause();
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(maxjax_int8_linear, Int8Linear,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
