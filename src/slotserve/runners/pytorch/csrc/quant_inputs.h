// The inputs' half of quant_gemm.h's arithmetic, compiled once per instruction set after
// quant_pairs.h (kernels_<isa>.cpp): a row's inputs rounded to integers of at most 127 per
// block of 32, with each block's step and sums.

namespace quant {

// The sum of v's eight int32 lanes.
static inline int32_t lanes_summed(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1)));
}

// Row `row`'s inputs as integers of at most 127 per block of 32 (quant_gemm.h's comment), as
// int16 (q16, the word path's) and int8 (q8, the byte path's): q, and each block's step and sums.
// AVX2 instructions on every instruction set: the largest |x| is exact in any order, the
// product rounds once and vcvtps2dq rounds it to nearest even, as std::nearbyint does.
static void quantize_row(const uint16_t* x, int64_t k, int16_t* q16, int8_t* q8,
                         const InputBlocks& blocks, int64_t row) {
    const int64_t rows = blocks.rows;
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256i largest_q = _mm256_set1_epi32(kLargestInput);
    const __m256i smallest_q = _mm256_set1_epi32(-kLargestInput);
    for (int64_t b = 0; b < k / kInputBlock; ++b) {
        __m256 v[4], top = _mm256_setzero_ps();
        for (int i = 0; i < 4; ++i) {
            const __m128i h = _mm_loadu_si128((const __m128i*)(x + b * kInputBlock + 8 * i));
            v[i] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
            top = _mm256_max_ps(top, _mm256_and_ps(v[i], magnitude));
        }
        __m128 t = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
        t = _mm_max_ps(t, _mm_movehl_ps(t, t));
        const float largest = _mm_cvtss_f32(_mm_max_ss(t, _mm_shuffle_ps(t, t, 1)));
        const __m256 scale = _mm256_set1_ps(largest > 0.0f ? float(kLargestInput) / largest : 0.0f);
        __m256i q[4];
        for (int i = 0; i < 4; ++i) {
            q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], scale));
            q[i] = _mm256_max_epi32(_mm256_min_epi32(q[i], largest_q), smallest_q);
        }
        // vpackssdw and vpacksswb interleave the 128-bit halves: vpermq puts them back in order.
        const __m256i w01 = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[0], q[1]), 0xd8);
        const __m256i w23 = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[2], q[3]), 0xd8);
        _mm256_storeu_si256((__m256i*)(q16 + b * kInputBlock), w01);
        _mm256_storeu_si256((__m256i*)(q16 + b * kInputBlock + 16), w23);
        const __m256i bytes = _mm256_permute4x64_epi64(_mm256_packs_epi16(w01, w23), 0xd8);
        _mm256_storeu_si256((__m256i*)(q8 + b * kInputBlock), bytes);
        const int32_t first = lanes_summed(_mm256_add_epi32(q[0], q[1]));
        const int32_t last = lanes_summed(_mm256_add_epi32(q[2], q[3]));
        blocks.step[b * rows + row] = largest / float(kLargestInput);
        blocks.sum16[2 * b * rows + row] = first;
        blocks.sum16[(2 * b + 1) * rows + row] = last;
        blocks.sum32[b * rows + row] = first + last;
        blocks.neg_sum[b * rows + row] = -float(first + last);
    }
}

}  // namespace quant
