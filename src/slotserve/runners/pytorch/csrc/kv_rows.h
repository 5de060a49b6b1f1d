// The int8 KV pool's rows read back as bfloat16 (kernel_types.h states the format), compiled
// once per instruction set (kernels_<isa>.cpp): every set gives the same bits, one product
// rounded once.

// Rows at byte `offsets` of `pool`, each `d` int8 codes and their scale, as bfloat16 [n][d].
static void kv_rows_bf16(const uint8_t* pool, const int64_t* offsets, int n, int d,
                         uint16_t* out) {
    // The rows are scattered over the pool's blocks, which defeats the hardware's prefetchers:
    // each is asked for kKvRowsAhead rows before it is read, into level 2 (into level 1, or
    // nearer, fewer fetches are in flight and the read-back waits on memory).
    constexpr int kKvRowsAhead = 64;
    for (int j = 0; j < n; ++j) {
        if (j + kKvRowsAhead < n) {
            const char* ahead = (const char*)(pool + offsets[j + kKvRowsAhead]);
            for (int line = 0; line < d + kKvScaleBytes; line += 64)
                __builtin_prefetch(ahead + line, 0, 1);
            __builtin_prefetch(ahead + d + kKvScaleBytes - 1, 0, 1);  // a row may end a line later
        }
        const uint8_t* row = pool + offsets[j];
        const float scale = int8_row_scale(row, d);
        for (int c = 0; c < d; c += kLanes) {
            uint16_t* to = out + int64_t(j) * d + c;
#if SLOTSERVE_AVX512
            const vf v = int8_products(row + c, splat(scale));
#if SLOTSERVE_BF16
            // vcvtneps2bf16 rounds to nearest even as store_bf16 does (denormals are flushed in
            // attention on every set, and a NaN scale is no row's).
            _mm256_storeu_si256((__m256i*)to, (__m256i)_mm512_cvtneps_pbh((__m512)v));
#else
            store_bf16(to, v);
#endif
#else
            // int8_values (attend_row_avx2.h) in order, each float32's high half kept.
            const __m128i in_order = _mm_setr_epi8(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13,
                                                   14, 15);
            __m256 lo, hi;
            int8_values(row + c, in_order, _mm256_set1_ps(scale), lo, hi);
            const __m256i halves =
                _mm256_packus_epi32(_mm256_srli_epi32(_mm256_castps_si256(lo), 16),
                                    _mm256_srli_epi32(_mm256_castps_si256(hi), 16));
            _mm256_storeu_si256((__m256i*)to, _mm256_permute4x64_epi64(halves, 0xD8));
#endif
        }
    }
}
