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
        float scale;
        std::memcpy(&scale, row + d, sizeof(scale));
        const vf s = splat(scale);
        for (int c = 0; c < d; c += kLanes) {
            const __m128i codes = _mm_loadu_si128((const __m128i*)(row + c));
#if SLOTSERVE_AVX512
            const vf v = (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(codes)) * s;
#else
            const __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(codes));
            const __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(codes, 8)));
            vf codes_f;
            std::memcpy(&codes_f, &lo, 32);
            std::memcpy(reinterpret_cast<char*>(&codes_f) + 32, &hi, 32);
            const vf v = codes_f * s;
#endif
            uint16_t* to = out + int64_t(j) * d + c;
#if SLOTSERVE_BF16
            // vcvtneps2bf16 rounds to nearest even as store_bf16 does (denormals are flushed in
            // attention on every set, and a NaN scale is no row's).
            _mm256_storeu_si256((__m256i*)to, (__m256i)_mm512_cvtneps_pbh((__m512)v));
#else
            store_bf16(to, v);
#endif
        }
    }
}
