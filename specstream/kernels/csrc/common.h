// Helpers shared by specstream's CPU kernels (kernels/cpu.py builds every .cpp here into one library).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <type_traits>
#include <vector>

#if defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif
#if defined(__AMX_TILE__)
#include <ATen/Parallel.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <memory>
#endif

namespace specstream_kernels {

#if defined(CPU_CAPABILITY_AVX512)
// A row's 16 float32 sums (a tile of outputs) stored in T, each rounded once.
template <typename T>
inline void store_tile(T* y, __m512 v) {
  if constexpr (std::is_same_v<T, float>) {
    _mm512_storeu_ps(y, v);
  } else {
    alignas(64) float tmp[16];
    _mm512_store_ps(tmp, v);
    for (int64_t i = 0; i < 16; ++i) y[i] = static_cast<T>(tmp[i]);
  }
}
#endif

#if defined(__AMX_TILE__)
// AMX's tile configuration (palette 1): rows and bytes per row of each of the 8 tiles.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Whether this process may use AMX tiles: Linux lends a process the tiles' register state only when asked
// (arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA); a kernel that does not know the request (older than
// 5.16) has no AMX for us.
inline bool amx_ready() {
  static const bool ready = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ready;
}

// The tiles of the bfloat16 kernels (q4_linear, q8_linear): 0, 1 C (rows x 16 float32 sums); 2, 3 A (rows x 32
// bfloat16 values of x); 4, 5 B (a block's 16 pairs of 32 inputs x 16 outputs). Per thread: bf16_tile_passes.
inline void configure_bf16_tiles(int64_t rows) {
  TileConfig cfg;
  for (int t : {0, 1, 2, 3}) cfg.rows[t] = static_cast<uint8_t>(rows), cfg.colsb[t] = 64;
  for (int t : {4, 5}) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  // Not _tile_loadconfig: GCC 12's declares only the first 8 bytes as read, so the stores of the rest may be
  // dropped or moved past it (the tiles then stay unconfigured: SIGILL at the first tile load).
  __asm__ volatile("ldtilecfg %0" : : "m"(cfg));
}

// One tile of 16 outputs against up to 16 rows, block by block, two blocks in flight on tiles 0, 1 (C), 2, 3 (A) and
// 4, 5 (B): A is block g's inputs of the rows (at a_at(g), the rows `stride` bytes apart, read in place), B is
// fill_b(g, scratch) (filled into scratch, 1 KiB, 64-byte aligned; or elsewhere, its address returned), Dot multiplies
// them into C (first: tiles 0 += 2 x 4, second: 1 += 3 x 5; TDPBF16PS, TDPBSUD: GCC's macros take literal tile numbers), and epilogue(sums, g) reads C's 16 x 16 sums back (row r's 16 at
// sums + 16 r: Sum is float or int32). The caller configured the tiles for its rows.
template <typename Dot, typename Sum, typename AAt, typename FillB, typename Epilogue>
inline void tile_blocks(int64_t blocks, int64_t stride, AAt&& a_at, FillB&& fill_b, Epilogue&& epilogue) {
  alignas(64) uint8_t s0[1024], s1[1024];
  alignas(64) Sum c0[16 * 16], c1[16 * 16];
  int64_t g = 0;
  for (; g + 1 < blocks; g += 2) {
    const void* b0 = fill_b(g, s0);
    const void* b1 = fill_b(g + 1, s1);
    _tile_loadd(2, a_at(g), stride);
    _tile_loadd(4, b0, 64);
    _tile_zero(0);
    Dot::first();
    _tile_loadd(3, a_at(g + 1), stride);
    _tile_loadd(5, b1, 64);
    _tile_zero(1);
    Dot::second();
    _tile_stored(0, c0, 64);
    _tile_stored(1, c1, 64);
    epilogue(c0, g);
    epilogue(c1, g + 1);
  }
  if (g < blocks) {
    const void* b0 = fill_b(g, s0);
    _tile_loadd(2, a_at(g), stride);
    _tile_loadd(4, b0, 64);
    _tile_zero(0);
    Dot::first();
    _tile_stored(0, c0, 64);
    epilogue(c0, g);
  }
}

// The unpacked weights a thread keeps for its passes over a group of tiles (kept_tile_passes): a few tiles' worth, so
// that they stay in the core's L2 while every pass reads them.
constexpr int64_t kKeptBytes = 256 * 1024;

// One thread's tiles begin .. end against m_rows rows (more than 16) in passes of up to 16, a group of tiles at a time
// (as many as kKeptBytes of unpacked weights hold, tile_bytes a tile): configure(rows) sets the tiles up for a pass of
// `rows`, and pass(t, m0, rows, kept, fill) runs pass m0 over tile t, `kept` its tile's unpacked weights (64-byte
// aligned), to be filled where `fill` (the group's first pass) and read back by the other passes. The weights are
// then read and unpacked once for all the rows, and a second pass costs the tiles' own work, not a second read and
// unpacking of every weight. Tile state is per thread, and other libraries on these threads (oneDNN) configure it
// for themselves: the tiles are configured for each run of passes of one height and released after each group.
template <typename Configure, typename Pass>
inline void kept_tile_passes(int64_t begin, int64_t end, int64_t m_rows, int64_t tile_bytes, Configure&& configure,
                             Pass&& pass) {
  if (begin >= end) return;
  const int64_t group = std::max<int64_t>(1, kKeptBytes / tile_bytes);
  const std::unique_ptr<uint8_t, decltype(&std::free)> owned(
      static_cast<uint8_t*>(std::aligned_alloc(64, std::min(group, end - begin) * tile_bytes)), &std::free);
  uint8_t* kept = owned.get();
  TORCH_CHECK(kept != nullptr, "kept_tile_passes: out of memory");
  for (int64_t t0 = begin; t0 < end; t0 += group) {
    const int64_t t1 = std::min(end, t0 + group);
    int64_t configured = 0;
    for (int64_t m0 = 0; m0 < m_rows; m0 += 16) {
      const int64_t rows = std::min<int64_t>(16, m_rows - m0);
      if (rows != configured) configure(configured = rows);
      for (int64_t t = t0; t < t1; ++t) pass(t, m0, rows, kept + (t - t0) * tile_bytes, m0 == 0);
    }
    _tile_release();
  }
}

#if defined(__AMX_BF16__)
struct DotBf16 {
  static void first() { _tile_dpbf16ps(0, 2, 4); }
  static void second() { _tile_dpbf16ps(1, 3, 5); }
};

// rows (<= 16) rows of bfloat16 x (its bits, row stride k) against one tile of 16 outputs, per block of 32 inputs:
// fill_b(g, buf) writes block g's B tile (its 16 code-pair vectors, 1 KiB), TDPBF16PS multiplies the rows' 32 values
// into 16 x 16 float32 sums, and epilogue(sums, g) applies block g's scales to them (tile_blocks). The caller
// configured the tiles (configure_bf16_tiles(rows)).
// kept: where not null, the tile's B for every block (k / 32 blocks of 512 bfloat16 bits, 64-byte aligned), which
// fill_b fills where `fill` (the first pass of rows over the tile) and a later pass reads as it was left, so that the
// codes are read and unpacked once for all the passes (bf16_tile_passes); null: B goes through the scratch blocks.
template <typename FillB, typename Epilogue>
inline void bf16_tile_blocks(const uint16_t* x, int64_t k, FillB&& fill_b, Epilogue&& epilogue,
                             uint16_t* kept = nullptr, bool fill = true) {
  tile_blocks<DotBf16, float>(
      k / 32, k * static_cast<int64_t>(sizeof(uint16_t)), [&](int64_t g) { return x + g * 32; },
      [&](int64_t g, uint8_t* scratch) -> const void* {
        uint16_t* b = kept != nullptr ? kept + g * 512 : reinterpret_cast<uint16_t*>(scratch);
        if (kept == nullptr || fill) fill_b(g, b);
        return b;
      },
      epilogue);
}

#if defined(CPU_CAPABILITY_AVX512)
// y [m_rows, 16 * tiles] (row stride n) through AMX-BF16 tiles: every tile of outputs against the rows in passes of up
// to 16, tile(t, m0, rows, out, kept, fill) leaving pass m0's sums of tile t in out, stored to y (each rounded once to
// T); kept and fill go to bf16_tile_blocks. Up to 16 rows, one pass over every tile; past 16, kept_tile_passes: each
// weight unpacked once for every pass. A row's sums are the same either way (the same B, the same order). Tile state
// is per thread, and other libraries on these threads (oneDNN) configure it for themselves: the tiles are configured
// here and released after the passes.
template <typename T, typename Tile>
inline void bf16_tile_passes(int64_t tiles, int64_t m_rows, int64_t n, int64_t k, T* y, Tile&& tile) {
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    __m512 out[16];
    if (m_rows <= 16) {
      configure_bf16_tiles(m_rows);
      for (int64_t t = begin; t < end; ++t) {
        tile(t, int64_t{0}, m_rows, out, static_cast<uint16_t*>(nullptr), true);
        for (int64_t r = 0; r < m_rows; ++r) store_tile(y + r * n + t * 16, out[r]);
      }
      _tile_release();
      return;
    }
    kept_tile_passes(begin, end, m_rows, (k / 32) * 1024, configure_bf16_tiles,
                     [&](int64_t t, int64_t m0, int64_t rows, uint8_t* kept, bool fill) {
                       tile(t, m0, rows, out, reinterpret_cast<uint16_t*>(kept), fill);
                       for (int64_t r = 0; r < rows; ++r) store_tile(y + (m0 + r) * n + t * 16, out[r]);
                     });
  });
}
#endif
#endif
#endif

using Vec = at::vec::Vectorized<float>;

// The sum of a vector's lanes.
inline float sum_lanes(const Vec& x) {
#if defined(CPU_CAPABILITY_AVX512)
  return x.reduce_add();
#else
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, x);
#endif
}

// A row of k values (`stride` apart) as float32; bfloat16 and float16 contiguous rows a vector at a time (exact:
// each is a float32).
template <typename T>
inline void widen_row(const T* row, int64_t stride, float* out, int64_t k) {
  int64_t j = 0;
  if constexpr (std::is_same_v<T, at::BFloat16> || std::is_same_v<T, at::Half>) {
    if (stride == 1) {
      for (; j + 2 * Vec::size() <= k; j += 2 * Vec::size()) {
        auto [lo, hi] = at::vec::convert_to_float<T>(at::vec::Vectorized<T>::loadu(row + j));
        lo.store(out + j);
        hi.store(out + j + Vec::size());
      }
    }
  }
  for (; j < k; ++j) out[j] = static_cast<float>(row[j * stride]);
}

// x [M, K] as float32, row by row (a vector rather than a tensor: no dispatch for so small a copy).
inline std::vector<float> as_float(const at::Tensor& x) {
  const int64_t m = x.size(0), k = x.size(1);
  std::vector<float> out(m * k);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "as_float", [&] {
    for (int64_t r = 0; r < m; ++r) widen_row(x.data_ptr<scalar_t>() + r * x.stride(0), x.stride(1), out.data() + r * k, k);
  });
  return out;
}

}  // namespace specstream_kernels
