// The projections' GEMM on AMX tiles (Intel Xeon, Sapphire Rapids and later; included once, by
// linear.cpp).
//
// The weight is packed as for gemm_vec.h: [N/16][K/2][16 outputs][2 inputs], which is already the
// layout of an AMX B tile: sixteen input pairs (rows) of sixteen outputs (64 bytes each), one
// tile every sixteen pairs of a block. Each `tdpbf16ps` takes a 16-row A tile (32 inputs of
// sixteen rows) and a B tile and adds to a 16x16 float32 C tile; C waits in its tile across
// the whole of K, and is rounded once to bfloat16 after the bias is added.
//
// Invariance: every output sums its inputs the same way whatever M is, which row tile a row
// falls in, its neighbours and the thread count: tiles of sixteen input pairs from k = 0
// upwards, each tile's contribution as the instruction defines it (Intel SDM, TDPBF16PS: the
// even and the odd products of the tile summed apart from zero in fused steps, then their sum
// added to C; denormals flushed). Rows are padded to whole tiles with zeros (a padded row never
// touches a real one), never computed another way. Only K decides whether a layer runs here (a
// multiple of 32, else gemm_vec.h serves it): a fixed choice per layer, never by M.
//
// That is not VDPBF16PS's order (each product added in turn), so an AMX host's last bits may
// differ from an AVX512-BF16 host's; each path is batch-invariant on its own.
//
// Tiles, real or emulated (amx_tiles.h): at load the real unit must give the emulation's bits
// on a small problem before it serves (`amx_verified`).
#pragma once

#include "amx_tiles.h"

namespace amx {

constexpr int kRowTiles = 2;    // C tiles 0..3 are [row tile][block]; A tiles 4, 5; B tiles 6, 7
constexpr int kBlockTiles = 2;
constexpr int kGroupRows = kRows * kRowTiles;

using Operands = GemmOperands;  // the same packed weight, inputs and outputs

// Round to nearest even, as c10::BFloat16 does (NaN becomes the canonical quiet NaN).
static inline uint16_t round_bf16(float f) {
    uint32_t bits;
    std::memcpy(&bits, &f, sizeof(bits));
    if (std::isnan(f)) return 0x7fc0;
    return uint16_t((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
}

// C tile [r][j] of a group of `R` row tiles and `J` blocks: the sum over every tile of K of
// A tile r times B tile j. `a`: the group's rows (R x 16 of them), `a_stride` elements apart.
template <class T, int R, int J>
static void group_sums(T& t, const Operands& op, const uint16_t* a, int64_t a_stride, int64_t b,
                       float (&c)[kGroupRows][kBlockTiles * kLanes]) {
    t.template zero<0>();
    if constexpr (J > 1) t.template zero<1>();
    if constexpr (R > 1) t.template zero<2>();
    if constexpr (R > 1 && J > 1) t.template zero<3>();
    const uint16_t* w = op.w + b * op.block_stride;
    for (int64_t kp = 0; kp < op.k / 2; kp += kPairs) {
        t.template load<4>(a + 2 * kp, a_stride * 2);
        if constexpr (R > 1) t.template load<5>(a + kRows * a_stride + 2 * kp, a_stride * 2);
        t.template load<6>(w + kp * 2 * kLanes, 64);
        if constexpr (J > 1) t.template load<7>(w + op.block_stride + kp * 2 * kLanes, 64);
        t.template dot<0, 4, 6>();
        if constexpr (J > 1) t.template dot<1, 4, 7>();
        if constexpr (R > 1) t.template dot<2, 5, 6>();
        if constexpr (R > 1 && J > 1) t.template dot<3, 5, 7>();
    }
    constexpr int64_t kStride = kBlockTiles * kLanes * sizeof(float);
    t.template store<0>(&c[0][0], kStride);
    if constexpr (J > 1) t.template store<1>(&c[0][kLanes], kStride);
    if constexpr (R > 1) t.template store<2>(&c[kRows][0], kStride);
    if constexpr (R > 1 && J > 1) t.template store<3>(&c[kRows][kLanes], kStride);
}

// store_group's steps sixteen outputs at a time (every AMX host runs the AVX-512 build,
// cpu::runs_avx512): the same float sum, the same rounding, the same bits.
__attribute__((target("avx512f,avx512bw,avx512vl"))) static void store_group_avx512(
    const Operands& op, const float (&c)[kGroupRows][kBlockTiles * kLanes], int64_t m, int rows,
    int64_t first, int64_t last) {
    const __m512i one = _mm512_set1_epi32(1), half = _mm512_set1_epi32(0x7fff);
    const __m512i quiet_nan = _mm512_set1_epi32(0x7fc0);
    for (int r = 0; r < rows; ++r)
        for (int64_t o = first; o < last; o += kLanes) {
            const int64_t valid = std::min<int64_t>(kLanes, last - o);
            __m512 v = _mm512_loadu_ps(&c[r][o - first]);
            if (op.bias != nullptr) v = _mm512_add_ps(v, _mm512_loadu_ps(op.bias + o));
            const __m512i bits = _mm512_castps_si512(v);
            const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), one);
            const __m512i up = _mm512_add_epi32(bits, _mm512_add_epi32(half, odd));
            __m512i rounded = _mm512_srli_epi32(up, 16);
            rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q),
                                            quiet_nan);
            _mm256_mask_storeu_epi16(op.out + (m + r) * op.n + o, __mmask16((1u << valid) - 1),
                                     _mm512_cvtepi32_epi16(rounded));
        }
}

// Rows [m, m + rows) of blocks [b, b + blocks): the bias added and each output rounded once.
static void store_group(const Operands& op, const float (&c)[kGroupRows][kBlockTiles * kLanes],
                        int64_t m, int rows, int64_t b, int blocks) {
    const int64_t first = b * kLanes, last = std::min(op.n, (b + blocks) * kLanes);
    static const bool wide = cpu::runs_avx512();
    if (wide) return store_group_avx512(op, c, m, rows, first, last);
    for (int r = 0; r < rows; ++r)
        for (int64_t o = first; o < last; ++o) {
            float v = c[r][o - first];
            if (op.bias != nullptr) v += op.bias[o];
            op.out[(m + r) * op.n + o] = round_bf16(v);
        }
}

template <class T, int J>
static void group(T& t, const Operands& op, const uint16_t* a, int64_t a_stride, int64_t m,
                  int rows, int64_t b) {
    float c[kGroupRows][kBlockTiles * kLanes];
    if (rows > kRows)
        group_sums<T, 2, J>(t, op, a, a_stride, b, c);
    else
        group_sums<T, 1, J>(t, op, a, a_stride, b, c);
    store_group(op, c, m, rows, b, J);
}

// Every row against blocks [b0, b1): blocks two by two, rows 32 by 32 within them (the blocks'
// weights stay in cache while the rows pass). The last group's rows, if fewer than whole tiles,
// are copied once into zero-padded scratch, so no tile reads past the input.
template <class T>
static void blocks(const Operands& op, int64_t rows, int64_t b0, int64_t b1) {
    T t;
    const int64_t whole = rows / kGroupRows * kGroupRows;
    const int tail = int(rows - whole);
    std::vector<uint16_t> padded;
    if (tail > 0) {
        const int tail_rows = (tail + kRows - 1) / kRows * kRows;
        padded.assign(size_t(tail_rows) * op.k, 0);
        for (int r = 0; r < tail; ++r)
            std::memcpy(&padded[size_t(r) * op.k], op.x + (whole + r) * op.x_stride, op.k * 2);
    }
    for (int64_t b = b0; b < b1; b += kBlockTiles) {
        const bool pair = b + 1 < b1;
        for (int64_t m = 0; m < rows; m += kGroupRows) {
            const bool is_tail = m == whole;
            const uint16_t* a = is_tail ? padded.data() : op.x + m * op.x_stride;
            const int64_t stride = is_tail ? op.k : op.x_stride;
            const int n_rows = is_tail ? tail : kGroupRows;
            if (pair)
                group<T, 2>(t, op, a, stride, m, n_rows, b);
            else
                group<T, 1>(t, op, a, stride, m, n_rows, b);
        }
    }
}

}  // namespace amx
