// The AMX-INT8 tiles of quant_linear.cc's AVX-512 build, for int8 calls of 8 rows or more (16
// digit rows fill a tile's 16 rows) whose inputs are a multiple of 64. tdpbsud (signed
// activation bytes x unsigned weight bytes) gives the same int32 sums as vpdpbusd over the same
// packed layout, and the float epilogue is tile8's, op for op: the outputs are the VNNI path's
// to the bit, so neither a cache entry nor an artifact depends on whether the tiles ran. The
// rows past a multiple of 8 go through the VNNI tiles.
// Tiles: 0-3 the int32 sums of 16 digit rows x 16 columns each (the 64 columns of a column
// tile), 4 the digit rows' next 64 inputs, 5 a weight tile: 16 byte groups (64 inputs) x 16
// columns x 4 bytes, read in place from the packed [out/64, in/4, 64, 4] (256-byte row stride).
// The 4-bit blocks stay on VNNI: each block of 32 inputs needs its own float epilogue, and
// through tiles (stored to memory, read back) that measured no faster (BENCHMARKS.md).
// Linux hands out the tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM), once a
// process; `maxjax_extension_avx512` (quant_linear.cc) asks for it and says whether the tiles run.
#include <sys/syscall.h>
#include <unistd.h>

std::atomic<bool> g_amx{false};

constexpr int kAmxRows = 8;    // real rows a tile

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

bool amx_enable(bool on) {
  static const bool can = [] {
    unsigned a, b, c, d;
    return __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d >> 24 & 1) && (d >> 25 & 1) &&
           syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  }();
  g_amx.store(on && can);
  return on && can;
}

void amx_begin() {
  TileConfig t;
  for (int i = 0; i < 6; ++i) { t.rows[i] = 16; t.colsb[i] = 64; }
  _tile_loadconfig(&t);
}

// C tiles 0-3 to acc (16 digit rows x 64 columns)
inline void store_sums(int32_t (*acc)[64]) {
  _tile_stored(0, &acc[0][0], 256); _tile_stored(1, &acc[0][16], 256);
  _tile_stored(2, &acc[0][32], 256); _tile_stored(3, &acc[0][48], 256);
}

// An AMX store read back at once by vector loads stalls until it lands: each row tile's sums
// go into one of two buffers, and the previous row tile's through the epilogue meanwhile.
struct Sums {
  alignas(64) int32_t acc[2][16][64];
  int slot = 0;
  int64_t r0 = -1;             // the row tile the other buffer holds (< 0: none)
  template <class Epilogue>
  void put(int64_t next, Epilogue&& epilogue) {
    store_sums(acc[slot]);
    flush(epilogue);
    r0 = next; slot ^= 1;
  }
  template <class Epilogue>
  void flush(Epilogue&& epilogue) {
    if (r0 >= 0) epilogue(acc[slot ^ 1], r0);
    r0 = -1;
  }
};

// rows 0 .. rows - 1 (a multiple of 8) x 64 columns from o0: tile8's arithmetic
__attribute__((noinline)) void amx_tile8(const Call& c, int64_t rows, int64_t o0) {
  const int64_t in = c.in;
  const uint8_t* qp = c.q + o0 * in;
  auto epilogue = [&](int32_t (*acc)[64], int64_t r0) {
    UNROLL for (int k = 0; k < 4; ++k) {
      __m512 ws = _mm512_loadu_ps(c.scale + o0 + 16 * k);
      for (int r = 0; r < kAmxRows; ++r) {
        __m512 v = _mm512_setzero_ps();
        UNROLL for (int digit = 0; digit < 2; ++digit) {
          int64_t dr = 2 * (r0 + r) + digit;
          __m512i n = _mm512_sub_epi32(_mm512_load_si512(&acc[2 * r + digit][16 * k]),
                                       _mm512_set1_epi32(c.d.sum[dr]));
          v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(n), _mm512_set1_ps(c.d.scale[dr]), v);
        }
        _mm512_storeu_ps(c.y + (r0 + r) * c.out + o0 + 16 * k, _mm512_mul_ps(v, ws));
      }
    }
  };
  Sums sums;
  for (int64_t r0 = 0; r0 < rows; r0 += kAmxRows) {
    const int8_t* xp = c.d.x.data() + 2 * r0 * in;
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    for (int64_t k0 = 0; k0 < in; k0 += 64) {
      const uint8_t* bp = qp + 64 * k0;          // byte group k0 / 4, 256 bytes each
      _tile_loadd(4, xp + k0, in);
      _tile_loadd(5, bp, 256); _tile_dpbsud(0, 4, 5);
      _tile_loadd(5, bp + 64, 256); _tile_dpbsud(1, 4, 5);
      _tile_loadd(5, bp + 128, 256); _tile_dpbsud(2, 4, 5);
      _tile_loadd(5, bp + 192, 256); _tile_dpbsud(3, 4, 5);
    }
    sums.put(r0, epilogue);
  }
  sums.flush(epilogue);
}

// the rows the tiles take in an int8 call of R rows and `in` inputs (0: none)
inline int64_t amx_rows(int64_t R, int64_t in) {
  return g_amx.load(std::memory_order_relaxed) && in % 64 == 0 ? R / kAmxRows * kAmxRows : 0;
}
