// A lone row's partition for every KV head at once (included by isa_kernels.h after attend.h).
//
// A position's keys (and values) of all KV heads lie side by side in the pool, so one head's
// rows are a few cache lines out of every position's: read head by head, a lone row's pass
// strides through each block once per head, and memory streams it worse than whole positions
// in order. Here every head computes its part of sixteen keys (its scores) or of kValueKeys
// keys (its values) in turn, each fetching its rows kWholeAhead positions ahead, so a
// position's rows are all requested within one such pass and used while they sit in the
// level-1 and level-2 caches. A core holds only so many fetches in flight, and not every row
// asked for arrives: the scores ask for their keys again kKeysAgain positions ahead, the value
// sums for their values kValueAhead ahead. Each head's arithmetic is attend_row_t's (on the AVX2
// build attend_row_avx2's), step for step, so a row has the same bits by either path.

constexpr int kWholeAhead = 96;  // positions ahead, keys to level 2 (values half as far)
constexpr int kValueKeys = 32;   // keys a head's value sums take at a time
constexpr int kKeysAgain = 24;   // positions ahead the scores ask for their keys again
constexpr int kValueAhead = 32;  // positions ahead the value sums ask for theirs again

// The ``bytes`` from ``row`` on, to level 2.
static inline __attribute__((always_inline)) void fetch(const uint16_t* row, int bytes) {
    for (int line = 0; line < bytes; line += 64)
        __builtin_prefetch(reinterpret_cast<const char*>(row) + line, 0, 1);
}

// What head h's scores of keys [j, j + step) ask for (its rows: ``D`` 16-bit units): its keys
// kWholeAhead and kKeysAgain positions ahead, its values kWholeAhead / 2 ahead (``n``: the
// partition's keys; ``reach``: the positions with offsets, the next partition's first ones too).
template <int D>
static inline __attribute__((always_inline)) void fetch_head_ahead(const PagedKv& kv,
                                                                   const int64_t* offsets, int h,
                                                                   int j, int step, int n,
                                                                   int reach) {
    const int64_t head = int64_t(h) * D;
    constexpr int bytes = D * 2;
    for (int i = j; i < j + step; ++i) {
        if (i + kWholeAhead < reach) fetch(kv.keys + offsets[i + kWholeAhead] + head, bytes);
        if (i + kKeysAgain < reach) fetch(kv.keys + offsets[i + kKeysAgain] + head, bytes);
        if (i + kWholeAhead / 2 < n) fetch(kv.values + offsets[i + kWholeAhead / 2] + head, bytes);
    }
}

// A lone row's partition by whole positions (``first``: its first head's tile): the pool offset of
// each position's first head's row into ``offsets``, the next partition's first ones too (how
// many in all is returned), and the first fetches, every head's rows: keys up to kWholeAhead
// positions ahead, values half as far.
static inline int start_whole_positions(const PagedKv& kv, const int32_t* table, const Tile& first,
                                        int64_t* offsets) {
    const int n = first.n[0], reach = n + std::min(first.beyond, kWholeAhead);
    key_offsets(kv, 0, table, first.start, reach, offsets);
    const int bytes = kv.kv_heads * row_units(kv) * 2;
    for (int j = 0; j < std::min(reach, kWholeAhead); ++j) fetch(kv.keys + offsets[j], bytes);
    for (int j = 0; j < std::min(n, kWholeAhead / 2); ++j) fetch(kv.values + offsets[j], bytes);
    return reach;
}

// What the value sums of keys [j0, end) ask for: every head's values kValueAhead ahead.
static inline __attribute__((always_inline)) void fetch_values_past(const PagedKv& kv,
                                                                    const int64_t* offsets,
                                                                    int j0, int end, int n) {
    const int bytes = kv.kv_heads * row_units(kv) * 2;
    for (int j = j0 + kValueAhead; j < std::min(n, end + kValueAhead); ++j)
        fetch(kv.values + offsets[j], bytes);
}

// A lone row's partition streamed by whole positions, every KV head (``tiles[h]``: KV head h's
// tile of one row, all of one partition: their n, start, beyond and scale the same; rows of
// ``Row`` 16-bit units): ``scores(h, offsets, j0, count)`` computes head h's scores of keys
// [j0, j0 + count) (sixteen at most; ``offsets`` of each position's first head's row), then
// every head's softmax zeroes its acc (``Softmax``: the arithmetic's own, else softmax_rows),
// then ``values(h, offsets, j0, end)`` adds keys [j0, end) (kValueKeys at a time) to it.
template <int Row, class Scores, class Softmax, class Values>
static inline __attribute__((always_inline)) void stream_positions(const PagedKv& kv,
                                                                   const int32_t* table,
                                                                   const Tile* tiles,
                                                                   Scores scores, Softmax softmax,
                                                                   Values values) {
    const int heads = kv.kv_heads, n = tiles[0].n[0];
    int64_t offsets[kPartition + kWholeAhead];  // of each position's first head's row
    const int reach = start_whole_positions(kv, table, tiles[0], offsets);
    for (int j0 = 0; j0 < n; j0 += kLanes) {
        const int count = std::min(kLanes, n - j0);
        for (int h = 0; h < heads; ++h) {
            fetch_head_ahead<Row>(kv, offsets, h, j0, count, n, reach);
            scores(h, offsets, j0, count);
        }
    }
    for (int h = 0; h < heads; ++h) softmax(tiles[h]);
    for (int j0 = 0; j0 < n; j0 += kValueKeys) {
        const int end = std::min(n, j0 + kValueKeys);
        fetch_values_past(kv, offsets, j0, end, n);
        for (int h = 0; h < heads; ++h) values(h, offsets, j0, end);
    }
}

// The vector arithmetic's softmax of a lone row of G query heads of CH sixteens (its acc
// zeroed).
template <int CH, int G>
static inline void row_softmax(const Tile& t) {
    softmax_rows(t.scores, t.probs, G, G, t.n, CH * kLanes, t.m, t.s, t.acc);
}

#if SLOTSERVE_AVX512
// A lone row's partition, every KV head (see stream_positions). ``Int8``: ``kv`` is an int8
// pool, read in registers.
template <int CH, int G, bool Int8 = false>
static void attend_row_heads_t(const PagedKv& kv, const int32_t* table, const Tile* tiles) {
    constexpr int d = CH * kLanes, row = row_units_of(d, Int8);
    const int n = tiles[0].n[0];
    auto scores = [&](int h, const int64_t* offsets, int j0, int count) {
        score_sixteen<CH, G, Int8>(tiles[h], kv.keys + int64_t(h) * row, offsets + j0, j0,
                                   count);
    };
    // Each head's sums over kValueKeys keys at a time, in registers, from its zeroed acc.
    constexpr int kRowGroup = G * CH <= 24 ? G : 1;  // heads whose sums fit the registers
    auto values = [&](int h, const int64_t* offsets, int j0, int end) {
        const Tile& t = tiles[h];
        const uint16_t* head = kv.values + int64_t(h) * row;  // the head's rows
        ValuePairOf<CH> v;
        for (int g0 = 0; g0 < G; g0 += kRowGroup) {
            vf out[kRowGroup][CH];
            for (int g = 0; g < kRowGroup; ++g)
                for (int c = 0; c < CH; ++c)
                    out[g][c] = load_f32(t.acc + (g0 + g) * d + c * kLanes);
            for (int j = j0; j < end; j += 2) {
                const uint16_t* odd = j + 1 < n ? head + offsets[j + 1] : nullptr;
                if constexpr (Int8)
                    load_int8_value_pair(reinterpret_cast<const uint8_t*>(head + offsets[j]),
                                         reinterpret_cast<const uint8_t*>(odd), d, v);
                else
                    load_value_pair(head + offsets[j], odd, CH, v);
                for (int g = 0; g < kRowGroup; ++g)
                    value_pair(out[g], CH, t.probs + (g0 + g) * (kPartition + 2) + j, v);
            }
            for (int g = 0; g < kRowGroup; ++g)
                for (int c = 0; c < CH; ++c)
                    store_f32(t.acc + (g0 + g) * d + c * kLanes, out[g][c]);
        }
    };
    stream_positions<row>(kv, table, tiles, scores, row_softmax<CH, G>, values);
}
#else
// The AVX2 build's: attend_row_avx2's pieces, eight keys of a head at a time.
template <int CH, int G, bool Int8 = false>
static void attend_row_heads_t(const PagedKv& kv, const int32_t* table, const Tile* tiles) {
    constexpr int d = CH * kLanes, row = row_units_of(d, Int8);
    const int n = tiles[0].n[0];
    auto scores = [&](int h, const int64_t* offsets, int j0, int count) {
        const QueryHalves<CH, G> q(tiles[h]);
        for (int j = j0; j < j0 + count; j += 8)
            score_eight<CH, G, Int8>(tiles[h], q, kv.keys + int64_t(h) * row, offsets, j,
                                     std::min(8, j0 + count - j), [](int) {});
    };
    auto values = [&](int h, const int64_t* offsets, int j0, int end) {
        value_span<CH, G, Int8>(tiles[h], kv.values + int64_t(h) * row, offsets, j0, end, n);
    };
    stream_positions<row>(kv, table, tiles, scores, row_softmax<CH, G>, values);
}
#endif

// One lone row's partition, every KV head (``tiles``: kv.kv_heads of them). The shapes without
// a specialization run attend_tile head by head.
static void attend_row_heads(const PagedKv& kv, const int32_t* table, const Tile* tiles) {
#define SLOTSERVE_HEADS_CASE(CH, G) \
    case CH * 100 + G: return attend_row_heads_t<CH, G>(kv, table, tiles);
    switch (SLOTSERVE_SHAPE_CODE(kv.head_dim, tiles[0].group)) {
        SLOTSERVE_ATTENTION_SHAPES(SLOTSERVE_HEADS_CASE)
        default: break;
    }
#undef SLOTSERVE_HEADS_CASE
    for (int h = 0; h < kv.kv_heads; ++h) attend_tile(kv, h, table, tiles[h]);
}

// attend_row_heads from an int8 pool's rows in place, for the shapes compiled above: the
// partition streams from memory once while it computes, where a read-back first would wait on
// memory, then compute from the cache. False (nothing done) for any other shape.
static bool attend_int8_row_heads(const PagedKv& kv, const int32_t* table, const Tile* tiles) {
#define SLOTSERVE_INT8_HEADS_CASE(CH, G) \
    case CH * 100 + G: attend_row_heads_t<CH, G, true>(kv, table, tiles); return true;
    switch (SLOTSERVE_SHAPE_CODE(kv.head_dim, tiles[0].group)) {
        SLOTSERVE_ATTENTION_SHAPES(SLOTSERVE_INT8_HEADS_CASE)
        default: return false;
    }
#undef SLOTSERVE_INT8_HEADS_CASE
}
