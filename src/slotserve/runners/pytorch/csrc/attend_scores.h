// A lone row's scores sixteen keys at a time, in registers (included by isa_kernels.h after
// attention.h; attend.h and attend_heads.h call it on AVX-512).

#if SLOTSERVE_AVX512
// The lanes of keys first .. first + N - 1 (zero from ``count`` on) for each of the G query heads
// (``q``: their pair chunks), combined by the first log2(N) rounds of sum_lanes_of_16's tree:
// the same sums in the same order, but each round as soon as its two halves exist, so a row's
// sixteen keys live in a few registers instead of sixteen spilled vectors per head. ``Int8``:
// ``keys`` and ``offsets`` address an int8 pool's rows (int8_pair_chunk).
template <int CH, int G, int N, bool Int8 = false>
static inline __attribute__((always_inline)) void key_tree(const vi (&q)[G][(CH + 1) / 2],
                                                           const uint16_t* keys,
                                                           const int64_t* offsets, int first,
                                                           int count, vf (&out)[G]) {
    constexpr int pairs = CH * kLanes / 2, chunks = (pairs + kLanes - 1) / kLanes;
    if constexpr (N == 1) {
        if (first >= count) {
            for (int g = 0; g < G; ++g) out[g] = splat(0.0f);
            return;
        }
        vi k[chunks];
        if constexpr (Int8) {
            const uint8_t* row = reinterpret_cast<const uint8_t*>(keys + offsets[first]);
            const vf scale = int8_scale(row, CH * kLanes);
            for (int c = 0; c < chunks; ++c) k[c] = int8_pair_chunk(row, c, scale);
        } else {
            for (int c = 0; c < chunks; ++c) k[c] = pair_chunk(keys + offsets[first], c, pairs);
        }
        for (int g = 0; g < G; ++g) {
            vf x = splat(0.0f);
            for (int c = 0; c < chunks; ++c) x = dot_pairs(x, q[g][c], k[c]);
            out[g] = x;
        }
    } else {
        // sum_lanes_of_16's round for two halves of N keys
        constexpr int round = N == 2 ? 8 : N == 4 ? 4 : N == 8 ? 2 : 1;
        const vi lo = round == 8   ? vi{0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23}
                      : round == 4 ? vi{0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27}
                      : round == 2 ? vi{0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29}
                                   : vi{0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
        const vi hi = lo + round;
        vf a[G], b[G];
        key_tree<CH, G, N / 2, Int8>(q, keys, offsets, first, count, a);
        key_tree<CH, G, N / 2, Int8>(q, keys, offsets, first + N / 2, count, b);
        for (int g = 0; g < G; ++g)
            out[g] = __builtin_shuffle(a[g], b[g], lo) + __builtin_shuffle(a[g], b[g], hi);
    }
}

// The scores of keys j0 .. j0 + count - 1 (at most sixteen; ``offsets`` from j0's, ``keys``
// the row's KV head's first) for each of the G query heads: store_scores' bits.
template <int CH, int G, bool Int8 = false>
static inline __attribute__((always_inline)) void score_sixteen(const Tile& t, const uint16_t* keys,
                                                                const int64_t* offsets, int j0,
                                                                int count) {
    vi q[G][(CH + 1) / 2];
    for (int g = 0; g < G; ++g)
        for (int c = 0; c < (CH + 1) / 2; ++c)
            q[g][c] = load_pairs(t.q + int64_t(g) * t.q_stride + 2 * c * kLanes);
    vf sums[G];
    key_tree<CH, G, kLanes, Int8>(q, keys, offsets, 0, count, sums);
    for (int g = 0; g < G; ++g)
        store_f32(t.scores + int64_t(g) * kScoreStride + j0, sums[g] * t.scale);
}
#endif
