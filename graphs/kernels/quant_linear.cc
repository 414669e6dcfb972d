// The CPU quantized linears of --use-experimental-kernels (graphs/cpu_kernels.py), XLA FFI
// handlers: jax.ffi.ffi_call("maxjax_int8_linear" | "maxjax_int4_linear", ...).
// Each activation row goes in two int8 digits as in graphs/quant.py, x ~ s1 * x1 + s2 * x2 (x2
// quantizing x - s1 * x1), and products are summed in int32 by AVX-512 VNNI (vpdpbusd: unsigned
// weight bytes x signed activation bytes, 4 inputs per 32-bit lane), 64 output columns a tile.
//  int8: weights w + 128 as bytes, packed [out/64, in/4, 64, 4]; the 128 * sum_i x[i] the
//        offset adds is taken off. One scale per output column.
//  int4: GGUF blocks of 32 inputs, w = scale[b] * nibble + low[b]; packed [out/64, in/8, 64, 4]
//        (for block b and group p < 4, 4 bytes per column whose low nibbles are inputs
//        32b + 4p .. + 3 and high nibbles inputs 32b + 16 + 4p .. + 3, GGUF's own pairing);
//        scale and low [out/64, in/32, 64]. Each block's int32 sums are scaled into the output.
// Only the first `live` rows are computed (the rest, a bucket's padding, come out 0); a call
// long enough shares its column tiles with XLA's intra-op threads. On this Zen 4 the int8 tile
// does 2.2x the multiply-adds per second of a float32-FMA kernel (BENCHMARKS.md).
#include <immintrin.h>
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>
#include "xla/ffi/api/ffi.h"
namespace ffi = xla::ffi;

#define UNROLL _Pragma("GCC unroll 16")

// Digit rows of a call: row r's digit d is digit row 2r + d.
struct Digits {
  std::vector<int8_t> x;        // [2R, in]
  std::vector<float> scale;     // [2R]
  std::vector<int32_t> sum;     // [2R] 128 * sum_i x (int8's unsigned offset)
  std::vector<float> block_sum; // [R, in/32] sum of x over each block of 32 inputs (int4)
};

static void quantize(const float* x, int64_t R, int64_t in, Digits& d) {
  d.x.resize(2 * R * in); d.scale.resize(2 * R); d.sum.resize(2 * R);
  d.block_sum.resize(R * (in / 32));
  std::vector<float> rest(in);
  for (int64_t r = 0; r < R; ++r) {
    std::copy(x + r * in, x + (r + 1) * in, rest.begin());
    for (int64_t b = 0; b < in / 32; ++b) {
      __m512 v = _mm512_add_ps(_mm512_loadu_ps(&rest[32 * b]), _mm512_loadu_ps(&rest[32 * b + 16]));
      d.block_sum[r * (in / 32) + b] = _mm512_reduce_add_ps(v);
    }
    for (int digit = 0; digit < 2; ++digit) {
      __m512 m = _mm512_setzero_ps();
      for (int64_t i = 0; i < in; i += 16) m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(&rest[i])));
      float amax = _mm512_reduce_max_ps(m);
      float s = amax > 0 ? amax / 127.0f : 1.0f;
      __m512 sv = _mm512_set1_ps(s), lim = _mm512_set1_ps(127.0f), neg = _mm512_set1_ps(-127.0f);
      int8_t* xq = d.x.data() + (2 * r + digit) * in;
      __m512i sum = _mm512_setzero_si512();
      for (int64_t i = 0; i < in; i += 16) {
        __m512 v = _mm512_loadu_ps(&rest[i]);
        __m512 n = _mm512_roundscale_ps(_mm512_div_ps(v, sv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        n = _mm512_min_ps(lim, _mm512_max_ps(neg, n));
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

// acc += unsigned bytes of a x signed bytes of b, 4 per 32-bit lane. Written in asm: g++ 12
// copies the accumulator around each _mm512_dpbusd_epi32.
static inline void dpbusd(__m512i& acc, __m512i a, __m512i b) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
}

static inline __m512i bcast4(const int8_t* p) {
  return _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(p));
}

struct Call {          // one call's operands, shared by the threads that work on it
  Digits d;
  const uint8_t* q; const float* scale; const float* low; float* y;
  int64_t R, in, out;
};

// RB real rows (2 * RB digit rows) x 64 output columns. noinline: inlined into its caller's loop,
// g++ 12 runs it at half speed.
template <int RB>
__attribute__((noinline)) static void tile8(const Call& c, int64_t r0, int64_t o0) {
  constexpr int D = 2 * RB;
  const int64_t in = c.in;
  __m512i acc[D][4];
  UNROLL for (int r = 0; r < D; ++r) UNROLL for (int k = 0; k < 4; ++k) acc[r][k] = _mm512_setzero_si512();
  const uint8_t* qp = c.q + o0 * in;
  const int8_t* xp = c.d.x.data() + 2 * r0 * in;
  for (int64_t g = 0; g < in; g += 4, qp += 256) {
    UNROLL for (int k = 0; k < 4; ++k) _mm_prefetch((const char*)(qp + 2048 + 64 * k), _MM_HINT_T0);
    __m512i w[4];
    UNROLL for (int k = 0; k < 4; ++k) w[k] = _mm512_loadu_si512(qp + 64 * k);
    UNROLL for (int r = 0; r < D; ++r) {
      __m512i a = bcast4(xp + r * in + g);
      UNROLL for (int k = 0; k < 4; ++k) dpbusd(acc[r][k], w[k], a);
    }
  }
  UNROLL for (int k = 0; k < 4; ++k) {
    __m512 ws = _mm512_loadu_ps(c.scale + o0 + 16 * k);
    UNROLL for (int r = 0; r < RB; ++r) {
      __m512 v = _mm512_setzero_ps();
      UNROLL for (int digit = 0; digit < 2; ++digit) {
        int64_t dr = 2 * (r0 + r) + digit;
        __m512i n = _mm512_sub_epi32(acc[2 * r + digit][k], _mm512_set1_epi32(c.d.sum[dr]));
        v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(n), _mm512_set1_ps(c.d.scale[dr]), v);
      }
      _mm512_storeu_ps(c.y + (r0 + r) * c.out + o0 + 16 * k, _mm512_mul_ps(v, ws));
    }
  }
}

template <int RB>
__attribute__((noinline)) static void tile4(const Call& c, int64_t r0, int64_t o0) {
  constexpr int D = 2 * RB;
  const int64_t in = c.in, blocks = in / 32;
  const __m512i nib = _mm512_set1_epi8(0x0F);
  float* y = c.y + r0 * c.out + o0;            // accumulated in place: registers are all taken
  UNROLL for (int r = 0; r < RB; ++r) UNROLL for (int k = 0; k < 4; ++k)
    _mm512_storeu_ps(y + r * c.out + 16 * k, _mm512_setzero_ps());
  const uint8_t* qp = c.q + o0 * (in / 2);
  const float* sp = c.scale + o0 * blocks;      // [out/64, in/32, 64]
  const float* lp = c.low + o0 * blocks;
  const int8_t* xp = c.d.x.data() + 2 * r0 * in;
  for (int64_t b = 0; b < blocks; ++b, sp += 64, lp += 64) {
    __m512i acc[D][4];
    UNROLL for (int r = 0; r < D; ++r) UNROLL for (int k = 0; k < 4; ++k) acc[r][k] = _mm512_setzero_si512();
    for (int p = 0; p < 4; ++p, qp += 256) {
      UNROLL for (int k = 0; k < 4; ++k) _mm_prefetch((const char*)(qp + 2048 + 64 * k), _MM_HINT_T0);
      const int64_t i = 32 * b + 4 * p;
      UNROLL for (int k = 0; k < 4; ++k) {
        __m512i raw = _mm512_loadu_si512(qp + 64 * k);
        __m512i lo = _mm512_and_si512(raw, nib), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), nib);
        UNROLL for (int r = 0; r < D; ++r) {
          dpbusd(acc[r][k], lo, bcast4(xp + r * in + i));
          dpbusd(acc[r][k], hi, bcast4(xp + r * in + i + 16));
        }
      }
    }
    UNROLL for (int k = 0; k < 4; ++k) {
      __m512 ws = _mm512_loadu_ps(sp + 16 * k), wl = _mm512_loadu_ps(lp + 16 * k);
      UNROLL for (int r = 0; r < RB; ++r) {
        int64_t dr = 2 * (r0 + r);
        __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(acc[2 * r][k]), _mm512_set1_ps(c.d.scale[dr]));
        v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[2 * r + 1][k]), _mm512_set1_ps(c.d.scale[dr + 1]), v);
        float* yp = y + r * c.out + 16 * k;
        __m512 acc_y = _mm512_fmadd_ps(v, ws, _mm512_loadu_ps(yp));
        acc_y = _mm512_fmadd_ps(_mm512_set1_ps(c.d.block_sum[(r0 + r) * blocks + b]), wl, acc_y);
        _mm512_storeu_ps(yp, acc_y);
      }
    }
  }
}

template <bool INT4>
static void run_cols(const Call& c, int64_t c0, int64_t c1) {
  for (int64_t o0 = c0; o0 < c1; o0 += 64) {
    int64_t r = 0;
    for (; r + 2 <= c.R; r += 2) INT4 ? tile4<2>(c, r, o0) : tile8<2>(c, r, o0);
    if (r < c.R) INT4 ? tile4<1>(c, r, o0) : tile8<1>(c, r, o0);
  }
}

// A call shares its column tiles with XLA's intra-op threads when one thread would take at least
// this long (weights read at ~17 GB/s or ~110 G multiply-adds/s per thread, measured here):
// shorter calls lose more waiting for a pool thread to wake than they gain. 10 us measured best
// on a quiet machine (100: the one-row step 1.10x slower); on cores other work keeps busy,
// threads can lose.
static constexpr double kThreadedMicros = 10;

template <bool INT4>
struct Shared {        // heap-held: a pool task may start after the call has returned
  Call c;
  int64_t tiles = 0, chunk = 1;
  std::atomic<int64_t> next{0}, done{0};
  void work() {
    for (int64_t k; (k = next.fetch_add(1)) * chunk < tiles;) {
      run_cols<INT4>(c, k * chunk * 64, std::min(tiles, (k + 1) * chunk) * 64);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

template <bool INT4>
static ffi::Error Linear(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> q,
                         ffi::Buffer<ffi::F32> scale, const float* low, int64_t live,
                         ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(), qd = q.dimensions();
  int64_t rows = xd[0], in = xd[1], out = qd[0] * 64, group = INT4 ? 8 : 4;
  if (qd.size() != 4 || qd[1] * group != in || qd[2] != 64 || qd[3] != 4 || in % 32)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "weights not packed for the kernel");
  int64_t R = std::clamp<int64_t>(live, 0, rows);
  std::fill(y->typed_data() + R * out, y->typed_data() + rows * out, 0.0f);
  if (R == 0) return ffi::Error::Success();
  auto sh = std::make_shared<Shared<INT4>>();
  Call& c = sh->c;
  quantize(x.typed_data(), R, in, c.d);
  c.q = q.typed_data(); c.scale = scale.typed_data(); c.low = low; c.y = y->typed_data();
  c.R = R; c.in = in; c.out = out;
  double bytes = double(in) * out / (INT4 ? 1.6 : 1.0);
  bool long_call = std::max(bytes / 17e3, double(R) * in * out / 110e3) >= kThreadedMicros;
  int64_t tiles = out / 64, threads = long_call ? std::min(pool.num_threads(), tiles) : 1;
  if (threads < 2) {
    run_cols<INT4>(c, 0, out);
    return ffi::Error::Success();
  }
  int64_t chunks = std::min(tiles, threads * 4);
  sh->tiles = tiles;
  sh->chunk = (tiles + chunks - 1) / chunks;
  int64_t total = (tiles + sh->chunk - 1) / sh->chunk;
  for (int64_t t = 1; t < threads; ++t) pool.Schedule([sh] { sh->work(); });
  sh->work();
  while (sh->done.load(std::memory_order_acquire) < total) _mm_pause();
  return ffi::Error::Success();
}

static ffi::Error Int8Linear(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                             ffi::Buffer<ffi::U8> q, ffi::Buffer<ffi::F32> scale,
                             ffi::Buffer<ffi::S32> live, ffi::ResultBuffer<ffi::F32> y) {
  return Linear<false>(pool, x, q, scale, nullptr, live.typed_data()[0], y);
}

static ffi::Error Int4Linear(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                             ffi::Buffer<ffi::U8> q, ffi::Buffer<ffi::F32> scale,
                             ffi::Buffer<ffi::F32> low, ffi::Buffer<ffi::S32> live,
                             ffi::ResultBuffer<ffi::F32> y) {
  return Linear<true>(pool, x, q, scale, low.typed_data(), live.typed_data()[0], y);
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(maxjax_int8_linear, Int8Linear,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(maxjax_int4_linear, Int4Linear,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
