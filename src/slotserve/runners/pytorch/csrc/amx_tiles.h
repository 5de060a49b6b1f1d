// AMX tiles (Intel Xeon, Sapphire Rapids and later), shared by the projections' GEMMs
// (gemm_amx.h, quant_amx.h) and attention (attend_amx.h): the unit itself, its arithmetic
// emulated, and whether this process may use it. Included at file scope, outside any target
// region: inline assembly needs no target flags, and the emulation is plain scalar code.
//
// `Tiles` is the real unit (inline assembly: GCC 12's `_tile_loadconfig` declares an 8-byte
// memory operand and drops the stores of the 64-byte configuration as dead, the bug that
// crashes ggml's AMX kernel); `EmulatedTiles` is the SDM's TDPBF16PS in scalar fused steps (the
// even and the odd products of a tile summed apart from zero, then their sum added to C;
// denormals flushed) and its TDPBSSD (signed bytes times signed bytes, four products a lane
// summed into int32: exact, so any order gives its bits), so the same kernel code runs on any CPU for the
// tests, and an AMX host checks that the unit gives the emulation's bits on a small problem
// before it serves.
#pragma once

#include <sys/syscall.h>
#include <unistd.h>

#include <cpuid.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace amx {

constexpr int kRows = 16;       // rows of an A or C tile
constexpr int kPairs = 16;      // input pairs one instruction reduces (A: 16 x 64 bytes)
constexpr int kLanes = 16;      // outputs of a block: columns of a C tile

struct alignas(64) TileConfig {
    uint8_t palette = 1, start_row = 0;
    uint8_t reserved0[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
};

// Every tile 16 rows of 64 bytes: the bfloat16 kernels' only shape.
inline TileConfig full_tiles() {
    TileConfig config;
    for (int t = 0; t < 8; ++t) {
        config.colsb[t] = 64;
        config.rows[t] = kRows;
    }
    return config;
}

// The int8 kernel's shapes for sub-blocks of `inputs` (16 or 32) bytes: C tiles 0-3 full (16
// rows of 16 int32), A tiles 4 and 5 16 rows of `inputs` bytes, B tiles 6 and 7 `inputs` / 4
// rows of sixteen outputs' four bytes.
inline TileConfig byte_tiles(int inputs) {
    TileConfig config = full_tiles();
    for (int t = 4; t < 6; ++t) config.colsb[t] = uint16_t(inputs);
    for (int t = 6; t < 8; ++t) config.rows[t] = uint8_t(inputs / 4);
    return config;
}

// The hardware unit. Tile numbers are immediates (`%c`); each instruction is volatile with a
// memory clobber, so loads see the padding written before them.
struct Tiles {
    Tiles() {
        static const TileConfig config = full_tiles();
        asm volatile("ldtilecfg %0" ::"m"(config));
    }
    explicit Tiles(const TileConfig& config) { asm volatile("ldtilecfg %0" ::"m"(config)); }
    ~Tiles() { asm volatile("tilerelease" ::: "memory"); }
    Tiles(const Tiles&) = delete;
    Tiles& operator=(const Tiles&) = delete;
    template <int T>
    void zero() {
        asm volatile("tilezero %%tmm%c0" ::"i"(T));
    }
    template <int T>
    void load(const void* p, int64_t stride) {
        asm volatile("tileloadd (%0,%1,1), %%tmm%c2" ::"r"(p), "r"(stride), "i"(T) : "memory");
    }
    template <int T>
    void store(void* p, int64_t stride) {
        asm volatile("tilestored %%tmm%c2, (%0,%1,1)" ::"r"(p), "r"(stride), "i"(T) : "memory");
    }
    template <int C, int A, int B>
    void dot() {
        asm volatile("tdpbf16ps %%tmm%c0, %%tmm%c1, %%tmm%c2" ::"i"(B), "i"(A), "i"(C));
    }
    template <int C, int A, int B>
    void dot_bytes() {
        asm volatile("tdpbssd %%tmm%c0, %%tmm%c1, %%tmm%c2" ::"i"(B), "i"(A), "i"(C));
    }
};

static inline float bf16_in(uint16_t bits) {  // input denormals are zero, as the unit reads them
    const uint32_t word =
        (bits & 0x7f80) == 0 ? uint32_t(bits & 0x8000) << 16 : uint32_t(bits) << 16;
    float f;
    std::memcpy(&f, &word, sizeof(f));
    return f;
}

static inline float flushed(float f) {  // output denormals are zero
    return std::fabs(f) < 1.17549435e-38f ? std::copysign(0.0f, f) : f;
}

// The SDM's TDPBF16PS and TDPBSSD in scalar steps, on tiles held in memory in the shapes
// `config` gives them (loads and stores move each tile's rows and bytes, as the unit's do).
struct EmulatedTiles {
    alignas(64) uint8_t reg[8][kRows][64];
    TileConfig config;

    EmulatedTiles() : config(full_tiles()) {}
    explicit EmulatedTiles(const TileConfig& c) : config(c) {}
    template <int T>
    void zero() {
        std::memset(reg[T], 0, sizeof(reg[T]));
    }
    template <int T>
    void load(const void* p, int64_t stride) {
        std::memset(reg[T], 0, sizeof(reg[T]));
        for (int r = 0; r < config.rows[T]; ++r)
            std::memcpy(reg[T][r], static_cast<const uint8_t*>(p) + r * stride, config.colsb[T]);
    }
    template <int T>
    void store(void* p, int64_t stride) {
        for (int r = 0; r < config.rows[T]; ++r)
            std::memcpy(static_cast<uint8_t*>(p) + r * stride, reg[T][r], config.colsb[T]);
    }
    template <int C, int A, int B>
    void dot_bytes() {
        for (int m = 0; m < config.rows[A]; ++m)
            for (int n = 0; n < config.colsb[C] / 4; ++n) {
                uint32_t c;  // wrapping, as the unit's int32 sums
                std::memcpy(&c, &reg[C][m][4 * n], 4);
                for (int k = 0; k < config.colsb[A] / 4; ++k)
                    for (int i = 0; i < 4; ++i)
                        c += uint32_t(int32_t(int8_t(reg[A][m][4 * k + i])) *
                                      int32_t(int8_t(reg[B][k][4 * n + i])));
                std::memcpy(&reg[C][m][4 * n], &c, 4);
            }
    }
    template <int C, int A, int B>
    void dot() {
        for (int m = 0; m < kRows; ++m) {
            uint16_t a[2 * kPairs];
            float c[kLanes], even[kLanes] = {}, odd[kLanes] = {};
            std::memcpy(a, reg[A][m], sizeof(a));
            std::memcpy(c, reg[C][m], sizeof(c));
            for (int k = 0; k < kPairs; ++k) {
                uint16_t b[2 * kLanes];
                std::memcpy(b, reg[B][k], sizeof(b));
                for (int n = 0; n < kLanes; ++n) {
                    even[n] = flushed(std::fma(bf16_in(a[2 * k]), bf16_in(b[2 * n]), even[n]));
                    odd[n] =
                        flushed(std::fma(bf16_in(a[2 * k + 1]), bf16_in(b[2 * n + 1]), odd[n]));
                }
            }
            for (int n = 0; n < kLanes; ++n) c[n] = flushed(c[n] + flushed(even[n] + odd[n]));
            std::memcpy(reg[C][m], c, sizeof(c));
        }
    }
};

// The inputs of the checks at load (a fixed linear congruential sequence): bfloat16 values
// with exponents near 1 and mixed signs, so every product matters to a sum and a unit that
// sums otherwise shows it.
struct CheckValues {
    uint32_t state;
    uint32_t next() { return state = state * 1664525u + 1013904223u; }
    uint16_t bf16() {
        return uint16_t(uint16_t(0x3c00 + (next() >> 20) % 0x0400) | (next() & 0x8000));
    }
};

// AMX-BF16 present, enabled by the OS, and this process allowed to use its tile data (Linux
// asks every process to request it: arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)).
inline bool runs_amx() {
    static const bool ok = [] {
        unsigned a, b, c, d;
        if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
        const bool tile = d & (1u << 24), bf16 = d & (1u << 22);
        if (!tile || !bf16 || !__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 27))) return false;
        uint32_t lo, hi;
        asm volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
        if ((lo & (3u << 17)) != (3u << 17)) return false;  // XTILECFG and XTILEDATA
#ifdef SYS_arch_prctl
        constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
        return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
#else
        return false;
#endif
    }();
    return ok;
}

}  // namespace amx
