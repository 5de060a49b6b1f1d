// What every translation unit of the CPU kernels shares: the operands' layouts, the attention
// constants, and the table of one instruction set's kernels. Each kernels_<isa>.cpp names its
// set and compiles isa_kernels.h (vec.h, rowwise.h, attention.h, attend.h, gemm_vec.h,
// quant_pairs.h, quant_byte_pairs.h, quant_scales.h, quant_gemm.h with quant_amx.h,
// quant_panel.h, kv_rows.h) inside its own target region and namespace, with no torch header,
// and hands out its table; cpu_kernels.cpp chooses one at run time, and the ops (cpu_kernels.h)
// call it.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

struct HeadLayout {
    int heads, kv_heads, head_dim, rotary_dim;
    bool gated;              // each query head's rows are [query | gate]
    const uint16_t* q_norm;  // per-head RMSNorm weights, or null
    const uint16_t* k_norm;
    float eps;
    bool plus_one;
};

// The int8 KV pool (--kv-cache-dtype int8): a head's row of one position holds head_dim int8
// codes, then their float32 scale (kKvScaleBytes): value = bfloat16(code · scale), with scale =
// max |x| / 127 and code = rne(x · (127 / max |x|)) at the write (row_ops.cpp). A lone row's
// partition reads the rows in registers (attend_heads.h); every other path reads a partition's
// rows back as bfloat16 (kv_rows.h), then runs as over a bfloat16 pool.
constexpr int kKvScaleBytes = 4;

// The scale of the int8 row at ``row`` (``d`` codes).
static inline float int8_row_scale(const uint8_t* row, int d) {
    float scale;
    std::memcpy(&scale, row + d, sizeof(scale));
    return scale;
}

// The 16-bit units of one KV head's row of ``head_dim`` values, bfloat16 or int8 with its scale:
// offsets into the pool count in them.
constexpr int row_units_of(int head_dim, bool int8) {
    return int8 ? (head_dim + kKvScaleBytes) / 2 : head_dim;
}

struct PagedKv {
    const uint16_t* keys;  // [rows, kv_heads, head_dim], or an int8 pool's rows
    const uint16_t* values;
    int kv_heads, head_dim, block_size;
    bool int8 = false;  // the pool's rows are int8 codes and their scale
};

static inline int row_units(const PagedKv& kv) { return row_units_of(kv.head_dim, kv.int8); }

// Keys are reduced in partitions of this many absolute positions (partition k holds positions
// [k * P, (k + 1) * P)): a token's partitions depend on its position and window only.
constexpr int kPartition = 256;
// Floats from one row-head's scores to the next: a power of two would put a tile's rows in a
// few level-1 cache sets.
constexpr int kScoreStride = kPartition + 16;
constexpr int kMaxPairChunks = 8;  // head_dim up to 256, in vectors of 16 bfloat16 pairs
// Query rows of one sequence computed together: each transposed key serves them all, and their
// scores and probabilities (~150 KiB at group 3) stay in the level-2 cache.
constexpr int kTileRows = 32;
// Consecutive tiles of one chunk that a thread computes partition by partition, each partition's
// keys transposed (on AMX tiles its values laid out too) once for all of them (Tile::ready).
constexpr int kRunTiles = 4;
// Per-thread vector scratch: a partition's keys transposed (sixteen at a place), then a block
// of key pairs' values (eight pairs of two float32 rows of up to 256 dimensions each, the
// emulation's larger form, or as many pairs of a smaller form in as many bytes), or a
// partition's values as AMX B tiles (up to 256 dimensions in bfloat16).
constexpr int kKeysBytes = kPartition / 16 * kMaxPairChunks * 16 * 64;
constexpr int kVectorScratch = kKeysBytes + kPartition * 256 * 2;

// The attention shapes compiled with head_dim (CH vectors of sixteen) and group (G) known, as
// X(CH, G): attend.h, attend_heads.h and attend_amx_unit_row.h dispatch on it; every other
// shape runs their generic code (attend.h) or the tiles (attend_amx.h).
#define SLOTSERVE_ATTENTION_SHAPES(X) \
    X(4, 1) X(4, 2) X(4, 3) X(4, 4) X(4, 5) X(4, 6) X(8, 1) X(8, 2) X(8, 3) X(8, 4) X(16, 1)
#define SLOTSERVE_SHAPE_CODE(head_dim, group) ((head_dim) / 16 * 100 + (group))

static inline bool compiled_attention_shape(int64_t head_dim, int64_t group) {
#define SLOTSERVE_SHAPE_IS(CH, G) || (head_dim == CH * 16 && group == G)
    return false SLOTSERVE_ATTENTION_SHAPES(SLOTSERVE_SHAPE_IS);
#undef SLOTSERVE_SHAPE_IS
}

// What a thread's scratch already holds of one partition for the next tile of the same chunk:
// its first ``keys`` keys transposed (keys_t), its first ``values`` keys' values as AMX B tiles
// (attend_amx.h; values).
struct PartitionReady {
    int keys = 0, values = 0;
};

// One partition of a tile of query rows, for attend_tile (attend.h): where its keys start, and
// its rows, scratch and results.
struct Tile {
    const uint16_t* q;  // [rows * group][q_stride] bfloat16, zero past head_dim
    int q_stride;       // head_dim rounded up to whole vectors of pairs
    int group, rows;
    const int* n;       // keys of each row in this partition, ascending (0: ends before it)
    int start;          // the partition's first key (absolute position)
    float scale;
    float* scores;      // [rows * group][kScoreStride]
    uint16_t* probs;    // [rows * group][kPartition + 2], bfloat16
    void* keys_t;       // 64-byte aligned: sixteen keys transposed, or with ready all of them
    PartitionReady* ready;  // what the scratch holds of the partition already (updated), or null
    void* values;       // 64-byte aligned: key pairs' values (attend.h, attend_amx.h)
    float* m;           // [rows * group]
    float* s;
    float* acc;         // [rows * group][head_dim]
    int beyond = 0;     // a lone row's keys past this partition (prefetched on the way there)
};

// The projections' GEMM operands (gemm_vec.h, gemm_amx.h): x [rows, k] bfloat16
// rows `x_stride` apart, the weight packed as [N/16][K/2][16 outputs][2 inputs] (pack_weight),
// an optional float32 bias padded to whole blocks, and the bfloat16 output [rows, n].
struct GemmOperands {
    const uint16_t* x;
    int64_t x_stride, k;
    const uint16_t* w;
    int64_t block_stride;  // elements from one packed block to the next
    const float* bias;     // padded to whole blocks, or null
    uint16_t* out;
    int64_t n;
};

#include "quant_format.h"

// Denormals flushed to zero, inputs and results, while it lives (restored after): the rule of
// AVX512-BF16's dot product, which the emulated one matches only so; attention runs under it on
// every instruction set, so all of them give the same bits.
struct FlushDenormals {
    unsigned saved = _mm_getcsr();
    FlushDenormals() { _mm_setcsr(saved | 0x8040); }  // FTZ | DAZ
    ~FlushDenormals() { _mm_setcsr(saved); }
    FlushDenormals(const FlushDenormals&) = delete;
    FlushDenormals& operator=(const FlushDenormals&) = delete;
};

// One instruction set's kernels (the functions of rowwise.h, attend.h, gemm_vec.h and
// quant_gemm.h of the same names), which the ops call through the chosen table.
struct Kernels {
    const char* name;
    void (*norm_bf16_row)(const uint16_t* x, int n, const uint16_t* weight, float eps,
                          bool plus_one, uint16_t* out, float* scratch);
    void (*add_norm_row)(const uint16_t* x, const uint16_t* residual, int n,
                         const uint16_t* weight, float eps, bool plus_one,
                         uint16_t* residual_out, uint16_t* out, float* scratch);
    void (*silu_mul_row)(const uint16_t* gate, const uint16_t* up, int n, uint16_t* out);
    void (*rotary_token)(const uint16_t* qkv, const HeadLayout& l, const uint16_t* cos,
                         const uint16_t* sin, uint16_t* q_out, uint16_t* key_row,
                         uint16_t* value_row, float* scratch);
    void (*attend_tile)(const PagedKv& kv, int kv_head, const int32_t* table, const Tile& t);
    void (*attend_row_heads)(const PagedKv& kv, const int32_t* table, const Tile* tiles);
    // attend_row_heads from an int8 pool in place; false (nothing done) for a shape not
    // compiled.
    bool (*attend_int8_row_heads)(const PagedKv& kv, const int32_t* table, const Tile* tiles);
    // attend_tile in the tiles' arithmetic (attend_amx.h, attend_amx_unit_row.h), on the unit or
    // emulated; null where not compiled.
    void (*attend_amx)(const PagedKv& kv, int kv_head, const int32_t* table, const Tile& t,
                       bool emulated);
    // attend_row_heads in the tiles' arithmetic (on the unit, or ``emulated``); false
    // (nothing done) for a shape not compiled; null where not compiled.
    bool (*attend_amx_row_heads)(const PagedKv& kv, const int32_t* table, const Tile* tiles,
                                 bool emulated);
    void (*merge_partitions)(const float* m, const float* s, const float* acc, int parts,
                             int group, int d, int ms_stride, int part_stride, uint16_t* out);
    void (*gemm_blocks)(const GemmOperands& op, int64_t rows, int64_t b0, int64_t b1);
    void (*quant_groups)(const QuantOperands& op, int64_t rows, int64_t g0, int64_t g1);
    void (*quantize_row)(const uint16_t* x, int64_t k, int16_t* q16, int8_t* q8,
                         const InputBlocks& blocks, int64_t row);
    void (*quant_rows)(const QuantOperands& op, const int64_t* rows, int64_t count,
                       uint16_t* out);
    // Output groups [g0, g1) as the GEMM's packed bfloat16 blocks (quant_panel.h).
    void (*quant_panel)(const QuantOperands& op, int64_t g0, int64_t g1, uint16_t* out);
    void (*kv_rows_bf16)(const uint8_t* pool, const int64_t* offsets, int n, int d,
                         uint16_t* out);
};

// The table of namespace `ns`, inside the translation unit that compiled it (after
// isa_kernels.h defined SLOTSERVE_ATTEND_AMX).
#define SLOTSERVE_KERNELS(ns)                                                           \
    Kernels {                                                                           \
        #ns, &ns::norm_bf16_row, &ns::add_norm_row, &ns::silu_mul_row, &ns::rotary_token, \
            &ns::attend_tile, &ns::attend_row_heads, &ns::attend_int8_row_heads,        \
            SLOTSERVE_ATTEND_AMX(ns),                                                   \
            &ns::merge_partitions,                                                      \
            &ns::gemmv::blocks,                                                         \
            &ns::quant::groups, &ns::quant::quantize_row, &ns::quant::rows_of,          \
            &ns::quant::panel,                                                          \
            &ns::kv_rows_bf16                                                           \
    }

namespace avx512bf16 { Kernels table(); }  // kernels_avx512bf16.cpp
namespace avx512 { Kernels table(); }      // kernels_avx512.cpp
namespace avx2 { Kernels table(); }        // kernels_avx2.cpp
