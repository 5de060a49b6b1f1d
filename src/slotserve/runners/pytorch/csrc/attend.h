// A partition of one lone row or one tile of rows of a sequence, from the pool's blocks in place,
// and the merge of a row's partitions in their order (the arithmetic: attention.h).

// A tile's rows, scratch and results for one partition (kernel_types.h's Tile), and the pool
// offsets of the partition's keys.
static inline void key_offsets(const PagedKv& kv, int kv_head, const int32_t* table, int start,
                               int count, int64_t* offsets) {
    const int64_t row = row_units(kv), stride = int64_t(kv.kv_heads) * row;
    for (int j = 0, block = start / kv.block_size, within = start % kv.block_size; j < count;
         ++block) {
        const int64_t base =
            int64_t(table[block]) * kv.block_size * stride + int64_t(kv_head) * row;
        for (; within < kv.block_size && j < count; ++within, ++j) offsets[j] = base + within * stride;
        within = 0;
    }
}

// Keys and values are scattered over the pool's blocks, which defeats the hardware's
// prefetchers, and a lone row computes too little per key to hide a memory access: keys are
// fetched to the level-2 cache kFarPrefetch ahead and to level 1 kPrefetch ahead, values to
// level 2 kValuePrefetch ahead while the scores are computed.
template <int RowBytes>  // a head's row, in bytes (0: ``row_bytes``)
struct RowPrefetch {
    const uint16_t* keys;
    const uint16_t* values;
    const int64_t* offsets;  // of the partition's keys (key_offsets)
    int n, row_bytes;

    template <bool near>  // to level 1, else to level 2
    __attribute__((always_inline)) void row(const uint16_t* base, int j) const {
        const char* row = (const char*)(base + offsets[j]);
        for (int line = 0; line < (RowBytes ? RowBytes : row_bytes); line += 64)
            near ? __builtin_prefetch(row + line) : __builtin_prefetch(row + line, 0, 1);
    }
    // Before the first key.
    __attribute__((always_inline)) void start() const {
        for (int j = 0; j < kPrefetch && j < n; ++j) row<true>(keys, j);
        for (int j = kPrefetch; j < kFarPrefetch && j < n; ++j) row<false>(keys, j);
        for (int j = 0; j < kValuePrefetch && j < n; ++j) row<false>(values, j);
    }
    // With key j.
    __attribute__((always_inline)) void ahead_of(int j) const {
        if (j + kPrefetch < n) row<true>(keys, j + kPrefetch);
        if (j + kFarPrefetch < n) row<false>(keys, j + kFarPrefetch);
        if (j + kValuePrefetch < n) row<false>(values, j + kValuePrefetch);
    }
};

#if !SLOTSERVE_AVX512
#include "attend_row_avx2.h"
#endif

// Lane l of partial[g * kLanes + jj]: x_l (attention.h) of the key at ``key`` for the row's
// query head g, each of ``group``.
static inline __attribute__((always_inline)) void key_lanes(const Tile& t, int group,
                                                            const uint16_t* key, int pairs,
                                                            int jj, vf* partial) {
    const int pair_chunks = (pairs + kLanes - 1) / kLanes;
    vi k[kMaxPairChunks];
    for (int c = 0; c < pair_chunks; ++c) k[c] = pair_chunk(key, c, pairs);
#if SLOTSERVE_AVX512
    for (int g = 0; g < group; ++g) {
        const uint16_t* q = t.q + int64_t(g) * t.q_stride;
        vf x = splat(0.0f);
        for (int c = 0; c < pair_chunks; ++c)
            x = dot_pairs(x, load_pairs(q + 2 * c * kLanes), k[c]);
        partial[g * kLanes + jj] = x;
    }
#else
    for (int g = 0; g < group; ++g)
        partial[g * kLanes + jj] = dot_pairs_halves(t.q + int64_t(g) * t.q_stride, k, pair_chunks);
#endif
}

// The scores of sixteen keys from j0 (``count`` of them real) from their lanes, for each of
// the row's ``group`` query heads.
static inline __attribute__((always_inline)) void store_scores(const Tile& t, int group, int j0,
                                                               int count, vf* partial) {
    for (int g = 0; g < group; ++g) {
        for (int jj = count; jj < kLanes; ++jj) partial[g * kLanes + jj] = splat(0.0f);
        store_f32(t.scores + int64_t(g) * kScoreStride + j0,
                  sum_lanes_of_16(partial + g * kLanes) * t.scale);
    }
}

// One row (``t.rows`` == 1) of ``G`` query heads (0: ``t.group``) reading its keys in place.
template <int CH, int G>
static void attend_row_t(const PagedKv& kv, int kv_head, const int32_t* table, const Tile& t) {
#if !SLOTSERVE_AVX512
    if constexpr (CH > 0 && G > 0) return attend_row_avx2<CH, G>(kv, kv_head, table, t);
#endif
    const int d = CH ? CH * kLanes : kv.head_dim, chunks = d / kLanes, group = G ? G : t.group;
    const int pairs = d / 2, n = t.n[0];
    int64_t offsets[kPartition];
    key_offsets(kv, kv_head, table, t.start, n, offsets);
    const RowPrefetch<CH * kLanes * 2> prefetch{kv.keys, kv.values, offsets, n, d * 2};
    prefetch.start();
    vf partial[kMaxGroup * kLanes];
    for (int j0 = 0; j0 < n; j0 += kLanes) {
        const int count = std::min(kLanes, n - j0);
#if SLOTSERVE_AVX512
        if constexpr (CH > 0 && G > 0) {
            for (int j = j0; j < j0 + count; ++j) prefetch.ahead_of(j);
            score_sixteen<CH, G>(t, kv.keys, offsets + j0, j0, count);
            continue;
        }
#endif
        for (int jj = 0; jj < count; ++jj) {
            const int j = j0 + jj;
            prefetch.ahead_of(j);
            key_lanes(t, group, kv.keys + offsets[j], pairs, jj, partial);
        }
        store_scores(t, group, j0, count, partial);
    }
    softmax_rows(t.scores, t.probs, group, group, t.n, d, t.m, t.s, t.acc);
    ValuePair v;
#if !SLOTSERVE_AVX512
    // softmax_rows zeroed t.acc (a lone row has keys in each partition it is given): each
    // head's sums run there, a key pair at a time.
    for (int j = 0; j < n; j += 2) {
        load_value_pair(kv.values + offsets[j], j + 1 < n ? kv.values + offsets[j + 1] : nullptr,
                        chunks, v);
        for (int g = 0; g < group; ++g)
            value_pairs_halves<CH>(t.acc + g * d, chunks, t.probs + g * (kPartition + 2) + j, &v,
                                   1, false);
    }
#else
    if constexpr (G > 0 && CH > 0 && G * CH <= 24) {
        vf out[G][CH];
        for (int g = 0; g < G; ++g)
            for (int c = 0; c < CH; ++c) out[g][c] = splat(0.0f);
        for (int j = 0; j < n; j += 2) {
            load_value_pair(kv.values + offsets[j], j + 1 < n ? kv.values + offsets[j + 1] : nullptr,
                            CH, v);
            for (int g = 0; g < G; ++g) value_pair(out[g], CH, t.probs + g * (kPartition + 2) + j, v);
        }
        for (int g = 0; g < G; ++g)
            for (int c = 0; c < CH; ++c) store_f32(t.acc + g * d + c * kLanes, out[g][c]);
    } else {
        for (int g = 0; g < group; ++g) {
            vf out[kMaxChunks];
            for (int c = 0; c < chunks; ++c) out[c] = splat(0.0f);
            for (int j = 0; j < n; j += 2) {
                load_value_pair(kv.values + offsets[j],
                                j + 1 < n ? kv.values + offsets[j + 1] : nullptr, chunks, v);
                value_pair(out, chunks, t.probs + g * (kPartition + 2) + j, v);
            }
            for (int c = 0; c < chunks; ++c) store_f32(t.acc + g * d + c * kLanes, out[c]);
        }
    }
#endif
}

// Scores of sixteen transposed keys (``kt``: vector 16c + l holds pair 16c + l of each key) for
// R row-heads (``q``: R rows ``stride`` apart), written R rows of kScoreStride apart: the x_l of
// R row-heads at a time, so each key vector is loaded once, then the tree as vector adds.
template <int R>
static inline __attribute__((always_inline)) void score_keys(const uint16_t* q, int stride,
                                                             int pair_chunks, const vi* kt,
                                                             float scale, float* out) {
    auto x = [&](int l, vf* X) {
        for (int r = 0; r < R; ++r) X[r] = splat(0.0f);
        for (int c = 0; c < pair_chunks; ++c) {
            const vi k = kt[c * kLanes + l];
            for (int r = 0; r < R; ++r)
                X[r] = dot_pairs_splat(X[r], q + r * stride + 2 * (c * kLanes + l), k);
        }
    };
    auto pair = [&](int l, vf* P) {
        vf a[R], b[R];
        x(l, a);
        x(l + 8, b);
        for (int r = 0; r < R; ++r) P[r] = a[r] + b[r];
    };
    auto quad = [&](int l, vf* Q) {
        vf a[R], b[R];
        pair(l, a);
        pair(l + 4, b);
        for (int r = 0; r < R; ++r) Q[r] = a[r] + b[r];
    };
    vf w0[R], w1[R], t[R];
    quad(0, w0);
    quad(2, t);
    for (int r = 0; r < R; ++r) w0[r] = w0[r] + t[r];
    quad(1, w1);
    quad(3, t);
    for (int r = 0; r < R; ++r) store_f32(out + r * kScoreStride, (w0[r] + (w1[r] + t[r])) * scale);
}

// Keys j0 .. j0 + 15 (the first ``count`` of them real, the rest zero) transposed into ``kt``:
// vector 16c + l holds pair 16c + l of each key.
static inline __attribute__((always_inline)) void transpose_keys(const uint16_t* keys,
                                                                 const int64_t* offsets, int j0,
                                                                 int count, int pairs, vi* kt) {
    for (int c = 0; c < (pairs + kLanes - 1) / kLanes; ++c) {
        vi block[kLanes];
        for (int jj = 0; jj < kLanes; ++jj)
            block[jj] = jj < count ? pair_chunk(keys + offsets[j0 + jj], c, pairs) : vi{};
        transpose_16(block);
        for (int l = 0; l < kLanes; ++l) kt[c * kLanes + l] = block[l];
    }
}

// Rows [j0, end) of ``base`` (a head's rows of ``d`` dimensions at ``offsets``) asked into the
// level-1 cache.
static inline __attribute__((always_inline)) void prefetch_rows(const uint16_t* base,
                                                                const int64_t* offsets, int j0,
                                                                int end, int d) {
    for (int j = j0; j < end; ++j)
        for (int line = 0; line < d * 2; line += 64)
            __builtin_prefetch((const char*)(base + offsets[j]) + line);
}

// A tile of rows (see Tile), ``G`` query heads each (0: ``t.group``).
template <int CH, int G>
static void attend_tile_t(const PagedKv& kv, int kv_head, const int32_t* table, const Tile& t) {
    const int d = CH ? CH * kLanes : kv.head_dim, chunks = d / kLanes, group = G ? G : t.group;
    const int pairs = d / 2, pair_chunks = (pairs + kLanes - 1) / kLanes;
    const int rows = t.rows, heads = rows * group, n_max = t.n[rows - 1];
    vi* const keys_t = static_cast<vi*>(t.keys_t);
    // With ``ready``, the partition's keys stay transposed in ``keys_t`` (sixteen at a
    // place) for the next tile of the same rows' chunk, which transposes only the keys past
    // those: every whole group of sixteen this tile read.
    const int ready = t.ready ? t.ready->keys : 0;
    // The value pass takes the keys in blocks of kBlockPairs pairs (their values ~8 KiB, in
    // the level-1 cache beside a row's accumulators): each row's accumulators are loaded and
    // stored once a block.
    using Values = ValuePairOf<CH ? CH : kMaxChunks>;
    constexpr int kBlockPairs = std::clamp<int>(8192 / int(sizeof(Values)), 8, 32);
    constexpr int kBlockKeys = 2 * kBlockPairs;
    static_assert(kBlockPairs * sizeof(Values) <= kVectorScratch - kKeysBytes,
                  "a block of key pairs' values fits the vector scratch");
    Values* values = static_cast<Values*>(t.values);
    int64_t offsets[kPartition];
    key_offsets(kv, kv_head, table, t.start, n_max, offsets);
    // Keys and values are scattered over the pool's blocks: each pass prefetches the next
    // sixteen rows it reads.
    auto prefetch = [&](const uint16_t* base, int j0) {
        prefetch_rows(base, offsets, j0, std::min(j0 + kLanes, n_max), d);
    };
    if (ready == 0) prefetch(kv.keys, 0);
    // Scores, sixteen keys at a time (rows that end before a group skip it).
    for (int j0 = 0, first = 0; j0 < n_max; j0 += kLanes) {
        const int count = std::min(kLanes, n_max - j0);
        vi* kt = t.ready ? keys_t + j0 / kLanes * pair_chunks * kLanes : keys_t;
        if (j0 + kLanes >= ready) prefetch(kv.keys, j0 + kLanes);
        if (j0 >= ready) transpose_keys(kv.keys, offsets, j0, count, pairs, kt);
        while (t.n[first] <= j0) ++first;
        int rh = first * group;
        const uint16_t* q = t.q + int64_t(rh) * t.q_stride;
        float* out = t.scores + int64_t(rh) * kScoreStride + j0;
#if SLOTSERVE_AVX512
        for (; rh + 4 <= heads; rh += 4, q += 4 * t.q_stride, out += 4 * kScoreStride)
            score_keys<4>(q, t.q_stride, pair_chunks, kt, t.scale, out);
        switch (heads - rh) {
            case 3: score_keys<3>(q, t.q_stride, pair_chunks, kt, t.scale, out); break;
            case 2: score_keys<2>(q, t.q_stride, pair_chunks, kt, t.scale, out); break;
            case 1: score_keys<1>(q, t.q_stride, pair_chunks, kt, t.scale, out); break;
        }
#else
        for (; rh + 2 <= heads; rh += 2, q += 2 * t.q_stride, out += 2 * kScoreStride)
            score_keys_halves<2>(q, t.q_stride, pair_chunks, kt, t.scale, out);
        if (rh < heads) score_keys_halves<1>(q, t.q_stride, pair_chunks, kt, t.scale, out);
#endif
    }
    if (t.ready) t.ready->keys = std::max(ready, n_max / kLanes * kLanes);
    softmax_rows(t.scores, t.probs, heads, group, t.n, d, t.m, t.s, t.acc);
    // Values, a block at a time, each sixteen keys prefetched while the sixteen before them
    // are read. A row whose keys end inside a pair takes it with no odd value, as the row alone
    // does.
    prefetch(kv.values, 0);
    for (int j0 = 0, first = 0; j0 < n_max; j0 += kBlockKeys) {
        const int count = std::min(kBlockKeys, n_max - j0);
        for (int i = 0; 2 * i < count; ++i) {
            if (i % (kLanes / 2) == 0) prefetch(kv.values, j0 + 2 * i + kLanes);
            load_value_pair(kv.values + offsets[j0 + 2 * i],
                            2 * i + 1 < count ? kv.values + offsets[j0 + 2 * i + 1] : nullptr,
                            chunks, values[i]);
        }
        while (t.n[first] <= j0) ++first;
        for (int r = first; r < rows; ++r) {
            const int mine = std::min(count, t.n[r] - j0), whole = mine / 2;
            const bool half = mine % 2 != 0;
            const uint16_t* probs = t.probs + int64_t(r) * group * (kPartition + 2) + j0;
            float* acc = t.acc + int64_t(r) * group * d;
#if !SLOTSERVE_AVX512
            for (int g = 0; g < group; ++g)
                value_pairs_halves<CH>(acc + g * d, chunks, probs + g * (kPartition + 2), values,
                                       whole, half);
#else
            if constexpr (G > 0 && CH > 0 && G * CH <= 24) {
                vf out[G][CH];
                for (int g = 0; g < G; ++g)
                    for (int c = 0; c < CH; ++c) out[g][c] = load_f32(acc + g * d + c * kLanes);
                for (int i = 0; i < whole; ++i)
                    for (int g = 0; g < G; ++g)
                        value_pair(out[g], CH, probs + g * (kPartition + 2) + 2 * i, values[i]);
                if (half)
                    for (int g = 0; g < G; ++g)
                        value_pair(out[g], CH, probs + g * (kPartition + 2) + 2 * whole,
                                   values[whole], true);
                for (int g = 0; g < G; ++g)
                    for (int c = 0; c < CH; ++c) store_f32(acc + g * d + c * kLanes, out[g][c]);
            } else {
                for (int g = 0; g < group; ++g) {
                    vf out[kMaxChunks];
                    for (int c = 0; c < chunks; ++c) out[c] = load_f32(acc + g * d + c * kLanes);
                    const uint16_t* p = probs + g * (kPartition + 2);
                    for (int i = 0; i < whole; ++i) value_pair(out, chunks, p + 2 * i, values[i]);
                    if (half) value_pair(out, chunks, p + 2 * whole, values[whole], true);
                    for (int c = 0; c < chunks; ++c) store_f32(acc + g * d + c * kLanes, out[c]);
                }
            }
#endif
        }
    }
}

#define SLOTSERVE_ATTEND(CH, G) \
    return t.rows == 1 ? attend_row_t<CH, G>(kv, kv_head, table, t) \
                       : attend_tile_t<CH, G>(kv, kv_head, table, t)
#define SLOTSERVE_ATTEND_CASE(CH, G) \
    case CH * 100 + G: SLOTSERVE_ATTEND(CH, G);

// One partition of a tile or a lone row: every row-head's m, s and acc (see Tile).
static void attend_tile(const PagedKv& kv, int kv_head, const int32_t* table, const Tile& t) {
    switch (SLOTSERVE_SHAPE_CODE(kv.head_dim, t.group)) {
        SLOTSERVE_ATTENTION_SHAPES(SLOTSERVE_ATTEND_CASE)
        default: SLOTSERVE_ATTEND(0, 0);
    }
}
#undef SLOTSERVE_ATTEND_CASE
#undef SLOTSERVE_ATTEND

// Merges a token's partitions in their order: out = Σ e^(m_i - M) acc_i / Σ e^(m_i - M) s_i.
// ``m`` and ``s``: ``ms_stride`` floats from one partition to the next; ``acc``: ``part_stride``.
static void merge_partitions(const float* m, const float* s, const float* acc, int parts,
                             int group, int d, int ms_stride, int part_stride, uint16_t* out) {
    const int chunks = d / kLanes;
    for (int g = 0; g < group; ++g) {
        float best = -INFINITY;
        for (int i = 0; i < parts; ++i) best = std::max(best, m[i * ms_stride + g]);
        float total = 0.0f;
        vf sum[kMaxChunks];
        for (int c = 0; c < chunks; ++c) sum[c] = splat(0.0f);
        // The weights sixteen partitions at a time, each lane as sexp would give it.
        for (int i0 = 0; i0 < parts; i0 += kLanes) {
            const int count = std::min(kLanes, parts - i0);
            float w[kLanes] = {};
            for (int i = 0; i < count; ++i) w[i] = m[(i0 + i) * ms_stride + g] - best;
            store_f32(w, vexp(load_f32(w)));
            for (int i = 0; i < count; ++i) {
                const int64_t part = i0 + i;
                total += w[i] * s[part * ms_stride + g];
                for (int c = 0; c < chunks; ++c)
                    sum[c] += w[i] * load_f32(acc + part * part_stride + g * d + c * kLanes);
            }
        }
        // + 0: a zero result has one sign, whatever zeros its tile's other rows added
        // (attend_amx.h).
        for (int c = 0; c < chunks; ++c)
            store_bf16(out + g * d + c * kLanes, sum[c] / total + splat(0.0f));
    }
}
