// A partition of a tile of rows on AMX tiles (amx_tiles.h; the AVX512-BF16 build only). On a
// host whose unit gives its documented bits, every partition of a model whose head_dim is a
// multiple of 32 runs in this arithmetic, so that each row has one arithmetic whatever its
// batch: a tile's here, a lone row's here or (the shapes compiled for it) with its keys as A
// tiles (attend_amx_unit_row.h; an int8 pool's in vector code, attend_amx_row.h); the pool is
// read in place as attend_tile_t reads it.
//
// The arithmetic of a row (in place of attention.h's lane tree and value pairs):
//
//   score_j = scale * S_j, S summed over the head's chunks of sixteen pairs in order: S += the
//             chunk's even products fused from zero plus its odd ones (TDPBF16PS)
//   p_j, m, s: as attention.h
//   acc     = summed over chunks of sixteen key pairs from the partition's first key, each
//             chunk's even keys' products p_j v_j fused from zero plus its odd keys', per
//             dimension
//
// A row's keys past its end carry p = 0, so a chunk it shares with longer rows (or that pads a
// tile) adds zeros to it: its sums change at most in the sign of a zero, which the merge drops
// (merge_partitions adds +0). Keys past the tile's last are zero. Row-heads are taken sixteen to
// an A tile, the last ones beside zero rows; every C row depends on its A row only.

constexpr int kAmxKeyPairs = amx::kPairs;  // key pairs of one value chunk
constexpr int kAmxKeys = 2 * kAmxKeyPairs;  // keys of one value chunk
static_assert(kPartition / kAmxKeys * kMaxChunks * kAmxKeyPairs * 64 <= kVectorScratch - kKeysBytes,
              "a partition's value chunks as B tiles fit the vector scratch");

// The last A tile's rows when ``heads`` is not a multiple of sixteen (from row-head ``last``):
// its queries, the partition's probabilities and the accumulators, zero past the real rows,
// filled once a partition.
struct AmxPads {
    alignas(64) uint16_t q[amx::kRows * kMaxChunks * kLanes];
    alignas(64) uint16_t probs[amx::kRows][kPartition];
    alignas(64) float acc[amx::kRows * kMaxChunks * kLanes];
    int last;

    AmxPads(const Tile& t, int heads, int d) : last(heads / amx::kRows * amx::kRows) {
        if (last == heads) return;
        std::memset(q, 0, sizeof(uint16_t) * amx::kRows * d);
        std::memset(probs, 0, sizeof(probs));
        for (int r = last; r < heads; ++r)
            std::memcpy(q + (r - last) * d, t.q + int64_t(r) * t.q_stride, 2 * d);
    }
};

// Where a row tile's queries (or its probabilities) lie: in the tile, or in the pads.
struct RowTile {
    const uint16_t* rows;
    int64_t stride;  // bytes
};

// C tile ``C``'s part of the scores: its row tile's queries (``a``: A tile 4 or 5) against the
// keys' chunk already in B tile 6.
template <int C, class T>
static inline __attribute__((always_inline)) void score_dot(T& tiles, RowTile a, int chunk) {
    tiles.template load<4 + C % 2>(a.rows + 2 * kLanes * chunk, a.stride);
    tiles.template dot<C, 4 + C % 2, 6>();
}

// Scores of sixteen keys from j0 (transposed: vector 16c + l holds pair 16c + l of each key, an
// AMX B tile per sixteen pairs) for every row-head: up to four row tiles at once, each in its C
// tile, so that the unit's dot products overlap and each B tile is loaded once for them. ``raw``:
// the sums S are stored unscaled (softmax_rows' raw_scale), a whole row tile's straight from its
// C tile into its rows.
template <class T>
static void amx_scores(T& tiles, const Tile& t, int heads, int d, int j0, const vi* kt,
                       const AmxPads& pads, bool raw) {
    alignas(64) float c[4][amx::kRows][kLanes];
    auto row_tile = [&](int rh) {
        return rh < pads.last ? RowTile{t.q + int64_t(rh) * t.q_stride, int64_t(t.q_stride) * 2}
                              : RowTile{pads.q, 2 * d};
    };
    for (int rh0 = 0; rh0 < heads; rh0 += 4 * amx::kRows) {
        const int count = std::min(4, (heads - rh0 + amx::kRows - 1) / amx::kRows);
        tiles.template zero<0>();
        if (count > 1) tiles.template zero<1>();
        if (count > 2) tiles.template zero<2>();
        if (count > 3) tiles.template zero<3>();
        for (int chunk = 0; chunk < d / (2 * kLanes); ++chunk) {
            tiles.template load<6>(kt + chunk * kLanes, 64);
            score_dot<0>(tiles, row_tile(rh0), chunk);
            if (count > 1) score_dot<1>(tiles, row_tile(rh0 + amx::kRows), chunk);
            if (count > 2) score_dot<2>(tiles, row_tile(rh0 + 2 * amx::kRows), chunk);
            if (count > 3) score_dot<3>(tiles, row_tile(rh0 + 3 * amx::kRows), chunk);
        }
        auto direct = [&](int i) { return raw && rh0 + i * amx::kRows < pads.last; };
        auto at = [&](int i) {
            return direct(i) ? t.scores + int64_t(rh0 + i * amx::kRows) * kScoreStride + j0
                             : &c[i][0][0];
        };
        auto stride = [&](int i) -> int64_t {
            return direct(i) ? kScoreStride * 4 : sizeof(c[0][0]);
        };
        tiles.template store<0>(at(0), stride(0));
        if (count > 1) tiles.template store<1>(at(1), stride(1));
        if (count > 2) tiles.template store<2>(at(2), stride(2));
        if (count > 3) tiles.template store<3>(at(3), stride(3));
        const vf scale = splat(raw ? 1.0f : t.scale);
        for (int i = 0; i < count; ++i) {
            const int rh = rh0 + i * amx::kRows;
            if (direct(i)) continue;
            for (int r = 0; r < std::min(amx::kRows, heads - rh); ++r)
                store_f32(t.scores + int64_t(rh + r) * kScoreStride + j0,
                          load_f32(c[i][r]) * scale);
        }
    }
}

// The value chunk from key j0 (rows at ``values`` + ``offsets``) as B tiles: ``vb[oc * 16 + i]``
// holds dimensions 16 oc .. of key pair i, (v_j0+2i, v_j0+2i+1) per lane; keys from ``n`` on are
// zero.
static void amx_value_tiles(const uint16_t* values, const int64_t* offsets, int j0, int n, int d,
                            vi* vb) {
    alignas(64) static const uint16_t zeros[kMaxChunks * kLanes] = {};
    const int chunks = d / kLanes;
    ValuePair pair;
    for (int i = 0; i < kAmxKeyPairs; ++i) {
        const int j = j0 + 2 * i;
        load_value_pair(j < n ? values + offsets[j] : zeros,
                        j + 1 < n ? values + offsets[j + 1] : nullptr, chunks, pair);
        for (int oc = 0; oc < chunks; ++oc) vb[oc * kAmxKeyPairs + i] = pair.pairs[oc];
    }
}

// The B tile of value chunk ``chunk``'s dimensions 16 oc .. (amx_value_tiles' layout, one
// chunk after another) into B tile 6 or 7, and its dot product into C tile ``C`` with the
// probabilities in A tile 4.
template <int C, class T>
static inline __attribute__((always_inline)) void value_dot(T& tiles, const vi* vb, int d,
                                                            int chunk, int oc) {
    tiles.template load<6 + C % 2>(vb + (int64_t(chunk) * (d / kLanes) + oc) * kAmxKeyPairs,
                                   64);
    tiles.template dot<C, 4, 6 + C % 2>();
}

// acc of every row-head: from zero, ``chunks`` value chunks from the partition's first key
// (``vb``), in their order: sixteen row-heads by up to 64 dimensions held in four C tiles
// while every chunk is added, so acc meets memory once a partition.
template <class T>
static void amx_values(T& tiles, const Tile& t, int heads, int d, int chunks, const vi* vb,
                       AmxPads& pads) {
    const int dims = d / kLanes;  // even: head_dim is a multiple of 32
    const int64_t stride = int64_t(d) * 4;
    for (int rh = 0; rh < heads; rh += amx::kRows) {
        const bool whole = rh < pads.last;
        const uint16_t* p = t.probs + int64_t(rh) * (kPartition + 2);
        int64_t p_stride = (kPartition + 2) * 2;
        if (!whole) {
            for (int r = rh; r < heads; ++r)
                std::memcpy(pads.probs[r - rh], p + int64_t(r - rh) * (kPartition + 2),
                            sizeof(pads.probs[0]));
            p = &pads.probs[0][0];
            p_stride = sizeof(pads.probs[0]);
        }
        float* const acc = whole ? t.acc + int64_t(rh) * d : pads.acc;
        for (int oc = 0; oc < dims; oc += 4) {
            const bool four = oc + 2 < dims;
            tiles.template zero<0>();
            tiles.template zero<1>();
            if (four) tiles.template zero<2>();
            if (four) tiles.template zero<3>();
            for (int chunk = 0; chunk < chunks; ++chunk) {
                tiles.template load<4>(p + chunk * kAmxKeys, p_stride);
                value_dot<0>(tiles, vb, d, chunk, oc);
                value_dot<1>(tiles, vb, d, chunk, oc + 1);
                if (four) value_dot<2>(tiles, vb, d, chunk, oc + 2);
                if (four) value_dot<3>(tiles, vb, d, chunk, oc + 3);
            }
            tiles.template store<0>(acc + oc * kLanes, stride);
            tiles.template store<1>(acc + (oc + 1) * kLanes, stride);
            if (four) tiles.template store<2>(acc + (oc + 2) * kLanes, stride);
            if (four) tiles.template store<3>(acc + (oc + 3) * kLanes, stride);
        }
    }
}

// Every row-head's probabilities zero from its last key's sixteen up to ``end``: the value
// chunks read whole chunks of 32.
static void amx_zero_probs(const Tile& t, int heads, int end) {
    for (int rh = 0; rh < heads; ++rh) {
        const int keys = t.n[rh / t.group];
        const int from = keys <= 0 ? 0 : (keys + kLanes - 1) / kLanes * kLanes;
        uint16_t* p = t.probs + int64_t(rh) * (kPartition + 2);
        if (from < end) std::memset(p + from, 0, sizeof(uint16_t) * (end - from));
    }
}

// One partition of ``t`` for KV head ``kv_head`` (attend_tile's contract; head_dim a multiple
// of 32).
template <class T>
static void attend_amx_t(const PagedKv& kv, int kv_head, const int32_t* table, const Tile& t) {
    const int d = kv.head_dim, pairs = d / 2, pair_chunks = pairs / kLanes;
    const int heads = t.rows * t.group, n_max = t.n[t.rows - 1];
    vi* const keys_t = static_cast<vi*>(t.keys_t);
    const int ready = t.ready ? t.ready->keys : 0;
    int64_t offsets[kPartition];
    key_offsets(kv, kv_head, table, t.start, n_max, offsets);
    auto prefetch = [&](const uint16_t* base, int j0, int count) {
        prefetch_rows(base, offsets, j0, std::min(j0 + count, n_max), d);
    };
    T tiles;
    AmxPads pads(t, heads, d);
    // Sums left unscaled (softmax_rows' raw_scale) where the scale is positive, as every
    // model's is: only then is the largest score the scale times the largest sum.
    const bool raw = t.scale > 0.0f;
    for (int j0 = 0; j0 < n_max; j0 += kLanes) {
        const int count = std::min(kLanes, n_max - j0);
        vi* kt = t.ready ? keys_t + j0 / kLanes * pair_chunks * kLanes : keys_t;
        if (j0 + kLanes >= ready) prefetch(kv.keys, j0 + kLanes, kLanes);
        if (j0 >= ready) transpose_keys(kv.keys, offsets, j0, count, pairs, kt);
        amx_scores(tiles, t, heads, d, j0, kt, pads, raw);
    }
    if (t.ready) t.ready->keys = std::max(ready, n_max / kLanes * kLanes);
    // amx_values starts acc from zero tiles
    softmax_rows(t.scores, t.probs, heads, t.group, t.n, d, t.m, t.s, nullptr,
                 raw ? t.scale : 0.0f);
    const int end = (n_max + kAmxKeys - 1) / kAmxKeys * kAmxKeys;
    amx_zero_probs(t, heads, end);
    // The value chunks a tile before built whole (every key real) stay.
    vi* const vb = static_cast<vi*>(t.values);
    const int built = t.ready ? t.ready->values : 0;
    prefetch(kv.values, built, kAmxKeys);
    for (int j0 = built; j0 < n_max; j0 += kAmxKeys) {
        prefetch(kv.values, j0 + kAmxKeys, kAmxKeys);
        amx_value_tiles(kv.values, offsets, j0, n_max, d, vb + int64_t(j0 / kAmxKeys) * d);
    }
    if (t.ready) t.ready->values = std::max(built, n_max / kAmxKeys * kAmxKeys);
    amx_values(tiles, t, heads, d, end / kAmxKeys, vb, pads);
    if (pads.last < heads)
        std::memcpy(t.acc + int64_t(pads.last) * d, pads.acc,
                    sizeof(float) * (heads - pads.last) * d);
}

// attend_tile on AMX tiles, real or (``emulated``) in scalar code.
static void attend_amx_tiles(const PagedKv& kv, int kv_head, const int32_t* table, const Tile& t,
                             bool emulated) {
    if (emulated) return attend_amx_t<amx::EmulatedTiles>(kv, kv_head, table, t);
    attend_amx_t<amx::Tiles>(kv, kv_head, table, t);
}
