// The projections' GEMM on CPUs with AVX512-BF16 (included once, by linear.cpp).
#pragma once

// ---- Projections: y = x Wᵀ (+ bias) with AVX512-BF16 dot products ---------------------------
//
// The weight is packed once as [N/16][K/2][16 outputs][2 inputs] (zero-padded), the operand
// layout of `vdpbf16ps`: one 64-byte load holds two k-steps of sixteen outputs. Every output
// is one float32 accumulator fed k-pair by k-pair from k = 0 upwards, then rounded once: the
// same instructions in the same order for any number of rows, any tile a row falls in, and any
// thread count (threads split the outputs, or for narrow layers the rows, never K).
// Batch-invariant by construction, for every K (no split-K needed).

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")
namespace gemm512 {

constexpr int kRowsPerTile = 6;      // rows sharing each weight load: 6 x 4 accumulators
constexpr int kBlocksPerTile = 4;    // 16-output blocks per tile
constexpr int kRowsPerPass = 96;     // rows whose inputs stay in L2 while a panel is reused
constexpr int64_t kPairsPerPanel = 1024;  // input pairs per panel: 4 blocks x 1024 x 64 B, in L2

using Operands = GemmOperands;

static inline __m512bh pair_of(const uint16_t* row, int64_t kp, int64_t k) {
    int32_t pair;
    if (2 * kp + 1 < k)
        std::memcpy(&pair, row + 2 * kp, sizeof(pair));
    else  // odd K: the packed weight holds a zero beside the last input
        pair = int32_t(row[2 * kp]);
    return (__m512bh)_mm512_set1_epi32(pair);
}

static inline void store_row(uint16_t* out, __m512 v, int valid) {
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_srli_epi32(
        _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7fff)), lsb), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7fc0));
    const __mmask16 keep = valid >= 16 ? __mmask16(0xffff) : __mmask16((1u << valid) - 1);
    _mm256_mask_storeu_epi16(out, keep, _mm512_cvtepi32_epi16(rounded));
}

// Rows [m, m + MR) against NB blocks from block b, input pairs [kp0, kp1). Between panels the
// accumulators wait in `partial` (float32, stored and reloaded exactly), so a long input is
// still one accumulation in order; the last panel adds the bias and rounds. `valid`: outputs of
// the last block that exist (N need not be a multiple of 16).
template <int MR, int NB>
static void tile(const Operands& op, int64_t m, int64_t b, int64_t kp0, int64_t kp1,
                 float* partial, int valid) {
    const int64_t k_pairs = (op.k + 1) / 2;
    const uint16_t* x = op.x + m * op.x_stride;
    const uint16_t* w = op.w + b * op.block_stride;
    constexpr int kStride = kBlocksPerTile * 16;  // floats per row of `partial`
    __m512 acc[MR][NB];
    for (int r = 0; r < MR; ++r)
        for (int j = 0; j < NB; ++j)
            acc[r][j] = kp0 == 0 ? _mm512_setzero_ps()
                                 : _mm512_loadu_ps(partial + r * kStride + j * 16);
    for (int64_t kp = kp0; kp < kp1; ++kp) {
        __m512bh wv[NB];
        for (int j = 0; j < NB; ++j)
            wv[j] = (__m512bh)_mm512_loadu_si512(w + j * op.block_stride + kp * 32);
        for (int r = 0; r < MR; ++r) {
            const __m512bh a = pair_of(x + r * op.x_stride, kp, op.k);
            for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], a, wv[j]);
        }
    }
    if (kp1 < k_pairs) {
        for (int r = 0; r < MR; ++r)
            for (int j = 0; j < NB; ++j)
                _mm512_storeu_ps(partial + r * kStride + j * 16, acc[r][j]);
        return;
    }
    for (int r = 0; r < MR; ++r)
        for (int j = 0; j < NB; ++j) {
            __m512 v = acc[r][j];
            if (op.bias != nullptr)
                v = _mm512_add_ps(v, _mm512_loadu_ps(op.bias + (b + j) * 16));
            store_row(op.out + (m + r) * op.n + (b + j) * 16, v, j == NB - 1 ? valid : 16);
        }
}

template <int NB>
static void rows_tile(int rows, const Operands& op, int64_t m, int64_t b, int64_t kp0,
                      int64_t kp1, float* partial, int valid) {
    switch (rows) {
        case 6: return tile<6, NB>(op, m, b, kp0, kp1, partial, valid);
        case 5: return tile<5, NB>(op, m, b, kp0, kp1, partial, valid);
        case 4: return tile<4, NB>(op, m, b, kp0, kp1, partial, valid);
        case 3: return tile<3, NB>(op, m, b, kp0, kp1, partial, valid);
        case 2: return tile<2, NB>(op, m, b, kp0, kp1, partial, valid);
        default: return tile<1, NB>(op, m, b, kp0, kp1, partial, valid);
    }
}

// Output blocks [b0, b1) for every row: passes of rows, and within a pass each tile's weight
// panel (up to kPairsPerPanel input pairs of 64 outputs) reused by every row of the pass.
static void blocks(const Operands& op, int64_t rows, int64_t b0, int64_t b1) {
    const int64_t k_pairs = (op.k + 1) / 2;
    std::vector<float> partial(kRowsPerPass * kBlocksPerTile * 16);
    for (int64_t m0 = 0; m0 < rows; m0 += kRowsPerPass) {
        const int64_t m1 = std::min(rows, m0 + kRowsPerPass);
        for (int64_t b = b0; b < b1; b += kBlocksPerTile) {
            const int nb = int(std::min<int64_t>(kBlocksPerTile, b1 - b));
            const int valid = int(std::min<int64_t>(16, op.n - (b + nb - 1) * 16));
            for (int64_t kp0 = 0; kp0 < k_pairs; kp0 += kPairsPerPanel) {
                const int64_t kp1 = std::min(k_pairs, kp0 + kPairsPerPanel);
                for (int64_t m = m0; m < m1; m += kRowsPerTile) {
                    const int mr = int(std::min<int64_t>(kRowsPerTile, m1 - m));
                    float* part = partial.data() + (m - m0) * kBlocksPerTile * 16;
                    switch (nb) {
                        case 4: rows_tile<4>(mr, op, m, b, kp0, kp1, part, valid); break;
                        case 3: rows_tile<3>(mr, op, m, b, kp0, kp1, part, valid); break;
                        case 2: rows_tile<2>(mr, op, m, b, kp0, kp1, part, valid); break;
                        default: rows_tile<1>(mr, op, m, b, kp0, kp1, part, valid);
                    }
                }
            }
        }
    }
}

}  // namespace gemm512
#pragma GCC pop_options
