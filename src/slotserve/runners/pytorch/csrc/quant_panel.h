// A quantized weight's output groups as the bfloat16 GEMM's packed blocks (compiled once per
// instruction set after quant_gemm.h): prompt rows multiply these with the GEMM of
// gemm_vec.h / gemm_amx.h instead of quant_gemm.h's integer arithmetic (quant_linear.cpp). Each
// value is row_values's, scale · v − min rounded once to bfloat16, the value the dequantized
// path loads, so a prompt row's bits are that path's.

namespace quant {

// Sixteen outputs' scales (or minimums) as the lanes of one pair's eight outputs, each twice:
// outputs 0-7's (`half` 0) or 8-15's.
#if SLOTSERVE_AVX512
static inline __attribute__((always_inline)) Acc pairs_of(Acc a, int half) {
    const __m512i twice = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    return {_mm512_permutexvar_ps(_mm512_add_epi32(twice, _mm512_set1_epi32(8 * half)), a.v)};
}
#else
static inline __attribute__((always_inline)) Acc pairs_of(Acc a, int half) {
    const __m256 eight = half ? a.hi : a.lo;
    return {_mm256_permutevar8x32_ps(eight, _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3)),
            _mm256_permutevar8x32_ps(eight, _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7))};
}
// Eight floats rounded to bfloat16 (to nearest even, as store_bf16; the values are never NaN).
static inline __attribute__((always_inline)) __m256i rounded_bf16(__m256 x) {
    const __m256i bits = _mm256_castps_si256(x);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i up = _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff)));
    return _mm256_srli_epi32(up, 16);
}
#endif

// Eight outputs' (even, odd) values of one pair as bfloat16: scale · v − min, each rounded once
// (the product and the difference in two steps, as row_values and the dequantized path).
static inline __attribute__((always_inline)) void panel_half(__m128i values, Acc scale, Acc min,
                                                             uint16_t* out) {
#if SLOTSERVE_AVX512
    const __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(values));
    const __m512 w = _mm512_sub_ps(_mm512_mul_ps(scale.v, v), min.v);
#if SLOTSERVE_BF16  // rounds to nearest even as store_bf16 (the values are never NaN nor tiny)
    _mm256_storeu_si256((__m256i*)out, (__m256i)_mm512_cvtneps_pbh(w));
#else
    _mm256_storeu_si256((__m256i*)out, _mm512_cvtepi32_epi16(_mm512_srli_epi32(
        _mm512_add_epi32(_mm512_castps_si512(w),
                         _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                                          _mm512_and_si512(_mm512_srli_epi32(
                                                               _mm512_castps_si512(w), 16),
                                                           _mm512_set1_epi32(1)))),
        16)));
#endif
#else
    const __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(values));
    const __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(values, 8)));
    const __m256i packed = _mm256_packus_epi32(
        rounded_bf16(_mm256_sub_ps(_mm256_mul_ps(scale.lo, lo), min.lo)),
        rounded_bf16(_mm256_sub_ps(_mm256_mul_ps(scale.hi, hi), min.hi)));
    _mm256_storeu_si256((__m256i*)out, _mm256_permute4x64_epi64(packed, 0xd8));
#endif
}

// Output group `g` as one packed block ([k / 2][16 outputs][2 inputs] bfloat16 at `out`).
template <int BITS, int OFFSET, bool MIN, int SUB, int SUPER>
static void group_values(const Operands& op, int64_t g, uint16_t* out) {
    constexpr int kSubBlocks = SUPER / SUB;
    const int64_t record_bytes = op.f.record_bytes(), header_bytes = op.f.header_bytes();
    const uint8_t* record = op.w + g * (op.k / SUPER) * record_bytes;
    for (int64_t b = 0; b < op.k / SUPER; ++b, record += record_bytes) {
        const Acc d = widen_f16(record), dmin = MIN ? widen_f16(record + 32) : acc_zero();
        const uint8_t* codes = record + header_bytes;
        for (int s = 0; s < kSubBlocks; ++s) {
            const SubBlockScales w = sub_block_scales<MIN, SUB, SUPER>(record, d, dmin, s);
            const Acc scale_lo = pairs_of(w.scale, 0), min_lo = pairs_of(w.min, 0);
            const Acc scale_hi = pairs_of(w.scale, 1), min_hi = pairs_of(w.min, 1);
#pragma GCC unroll 16
            for (int p = s * SUB / 2; p < (s + 1) * SUB / 2; ++p) {
                const PairValues v = pair_values<BITS, OFFSET, SUPER>(codes, p);
                uint16_t* pair_out = out + (b * SUPER / 2 + p) * 32;
                panel_half(v.lo, scale_lo, min_lo, pair_out);
                panel_half(v.hi, scale_hi, min_hi, pair_out + 16);
            }
        }
    }
}

// Output groups [g0, g1) as packed blocks from `out` on, one after the other.
static void panel(const Operands& op, int64_t g0, int64_t g1, uint16_t* out) {
    in_format(op.f, [&](auto bits, auto offset, auto min, auto sub, auto super) {
        for (int64_t g = g0; g < g1; ++g)
            group_values<bits(), offset(), min(), sub(), super()>(op, g,
                                                                  out + (g - g0) * op.k * 16);
    });
}

}  // namespace quant
