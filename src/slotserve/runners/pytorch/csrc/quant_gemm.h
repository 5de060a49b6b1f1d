// Projections whose weights stay quantized (GGUF's Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K,
// Q6_K, and our Q4_ZP), compiled once per instruction set after gemm_vec.h, quant_pairs.h,
// quant_byte_pairs.h and quant_scales.h (kernels_<isa>.cpp): y = x Wᵀ (+ bias) with x in
// bfloat16 and W read as the file stores it, decoded in registers while it streams.
//
// Every weight is scale · v − min: v a small integer (a code less the format's offset), scale =
// d · sc and min = dmin · m per sub-block of 16 or 32 inputs (exact in float32: an fp16 times an
// 8-bit integer). Each row's inputs are rounded to integers of at most 127 per block of 32,
// q = rne(x · 127 / a) with a the block's largest |x| (one step a / 127, as llama.cpp's 8-bit
// activations), Σ q kept per 16 inputs (quant_inputs.h). An output then sums, sub-block by
// sub-block from k = 0:
//
//   block = Σ v · q over the sub-block, in int32: exact, whatever the order of its terms
//   acc   = fma(scale · step, float(block), acc), then acc = fma(−min · step, float(Σ q), acc)
//
// then adds the bias and rounds once to bfloat16. The float steps run in input order and depend
// on K and the format alone: a row's bits do not depend on its batch, its tile or the thread
// count (threads split outputs), and every instruction set gives the same bits (integer sums are
// exact, whichever instructions form them: quant_pairs.h; the float steps are the same fused
// operations lane by lane).
//
// Packed layout (quant_pack.cpp writes it): the outputs in groups of 16, each group's inputs in
// super-blocks of `super` inputs, one record per (group, super-block):
//   d[16] fp16 | dmin[16] fp16 (formats with a min) | with sub-blocks (the K types):
//   sc[sub-blocks][16] int8 and m[sub-blocks][16] uint8 (with a min) | codes:
//   - 4 and 6 bits, per unit of 8 inputs, 64 bytes: byte 4j + i holds output j's code of input
//     i in its low nibble and of input 4 + i in its high one (each nibble plane is vpdpbusd's
//     operand: four inputs per output's 32-bit lane) | 6 bits: per two units 64 bytes of high
//     bits, byte b for the units' bytes b: bits 4-5 the even unit's low nibble's code's, 6-7
//     its high nibble's, 0-1 and 2-3 the odd unit's;
//   - 5 and 8 bits, per input pair, the 32 codes in the order of vpmaddwd's words, outputs
//     0-7's (even, odd) pairs then outputs 8-15's ("lo" and "hi"): 16 bytes (5 bits: byte w
//     holds lo's word w in its low nibble, hi's in its high one) or 32 (8 bits: lo's 16 bytes,
//     then hi's) | 5 bits: per 4 pairs 16 bytes of high bits (bit 2j: pair j's lo word, 2j+1:
//     its hi word).

namespace quant {

#if SLOTSERVE_AVX512
constexpr int kRowsPerTile = 8;
#else
constexpr int kRowsPerTile = 4;
#endif
// Whether a sub-block's pairs are unrolled whole: five- and six-bit codes find their high bits
// at places that are then constants. AVX2's sixteen registers hold a tile's sums and one
// operand: the four- and eight-bit codes' unrolled operands would be decoded ahead and spilled
// (its four-bit codes unroll whole through add_tile, half an operand at a time).
template <int BITS>
constexpr bool kUnrollPairs = SLOTSERVE_AVX512 || BITS == 5 || BITS == 6;
// Whether a tile's running sums wait in memory while its partial sums are formed: AVX2's
// sixteen registers hold a tile's partial sums and half an operand, not its running sums too.
constexpr bool kSumsWait = !SLOTSERVE_AVX512;
// Whether Math adds a whole tile's rows in one call (add_tile), in an order of its own.
template <class Math, class = void>
constexpr bool kAddsTiles = false;
template <class Math>
constexpr bool kAddsTiles<Math, std::void_t<decltype(Math::kAddsTiles)>> = Math::kAddsTiles;
constexpr int64_t kRowsPerPass = 64;      // rows whose running sums stay in the level-1 cache
constexpr int64_t kPrefetchAhead = 2048;  // bytes of the weight stream requested before use

// Output group g's input pairs (its records at `group`), decoded once into `out` (one operand per
// pair, in input order) for a step of more rows than one tile: every tile then reads them there.
template <int BITS, int OFFSET, int SUB, int SUPER>
static void decode_group(const Operands& op, const uint8_t* group,
                         typename PairMath<BITS, OFFSET>::Operand* out) {
    using Math = PairMath<BITS, OFFSET>;
    constexpr int kSubBlocks = SUPER / SUB, kPairs = SUB / 2;
    const int64_t record_bytes = op.f.record_bytes(), header_bytes = op.f.header_bytes();
    const uint8_t* record = group;
    for (int64_t b = 0; b < op.k / SUPER; ++b, record += record_bytes) {
        const uint8_t* codes = record + header_bytes;
        for (int s = 0; s < kSubBlocks; ++s)
#pragma GCC unroll 16  // whole: each pair's place among the high bits is then a constant
            for (int p = 0; p < kPairs; p += Math::kPairsPerOperand)
                out[(b * (SUPER / 2) + s * kPairs + p) / Math::kPairsPerOperand] =
                    Math::template decode<SUPER>(codes, s * kPairs + p);
    }
}

// Σ q over the SUB inputs from `first` (a sub-block) of rows m0, m0 + 1, ...
template <int SUB>
static inline const int32_t* input_sums(const Operands& op, int64_t m0, int64_t first) {
    const InputBlocks& in = op.blocks;
    return SUB == 16 ? in.sum16 + first / 16 * in.rows + m0 : in.sum32 + first / 32 * in.rows + m0;
}

// Output group g (its records at `group`) for rows [m0, m0 + MR) over the whole input: each
// sub-block's input pairs decoded once in registers for the tile's rows (or read from
// `decoded`, decode_group's), then the sub-block scaled into each row's running sum, kept in
// registers (on AVX2 in `acc` between sub-blocks) and stored in `acc` ([rows][16] float32) at
// the end. Either way the same integers meet in the same order.
template <int BITS, int OFFSET, bool MIN, int SUB, int SUPER, int MR, bool DECODED>
static void group_tile(const Operands& op, const uint8_t* group, int64_t m0, float* acc,
                       const typename PairMath<BITS, OFFSET>::Operand* decoded) {
    using Math = PairMath<BITS, OFFSET>;
    constexpr int kSubBlocks = SUPER / SUB, kPairs = SUB / 2;
    const int64_t supers = op.k / SUPER;
    const int64_t record_bytes = op.f.record_bytes(), header_bytes = op.f.header_bytes();
    Acc running[MR];  // in registers until the end, or in `acc` between sub-blocks
    for (int r = 0; r < MR; ++r) running[r] = acc_zero();
    if constexpr (kSumsWait)
        for (int r = 0; r < MR; ++r) acc_store(acc + r * kLanes, running[r]);
    const uint8_t* record = group;
    for (int64_t b = 0; b < supers; ++b, record += record_bytes) {
        const uint8_t* codes = record + header_bytes;
        for (int s = 0; s < kSubBlocks; ++s) {
            const int64_t first = b * SUPER + s * SUB;
            if (!DECODED && m0 == 0) {
                // The weight stream ahead, asked for from memory now (the first tile streams it,
                // the others find it cached): one core's own requests alone fetch too little of
                // it at a time to keep up with a single row. A tile of several rows computes
                // long enough to wait on memory besides: it also asks for the next group's
                // records into the level-2 cache, a whole group ahead.
                const int64_t sub_bytes = (record_bytes + kSubBlocks - 1) / kSubBlocks;
                const uint8_t* sub = record + s * sub_bytes;
                for (int64_t line = 0; line < sub_bytes; line += 64) {
                    _mm_prefetch((const char*)(sub + line + kPrefetchAhead), _MM_HINT_T0);
                    if constexpr (MR > 2)
                        _mm_prefetch((const char*)(sub + line + supers * record_bytes),
                                     _MM_HINT_T1);
                }
            }
            Sums sums[MR];
            typename Math::Partial partial[MR];
            for (int r = 0; r < MR; ++r) partial[r] = Math::zero();
            constexpr bool kTileAdds = !DECODED && kAddsTiles<Math>;
            constexpr int kUnrolled =
                kUnrollPairs<BITS> || kTileAdds ? kPairs : Math::kPairsPerOperand;
            // Whether the whole sub-block's products fit the partial sums: then they are
            // widened once, after the loop, and stay in registers from pass to pass.
            constexpr bool kOneFlush = Math::kFlush >= kPairs;
#pragma GCC unroll 1
            for (int p0 = 0; p0 < kPairs; p0 += kUnrolled)
#pragma GCC unroll 16  // whole: each pair's place among the high bits is then a constant
            for (int p = p0; p < p0 + kUnrolled; p += Math::kPairsPerOperand) {
                if constexpr (kTileAdds) {
                    const auto* x = Math::inputs(op) + m0 * op.k + first + 2 * p;
                    Math::template add_tile<SUPER, MR>(partial, codes, s * kPairs + p, x, op.k);
                } else {
                    typename Math::Operand w;
                    if constexpr (DECODED)
                        w = decoded[(first / 2 + p) / Math::kPairsPerOperand];
                    else
                        w = Math::template decode<SUPER>(codes, s * kPairs + p);
                    for (int r = 0; r < MR; ++r)
                        partial[r] = Math::add(
                            partial[r], w, Math::inputs(op) + (m0 + r) * op.k + first + 2 * p);
                }
                // The partial sums widened into the int32 ones before they can overflow (the
                // first time they are the int32 sums: the word path adds nothing then).
                const int done = p + Math::kPairsPerOperand;
                if (!kOneFlush && (done % Math::kFlush == 0 || done == kPairs))
                    for (int r = 0; r < MR; ++r) {
                        const Sums widened = Math::widen(partial[r]);
                        sums[r] = done <= Math::kFlush ? widened : sums_plus(sums[r], widened);
                        partial[r] = Math::zero();
                    }
            }
            if constexpr (kOneFlush)
                for (int r = 0; r < MR; ++r) sums[r] = Math::widen(partial[r]);
            if constexpr (Math::kCodeOffset != 0) {
                const int32_t* input_sum = input_sums<SUB>(op, m0, first);
                for (int r = 0; r < MR; ++r)
                    sums[r] = sums_less(sums[r], Math::kCodeOffset * input_sum[r]);
            }
            if constexpr (kSumsWait) {
                // Read back from `acc` only now: GCC would hold them in registers throughout.
                asm volatile("" ::: "memory");
                for (int r = 0; r < MR; ++r) running[r] = gemmv::acc_load(acc + r * kLanes);
            }
            const Acc d = widen_f16(record), dmin = MIN ? widen_f16(record + 32) : acc_zero();
            const SubBlockScales w = sub_block_scales<MIN, SUB, SUPER>(record, d, dmin, s);
            const int64_t at = first / kInputBlock * op.blocks.rows + m0;  // rows m0, m0 + 1, ...
            const float *step = op.blocks.step + at, *neg_sum = op.blocks.neg_sum + at;
            static_assert(!MIN || SUB == kInputBlock, "a minimum per block of inputs");
            for (int r = 0; r < MR; ++r)
                running[r] = scaled_into<MIN>(running[r], sums[r], w, step[r], neg_sum[r]);
            if constexpr (kSumsWait)
                for (int r = 0; r < MR; ++r) acc_store(acc + r * kLanes, running[r]);
        }
    }
    if constexpr (!kSumsWait)
        for (int r = 0; r < MR; ++r) acc_store(acc + r * kLanes, running[r]);
}

// Rows from m of [m0, m1) in tiles of MR rows while whole ones fit; returns the first row left.
template <int BITS, int OFFSET, bool MIN, int SUB, int SUPER, int MR, bool DECODED>
static int64_t tiles_of(const Operands& op, const uint8_t* group, int64_t m, int64_t m0,
                        int64_t m1, float* acc,
                        const typename PairMath<BITS, OFFSET>::Operand* decoded) {
    for (; m + MR <= m1; m += MR)
        group_tile<BITS, OFFSET, MIN, SUB, SUPER, MR, DECODED>(op, group, m,
                                                              acc + (m - m0) * kLanes, decoded);
    return m;
}

// Rows [m0, m1) of one group, their running sums in `acc` from row m0 on: in tiles of
// kRowsPerTile rows, the rest in tiles of 4 (AVX-512's wider tile), 2 and 1, so that a step of
// a few rows still decodes each weight once or twice, not once per row.
template <int BITS, int OFFSET, bool MIN, int SUB, int SUPER, bool DECODED>
static void pass_tiles(const Operands& op, const uint8_t* group, int64_t m0, int64_t m1,
                       float* acc, const typename PairMath<BITS, OFFSET>::Operand* decoded) {
    int64_t m = tiles_of<BITS, OFFSET, MIN, SUB, SUPER, kRowsPerTile, DECODED>(
        op, group, m0, m0, m1, acc, decoded);
    if constexpr (kRowsPerTile > 4)
        m = tiles_of<BITS, OFFSET, MIN, SUB, SUPER, 4, DECODED>(op, group, m, m0, m1, acc,
                                                                decoded);
    m = tiles_of<BITS, OFFSET, MIN, SUB, SUPER, 2, DECODED>(op, group, m, m0, m1, acc, decoded);
    tiles_of<BITS, OFFSET, MIN, SUB, SUPER, 1, DECODED>(op, group, m, m0, m1, acc, decoded);
}

// Group g's outputs of rows [m0, m1) from their running sums in `acc` (row m0's first): the
// bias added and each rounded once to bfloat16.
static void store_rows(const Operands& op, const float* acc, int64_t g, int64_t m0, int64_t m1) {
    const int valid = int(std::min<int64_t>(kLanes, op.n - g * kLanes));
    for (int64_t m = m0; m < m1; ++m) {
        vf v = load_f32(acc + (m - m0) * kLanes);
        if (op.bias != nullptr) v += load_f32(op.bias + g * kLanes);
        uint16_t whole[kLanes];
        store_bf16(whole, v);
        std::memcpy(op.out + m * op.n + g * kLanes, whole, valid * sizeof(uint16_t));
    }
}

template <int BITS, int OFFSET, bool MIN, int SUB, int SUPER>
static void groups_of(const Operands& op, int64_t rows, int64_t g0, int64_t g1) {
    alignas(64) float acc[kRowsPerPass * kLanes];
    const int64_t group_bytes = op.k / SUPER * op.f.record_bytes();
    // More rows than a tile: five-bit codes, whose decoding costs most, decoded once per
    // group, not once per tile (the others decode faster than they load).
    const bool decode_once = BITS == 5 && rows > kRowsPerTile;
    // Raw aligned memory, not a std::vector: the vector's members would be compiled outside
    // this instruction set's target attribute.
    using Operand = typename PairMath<BITS, OFFSET>::Operand;
    const std::unique_ptr<void, decltype(&std::free)> buffer(
        decode_once ? std::aligned_alloc(64, op.k / 2 * sizeof(Operand)) : nullptr,
        &std::free);  // one operand per pair at most
    Operand* decoded_words = static_cast<Operand*>(buffer.get());
    for (int64_t g = g0; g < g1; ++g) {
        const uint8_t* group = op.w + g * group_bytes;
        if (decode_once) decode_group<BITS, OFFSET, SUB, SUPER>(op, group, decoded_words);
        for (int64_t m0 = 0; m0 < rows; m0 += kRowsPerPass) {
            const int64_t m1 = std::min(rows, m0 + kRowsPerPass);
            if (decode_once)
                pass_tiles<BITS, OFFSET, MIN, SUB, SUPER, true>(op, group, m0, m1, acc,
                                                                decoded_words);
            else
                pass_tiles<BITS, OFFSET, MIN, SUB, SUPER, false>(op, group, m0, m1, acc, nullptr);
            store_rows(op, acc, g, m0, m1);
        }
    }
}

// Weight row `row` (an output) as bfloat16: scale · v − min per input, rounded once (gguf-py's
// dequantized float32 value, so the embedding rows a model looks up are the dequantized path's).
template <int BITS, int OFFSET, bool MIN, int SUB, int SUPER>
static void row_values(const Operands& op, int64_t row, uint16_t* out) {
    constexpr int kSubBlocks = SUPER / SUB;
    const int64_t record_bytes = op.f.record_bytes(), header_bytes = op.f.header_bytes();
    const int lane = int(row % kLanes);
    const uint8_t* record = op.w + row / kLanes * (op.k / SUPER) * record_bytes;
    for (int64_t b = 0; b < op.k / SUPER; ++b, record += record_bytes) {
        uint16_t half[2];
        std::memcpy(half, record + 2 * lane, 2);
        const float d = _cvtsh_ss(half[0]);
        const float dmin = MIN ? (std::memcpy(half, record + 32 + 2 * lane, 2), _cvtsh_ss(half[0]))
                               : 0.0f;
        const uint8_t* sc = record + 32 * (MIN ? 2 : 1);
        const uint8_t* codes = record + header_bytes;
        for (int64_t p = 0; p < SUPER / 2; ++p) {
            const PairValues v = pair_values<BITS, OFFSET, SUPER>(codes, p);
            alignas(16) int8_t words[32];  // outputs 0-15's (even, odd) values
            _mm_store_si128((__m128i*)words, v.lo);
            _mm_store_si128((__m128i*)(words + 16), v.hi);
            const int s = int(2 * p / SUB);
            const bool subs = kSubBlocks > 1;  // else sc and m are one, and not stored
            const float scale = subs ? d * float(int8_t(sc[16 * s + lane])) : d;
            const float min = !MIN ? 0.0f : subs ? dmin * float(sc[16 * (kSubBlocks + s) + lane])
                                                 : dmin;
            out[b * SUPER + 2 * p] = f32_to_bf16(scale * float(words[2 * lane]) - min);
            out[b * SUPER + 2 * p + 1] = f32_to_bf16(scale * float(words[2 * lane + 1]) - min);
        }
    }
}

// `run` instantiated for the format the operands name: the GGUF formats' combinations and
// Q4_ZP's (anything else is refused before a call).
template <class Run>
static void in_format(const Format& f, Run&& run) {
    const auto is = [&f](int bits, int offset, bool min, int sub, int super) {
        return f.bits == bits && f.offset == offset && f.has_min == min && f.sub == sub &&
               f.super == super;
    };
    using std::integral_constant;
    if (is(4, 8, false, 32, 32))  // Q4_0
        run(integral_constant<int, 4>{}, integral_constant<int, 8>{}, std::false_type{},
            integral_constant<int, 32>{}, integral_constant<int, 32>{});
    else if (is(4, 0, true, 32, 32))  // Q4_1
        run(integral_constant<int, 4>{}, integral_constant<int, 0>{}, std::true_type{},
            integral_constant<int, 32>{}, integral_constant<int, 32>{});
    else if (is(5, 16, false, 32, 32))  // Q5_0
        run(integral_constant<int, 5>{}, integral_constant<int, 16>{}, std::false_type{},
            integral_constant<int, 32>{}, integral_constant<int, 32>{});
    else if (is(5, 0, true, 32, 32))  // Q5_1
        run(integral_constant<int, 5>{}, integral_constant<int, 0>{}, std::true_type{},
            integral_constant<int, 32>{}, integral_constant<int, 32>{});
    else if (is(8, 0, false, 32, 32))  // Q8_0
        run(integral_constant<int, 8>{}, integral_constant<int, 0>{}, std::false_type{},
            integral_constant<int, 32>{}, integral_constant<int, 32>{});
    else if (is(4, 0, true, 32, 128))  // Q4_ZP (quant_pack.cpp)
        run(integral_constant<int, 4>{}, integral_constant<int, 0>{}, std::true_type{},
            integral_constant<int, 32>{}, integral_constant<int, 128>{});
    else if (is(4, 0, true, 32, 256))  // Q4_K
        run(integral_constant<int, 4>{}, integral_constant<int, 0>{}, std::true_type{},
            integral_constant<int, 32>{}, integral_constant<int, 256>{});
    else if (is(5, 0, true, 32, 256))  // Q5_K
        run(integral_constant<int, 5>{}, integral_constant<int, 0>{}, std::true_type{},
            integral_constant<int, 32>{}, integral_constant<int, 256>{});
    else if (is(6, 32, false, 16, 256))  // Q6_K
        run(integral_constant<int, 6>{}, integral_constant<int, 32>{}, std::false_type{},
            integral_constant<int, 16>{}, integral_constant<int, 256>{});
}

}  // namespace quant

#if SLOTSERVE_BF16 && SLOTSERVE_VNNI
#include "quant_amx.h"
#endif

namespace quant {

// Output groups [g0, g1) for every row: on AMX tiles where the operands ask for them and the
// step holds enough rows (the same bits either way), else on the vector path.
static void groups(const Operands& op, int64_t rows, int64_t g0, int64_t g1) {
    in_format(op.f, [&](auto bits, auto offset, auto min, auto sub, auto super) {
#if SLOTSERVE_BF16 && SLOTSERVE_VNNI
        if (op.tiles != QuantTiles::none && rows >= kTileMinRows) {
            if (op.tiles == QuantTiles::unit)
                tiled_groups_of<amx::Tiles, bits(), offset(), min(), sub(), super()>(op, rows, g0,
                                                                                     g1);
            else
                tiled_groups_of<amx::EmulatedTiles, bits(), offset(), min(), sub(), super()>(
                    op, rows, g0, g1);
            return;
        }
#endif
        groups_of<bits(), offset(), min(), sub(), super()>(op, rows, g0, g1);
    });
}

// Weight rows `rows` (outputs) as bfloat16 rows of k values.
static void rows_of(const Operands& op, const int64_t* rows, int64_t count, uint16_t* out) {
    in_format(op.f, [&](auto bits, auto offset, auto min, auto sub, auto super) {
        for (int64_t i = 0; i < count; ++i)
            row_values<bits(), offset(), min(), sub(), super()>(op, rows[i], out + i * op.k);
    });
}

}  // namespace quant
