// Projections whose weights stay quantized (GGUF's Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K,
// Q6_K), compiled once per instruction set after gemm_vec.h (cpu_kernels.cpp): y = x Wᵀ (+ bias)
// with x in bfloat16 and W read as the file stores it, decoded in registers while it streams.
//
// Every weight is scale · v − min: v a small integer (a code less the format's offset), scale =
// d · sc and min = dmin · m per sub-block of 16 or 32 inputs (exact in float32: an fp16 times an
// 8-bit integer). Each row's inputs are rounded to int16 per block of 32, q = rne(x · 32767 / a)
// with a the block's largest |x| (one step a / 32767, so a block's error stays under its largest
// input's bfloat16 rounding), Σ q kept per block (quantize_row). An output then sums, sub-block by
// sub-block from k = 0:
//
//   block = Σ v · q over the sub-block, in int32: exact, whatever the order of its terms
//   acc   = fma(scale · step, float(block), acc), then acc = fma(−min · step, float(Σ q), acc)
//
// then adds the bias and rounds once to bfloat16. The float steps run in input order and depend
// on K and the format alone: a row's bits do not depend on its batch, its tile or the thread
// count (threads split outputs), and every instruction set gives the same bits (integer sums are
// exact; the float steps are the same fused operations lane by lane).
//
// Packed layout (quant/packing.py writes it): the outputs in groups of 16, each group's inputs in
// super-blocks of `super` inputs, one record per (group, super-block):
//   d[16] fp16 | dmin[16] fp16 (formats with a min) | sc[sub-blocks][16] int8 |
//   m[sub-blocks][16] uint8 (with a min) | codes: per input pair the 32 codes in the order of
//   vpmaddwd's words, outputs 0-7's (even, odd) pairs then outputs 8-15's ("lo" and "hi"):
//   16 bytes (4 and 5 bits: byte w holds lo's word w in its low nibble, hi's in its high one)
//   or 32 (8 bits: lo's 16 bytes, then hi's) | 5 bits: per 4 pairs 16 bytes of high bits (bit
//   2j: pair j's lo word, 2j+1: its hi word). Q6_K's six-bit codes are stored as bytes
//   (quant/formats.py says why).

namespace quant {

using gemmv::Acc;
using gemmv::acc_fma;
using gemmv::acc_load;
using gemmv::acc_store;
using gemmv::acc_zero;
using gemmv::broadcast;

using Format = QuantFormat;
using Operands = QuantOperands;

// The 16 outputs' values of one input pair as int8 (v = code − offset), in word order: `lo`
// holds outputs 0-7's (even, odd) values, `hi` outputs 8-15's. The format's constants are
// template arguments: the decoding compiles to a few byte operations.
struct PairValues {
    __m128i lo, hi;
};

template <int BITS, int OFFSET, int SUPER>
static inline __attribute__((always_inline)) PairValues pair_values(const uint8_t* codes,
                                                                   int64_t pair) {
    PairValues v;
    if constexpr (BITS == 8) {
        v.lo = _mm_loadu_si128((const __m128i*)(codes + pair * 32));
        v.hi = _mm_loadu_si128((const __m128i*)(codes + pair * 32 + 16));
        if constexpr (OFFSET != 0) {  // Q6_K's codes, widened to a byte at load
            const __m128i offset = _mm_set1_epi8(char(OFFSET));
            v.lo = _mm_sub_epi8(v.lo, offset);
            v.hi = _mm_sub_epi8(v.hi, offset);
        }
        return v;
    }
    const __m128i nibble = _mm_set1_epi8(0x0f);
    const __m128i both = _mm_loadu_si128((const __m128i*)(codes + pair * 16));
    v.lo = _mm_and_si128(both, nibble);
    v.hi = _mm_and_si128(_mm_srli_epi16(both, 4), nibble);
    // The high bits moved into place with one shift and one mask each: a shift within 16-bit
    // lanes carries bits across the byte boundary only where the mask then drops them. `pair`'s
    // place in its group is a constant once the caller's loop is unrolled.
    const uint8_t* high = codes + SUPER / 2 * 16;  // the high bits' plane
    if constexpr (BITS == 5) {
        const __m128i h = _mm_loadu_si128((const __m128i*)(high + pair / 4 * 16));
        const __m128i bit4 = _mm_set1_epi8(0x10);
        const int j = int(pair % 4) * 2;  // lo at bit j, hi at bit j + 1; both go to bit 4
        const __m128i e = j <= 4 ? _mm_slli_epi16(h, 4 - j) : _mm_srli_epi16(h, j - 4);
        const __m128i o = j <= 2 ? _mm_slli_epi16(h, 3 - j) : _mm_srli_epi16(h, j - 3);
        v.lo = _mm_or_si128(v.lo, _mm_and_si128(e, bit4));
        v.hi = _mm_or_si128(v.hi, _mm_and_si128(o, bit4));
    }
    if constexpr (OFFSET != 0) {
        const __m128i offset = _mm_set1_epi8(char(OFFSET));
        v.lo = _mm_sub_epi8(v.lo, offset);
        v.hi = _mm_sub_epi8(v.hi, offset);
    }
    return v;
}

constexpr int kInputBlock = 32;  // inputs sharing one int16 step

// Sixteen outputs' values of one input pair as 32 int16 words, (even, odd) per output: the
// operand of vpmaddwd, which sums each output's two products into an int32 lane.
#if SLOTSERVE_AVX512
struct Words {
    __m512i v;
};
struct Sums {  // sixteen int32
    __m512i v;
};
static inline __attribute__((always_inline)) Words words_of(PairValues p) {
    return {_mm512_cvtepi8_epi16(_mm256_inserti128_si256(_mm256_castsi128_si256(p.lo), p.hi, 1))};
}
static inline __attribute__((always_inline)) Sums sums_zero() { return {_mm512_setzero_si512()}; }
// sums + each output's two products with the row's input pair (a broadcast int32 of two int16).
static inline __attribute__((always_inline)) Sums sums_add(Sums s, Words w, int32_t pair) {
    return {_mm512_add_epi32(s.v, _mm512_madd_epi16(w.v, _mm512_set1_epi32(pair)))};
}
static inline __attribute__((always_inline)) Acc sums_float(Sums s) {
    return {_mm512_cvtepi32_ps(s.v)};
}
static inline __attribute__((always_inline)) Acc widen_i8(__m128i b) {
    return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b))};
}
static inline __attribute__((always_inline)) Acc widen_u8(__m128i b) {
    return {_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b))};
}
static inline __attribute__((always_inline)) Acc widen_f16(const uint8_t* p) {
    return {_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p))};
}
static inline __attribute__((always_inline)) Acc acc_mul(Acc a, __m512 b) {
    return {_mm512_mul_ps(a.v, b)};
}
static inline __attribute__((always_inline)) Acc acc_mul(Acc a, Acc b) {
    return {_mm512_mul_ps(a.v, b.v)};
}
// acc + a · b, lane by lane, fused, with `a` a vector (not a broadcast).
static inline __attribute__((always_inline)) Acc acc_fma_v(Acc a, Acc b, Acc acc) {
    return {_mm512_fmadd_ps(a.v, b.v, acc.v)};
}
#else
struct Words {
    __m256i lo, hi;  // outputs 0-7, 8-15
};
struct Sums {
    __m256i lo, hi;
};
static inline __attribute__((always_inline)) Words words_of(PairValues p) {
    return {_mm256_cvtepi8_epi16(p.lo), _mm256_cvtepi8_epi16(p.hi)};
}
static inline __attribute__((always_inline)) Sums sums_zero() {
    return {_mm256_setzero_si256(), _mm256_setzero_si256()};
}
static inline __attribute__((always_inline)) Sums sums_add(Sums s, Words w, int32_t pair) {
    const __m256i x = _mm256_set1_epi32(pair);
    return {_mm256_add_epi32(s.lo, _mm256_madd_epi16(w.lo, x)),
            _mm256_add_epi32(s.hi, _mm256_madd_epi16(w.hi, x))};
}
static inline __attribute__((always_inline)) Acc sums_float(Sums s) {
    return {_mm256_cvtepi32_ps(s.lo), _mm256_cvtepi32_ps(s.hi)};
}
static inline __attribute__((always_inline)) Acc widen_i8(__m128i b) {
    return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)),
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)))};
}
static inline __attribute__((always_inline)) Acc widen_u8(__m128i b) {
    return {_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)),
            _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(b, 8)))};
}
static inline __attribute__((always_inline)) Acc widen_f16(const uint8_t* p) {
    return {_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)),
            _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + 16)))};
}
static inline __attribute__((always_inline)) Acc acc_mul(Acc a, __m256 b) {
    return {_mm256_mul_ps(a.lo, b), _mm256_mul_ps(a.hi, b)};
}
static inline __attribute__((always_inline)) Acc acc_mul(Acc a, Acc b) {
    return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)};
}
static inline __attribute__((always_inline)) Acc acc_fma_v(Acc a, Acc b, Acc acc) {
    return {_mm256_fmadd_ps(a.lo, b.lo, acc.lo), _mm256_fmadd_ps(a.hi, b.hi, acc.hi)};
}
#endif

#if SLOTSERVE_AVX512
constexpr int kRowsPerTile = 8;
#else
constexpr int kRowsPerTile = 4;
#endif
constexpr int64_t kRowsPerPass = 64;  // rows whose running sums stay in the level-1 cache

// Output group g's input pairs (its records at `group`), decoded once into `out` (one Words per
// pair, in input order) for a step of more rows than one tile: every tile then reads them there.
template <int BITS, int OFFSET, int SUB, int SUPER>
static void decode_group(const Operands& op, const uint8_t* group, Words* out) {
    constexpr int kSubBlocks = SUPER / SUB, kPairs = SUB / 2;
    const int64_t record_bytes = op.f.record_bytes(), header_bytes = op.f.header_bytes();
    const uint8_t* record = group;
    for (int64_t b = 0; b < op.k / SUPER; ++b, record += record_bytes) {
        const uint8_t* codes = record + header_bytes;
        for (int s = 0; s < kSubBlocks; ++s)
#pragma GCC unroll 16  // whole: each pair's place among the high bits is then a constant
            for (int p = 0; p < kPairs; ++p)
                out[b * (SUPER / 2) + s * kPairs + p] =
                    words_of(pair_values<BITS, OFFSET, SUPER>(codes, s * kPairs + p));
    }
}

// Output group g (its records at `group`) for rows [m0, m0 + MR) over the whole input: each
// sub-block's input pairs decoded once in registers for the tile's rows (or read from
// `decoded`, decode_group's), then the sub-block scaled into each row's running sum, which waits
// in `acc` ([rows][16] float32). Either way the same integers meet in the same order.
template <int BITS, int OFFSET, bool MIN, int SUB, int SUPER, int MR, bool DECODED>
static void group_tile(const Operands& op, const uint8_t* group, int64_t m0, float* acc,
                       const Words* decoded) {
    constexpr int kSubBlocks = SUPER / SUB, kPairs = SUB / 2;
    const int64_t supers = op.k / SUPER, blocks_per_row = op.k / kInputBlock;
    const int64_t record_bytes = op.f.record_bytes(), header_bytes = op.f.header_bytes();
    for (int r = 0; r < MR; ++r) acc_store(acc + r * kLanes, acc_zero());
    const uint8_t* record = group;
    for (int64_t b = 0; b < supers; ++b, record += record_bytes) {
        const Acc d = widen_f16(record);
        const uint8_t* sc = record + 32 * (MIN ? 2 : 1);
        const uint8_t* codes = record + header_bytes;
        for (int s = 0; s < kSubBlocks; ++s) {
            const int64_t first = b * SUPER + s * SUB;
            Sums sums[MR];
            for (int r = 0; r < MR; ++r) sums[r] = sums_zero();
#pragma GCC unroll 16  // whole: each pair's place among the high bits is then a constant
            for (int p = 0; p < kPairs; ++p) {
                Words w;
                if constexpr (DECODED)
                    w = decoded[first / 2 + p];
                else
                    w = words_of(pair_values<BITS, OFFSET, SUPER>(codes, s * kPairs + p));
                for (int r = 0; r < MR; ++r) {
                    int32_t pair;
                    std::memcpy(&pair, op.xq + (m0 + r) * op.k + first + 2 * p, sizeof(pair));
                    sums[r] = sums_add(sums[r], w, pair);
                }
            }
            const Acc scale = acc_mul(d, widen_i8(_mm_loadu_si128((const __m128i*)(sc + 16 * s))));
            Acc min = acc_zero();
            if constexpr (MIN) {
                const __m128i m = _mm_loadu_si128((const __m128i*)(sc + 16 * (kSubBlocks + s)));
                min = acc_mul(widen_f16(record + 32), widen_u8(m));
            }
            const int64_t block = first / kInputBlock;
            for (int r = 0; r < MR; ++r) {
                const int64_t at = (m0 + r) * blocks_per_row + block;
                float* a = acc + r * kLanes;
                Acc sum = acc_fma_v(acc_mul(scale, broadcast(op.xstep[at])), sums_float(sums[r]),
                                    acc_load(a));
                if constexpr (MIN)
                    sum = acc_fma(broadcast(-float(op.xsum[at])),
                                  acc_mul(min, broadcast(op.xstep[at])), sum);
                acc_store(a, sum);
            }
        }
    }
}

// Rows [m0, m1) of one group, in tiles of kRowsPerTile rows and then one row at a time, their
// running sums in `acc` from row m0 on.
template <int BITS, int OFFSET, bool MIN, int SUB, int SUPER, bool DECODED>
static void pass_tiles(const Operands& op, const uint8_t* group, int64_t m0, int64_t m1,
                       float* acc, const Words* decoded) {
    int64_t m = m0;
    for (; m + kRowsPerTile <= m1; m += kRowsPerTile)
        group_tile<BITS, OFFSET, MIN, SUB, SUPER, kRowsPerTile, DECODED>(
            op, group, m, acc + (m - m0) * kLanes, decoded);
    for (; m < m1; ++m)
        group_tile<BITS, OFFSET, MIN, SUB, SUPER, 1, DECODED>(op, group, m,
                                                             acc + (m - m0) * kLanes, decoded);
}

template <int BITS, int OFFSET, bool MIN, int SUB, int SUPER>
static void groups_of(const Operands& op, int64_t rows, int64_t g0, int64_t g1) {
    alignas(64) float acc[kRowsPerPass * kLanes];
    const int64_t group_bytes = op.k / SUPER * op.f.record_bytes();
    // More rows than a tile: five-bit codes, whose decoding costs most, decoded once per
    // group, not once per tile (four and eight bits decode faster than they load).
    const bool decode_once = BITS == 5 && rows > kRowsPerTile;
    // Raw aligned memory, not a std::vector<Words>: the vector's members would be compiled
    // outside this instruction set's target attribute.
    const std::unique_ptr<void, decltype(&std::free)> buffer(
        decode_once ? std::aligned_alloc(64, op.k / 2 * sizeof(Words)) : nullptr, &std::free);
    Words* decoded_words = static_cast<Words*>(buffer.get());
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
            const int valid = int(std::min<int64_t>(kLanes, op.n - g * kLanes));
            for (int64_t m = m0; m < m1; ++m) {
                vf v = load_f32(acc + (m - m0) * kLanes);
                if (op.bias != nullptr) v += load_f32(op.bias + g * kLanes);
                uint16_t whole[kLanes];
                store_bf16(whole, v);
                std::memcpy(op.out + m * op.n + g * kLanes, whole, valid * sizeof(uint16_t));
            }
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
            const float scale = d * float(int8_t(sc[16 * s + lane]));
            const float min = MIN ? dmin * float(sc[16 * (kSubBlocks + s) + lane]) : 0.0f;
            out[b * SUPER + 2 * p] = f32_to_bf16(scale * float(words[2 * lane]) - min);
            out[b * SUPER + 2 * p + 1] = f32_to_bf16(scale * float(words[2 * lane + 1]) - min);
        }
    }
}

// A row's inputs as int16 per block of 32 (the module's comment): q, the block's step and Σ q.
static void quantize_row(const uint16_t* x, int64_t k, int16_t* q, float* step, int32_t* sum) {
    for (int64_t b = 0; b < k / kInputBlock; ++b) {
        const uint16_t* in = x + b * kInputBlock;
        float largest = 0.0f;
        for (int j = 0; j < kInputBlock; ++j) largest = std::max(largest, std::fabs(bf16_to_f32(in[j])));
        const float scale = largest > 0.0f ? 32767.0f / largest : 0.0f;
        int32_t total = 0;
        for (int j = 0; j < kInputBlock; ++j) {
            const int32_t v = int32_t(std::nearbyint(bf16_to_f32(in[j]) * scale));
            q[b * kInputBlock + j] = int16_t(std::max(-32767, std::min(32767, v)));
            total += q[b * kInputBlock + j];
        }
        step[b] = largest / 32767.0f;
        sum[b] = total;
    }
}

// `run` instantiated for the format the operands name: the GGUF formats' combinations (anything
// else is refused before a call).
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
    else if (is(4, 0, true, 32, 256))  // Q4_K
        run(integral_constant<int, 4>{}, integral_constant<int, 0>{}, std::true_type{},
            integral_constant<int, 32>{}, integral_constant<int, 256>{});
    else if (is(5, 0, true, 32, 256))  // Q5_K
        run(integral_constant<int, 5>{}, integral_constant<int, 0>{}, std::true_type{},
            integral_constant<int, 32>{}, integral_constant<int, 256>{});
    else if (is(8, 32, false, 16, 256))  // Q6_K, codes widened to bytes
        run(integral_constant<int, 8>{}, integral_constant<int, 32>{}, std::false_type{},
            integral_constant<int, 16>{}, integral_constant<int, 256>{});
}

// Output groups [g0, g1) for every row.
static void groups(const Operands& op, int64_t rows, int64_t g0, int64_t g1) {
    in_format(op.f, [&](auto bits, auto offset, auto min, auto sub, auto super) {
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
