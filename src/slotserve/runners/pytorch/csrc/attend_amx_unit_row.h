// A lone row's partition on the AMX unit, every KV head at once (included by isa_kernels.h after
// attend_amx_row.h; the AVX512-BF16 build only).
//
// attend_amx.h puts query rows in A tiles and transposes the keys into B tiles: for a lone row
// the unit then does sixteen rows' work for one, and the transposes cost more than the sums.
// Here the roles turn. Sixteen positions' keys of a KV head lie in the pool sixteen rows a fixed
// stride apart (a block), so they are an A tile read in place; the row's G query heads,
// transposed once a partition, are a B tile of G columns; the C tile holds sixteen keys' sums of
// every head. Products commute, so each C element is the same chain of fused steps over the
// same pairs as the Q·Kᵀ tiles form: a score keeps its bits. The value sums are the tiles' own:
// the G heads' probabilities of a chunk of 32 keys are an A tile of G rows, the chunk's values
// (each key pair's interleaved) B tiles of sixteen dimensions, and each chunk's sums are added
// to acc as attend_amx_row.h's vector code adds them. So a lone row has the bits of that code
// and of a tile's rows, and the unit and the vector ports work side by side while the pool
// streams in.

// Tiles: 0 and 1 value sums (G rows of sixteen dimensions), 2 the probabilities (G rows of 32
// keys), 3 and 7 a value chunk's pairs, 4 the scores (sixteen keys by G heads), 5 sixteen keys
// (32 dimensions), 6 the queries' pairs (sixteen pairs by G heads).
template <int G>
static amx::TileConfig unit_row_tiles() {
    amx::TileConfig config;
    auto shape = [&](int tile, int rows, int bytes) {
        config.rows[tile] = uint8_t(rows);
        config.colsb[tile] = uint16_t(bytes);
    };
    for (int tile : {0, 1, 2}) shape(tile, G, 64);
    for (int tile : {3, 5, 7}) shape(tile, amx::kRows, 64);
    for (int tile : {4, 6}) shape(tile, amx::kRows, 4 * G);
    return config;
}

// A row's G query heads as the scores' B tiles: chunk c's pair l of head g (two bfloat16).
template <int CH, int G>
struct QueryColumns {
    alignas(64) uint32_t pairs[CH / 2][amx::kPairs][G];

    void fill(const Tile& t) {
        for (int g = 0; g < G; ++g) {
            uint32_t q[CH * kLanes / 2];
            std::memcpy(q, t.q + int64_t(g) * t.q_stride, sizeof(q));
            for (int p = 0; p < CH * kLanes / 2; ++p)
                pairs[p / amx::kPairs][p % amx::kPairs][g] = q[p];
        }
    }
};

// Head g's sixteen scores from C tile rows stored [key][G] at ``sums``: the floats g, g + G, ...
template <int G>
static inline __attribute__((always_inline)) vf head_column(const float* sums, int g) {
    if constexpr (G == 1) return load_f32(sums);
    const __m512i at = _mm512_add_epi32(_mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11,
                                                                             10, 9, 8, 7, 6, 5,
                                                                             4, 3, 2, 1, 0),
                                                           _mm512_set1_epi32(G)),
                                        _mm512_set1_epi32(g));
    __m512 out = _mm512_setzero_ps();
    for (int v = 0; v < G; v += 2) {  // vectors v and v + 1: floats 16v .. 16v + 31
        const __m512i index = _mm512_sub_epi32(at, _mm512_set1_epi32(kLanes * v));
        const int span = kLanes * std::min(2, G - v);
        const __mmask16 here = _mm512_cmpge_epi32_mask(index, _mm512_setzero_si512()) &
                               _mm512_cmplt_epi32_mask(index, _mm512_set1_epi32(span));
        const __m512 hi = v + 1 < G ? _mm512_load_ps(sums + kLanes * (v + 1)) : _mm512_setzero_ps();
        out = _mm512_mask_mov_ps(
            out, here, _mm512_permutex2var_ps(_mm512_load_ps(sums + kLanes * v), index, hi));
    }
    return (vf)out;
}

// The scores of keys j0 .. j0 + count - 1 (at most sixteen; ``offsets`` from j0's, ``keys`` the
// KV head's first row) for each of the G heads. Sixteen keys a fixed stride apart are read in
// place, fewer (or spread over two blocks) copied first, zero past the last.
template <int CH, int G, class T>
static inline void unit_row_scores(T& unit, const Tile& t, const QueryColumns<CH, G>& queries,
                                   const uint16_t* keys, const int64_t* offsets, int j0,
                                   int count) {
    constexpr int d = CH * kLanes;
    int64_t stride = count > 1 ? offsets[1] - offsets[0] : 0;
    bool in_place = count == kLanes;
    for (int i = 2; in_place && i < kLanes; ++i) in_place = offsets[i] - offsets[i - 1] == stride;
    alignas(64) uint16_t copied[kLanes * d];
    const uint16_t* rows = keys + offsets[0];
    if (!in_place) {
        for (int i = 0; i < count; ++i) std::memcpy(copied + i * d, keys + offsets[i], 2 * d);
        std::memset(copied + count * d, 0, sizeof(uint16_t) * (kLanes - count) * d);
        rows = copied;
        stride = d;
    }
    unit.template zero<4>();
    for (int c = 0; c < CH / 2; ++c) {
        unit.template load<5>(rows + c * kAmxDims, stride * 2);
        unit.template load<6>(queries.pairs[c], 4 * G);
        unit.template dot<4, 5, 6>();
    }
    alignas(64) float sums[kLanes * G];  // [key][head]
    unit.template store<4>(sums, 4 * G);
    for (int g = 0; g < G; ++g)
        store_f32(t.scores + int64_t(g) * kScoreStride + j0, head_column<G>(sums, g) * t.scale);
}

// Every head's acc advanced by the value chunk of keys j0 .. j0 + 31 (of the row's ``n``;
// ``values`` the KV head's first row; keys from n on are zero).
template <int CH, int G, class T>
static inline void unit_row_values(T& unit, const Tile& t, const uint16_t* values,
                                   const int64_t* offsets, int j0, int n) {
    constexpr int d = CH * kLanes;
    alignas(64) vi pairs[CH][amx::kPairs];  // B tile oc: pair i's dimensions 16 oc ..
    amx_value_tiles(values, offsets, j0, n, d, pairs[0]);
    unit.template load<2>(t.probs + j0, (kPartition + 2) * 2);
    alignas(64) float sums[2][G][kLanes];
    for (int oc = 0; oc < CH; oc += 2) {
        unit.template zero<0>();
        unit.template zero<1>();
        unit.template load<3>(pairs[oc], 64);
        unit.template dot<0, 2, 3>();
        unit.template load<7>(pairs[oc + 1], 64);
        unit.template dot<1, 2, 7>();
        unit.template store<0>(sums[0], 64);
        unit.template store<1>(sums[1], 64);
        for (int g = 0; g < G; ++g)
            for (int half = 0; half < 2; ++half) {
                float* acc = t.acc + g * d + (oc + half) * kLanes;
                store_f32(acc, load_f32(acc) + load_f32(sums[half][g]));
            }
    }
}

// One lone row (``t.rows`` == 1) of KV head ``kv_head`` on the unit ``T`` (real or emulated):
// attend_amx's contract.
template <int CH, int G, class T>
static void attend_unit_row_t(const PagedKv& kv, int kv_head, const int32_t* table,
                              const Tile& t) {
    constexpr int d = CH * kLanes;
    const int n = t.n[0];
    int64_t offsets[kPartition];
    key_offsets(kv, kv_head, table, t.start, n, offsets);
    const RowPrefetch<d * 2> prefetch{kv.keys, kv.values, offsets, n, d * 2};
    prefetch.start();
    T unit(unit_row_tiles<G>());
    QueryColumns<CH, G> queries;
    queries.fill(t);
    for (int j0 = 0; j0 < n; j0 += kLanes) {
        const int count = std::min(kLanes, n - j0);
        for (int j = j0; j < j0 + count; ++j) prefetch.ahead_of(j);
        unit_row_scores<CH, G>(unit, t, queries, kv.keys, offsets + j0, j0, count);
    }
    amx_row_softmax<CH, G>(t);
    for (int j0 = 0; j0 < n; j0 += kAmxDims)
        unit_row_values<CH, G>(unit, t, kv.values, offsets, j0, n);
}

// A lone row's partition for every KV head from a bfloat16 pool on the unit ``T`` (real or
// emulated), in stream_positions' order.
template <int CH, int G, class T>
static void attend_unit_row_heads_t(const PagedKv& kv, const int32_t* table, const Tile* tiles) {
    static_assert(CH % 2 == 0 && kValueKeys == kAmxDims, "whole chunks of 32");
    constexpr int d = CH * kLanes;
    const int n = tiles[0].n[0];
    T unit(unit_row_tiles<G>());
    QueryColumns<CH, G> queries[kTileRows];
    for (int h = 0; h < kv.kv_heads; ++h) queries[h].fill(tiles[h]);
    auto scores = [&](int h, const int64_t* offsets, int j0, int count) {
        unit_row_scores<CH, G>(unit, tiles[h], queries[h], kv.keys + int64_t(h) * d, offsets + j0,
                               j0, count);
    };
    auto values = [&](int h, const int64_t* offsets, int j0, int) {
        unit_row_values<CH, G>(unit, tiles[h], kv.values + int64_t(h) * d, offsets, j0, n);
    };
    stream_positions<d>(kv, table, tiles, scores, amx_row_softmax<CH, G>, values);
}

// A lone row's partition for every KV head in the tiles' arithmetic: a bfloat16 pool's on the
// unit (``emulated``: its emulation), an int8 pool's in vector code (attend_amx_row.h), its rows
// read in place; false (nothing done) for a shape not compiled.
static bool attend_amx_row_heads(const PagedKv& kv, const int32_t* table, const Tile* tiles,
                                 bool emulated) {
#define SLOTSERVE_AMX_HEADS_CASE(CH, G)                                                  \
    case CH * 100 + G:                                                                    \
        if (kv.int8)                                                                      \
            attend_amx_int8_row_heads_t<CH, G>(kv, table, tiles);                        \
        else if (emulated)                                                                \
            attend_unit_row_heads_t<CH, G, amx::EmulatedTiles>(kv, table, tiles);        \
        else                                                                              \
            attend_unit_row_heads_t<CH, G, amx::Tiles>(kv, table, tiles);                \
        return true;
    switch (SLOTSERVE_SHAPE_CODE(kv.head_dim, tiles[0].group)) {
        SLOTSERVE_ATTENTION_SHAPES(SLOTSERVE_AMX_HEADS_CASE)
        default: return false;
    }
#undef SLOTSERVE_AMX_HEADS_CASE
}

// attend_tile in the tiles' arithmetic, on the unit (or, ``emulated``, its emulation); a lone
// row of a shape compiled above with the keys as A tiles.
static void attend_amx(const PagedKv& kv, int kv_head, const int32_t* table, const Tile& t,
                       bool emulated) {
#define SLOTSERVE_AMX_ROW_CASE(CH, G)                                                      \
    case CH * 100 + G:                                                                      \
        return emulated ? attend_unit_row_t<CH, G, amx::EmulatedTiles>(kv, kv_head, table, t) \
                        : attend_unit_row_t<CH, G, amx::Tiles>(kv, kv_head, table, t);
    if (t.rows == 1 && !kv.int8) switch (SLOTSERVE_SHAPE_CODE(kv.head_dim, t.group)) {
            SLOTSERVE_ATTENTION_SHAPES(SLOTSERVE_AMX_ROW_CASE)
            default: break;
        }
#undef SLOTSERVE_AMX_ROW_CASE
    attend_amx_tiles(kv, kv_head, table, t, emulated);
}
