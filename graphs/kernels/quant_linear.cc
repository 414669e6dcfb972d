// The CPU quantized linears of --use-experimental-kernels (graphs/cpu_kernels.py), XLA FFI
// handlers: jax.ffi.ffi_call("maxjax_int8_linear_<isa>" | "maxjax_int4_linear_<isa>", ...).
// One source, two instruction sets, picked at build time: -DMAXJAX_ISA=avx512 (with
// -mavx512f -mavx512bw -mavx512vnni -mfma, and AMX-INT8 tiles where the CPU has them:
// quant_linear_amx.h) or avx2 (-mavx2 -mfma -mf16c); the exported symbols
// carry that suffix, so both libraries load in one process. Only the vector ops of the
// activation quantizer (struct V) and the micro-tiles differ; the packed layouts do not.
// Each activation row goes in two int8 digits as in graphs/quant.py, x ~ s1 * x1 + s2 * x2 (x2
// quantizing x - s1 * x1), and products are summed in int32, 64 output columns a tile.
//  int8: weights w + 128 as bytes, packed [out/64, in/4, 64, 4]. One scale per output column.
//  int4: GGUF blocks of 32 inputs, w = scale[b] * nibble + low[b]; packed [out/64, in/8, 64, 4]
//        (for block b and group p < 4, 4 bytes per column whose low nibbles are inputs
//        32b + 4p .. + 3 and high nibbles inputs 32b + 16 + 4p .. + 3, GGUF's own pairing);
//        scale and low [out/64, in/32, 64]. Each block's int32 sums are scaled into the output.
// AVX-512 VNNI: vpdpbusd (unsigned weight bytes x signed activation bytes, 4 inputs per 32-bit
// lane); int8 takes back the 128 * sum_i x[i] its offset adds. AVX2: vpmaddubsw + vpmaddwd;
// int8 turns the bytes back into w (xor 0x80) and multiplies |w| by x with w's sign (no
// saturation: |w| <= 128, |x| <= 127), 4-bit multiplies the nibbles by x directly. Both give the
// same int32 sums and, in the same float order, the same outputs.
// Only the first `live` rows are computed (the rest, a bucket's padding, come out 0); a call
// long enough shares its column tiles with helper threads (workers.h). On this Zen 4 the AVX-512
// int8 tile does 2.2x the multiply-adds per second of a float32-FMA kernel (BENCHMARKS.md).
#include <cpuid.h>
#include <immintrin.h>
#include <algorithm>
#include <atomic>
#include <cstdint>
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
#define MAXJAX_SYMBOL(name) MAXJAX_NAMED(name, MAXJAX_ISA)   // maxjax_int8_linear_avx2, ...

#define UNROLL _Pragma("GCC unroll 16")

namespace {

// Digit rows of a call: row r's digit d is digit row 2r + d.
struct Digits {
  std::vector<int8_t> x;        // [2R, in]
  std::vector<float> scale;     // [2R]
  std::vector<int32_t> sum;     // [2R] 128 * sum_i x (the AVX-512 int8 tile's unsigned offset)
  std::vector<float> block_sum; // [R, in/32] sum of x over each block of 32 inputs (int4)
};

struct Call {          // one call's operands, shared by the threads that work on it
  Digits d;
  const uint8_t* q; const float* scale; const float* low; float* y;
  int64_t R, in, out;
};

// the sum of v's 8 lanes: lanes 4 apart added, then 2 apart, then neighbours (one fixed order)
inline float hsum8(__m256 v) {
  __m128 t = _mm_add_ps(_mm256_extractf128_ps(v, 1), _mm256_castps256_ps128(v));
  t = _mm_add_ps(t, _mm_shuffle_ps(t, t, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, _MM_SHUFFLE(2, 3, 0, 1))));
}

#if defined(__AVX512F__)
// ---- AVX-512F/BW/VNNI ---------------------------------------------------------------------------
struct V {             // the activation quantizer's vector ops: 16 float lanes
  static constexpr int W = 16;
  using F = __m512;
  using I = __m512i;
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
  static F set1(float x) { return _mm512_set1_ps(x); }
  static F max(F a, F b) { return _mm512_max_ps(a, b); }
  static F min(F a, F b) { return _mm512_min_ps(a, b); }
  static F abs(F a) { return _mm512_abs_ps(a); }
  static F div(F a, F b) { return _mm512_div_ps(a, b); }
  static F fnmadd(F a, F b, F c) { return _mm512_fnmadd_ps(a, b, c); }
  static F round(F a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static float reduce_max(F a) { return _mm512_reduce_max_ps(a); }
  static I cvt(F a) { return _mm512_cvtps_epi32(a); }
  static I izero() { return _mm512_setzero_si512(); }
  static I iadd(I a, I b) { return _mm512_add_epi32(a, b); }
  static int32_t reduce_add(I a) { return _mm512_reduce_add_epi32(a); }
  static void store_i8(int8_t* p, I a) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(a));
  }
  static float sum32(const float* p) {       // p[i] + p[16 + i], then i + 8, then hsum8
    __m512 v = _mm512_add_ps(_mm512_loadu_ps(p), _mm512_loadu_ps(p + 16));
    __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
    return hsum8(_mm256_add_ps(hi, _mm512_castps512_ps256(v)));
  }
};

constexpr int kRows = 2;     // real rows a tile: 2 x 2 digit rows x 4 zmm accumulators

// acc += unsigned bytes of a x signed bytes of b, 4 per 32-bit lane. Written in asm: g++ 12
// copies the accumulator around each _mm512_dpbusd_epi32.
inline void dpbusd(__m512i& acc, __m512i a, __m512i b) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
}

inline __m512i bcast4(const int8_t* p) {
  return _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(p));
}

// RB real rows (2 * RB digit rows) x 64 output columns. noinline: inlined into its caller's loop,
// g++ 12 runs it at half speed.
template <int RB>
__attribute__((noinline)) void tile8(const Call& c, int64_t r0, int64_t o0) {
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
__attribute__((noinline)) void tile4(const Call& c, int64_t r0, int64_t o0) {
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

#include "quant_linear_amx.h"

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// ---- AVX2 + FMA ---------------------------------------------------------------------------------
struct V {             // the activation quantizer's vector ops: 8 float lanes
  static constexpr int W = 8;
  using F = __m256;
  using I = __m256i;
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
  static F set1(float x) { return _mm256_set1_ps(x); }
  static F max(F a, F b) { return _mm256_max_ps(a, b); }
  static F min(F a, F b) { return _mm256_min_ps(a, b); }
  static F abs(F a) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), a); }
  static F div(F a, F b) { return _mm256_div_ps(a, b); }
  static F fnmadd(F a, F b, F c) { return _mm256_fnmadd_ps(a, b, c); }
  static F round(F a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static float reduce_max(F a) {
    __m128 t = _mm_max_ps(_mm256_extractf128_ps(a, 1), _mm256_castps256_ps128(a));
    t = _mm_max_ps(t, _mm_shuffle_ps(t, t, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtss_f32(_mm_max_ss(t, _mm_shuffle_ps(t, t, _MM_SHUFFLE(2, 3, 0, 1))));
  }
  static I cvt(F a) { return _mm256_cvtps_epi32(a); }
  static I izero() { return _mm256_setzero_si256(); }
  static I iadd(I a, I b) { return _mm256_add_epi32(a, b); }
  static int32_t reduce_add(I a) {
    __m128i t = _mm_add_epi32(_mm256_extracti128_si256(a, 1), _mm256_castsi256_si128(a));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtsi128_si32(_mm_add_epi32(t, _mm_shuffle_epi32(t, _MM_SHUFFLE(2, 3, 0, 1))));
  }
  static void store_i8(int8_t* p, I a) {     // |a| <= 127: the saturating packs keep it
    __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packs_epi16(w, w));
  }
  static float sum32(const float* p) {       // the AVX-512 order: (p[i] + p[16 + i]) + (.. + 8)
    return hsum8(_mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(p + 8), _mm256_loadu_ps(p + 24)),
                               _mm256_add_ps(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 16))));
  }
};

// Real rows a tile. A tile of RB rows goes over its 64 columns 32 / RB at a time: 2 * RB digit
// rows x 4 / RB accumulators, 8 of the 16 ymm. 1 and 2 rows measured the same on this Zen 4
// (compute-bound: 4 ops for 32 int8 multiply-adds, where vpdpbusd does 64 in one).
constexpr int kRows = 2;

inline __m256i bcast4(const int8_t* p) {
  return _mm256_set1_epi32(*reinterpret_cast<const int32_t*>(p));
}

// AVX-VNNI (Intel Alder Lake and later cores, no AVX-512 needed): ymm vpdpbusd, one instruction
// where vpmaddubsw + vpmaddwd take three, chosen at run time (CPUID leaf 7.1, EAX bit 4). int8
// then reads the weight bytes w + 128 and takes back 128 x the digit row's sum, as the AVX-512
// tile does; 4-bit sums the nibbles in int32. The same sums and epilogue: the same bits. In asm:
// the intrinsic needs the function compiled for AVX-VNNI.
std::atomic<bool> g_avx_vnni{false};

bool avx_vnni_enable(bool on) {
  static const bool can = [] {
    unsigned a, b, c, d;
    return __get_cpuid_count(7, 1, &a, &b, &c, &d) && (a >> 4 & 1);
  }();
  g_avx_vnni.store(on && can);
  return on && can;
}

inline void dpbusd(__m256i& acc, __m256i a, __m256i b) {
  asm("%{vex%} vpdpbusd %2, %1, %0" : "+x"(acc) : "x"(a), "x"(b));
}

template <int RB, bool VNNI>
__attribute__((noinline)) void tile8(const Call& c, int64_t r0, int64_t o0) {
  constexpr int D = 2 * RB, K = 4 / RB;        // digit rows; 8-column vectors a pass
  const int64_t in = c.in;
  const __m256i flip = _mm256_set1_epi8(char(0x80)), ones = _mm256_set1_epi16(1);
  const int8_t* xp = c.d.x.data() + 2 * r0 * in;
  for (int h = 0; h < 64; h += 8 * K) {
    __m256i acc[D][K];
    UNROLL for (int r = 0; r < D; ++r) UNROLL for (int k = 0; k < K; ++k) acc[r][k] = _mm256_setzero_si256();
    const uint8_t* qp = c.q + o0 * in + 4 * h;
    for (int64_t g = 0; g < in; g += 4, qp += 256) {
      UNROLL for (int k = 0; k < K; k += 2) _mm_prefetch((const char*)(qp + 2048 + 32 * k), _MM_HINT_T0);
      __m256i a[D];
      UNROLL for (int r = 0; r < D; ++r) a[r] = bcast4(xp + r * in + g);
      UNROLL for (int k = 0; k < K; ++k) {
        if constexpr (VNNI) {
          __m256i w = _mm256_loadu_si256((const __m256i*)(qp + 32 * k));
          UNROLL for (int r = 0; r < D; ++r) dpbusd(acc[r][k], w, a[r]);
          continue;
        }
        // the weight bytes w + 128 back to w; |w| (128 for -128: unsigned) x x with w's sign
        __m256i w = _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)(qp + 32 * k)), flip);
        __m256i aw = _mm256_abs_epi8(w);
        UNROLL for (int r = 0; r < D; ++r) {
          __m256i pairs = _mm256_maddubs_epi16(aw, _mm256_sign_epi8(a[r], w));
          acc[r][k] = _mm256_add_epi32(acc[r][k], _mm256_madd_epi16(pairs, ones));
        }
      }
    }
    UNROLL for (int k = 0; k < K; ++k) {
      const int64_t col = o0 + h + 8 * k;
      __m256 ws = _mm256_loadu_ps(c.scale + col);
      UNROLL for (int r = 0; r < RB; ++r) {
        __m256 v = _mm256_setzero_ps();
        UNROLL for (int digit = 0; digit < 2; ++digit) {
          int64_t dr = 2 * (r0 + r) + digit;
          __m256i n = VNNI ? _mm256_sub_epi32(acc[2 * r + digit][k], _mm256_set1_epi32(c.d.sum[dr]))
                           : acc[2 * r + digit][k];
          v = _mm256_fmadd_ps(_mm256_cvtepi32_ps(n), _mm256_set1_ps(c.d.scale[dr]), v);
        }
        _mm256_storeu_ps(c.y + (r0 + r) * c.out + col, _mm256_mul_ps(v, ws));
      }
    }
  }
}

template <int RB, bool VNNI>
__attribute__((noinline)) void tile4(const Call& c, int64_t r0, int64_t o0) {
  constexpr int D = 2 * RB, K = 4 / RB;
  const int64_t in = c.in, blocks = in / 32;
  const __m256i nib = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const int8_t* xp = c.d.x.data() + 2 * r0 * in;
  for (int h = 0; h < 64; h += 8 * K) {
    float* y = c.y + r0 * c.out + o0 + h;       // accumulated in place, block by block
    UNROLL for (int r = 0; r < RB; ++r) UNROLL for (int k = 0; k < K; ++k)
      _mm256_storeu_ps(y + r * c.out + 8 * k, _mm256_setzero_ps());
    const uint8_t* qp = c.q + o0 * (in / 2) + 4 * h;
    const float* sp = c.scale + o0 * blocks + h;  // [out/64, in/32, 64]
    const float* lp = c.low + o0 * blocks + h;
    for (int64_t b = 0; b < blocks; ++b, sp += 64, lp += 64) {
      // int16 lanes (AVX-VNNI: int32): 16 products nibble x digit of a block, |sum| <= 16 * 15 *
      // 127 < 2^15
      __m256i acc[D][K];
      UNROLL for (int r = 0; r < D; ++r) UNROLL for (int k = 0; k < K; ++k) acc[r][k] = _mm256_setzero_si256();
      for (int p = 0; p < 4; ++p, qp += 256) {
        UNROLL for (int k = 0; k < K; k += 2) _mm_prefetch((const char*)(qp + 2048 + 32 * k), _MM_HINT_T0);
        const int64_t i = 32 * b + 4 * p;
        UNROLL for (int k = 0; k < K; ++k) {
          __m256i raw = _mm256_loadu_si256((const __m256i*)(qp + 32 * k));
          __m256i lo = _mm256_and_si256(raw, nib), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nib);
          UNROLL for (int r = 0; r < D; ++r) {
            if constexpr (VNNI) {
              dpbusd(acc[r][k], lo, bcast4(xp + r * in + i));
              dpbusd(acc[r][k], hi, bcast4(xp + r * in + i + 16));
            } else {
              acc[r][k] = _mm256_add_epi16(acc[r][k], _mm256_add_epi16(
                  _mm256_maddubs_epi16(lo, bcast4(xp + r * in + i)),
                  _mm256_maddubs_epi16(hi, bcast4(xp + r * in + i + 16))));
            }
          }
        }
      }
      UNROLL for (int k = 0; k < K; ++k) {
        __m256 ws = _mm256_loadu_ps(sp + 8 * k), wl = _mm256_loadu_ps(lp + 8 * k);
        UNROLL for (int r = 0; r < RB; ++r) {
          int64_t dr = 2 * (r0 + r);
          __m256 n0 = _mm256_cvtepi32_ps(VNNI ? acc[2 * r][k] : _mm256_madd_epi16(acc[2 * r][k], ones));
          __m256 n1 = _mm256_cvtepi32_ps(VNNI ? acc[2 * r + 1][k]
                                              : _mm256_madd_epi16(acc[2 * r + 1][k], ones));
          __m256 v = _mm256_mul_ps(n0, _mm256_set1_ps(c.d.scale[dr]));
          v = _mm256_fmadd_ps(n1, _mm256_set1_ps(c.d.scale[dr + 1]), v);
          float* yp = y + r * c.out + 8 * k;
          __m256 acc_y = _mm256_fmadd_ps(v, ws, _mm256_loadu_ps(yp));
          acc_y = _mm256_fmadd_ps(_mm256_set1_ps(c.d.block_sum[(r0 + r) * blocks + b]), wl, acc_y);
          _mm256_storeu_ps(yp, acc_y);
        }
      }
    }
  }
}

#else
#error "needs AVX-512F/BW/VNNI or AVX2 + FMA + F16C (graphs/cpu_kernels.py's build flags)"
#endif

void quantize(const float* x, int64_t R, int64_t in, Digits& d) {
  using F = V::F;
  d.x.resize(2 * R * in); d.scale.resize(2 * R); d.sum.resize(2 * R);
  d.block_sum.resize(R * (in / 32));
  std::vector<float> rest(in);
  for (int64_t r = 0; r < R; ++r) {
    std::copy(x + r * in, x + (r + 1) * in, rest.begin());
    for (int64_t b = 0; b < in / 32; ++b) d.block_sum[r * (in / 32) + b] = V::sum32(&rest[32 * b]);
    for (int digit = 0; digit < 2; ++digit) {
      F m = V::set1(0.0f);
      for (int64_t i = 0; i < in; i += V::W) m = V::max(m, V::abs(V::load(&rest[i])));
      float amax = V::reduce_max(m);
      float s = amax > 0 ? amax / 127.0f : 1.0f;
      F sv = V::set1(s), lim = V::set1(127.0f), neg = V::set1(-127.0f);
      int8_t* xq = d.x.data() + (2 * r + digit) * in;
      V::I sum = V::izero();
      for (int64_t i = 0; i < in; i += V::W) {
        F v = V::load(&rest[i]);
        F n = V::min(lim, V::max(neg, V::round(V::div(v, sv))));
        V::I ni = V::cvt(n);
        V::store_i8(xq + i, ni);
        sum = V::iadd(sum, ni);
        V::store(&rest[i], V::fnmadd(n, sv, v));
      }
      d.scale[2 * r + digit] = s;
      d.sum[2 * r + digit] = 128 * V::reduce_add(sum);
    }
  }
}

// RB rows from r of the 64 columns from o0 on the vector tiles; `vnni`: AVX-VNNI's (AVX2)
template <bool INT4, int RB>
inline void tile(const Call& c, int64_t r, int64_t o0, bool vnni) {
#if defined(__AVX512F__)
  INT4 ? tile4<RB>(c, r, o0) : tile8<RB>(c, r, o0);
#else
  if (vnni) INT4 ? tile4<RB, true>(c, r, o0) : tile8<RB, true>(c, r, o0);
  else INT4 ? tile4<RB, false>(c, r, o0) : tile8<RB, false>(c, r, o0);
#endif
}

template <bool INT4>
void run_cols(const Call& c, int64_t c0, int64_t c1) {
#if defined(__AVX512F__)
  const int64_t tiled = INT4 ? 0 : amx_rows(c.R, c.in);  // the AMX tiles' rows, the rest VNNI's
  const bool vnni = false;
  if (tiled) amx_begin();
#else
  const int64_t tiled = 0;
  const bool vnni = g_avx_vnni.load(std::memory_order_relaxed);
#endif
  for (int64_t o0 = c0; o0 < c1; o0 += 64) {
    int64_t r = tiled;
#if defined(__AVX512F__)
    if (tiled) amx_tile8(c, tiled, o0);
#endif
    for (; r + kRows <= c.R; r += kRows) tile<INT4, kRows>(c, r, o0, vnni);
    if (r < c.R) tile<INT4, 1>(c, r, o0, vnni);
  }
#if defined(__AVX512F__)
  if (tiled) _tile_release();
#endif
}

// A call shares its column tiles with other threads when one thread would take at least
// this long (weights read at ~17 GB/s or ~110 G multiply-adds/s per thread, measured here):
// shorter calls lose more waiting for a pool thread to wake than they gain. 10 us measured best
// on a quiet machine (100: the one-row step 1.10x slower); on cores other work keeps busy,
// threads can lose.
constexpr double kThreadedMicros = 10;

template <bool INT4>
struct Shared : Job {  // heap-held: a helper or pool task may start after the call has returned
  Call c;
  int64_t tiles = 0, chunk = 1;
  std::atomic<int64_t> next{0};
  void work() override {
    for (int64_t k; (k = next.fetch_add(1)) * chunk < tiles;) {
      run_cols<INT4>(c, k * chunk * 64, std::min(tiles, (k + 1) * chunk) * 64);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

template <bool INT4>
ffi::Error Linear(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> q,
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
  sh->total = (tiles + sh->chunk - 1) / sh->chunk;
  run_shared(pool, sh, threads - 1, 4096);
  return ffi::Error::Success();
}

ffi::Error Int8Linear(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                      ffi::Buffer<ffi::U8> q, ffi::Buffer<ffi::F32> scale,
                      ffi::Buffer<ffi::S32> live, ffi::ResultBuffer<ffi::F32> y) {
  return Linear<false>(pool, x, q, scale, nullptr, live.typed_data()[0], y);
}

ffi::Error Int4Linear(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                      ffi::Buffer<ffi::U8> q, ffi::Buffer<ffi::F32> scale,
                      ffi::Buffer<ffi::F32> low, ffi::Buffer<ffi::S32> live,
                      ffi::ResultBuffer<ffi::F32> y) {
  return Linear<true>(pool, x, q, scale, low.typed_data(), live.typed_data()[0], y);
}

}  // namespace

// asks for the ISA's extension (AVX-512: the AMX tiles; AVX2: AVX-VNNI) with on = 1, or turns it
// off (0); whether it runs now
#if defined(__AVX512F__)
extern "C" int MAXJAX_SYMBOL(maxjax_extension)(int on) { return amx_enable(on); }
#else
extern "C" int MAXJAX_SYMBOL(maxjax_extension)(int on) { return avx_vnni_enable(on); }
#endif

XLA_FFI_DEFINE_HANDLER_SYMBOL(MAXJAX_SYMBOL(maxjax_int8_linear), Int8Linear,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(MAXJAX_SYMBOL(maxjax_int4_linear), Int4Linear,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
