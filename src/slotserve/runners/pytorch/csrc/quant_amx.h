// quant_gemm.h's projections on AMX tiles for steps of whole tiles of rows (included by it on the
// AVX512-BF16 build, whose VNNI paths it matches bit for bit).
//
// A sub-block's integer sums Σ v · q are the same exact int32 however they are formed, so the
// tiles form them: one output group's values v = code − offset are decoded once per call into a
// panel of B tiles (per four inputs a 64-byte row, output j's four values in bytes 4j..4j+3,
// signed), and each TDPBSSD multiplies a sub-block's inputs of sixteen rows (the signed int8 q,
// an A tile of 16 or 32 bytes a row) by its panel rows into a C tile of sixteen rows' sixteen
// int32 sums. Each row's float steps then run exactly as group_tile's, in the same order, with
// the same operations: the rows' bits are the vector path's, so the tiles may serve any step,
// chosen by its row count (kTileMinRows). Rows past the last whole tile take the vector path.

namespace quant {

constexpr int64_t kTileRows = amx::kRows;
// The fewest rows a step takes to the tiles: below four row tiles, decoding each group's panel
// and scaling each tile's sums cost more than the vector path's fused sums save.
constexpr int64_t kTileMinRows = 4 * kTileRows;

// Output group `group`'s values over the whole input as B tile rows: [k / 4][16][4] int8.
template <int BITS, int OFFSET, int SUPER>
static void decode_panel(const Operands& op, const uint8_t* group, int8_t* panel) {
    const int64_t record_bytes = op.f.record_bytes(), header_bytes = op.f.header_bytes();
    const __m512i offset = _mm512_set1_epi8(char(BITS == 8 ? 0x80 : OFFSET));
    const uint8_t* record = group;
    for (int64_t b = 0; b < op.k / SUPER; ++b, record += record_bytes) {
        const uint8_t* codes = record + header_bytes;
        int8_t* rows = panel + b * SUPER * kLanes;  // SUPER / 4 rows of 64 bytes
        if constexpr (BITS == 4 || BITS == 6) {
            for (int p = 0; p < SUPER / 2; p += 4) {  // a unit of 8 inputs: two rows
                const Nibbles n = NibblePairs<BITS, OFFSET>::template decode<SUPER>(codes, p);
                _mm512_storeu_si512(rows + p / 4 * 128, _mm512_sub_epi8(n.first, offset));
                _mm512_storeu_si512(rows + p / 4 * 128 + 64, _mm512_sub_epi8(n.last, offset));
            }
        } else if constexpr (BITS == 8) {  // the quad path's codes, their sign bit back
            for (int p = 0; p < SUPER / 2; p += 2)  // two pairs: a row
                _mm512_storeu_si512(rows + p / 2 * 64,
                                    _mm512_xor_si512(QuadPairs<OFFSET>::template decode<SUPER>(
                                                         codes, p),
                                                     offset));
        } else {  // five bits: two pairs' (even, odd) values interleaved per output
            for (int p = 0; p < SUPER / 2; p += 2) {
                const PairValues a = pair_values<BITS, OFFSET, SUPER>(codes, p);
                const PairValues c = pair_values<BITS, OFFSET, SUPER>(codes, p + 1);
                int8_t* row = rows + p / 2 * 64;
                _mm_storeu_si128((__m128i*)row, _mm_unpacklo_epi16(a.lo, c.lo));
                _mm_storeu_si128((__m128i*)(row + 16), _mm_unpackhi_epi16(a.lo, c.lo));
                _mm_storeu_si128((__m128i*)(row + 32), _mm_unpacklo_epi16(a.hi, c.hi));
                _mm_storeu_si128((__m128i*)(row + 48), _mm_unpackhi_epi16(a.hi, c.hi));
            }
        }
    }
}

// Sub-block u's sums of rows x (sixteen, op.k apart) into C tile C, from A tile A and B tile B.
template <int C, int A, int B, int SUB, class T>
static inline void sum_sub_block(T& t, const Operands& op, const int8_t* x, const int8_t* panel,
                                 int64_t u) {
    t.template zero<C>();
    t.template load<A>(x + u * SUB, op.k);
    t.template load<B>(panel + u * SUB / 4 * 64, 64);
    t.template dot_bytes<C, A, B>();
}

// Sub-block u's sums (`sums`, stored from its C tile) scaled into the sixteen rows' running
// sums (from row m0) as group_tile scales them.
template <bool MIN, int SUB, int SUPER>
static inline __attribute__((always_inline)) void scale_sub_block(
    const Operands& op, const uint8_t* group, int64_t m0, int64_t u,
    const int32_t (&sums)[kTileRows][kLanes], Acc (&running)[kTileRows]) {
    constexpr int kSubBlocks = SUPER / SUB;
    const uint8_t* record = group + u / kSubBlocks * op.f.record_bytes();
    const int s = int(u % kSubBlocks);
    const Acc d = widen_f16(record), dmin = MIN ? widen_f16(record + 32) : acc_zero();
    const SubBlockScales w = sub_block_scales<MIN, SUB, SUPER>(record, d, dmin, s);
    const int64_t at = u * SUB / kInputBlock * op.blocks.rows + m0;
    const float *step = op.blocks.step + at, *neg_sum = op.blocks.neg_sum + at;
#pragma GCC unroll 16
    for (int r = 0; r < kTileRows; ++r) {
        const Sums sum{_mm512_load_si512((const void*)sums[r])};
        running[r] = scaled_into<MIN>(running[r], sum, w, step[r], neg_sum[r]);
    }
}

// Rows [m0, m0 + 16) of one group (its records at `group`, its panel decoded), their sums
// stored in `acc` ([16][16] float32), sub-blocks in order. C tiles 0 and 1 (A 4 and 5, B 6 and
// 7) take turns, two sub-blocks ahead of the scaling: while one sub-block is scaled from memory
// the next one's sums are being stored and the one after that's formed.
template <class T, bool MIN, int SUB, int SUPER>
static void tile_rows(T& t, const Operands& op, const uint8_t* group, const int8_t* panel,
                      int64_t m0, float* acc) {
    const int64_t subs = op.k / SUB;
    const int8_t* x = op.xq8 + m0 * op.k;
    alignas(64) int32_t sums[2][kTileRows][kLanes];
    constexpr int64_t kStride = kLanes * sizeof(int32_t);
    // Each loop over the rows whole, scale_sub_block's too: the running sums then stay in
    // registers, where a loop's variable index would keep them in memory (a load and a store
    // per row and sub-block).
    Acc running[kTileRows];
#pragma GCC unroll 16
    for (int r = 0; r < kTileRows; ++r) running[r] = acc_zero();
    sum_sub_block<0, 4, 6, SUB>(t, op, x, panel, 0);
    if (subs > 1) sum_sub_block<1, 5, 7, SUB>(t, op, x, panel, 1);
    t.template store<0>(sums[0], kStride);
    for (int64_t u = 0; u < subs; u += 2) {  // sums[0] holds u's sums, C1 forms u + 1's
        if (u + 2 < subs) sum_sub_block<0, 4, 6, SUB>(t, op, x, panel, u + 2);
        if (u + 1 < subs) t.template store<1>(sums[1], kStride);
        scale_sub_block<MIN, SUB, SUPER>(op, group, m0, u, sums[0], running);
        if (u + 1 == subs) break;
        if (u + 3 < subs) sum_sub_block<1, 5, 7, SUB>(t, op, x, panel, u + 3);
        if (u + 2 < subs) t.template store<0>(sums[0], kStride);
        scale_sub_block<MIN, SUB, SUPER>(op, group, m0, u + 1, sums[1], running);
    }
#pragma GCC unroll 16
    for (int r = 0; r < kTileRows; ++r) acc_store(acc + r * kLanes, running[r]);
}

// Panels decoded at once: each row tile's inputs then meet this many groups while they stay in
// the level-2 cache, rather than streaming from memory once per group in a long prefill chunk.
constexpr int64_t kPanelGroups = 8;
constexpr int64_t kPanelBytes = int64_t(1) << 20;  // the panels' most: half a core's level 2

// groups_of for a step of at least one whole tile of rows: the whole tiles on the tiles (real
// or emulated), the rest on the vector path.
template <class T, int BITS, int OFFSET, bool MIN, int SUB, int SUPER>
static void tiled_groups_of(const Operands& op, int64_t rows, int64_t g0, int64_t g1) {
    T t(amx::byte_tiles(SUB));
    const int64_t group_bytes = op.k / SUPER * op.f.record_bytes(), panel_bytes = op.k * kLanes;
    const int64_t chunk = std::clamp<int64_t>(kPanelBytes / panel_bytes, 1, kPanelGroups);
    const int64_t whole = rows / kTileRows * kTileRows;
    const std::unique_ptr<void, decltype(&std::free)> buffer(
        std::aligned_alloc(64, chunk * panel_bytes), &std::free);
    int8_t* panels = static_cast<int8_t*>(buffer.get());
    alignas(64) float acc[kTileRows * kLanes];
    for (int64_t c0 = g0; c0 < g1; c0 += chunk) {
        const int64_t c1 = std::min(g1, c0 + chunk);
        for (int64_t g = c0; g < c1; ++g)
            decode_panel<BITS, OFFSET, SUPER>(op, op.w + g * group_bytes,
                                              panels + (g - c0) * panel_bytes);
        for (int64_t m0 = 0; m0 < whole; m0 += kTileRows)
            for (int64_t g = c0; g < c1; ++g) {
                tile_rows<T, MIN, SUB, SUPER>(t, op, op.w + g * group_bytes,
                                              panels + (g - c0) * panel_bytes, m0, acc);
                store_rows(op, acc, g, m0, m0 + kTileRows);
            }
        for (int64_t g = c0; g < c1 && whole < rows; ++g) {  // fewer rows than kRowsPerPass
            pass_tiles<BITS, OFFSET, MIN, SUB, SUPER, false>(op, op.w + g * group_bytes, whole,
                                                             rows, acc, nullptr);
            store_rows(op, acc, g, whole, rows);
        }
    }
}

}  // namespace quant
