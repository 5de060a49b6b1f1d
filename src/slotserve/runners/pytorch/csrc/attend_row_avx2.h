// A lone row's partition for the AVX2 build, head_dim (CH vectors of sixteen) and group (G)
// known (attend.h includes this there alone): attend_row_t's operations in their order, so its
// bits (attention.h states them), with what repeats per head done once and every running sum in
// registers. The generic attend_row_t, on sixteen-lane vectors, keeps them in memory on AVX2.
//
// Scores: the query's pairs are split into their high and low bfloat16 once for the partition,
// and each key's once for all G heads; a key's x_l comes as two eight-lane halves (lanes 0-7,
// 8-15), whose sum is the tree's first round (x_l + x_l+8); the rounds + 4, + 2 and + 1 then run
// over eight keys at a time as in-register transposes. Values: the accumulators of G heads for
// kDims dimensions at a time stay in registers over a span of keys (all of them here; a few
// dozen at a time in attend_heads.h, which runs these pieces for every KV head at once), each
// key pair's values widened to float32 once for the G heads.

template <int G>
constexpr int kDims = G == 1 ? 64 : G <= 3 ? 32 : 16;  // dimensions per value pass

// The scores of eight keys from their halves' sums ``a`` (lane l: x_l + x_l+8), by the tree's
// rounds + 4, + 2, + 1, times ``scale``.
static inline __attribute__((always_inline)) __m256 eight_scores(const __m256* a, __m256 scale) {
    __m256 b[4], c[2];
    for (int i = 0; i < 4; ++i)  // key 2i and 2i + 1: lanes l and l + 4
        b[i] = _mm256_add_ps(_mm256_permute2f128_ps(a[2 * i], a[2 * i + 1], 0x20),
                             _mm256_permute2f128_ps(a[2 * i], a[2 * i + 1], 0x31));
    for (int i = 0; i < 2; ++i)  // keys 4i .. 4i + 3: lanes l and l + 2
        c[i] = _mm256_add_ps(_mm256_shuffle_ps(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm256_shuffle_ps(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    // Lanes l and l + 1: keys 0, 2, 4, 6 in the low half, 1, 3, 5, 7 in the high one.
    const __m256 s = _mm256_add_ps(_mm256_shuffle_ps(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm256_shuffle_ps(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m256 ordered = _mm256_permutevar8x32_ps(s, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    return _mm256_mul_ps(ordered, scale);
}

// Eight bfloat16 values from ``p`` as float32.
static inline __attribute__((always_inline)) __m256 widen_bf16(const uint16_t* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// Eight float32 rounded to bfloat16 as store_bf16 rounds them (a NaN as 0x7fc0), kept as float32.
static inline __attribute__((always_inline)) __m256 round_bf16_8(__m256 x) {
    const __m256i bits = _mm256_castps_si256(x);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i up = _mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd));
    const __m256 rounded =
        _mm256_castsi256_ps(_mm256_and_si256(up, _mm256_set1_epi32(int32_t(0xffff0000u))));
    return _mm256_blendv_ps(rounded, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc00000)),
                            _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
}

// Sixteen codes of an int8 pool's row (kernel_types.h), reordered by ``order``, as kv_rows_bf16
// reads them back: bfloat16(code · scale), in float32; the first eight to ``a``, the others to
// ``b``.
static inline __attribute__((always_inline)) void int8_values(const uint8_t* codes, __m128i order,
                                                              __m256 scale, __m256& a, __m256& b) {
    const __m128i x = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i*)codes), order);
    const __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(x));
    const __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(x, 8)));
    a = round_bf16_8(_mm256_mul_ps(lo, scale));
    b = round_bf16_8(_mm256_mul_ps(hi, scale));
}

// A row's queries, each pair split into its high and low bfloat16 (as float32 bits), the form
// dot_pairs_halves' fused steps take: G heads of ``halves`` vectors of eight pairs.
template <int CH, int G>
struct QueryHalves {
    static constexpr int halves = CH * kLanes / 16;
    __m256 high[G][halves], low[G][halves];

    explicit QueryHalves(const Tile& t) {
        const __m256i mask = _mm256_set1_epi32(int32_t(0xffff0000u));
        for (int g = 0; g < G; ++g)
            for (int h = 0; h < halves; ++h) {
                const __m256i a = _mm256_loadu_si256(
                    reinterpret_cast<const __m256i*>(t.q + int64_t(g) * t.q_stride) + h);
                high[g][h] = _mm256_castsi256_ps(_mm256_and_si256(a, mask));
                low[g][h] = _mm256_castsi256_ps(_mm256_slli_epi32(a, 16));
            }
    }
};

// The scores of keys j0 .. j0 + count - 1 (at most eight; ``keys``: the row's KV head's first)
// for each of the G query heads, into ``t.scores``; ``ahead(j)`` before key j's. ``Int8``:
// ``keys`` and ``offsets`` address an int8 pool's rows.
template <int CH, int G, bool Int8 = false, typename Ahead>
static inline __attribute__((always_inline)) void score_eight(const Tile& t,
                                                              const QueryHalves<CH, G>& q,
                                                              const uint16_t* keys,
                                                              const int64_t* offsets, int j0,
                                                              int count, Ahead ahead) {
    constexpr int halves = QueryHalves<CH, G>::halves;
    const __m256i high = _mm256_set1_epi32(int32_t(0xffff0000u));
    __m256 sums[G][8];
    for (int jj = 0; jj < 8; ++jj) {
        if (jj >= count) {  // past the row's keys: softmax_rows writes -inf there
            for (int g = 0; g < G; ++g) sums[g][jj] = _mm256_setzero_ps();
            continue;
        }
        ahead(j0 + jj);
        const __m256i* key = reinterpret_cast<const __m256i*>(keys + offsets[j0 + jj]);
        __m256 k_high[halves], k_low[halves];
        if constexpr (Int8) {  // each sixteen codes' even ones to k_low, odd ones to k_high
            const uint8_t* row = reinterpret_cast<const uint8_t*>(key);
            const __m256 scale = _mm256_set1_ps(int8_row_scale(row, CH * kLanes));
            const __m128i evens_odds =
                _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
            for (int h = 0; h < halves; ++h)
                int8_values(row + 16 * h, evens_odds, scale, k_low[h], k_high[h]);
        } else {
            for (int h = 0; h < halves; ++h) {
                const __m256i b = _mm256_loadu_si256(key + h);
                k_high[h] = _mm256_castsi256_ps(_mm256_and_si256(b, high));
                k_low[h] = _mm256_castsi256_ps(_mm256_slli_epi32(b, 16));
            }
        }
        for (int g = 0; g < G; ++g) {
            __m256 x[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
            for (int h = 0; h < halves; ++h) {  // chunk h / 2, half h % 2
                x[h % 2] = _mm256_fmadd_ps(q.high[g][h], k_high[h], x[h % 2]);
                x[h % 2] = _mm256_fmadd_ps(q.low[g][h], k_low[h], x[h % 2]);
            }
            sums[g][jj] = _mm256_add_ps(x[0], x[1]);
        }
    }
    const __m256 scale = _mm256_set1_ps(t.scale);
    for (int g = 0; g < G; ++g)
        _mm256_storeu_ps(t.scores + int64_t(g) * kScoreStride + j0, eight_scores(sums[g], scale));
}

// value_pair's steps over keys [j0, end) (j0 even; ``values``: the row's KV head's first) for
// the G heads' sums in ``t.acc``, kDims<G> dimensions at a time held in registers:
// acc = fma(p_even, v_even, fma(p_odd, v_odd, acc)) key pair by key pair; the odd key of a last
// half pair (past ``n``) has v zero. The span's probabilities are widened to float32 once, so
// each fused step broadcasts its p straight from memory. ``Int8``: as score_eight's.
template <int CH, int G, bool Int8 = false>
static inline __attribute__((always_inline)) void value_span(const Tile& t, const uint16_t* values,
                                                             const int64_t* offsets, int j0,
                                                             int end, int n) {
    constexpr int d = CH * kLanes, vectors = kDims<G> / 8;
    const int count = (end - j0 + 1) & ~1;  // whole pairs
    alignas(32) float p[G][kPartition + 8];
    for (int g = 0; g < G; ++g) {
        const uint16_t* row = t.probs + g * (kPartition + 2) + j0;
        int j = 0;
        for (; j + 8 <= count; j += 8) _mm256_store_ps(p[g] + j, widen_bf16(row + j));
        for (; j < count; ++j) p[g][j] = bf16_to_f32(row[j]);
    }
    // Sixteen values widen from one load by interleaving zeros below them, which leaves their
    // dimensions in the order 0-3, 8-11 | 4-7, 12-15: the sums are held in that order.
    const __m256i zero = _mm256_setzero_si256();
    auto widen16 = [&](const uint16_t* v, __m256& lo, __m256& hi) {
        const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v));
        lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, x));
        hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, x));
    };
    // An int8 row's sixteen codes in that order (int8_values).
    const __m128i held_order = _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15);
    auto int8_row = [&](int j) { return reinterpret_cast<const uint8_t*>(values + offsets[j]); };
    for (int dim = 0; dim < d; dim += kDims<G>) {
        __m256 acc[G][vectors];
        for (int g = 0; g < G; ++g)
            for (int e = 0; e < vectors; e += 2) {
                const float* a = t.acc + g * d + dim + 8 * e;
                const __m256 first = _mm256_loadu_ps(a), second = _mm256_loadu_ps(a + 8);
                acc[g][e] = _mm256_permute2f128_ps(first, second, 0x20);
                acc[g][e + 1] = _mm256_permute2f128_ps(first, second, 0x31);
            }
        for (int j = j0; j < end; j += 2) {
            const bool has_odd = j + 1 < n;
            __m256 v_even[vectors], v_odd[vectors];
            __m256 scale_even = _mm256_setzero_ps(), scale_odd = scale_even;
            if constexpr (Int8) {  // each row's scale once a pass
                scale_even = _mm256_set1_ps(int8_row_scale(int8_row(j), d));
                if (has_odd) scale_odd = _mm256_set1_ps(int8_row_scale(int8_row(j + 1), d));
            }
            for (int e = 0; e < vectors; e += 2) {
                if constexpr (Int8) {
                    const int at = dim + 8 * e;
                    int8_values(int8_row(j) + at, held_order, scale_even, v_even[e],
                                v_even[e + 1]);
                    if (has_odd)
                        int8_values(int8_row(j + 1) + at, held_order, scale_odd, v_odd[e],
                                    v_odd[e + 1]);
                } else {
                    widen16(values + offsets[j] + dim + 8 * e, v_even[e], v_even[e + 1]);
                    if (has_odd)
                        widen16(values + offsets[j + 1] + dim + 8 * e, v_odd[e], v_odd[e + 1]);
                }
                if (!has_odd) v_odd[e] = v_odd[e + 1] = _mm256_setzero_ps();
            }
            for (int g = 0; g < G; ++g) {
                const __m256 pe = _mm256_broadcast_ss(&p[g][j - j0]);
                const __m256 po = _mm256_broadcast_ss(&p[g][j - j0 + 1]);
                for (int e = 0; e < vectors; ++e)
                    acc[g][e] =
                        _mm256_fmadd_ps(pe, v_even[e], _mm256_fmadd_ps(po, v_odd[e], acc[g][e]));
            }
        }
        for (int g = 0; g < G; ++g)
            for (int e = 0; e < vectors; e += 2) {
                float* a = t.acc + g * d + dim + 8 * e;
                _mm256_storeu_ps(a, _mm256_permute2f128_ps(acc[g][e], acc[g][e + 1], 0x20));
                _mm256_storeu_ps(a + 8, _mm256_permute2f128_ps(acc[g][e], acc[g][e + 1], 0x31));
            }
    }
}

template <int CH, int G>
static void attend_row_avx2(const PagedKv& kv, int kv_head, const int32_t* table, const Tile& t) {
    constexpr int d = CH * kLanes;
    static_assert(CH % 2 == 0 && d % kDims<G> == 0, "whole pair chunks, whole value passes");
    const int n = t.n[0];
    int64_t offsets[kPartition];
    key_offsets(kv, kv_head, table, t.start, n, offsets);
    const RowPrefetch<d * 2> prefetch{kv.keys, kv.values, offsets, n, d * 2};
    prefetch.start();
    const QueryHalves<CH, G> q(t);
    for (int j0 = 0; j0 < n; j0 += 8)
        score_eight<CH, G>(t, q, kv.keys, offsets, j0, std::min(8, n - j0),
                           [&](int j) { prefetch.ahead_of(j); });
    softmax_rows(t.scores, t.probs, G, G, t.n, d, t.m, t.s, t.acc);  // acc zeroed
    value_span<CH, G>(t, kv.values, offsets, 0, n, n);
}
