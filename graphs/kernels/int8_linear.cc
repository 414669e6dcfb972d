// The CPU int8 linear of --use-experimental-kernels (graphs/cpu_kernels.py):
// y[r, o] = scale[o] * sum_i x[r, i] * q[i, o], float32 activations times int8 weights
// (weight-only int8: no activation rounding), the weights packed as [out / 64, in, 64] so each
// 64-column tile streams contiguous memory. AVX-512F/BW. Large calls share their column tiles with
// XLA's intra-op threads (an AVX-512 VNNI version on two int8 activation digits measured slower on
// this Zen 4: its 512-bit vpdpbusd runs at half the rate of the float32 FMA).
// An XLA FFI handler: jax.ffi.ffi_call("maxjax_int8_linear", ...).
#include <immintrin.h>
#include <cstdint>
#include <algorithm>
#include <atomic>
#include <memory>
#include "xla/ffi/api/ffi.h"
namespace ffi = xla::ffi;

template <int RB>
static void tile(const float* x, const int8_t* q, const float* scale, float* y,
                 int64_t rows_stride, int64_t in, int64_t out, int64_t o0) {
  // RB rows x 64 output columns, accumulated in 4*RB zmm registers.
  __m512 acc[RB][4];
  for (int r = 0; r < RB; ++r) for (int k = 0; k < 4; ++k) acc[r][k] = _mm512_setzero_ps();
  const int8_t* qp = q + o0 * in;   // packed [out/64, in, 64]
  for (int64_t i = 0; i < in; ++i, qp += 64) {
    _mm_prefetch((const char*)(qp + 1024), _MM_HINT_T0);
    __m512i raw = _mm512_loadu_si512(qp);
    __m512 w[4];
    w[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(raw, 0)));
    w[1] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(raw, 1)));
    w[2] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(raw, 2)));
    w[3] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(raw, 3)));
    for (int r = 0; r < RB; ++r) {
      __m512 xv = _mm512_set1_ps(x[r * rows_stride + i]);
      for (int k = 0; k < 4; ++k) acc[r][k] = _mm512_fmadd_ps(xv, w[k], acc[r][k]);
    }
  }
  for (int k = 0; k < 4; ++k) {
    __m512 s = _mm512_loadu_ps(scale + o0 + 16 * k);
    for (int r = 0; r < RB; ++r)
      _mm512_storeu_ps(y + r * out + o0 + 16 * k, _mm512_mul_ps(acc[r][k], s));
  }
}

static void run_cols(const float* x, const int8_t* q, const float* s, float* y,
                     int64_t R, int64_t in, int64_t out, int64_t c0, int64_t c1) {
  for (int64_t o0 = c0; o0 < c1; o0 += 64) {
    int64_t r = 0;
    for (; r + 6 <= R; r += 6) tile<6>(x + r * in, q, s, y + r * out, in, in, out, o0);
    switch (R - r) {
      case 5: tile<5>(x + r * in, q, s, y + r * out, in, in, out, o0); break;
      case 4: tile<4>(x + r * in, q, s, y + r * out, in, in, out, o0); break;
      case 3: tile<3>(x + r * in, q, s, y + r * out, in, in, out, o0); break;
      case 2: tile<2>(x + r * in, q, s, y + r * out, in, in, out, o0); break;
      case 1: tile<1>(x + r * in, q, s, y + r * out, in, in, out, o0); break;
    }
  }
}

// Calls of at least this many weight bytes per thread share their column tiles with XLA's
// intra-op threads: below it, handing work over costs more than it saves.
static constexpr int64_t kBytesPerThread = int64_t(64) << 10;

struct Shared {        // heap-held: a pool task may start after the call has returned
  const float* x; const int8_t* q; const float* s; float* y;
  int64_t R, in, out, tiles, chunk;
  std::atomic<int64_t> next{0}, done{0};
  void work() {
    for (int64_t c; (c = next.fetch_add(1)) * chunk < tiles;) {
      int64_t c0 = c * chunk * 64, c1 = std::min(tiles, (c + 1) * chunk) * 64;
      run_cols(x, q, s, y, R, in, out, c0, c1);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

static ffi::Error Int8Linear(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                             ffi::Buffer<ffi::S8> q, ffi::Buffer<ffi::F32> scale,
                             ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(), qd = q.dimensions();
  int64_t R = xd[0], in = xd[1], out = qd[0] * qd[2];
  if (out % 64) return ffi::Error(ffi::ErrorCode::kInvalidArgument, "out % 64");
  const float* xp = x.typed_data(); const int8_t* qp = q.typed_data();
  const float* sp = scale.typed_data(); float* yp = y->typed_data();
  int64_t tiles = out / 64;
  int64_t threads = std::min<int64_t>({pool.num_threads(), tiles, in * out / kBytesPerThread});
  if (threads < 2) {
    run_cols(xp, qp, sp, yp, R, in, out, 0, out);
    return ffi::Error::Success();
  }
  int64_t chunks = std::min(tiles, threads * 4);
  auto sh = std::shared_ptr<Shared>(
      new Shared{xp, qp, sp, yp, R, in, out, tiles, (tiles + chunks - 1) / chunks});
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
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
