// A lone row's partition from an int8 pool in the tiles' arithmetic, computed in vector code
// (included by isa_kernels.h after attend_amx.h and attend_heads.h; the AVX512-BF16 build only).
//
// Where attention runs in the tiles' arithmetic (attend_amx.h), every row of a model must, so
// that a decode row keeps the bits it would have in a prefill chunk. A bfloat16 pool's lone rows
// run on the unit with the keys as A tiles (attend_amx_unit_row.h); an int8 pool's rows are
// widened as they are read, so here a lone row sums the unit's products in the same order in
// vector registers, streaming the pool's rows in place (attend_heads.h's stream_positions):
//
//   score_j  sixteen keys at a time, one per lane (their pairs transposed in registers): per
//            chunk of sixteen pairs, the even products fused in order from zero, the odd ones
//            likewise, their sum added to the score's running sum, then times the scale
//   acc      per chunk of sixteen key pairs, one dimension per lane: the even keys' products
//            p_j v_j fused in order from zero, the odd keys' likewise, their sum added to acc
//
// Under FlushDenormals the vector steps flush inputs and results as the unit does; keys and
// probabilities past a row's end are zero, as in a tile. So a row has the unit's bits by
// either path.

constexpr int kAmxDims = 2 * amx::kPairs;  // dimensions of one chunk of an A tile's row

// The float at ``p`` in every lane: the broadcast memory operand of a fused step (splat adds
// +0, one more operation, and its -0 would turn +0).
static inline __attribute__((always_inline)) vf broadcast(const float* p) {
    return (vf)_mm512_set1_ps(*p);
}

// A row's G query heads in float32, the broadcast operands of the score chains.
template <int CH, int G>
struct QueryFloats {
    alignas(64) float q[G][CH * kLanes];

    explicit QueryFloats(const Tile& t) {
        for (int g = 0; g < G; ++g)
            for (int c = 0; c < CH; ++c)
                store_f32(q[g] + c * kLanes,
                          load_bf16(t.q + int64_t(g) * t.q_stride + c * kLanes));
    }
};

// The scores of keys j0 .. j0 + count - 1 (at most sixteen; ``offsets`` from j0's, ``keys`` the
// row's KV head's first row, of an int8 pool) for each of the G query heads.
template <int CH, int G>
static inline __attribute__((always_inline)) void amx_row_scores(const Tile& t,
                                                                 const QueryFloats<CH, G>& qf,
                                                                 const uint16_t* keys,
                                                                 const int64_t* offsets, int j0,
                                                                 int count) {
    constexpr int d = CH * kLanes;
    vf sums[G];
    for (int g = 0; g < G; ++g) sums[g] = splat(0.0f);
    for (int c = 0; c < d / kAmxDims; ++c) {
        vi kt[kLanes];  // key jj's pairs 16c .. in vector jj, then (transposed) pair l in kt[l]
        for (int jj = 0; jj < kLanes; ++jj) {
            if (jj >= count) {
                kt[jj] = vi{};
            } else {
                const uint8_t* row = reinterpret_cast<const uint8_t*>(keys + offsets[jj]);
                kt[jj] = int8_pair_chunk(row, c, int8_scale(row, d));
            }
        }
        transpose_16(kt);
        vf even[G], odd[G];
        for (int g = 0; g < G; ++g) even[g] = odd[g] = splat(0.0f);
        for (int l = 0; l < kLanes; ++l) {
            const vf ke = even_halves(kt[l]), ko = odd_halves(kt[l]);
            for (int g = 0; g < G; ++g) {
                const float* q = qf.q[g] + c * kAmxDims + 2 * l;
                even[g] = vfma(broadcast(q), ke, even[g]);
                odd[g] = vfma(broadcast(q + 1), ko, odd[g]);
            }
        }
        for (int g = 0; g < G; ++g) sums[g] = sums[g] + (even[g] + odd[g]);
    }
    for (int g = 0; g < G; ++g)
        store_f32(t.scores + int64_t(g) * kScoreStride + j0, sums[g] * t.scale);
}

// The values of keys ``even`` and ``odd`` (int8 rows; null: past the row's end, zero) in
// float32, one dimension a lane.
template <int CH>
static inline __attribute__((always_inline)) void value_floats(const uint16_t* even,
                                                               const uint16_t* odd, vf (&ve)[CH],
                                                               vf (&vo)[CH]) {
    if (even == nullptr) {
        for (int c = 0; c < CH; ++c) ve[c] = vo[c] = splat(0.0f);
        return;
    }
    ValuePairOf<CH> v;
    load_int8_value_pair(reinterpret_cast<const uint8_t*>(even),
                         reinterpret_cast<const uint8_t*>(odd), CH * kLanes, v);
    for (int c = 0; c < CH; ++c) {
        ve[c] = even_halves(v.pairs[c]);
        vo[c] = odd_halves(v.pairs[c]);
    }
}

// Every head's acc advanced by the value chunk of keys j0 .. j0 + 31 (of the row's ``n``;
// ``values`` the row's KV head's first row, of an int8 pool).
template <int CH, int G>
static inline __attribute__((always_inline)) void amx_row_values(const Tile& t,
                                                                 const uint16_t* values,
                                                                 const int64_t* offsets, int j0,
                                                                 int n) {
    constexpr int d = CH * kLanes;
    // Heads whose chains fit the registers, taken together: G, or half of them, or one.
    constexpr int kHeads = 2 * G * CH <= 24 ? G : G % 2 == 0 && G * CH <= 24 ? G / 2 : 1;
    alignas(64) float p[G][kAmxDims];  // the chunk's probabilities, each head's
    for (int g = 0; g < G; ++g)
        for (int i = 0; i < kAmxDims; i += kLanes)
            store_f32(p[g] + i, load_bf16(t.probs + int64_t(g) * (kPartition + 2) + j0 + i));
    for (int g0 = 0; g0 < G; g0 += kHeads) {
        vf even[kHeads][CH], odd[kHeads][CH];
        for (int g = 0; g < kHeads; ++g)
            for (int c = 0; c < CH; ++c) even[g][c] = odd[g][c] = splat(0.0f);
        for (int i = 0; i < amx::kPairs; ++i) {
            const int j = j0 + 2 * i;
            vf ve[CH], vo[CH];
            value_floats<CH>(j < n ? values + offsets[j] : nullptr,
                             j + 1 < n ? values + offsets[j + 1] : nullptr, ve, vo);
            for (int g = 0; g < kHeads; ++g) {
                const vf pe = broadcast(p[g0 + g] + 2 * i), po = broadcast(p[g0 + g] + 2 * i + 1);
                for (int c = 0; c < CH; ++c) {
                    even[g][c] = vfma(pe, ve[c], even[g][c]);
                    odd[g][c] = vfma(po, vo[c], odd[g][c]);
                }
            }
        }
        for (int g = 0; g < kHeads; ++g)
            for (int c = 0; c < CH; ++c) {
                float* acc = t.acc + (g0 + g) * d + c * kLanes;
                store_f32(acc, load_f32(acc) + (even[g][c] + odd[g][c]));
            }
    }
}

// A lone row's softmax (its acc zeroed), and its probabilities zero up to its last value
// chunk's end.
template <int CH, int G>
static inline void amx_row_softmax(const Tile& t) {
    softmax_rows(t.scores, t.probs, G, G, t.n, CH * kLanes, t.m, t.s, t.acc);
    const int n = t.n[0], from = (n + kLanes - 1) / kLanes * kLanes;
    const int end = (n + kAmxDims - 1) / kAmxDims * kAmxDims;
    for (int g = 0; g < G; ++g)
        std::memset(t.probs + int64_t(g) * (kPartition + 2) + from, 0,
                    sizeof(uint16_t) * (end - from));
}

// One lone row's partition for every KV head of an int8 pool (attend_heads.h's
// stream_positions).
template <int CH, int G>
static void attend_amx_int8_row_heads_t(const PagedKv& kv, const int32_t* table,
                                        const Tile* tiles) {
    static_assert(kValueKeys == kAmxDims, "the value pass takes whole chunks");
    constexpr int d = CH * kLanes, row = row_units_of(d, true);
    const int n = tiles[0].n[0];
    auto scores = [&](int h, const int64_t* offsets, int j0, int count) {
        amx_row_scores<CH, G>(tiles[h], QueryFloats<CH, G>(tiles[h]), kv.keys + int64_t(h) * row,
                              offsets + j0, j0, count);
    };
    auto values = [&](int h, const int64_t* offsets, int j0, int) {
        amx_row_values<CH, G>(tiles[h], kv.values + int64_t(h) * row, offsets, j0, n);
    };
    stream_positions<row>(kv, table, tiles, scores, amx_row_softmax<CH, G>, values);
}
