// AMX tile configuration shared by the AMX build's micro-kernels (amx/q4_gemm.h, amx/q6_gemm.h).
//
// A tile configuration is per thread: each thread's chunk of a product's column groups loads its own (the shapes of
// its row tile and of its weight tiles; a micro-kernel call loads it where the chunk did not) and puts back what the
// thread had before when done (TileScope), so neither our kernels nor other AMX code in the process (oneDNN,
// llama.cpp) ever runs with another kernel's shapes. Linux hands a process the tile state only once it asks (arch_prctl ARCH_REQ_XCOMP_PERM):
// eaglespec.backends.cpu.kernels asks before it picks this build, and `request_tiles` asks again when the library
// loads (a process that loads it by hand).

#pragma once

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <optional>

namespace eaglespec::amx {
namespace {

constexpr int kArchReqXcompPerm = 0x1023;  // arch_prctl: ask for an extended state component
constexpr int kXfeatureXtiledata = 18;     // the tiles' data

inline bool request_tiles() { return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0; }
[[maybe_unused]] const bool kTilesGranted = request_tiles();

// The 64-byte tile configuration (palette 1): rows and bytes per row of tiles 0-7.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};

  TileConfig& tile(int t, int rows_, int bytes) {
    rows[t] = static_cast<uint8_t>(rows_);
    colsb[t] = static_cast<uint16_t>(bytes);
    return *this;
  }
  const void* bytes() const { return this; }
};
static_assert(sizeof(TileConfig) == 64, "a tile configuration is 64 bytes");

// Loads a configuration for the scope's lifetime, then puts back the thread's previous one (or releases the tiles
// where there was none). Other AMX code in the process (llama.cpp's ggml, oneDNN) may configure a thread's tiles once
// and count on the configuration staying: releasing it under them makes their next tile instruction fault.
class TileScope {
 public:
  explicit TileScope(const TileConfig& config) {
    _tile_storeconfig(&previous_);
    _tile_loadconfig(config.bytes());
  }
  ~TileScope() {
    if (previous_.palette != 0)
      _tile_loadconfig(previous_.bytes());
    else
      _tile_release();
  }
  TileScope(const TileScope&) = delete;
  TileScope& operator=(const TileScope&) = delete;

 private:
  TileConfig previous_;
};

// A thread's chunk of a product's column groups, in a call of up to Kernel::kTileRows rows: the kernel's tiles
// (Kernel::tiles_for(rows)) configured once for all of its groups, not per micro-kernel call (a 1-row step of the 1.5B
// makes 20,000 of them), the thread's previous configuration back after. A call of more rows configures per
// micro-kernel call (`ensure`), its last tile having fewer rows.
template <typename Kernel>
class ChunkScope {
 public:
  explicit ChunkScope(int64_t rows) {
    if (rows <= Kernel::kTileRows) {
      scope_.emplace(Kernel::tiles_for(static_cast<int>(rows)));
      configured_ = static_cast<int>(rows);
    }
  }
  ~ChunkScope() { configured_ = 0; }
  ChunkScope(const ChunkScope&) = delete;
  ChunkScope& operator=(const ChunkScope&) = delete;

  // In a micro-kernel call of R rows: the tiles for R rows in `scope` where the chunk did not configure them.
  static void ensure(std::optional<TileScope>& scope, int R) {
    if (configured_ != R) scope.emplace(Kernel::tiles_for(R));
  }

 private:
  static inline thread_local int configured_ = 0;  // the rows this thread's chunk configured the tiles for
  std::optional<TileScope> scope_;
};

}  // namespace
}  // namespace eaglespec::amx
