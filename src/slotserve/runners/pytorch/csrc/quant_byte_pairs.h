// The byte paths of quant_pairs.h's integer sums (included after it, once per instruction
// set): codes met as unsigned bytes by vpdpbusd (VNNI) or vpmaddubsw, the row's inputs as
// signed ones; and PairMath, the path each code width takes on each instruction set.

namespace quant {
#if SLOTSERVE_AVX512
#if SLOTSERVE_VNNI
// acc + vpdpbusd(codes, the four int8 inputs at x in every lane), the broadcast read by the
// instruction itself: GCC 12 loads each into a register first, and a step of several rows
// issues one such load per vpdpbusd, as many instructions again.
static inline __attribute__((always_inline)) __m512i dpbusd_broadcast(__m512i acc, __m512i codes,
                                                                      const int8_t* x) {
    asm("vpdpbusd %2%{1to16%}, %g1, %g0"
        : "+v"(acc)
        : "v"(codes), "m"(*reinterpret_cast<const int32_t*>(x)));
    return acc;
}
#endif
// The nibble path (AVX-512, codes of 4 and 6 bits): one 64-byte load holds a unit of 8 inputs,
// byte 4j + i output j's codes of inputs i (low nibble) and 4 + i (high one), so each nibble
// plane holds four inputs' codes in every output's 32-bit lane. Six-bit codes add their two
// high bits from the high plane (`high_bits`). With VNNI, vpdpbusd sums
// each lane's four products into it as int32; without, vpmaddubsw sums two into each int16
// half, a few pairs before they must be widened (|q| ≤ 127). The offset comes off once per
// sub-block as offset · Σ q.
struct Nibbles {
    __m512i first, last;  // inputs 0-3's codes and 4-7's; output j in lane j
};
// A six-bit code's high two bits, moved to bits 4-5 of its byte: unit byte p's are in byte p of
// its pair of units' 64 bytes in the high plane, the even unit's at bits 4-5 (input i's) and 6-7
// (input 4 + i's), the odd unit's at 0-1 and 2-3. A shift within 16-bit lanes carries bits
// across a byte boundary only where the mask then drops them. `pair`'s unit is a constant once
// the caller's loop is unrolled.
template <int SUPER>
static inline __attribute__((always_inline)) Nibbles high_bits(Nibbles n, const uint8_t* codes,
                                                               int64_t pair) {
    const int64_t unit = pair / 4;
    const __m512i h = _mm512_loadu_si512((const void*)(codes + SUPER / 2 * 16 + unit / 2 * 64));
    const __m512i bits45 = _mm512_set1_epi8(0x30);
    constexpr int kOrAnd = 0xF8;  // vpternlogd's table of a | (b & c)
    if (unit % 2 == 0)
        return {_mm512_ternarylogic_epi32(n.first, h, bits45, kOrAnd),
                _mm512_ternarylogic_epi32(n.last, _mm512_srli_epi16(h, 2), bits45, kOrAnd)};
    return {_mm512_ternarylogic_epi32(n.first, _mm512_slli_epi16(h, 4), bits45, kOrAnd),
            _mm512_ternarylogic_epi32(n.last, _mm512_slli_epi16(h, 2), bits45, kOrAnd)};
}
template <int BITS, int OFFSET>
struct NibblePairs {
    static_assert(BITS == 4 || BITS == 6, "a nibble, or a nibble and two high bits");
    using Operand = Nibbles;
    struct Partial {
        __m512i first, last;  // each plane's sums: int32 with VNNI, else int16 halves
    };
    static constexpr int kCodeOffset = OFFSET;
    static constexpr int kPairsPerOperand = 4;
#if SLOTSERVE_VNNI
    static constexpr int kFlush = 1 << 20;  // int32 lanes: the sub-block never overflows one
#else
    static constexpr int kFlush = 4 * (32767 / (2 * kLargestInput * ((1 << BITS) - 1)));
#endif
    template <int SUPER>
    static inline __attribute__((always_inline)) Operand decode(const uint8_t* codes,
                                                                int64_t pair) {
        const __m512i unit = _mm512_loadu_si512((const void*)(codes + pair * 16));
        const __m512i nibble = _mm512_set1_epi8(0x0f);
        const Nibbles low{_mm512_and_si512(unit, nibble),
                          _mm512_and_si512(_mm512_srli_epi16(unit, 4), nibble)};
        if constexpr (BITS == 6) return high_bits<SUPER>(low, codes, pair);
        return low;
    }
    static inline __attribute__((always_inline)) Partial zero() {
        return {_mm512_setzero_si512(), _mm512_setzero_si512()};
    }
    static const int8_t* inputs(const Operands& op) { return op.xq8; }
    // + the products with a row's eight inputs at x, four broadcast to each plane.
    static inline __attribute__((always_inline)) Partial add(Partial s, Operand w,
                                                             const int8_t* x) {
#if SLOTSERVE_VNNI
        return {dpbusd_broadcast(s.first, w.first, x), dpbusd_broadcast(s.last, w.last, x + 4)};
#else
        const __m512i first = _mm512_set1_epi32(loaded<int32_t>(x));
        const __m512i last = _mm512_set1_epi32(loaded<int32_t>(x + 4));
        return {_mm512_add_epi16(s.first, _mm512_maddubs_epi16(w.first, first)),
                _mm512_add_epi16(s.last, _mm512_maddubs_epi16(w.last, last))};
#endif
    }
    static inline __attribute__((always_inline)) Sums widen(Partial p) {
#if SLOTSERVE_VNNI
        return {_mm512_add_epi32(p.first, p.last)};
#else
        const __m512i ones = _mm512_set1_epi16(1);  // a lane's two int16 halves: one output's
        return {_mm512_add_epi32(_mm512_madd_epi16(p.first, ones),
                                 _mm512_madd_epi16(p.last, ones))};
#endif
    }
};

#if SLOTSERVE_VNNI
// The quad path (VNNI, codes of 8 bits): two input pairs' 64 bytes regrouped by one vpermw so
// that each output's 32-bit lane holds its codes of four inputs (the first pair's even and odd,
// then the second's), which vpdpbusd multiplies by the row's four int8 inputs and sums into the
// lane. vpdpbusd's codes are unsigned: Q8_0's signed ones become so with their sign bit flipped
// (+128), an offset that comes off once per sub-block as 128 · Σ q.
template <int OFFSET>
struct QuadPairs {
    using Operand = __m512i;  // output j's four codes in lane j
    using Partial = __m512i;  // sixteen int32
    static constexpr bool kSigned = OFFSET == 0;  // Q8_0's codes
    static constexpr int kCodeOffset = kSigned ? 128 : OFFSET;
    static constexpr int kPairsPerOperand = 2;
    static constexpr int kFlush = 1 << 20;  // int32 lanes: the sub-block never overflows one
    template <int SUPER>
    static inline __attribute__((always_inline)) Operand decode(const uint8_t* codes,
                                                                int64_t pair) {
        // Words 0-15: the first pair's (even, odd) codes of outputs 0-15; 16-31: the second's.
        const __m512i words = _mm512_loadu_si512((const void*)(codes + pair * 32));
        const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10,
                                               25, 9, 24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3,
                                               18, 2, 17, 1, 16, 0);
        const __m512i quads = _mm512_permutexvar_epi16(order, words);
        return kSigned ? _mm512_xor_si512(quads, _mm512_set1_epi8(char(0x80))) : quads;
    }
    static const int8_t* inputs(const Operands& op) { return op.xq8; }
    static inline __attribute__((always_inline)) Partial zero() { return _mm512_setzero_si512(); }
    // + the products with a row's four inputs at x.
    static inline __attribute__((always_inline)) Partial add(Partial s, Operand w,
                                                             const int8_t* x) {
        return dpbusd_broadcast(s, w, x);
    }
    static inline __attribute__((always_inline)) Sums widen(Partial p) { return {p}; }
};
#endif

// Five bits take the word path (vpmaddwd's 512 bits decode them faster than bytes), and eight
// without VNNI.
template <int BITS, int OFFSET>
#if SLOTSERVE_VNNI
using PairMath = std::conditional_t<
    BITS == 4 || BITS == 6, NibblePairs<BITS, OFFSET>,
    std::conditional_t<BITS == 8, QuadPairs<OFFSET>, WordPairs<BITS, OFFSET>>>;
#else
using PairMath = std::conditional_t<BITS == 4 || BITS == 6, NibblePairs<BITS, OFFSET>,
                                    WordPairs<BITS, OFFSET>>;
#endif
#else
// The byte path (AVX2, codes of 5 bits): the pair's 32 raw codes as unsigned bytes,
// outputs 0-7's (even, odd) then 8-15's, met by vpmaddubsw with the row's two int8 inputs: each
// output's two products summed in an int16 lane, `kFlush` pairs at most before the lanes are
// widened into the int32 sums (codes ≤ kLargestCode, |q| ≤ 127: no sum saturates). Fewer
// instructions per product than the word path; the offset comes off once per sub-block as
// offset · Σ q.
struct Bytes {
    __m256i v;
};
template <int BITS, int OFFSET>
struct BytePairs {
    using Operand = Bytes;
    using Partial = __m256i;  // sixteen int16
    static constexpr int kCodeOffset = OFFSET;
    static constexpr int kPairsPerOperand = 1;
    static constexpr int kLargestCode = (1 << BITS) - 1;
    static constexpr int kFlush = 32767 / (2 * kLargestInput * kLargestCode);
    static_assert(BITS == 5 && kFlush >= 4, "a few pairs' products fit an int16 lane");
    template <int SUPER>
    static inline __attribute__((always_inline)) Operand decode(const uint8_t* codes,
                                                                int64_t pair) {
        const PairValues p = pair_values<BITS, OFFSET, SUPER, true>(codes, pair);
        return {_mm256_inserti128_si256(_mm256_castsi128_si256(p.lo), p.hi, 1)};
    }
    static const int8_t* inputs(const Operands& op) { return op.xq8; }
    static inline __attribute__((always_inline)) Partial zero() { return _mm256_setzero_si256(); }
    // + the products with a row's two inputs at x.
    static inline __attribute__((always_inline)) Partial add(Partial s, Operand w,
                                                             const int8_t* x) {
        const __m256i pair = _mm256_set1_epi16(loaded<int16_t>(x));
        return _mm256_add_epi16(s, _mm256_maddubs_epi16(w.v, pair));
    }
    static inline __attribute__((always_inline)) Sums widen(Partial p) {
        return {_mm256_cvtepi16_epi32(_mm256_castsi256_si128(p)),
                _mm256_cvtepi16_epi32(_mm256_extracti128_si256(p, 1))};
    }
};
// The nibble path (AVX2, codes of 4 and 6 bits): a unit of 8 inputs is two 32-byte loads,
// outputs 0-7's and 8-15's, laid out as AVX-512's (byte 4j + i: output j's codes of inputs i
// and 4 + i; six bits take their high two from the planes AVX-512's `high_bits` reads).
// vpmaddubsw sums two
// products into each int16 half of an output's 32-bit lane, both nibble planes into the same
// halves, a few pairs before they must be widened.
struct Nibbles {
    __m256i first_lo, last_lo, first_hi, last_hi;  // inputs 0-3's and 4-7's; outputs 0-7, 8-15
};
// Nibbles `low` with two high bits from `high` (its bits 4 - shift and up) at bits 4-5 of each
// byte; `shift` is a constant once the caller is unrolled.
static inline __attribute__((always_inline)) __m256i with_high(__m256i low, __m256i high,
                                                               int shift) {
    const __m256i moved = shift > 0   ? _mm256_slli_epi16(high, shift)
                          : shift < 0 ? _mm256_srli_epi16(high, -shift)
                                      : high;
    return _mm256_or_si256(low, _mm256_and_si256(moved, _mm256_set1_epi8(0x30)));
}
template <int BITS, int OFFSET>
struct NibblePairs {
    static_assert(BITS == 4 || BITS == 6, "a nibble, or a nibble and two high bits");
    using Operand = Nibbles;
    struct Partial {
        __m256i lo, hi;  // int16 halves of outputs 0-7's lanes and 8-15's
    };
    static constexpr int kCodeOffset = OFFSET;
    static constexpr int kPairsPerOperand = 4;
    static constexpr int kFlush = 4 * (32767 / (2 * 2 * kLargestInput * ((1 << BITS) - 1)));
    static_assert(kFlush >= kPairsPerOperand, "one operand's products fit an int16 lane");
    template <int SUPER>
    static inline __attribute__((always_inline)) Operand decode(const uint8_t* codes,
                                                                int64_t pair) {
        const __m256i lo = _mm256_loadu_si256((const __m256i*)(codes + pair * 16));
        const __m256i hi = _mm256_loadu_si256((const __m256i*)(codes + pair * 16 + 32));
        const __m256i nibble = _mm256_set1_epi8(0x0f);
        Nibbles n{_mm256_and_si256(lo, nibble),
                  _mm256_and_si256(_mm256_srli_epi16(lo, 4), nibble),
                  _mm256_and_si256(hi, nibble),
                  _mm256_and_si256(_mm256_srli_epi16(hi, 4), nibble)};
        if constexpr (BITS == 6) {  // the unit's pair's 64 high-plane bytes, as AVX-512's
            const int64_t unit = pair / 4;
            const uint8_t* high = codes + SUPER / 2 * 16 + unit / 2 * 64;
            const __m256i h_lo = _mm256_loadu_si256((const __m256i*)high);
            const __m256i h_hi = _mm256_loadu_si256((const __m256i*)(high + 32));
            if (unit % 2 == 0)
                n = {with_high(n.first_lo, h_lo, 0), with_high(n.last_lo, h_lo, -2),
                     with_high(n.first_hi, h_hi, 0), with_high(n.last_hi, h_hi, -2)};
            else
                n = {with_high(n.first_lo, h_lo, 4), with_high(n.last_lo, h_lo, 2),
                     with_high(n.first_hi, h_hi, 4), with_high(n.last_hi, h_hi, 2)};
        }
        return n;
    }
    static inline __attribute__((always_inline)) Partial zero() {
        return {_mm256_setzero_si256(), _mm256_setzero_si256()};
    }
    static const int8_t* inputs(const Operands& op) { return op.xq8; }
    // + the products with a row's eight inputs at x, four broadcast to each plane.
    static inline __attribute__((always_inline)) Partial add(Partial s, Operand w,
                                                             const int8_t* x) {
        const __m256i first = _mm256_set1_epi32(loaded<int32_t>(x));
        const __m256i last = _mm256_set1_epi32(loaded<int32_t>(x + 4));
        const __m256i lo = _mm256_add_epi16(_mm256_maddubs_epi16(w.first_lo, first),
                                            _mm256_maddubs_epi16(w.last_lo, last));
        const __m256i hi = _mm256_add_epi16(_mm256_maddubs_epi16(w.first_hi, first),
                                            _mm256_maddubs_epi16(w.last_hi, last));
        return {_mm256_add_epi16(s.lo, lo), _mm256_add_epi16(s.hi, hi)};
    }
    static inline __attribute__((always_inline)) Sums widen(Partial p) {
        const __m256i ones = _mm256_set1_epi16(1);  // a lane's two int16 halves: one output's
        return {_mm256_madd_epi16(p.lo, ones), _mm256_madd_epi16(p.hi, ones)};
    }
    // `add` for MR rows at once (rows r's inputs at x + r · stride), one nibble plane after the
    // other: half an operand in registers beside a tile's partial sums, where a whole one
    // beside them would spill. The same products in another order: their int16 sums are exact.
    // Four-bit codes only: a six-bit sub-block's products are widened halfway, and its
    // running int32 sums beside the partial ones fill the registers whichever way it is added.
    static constexpr bool kAddsTiles = BITS == 4;
    template <int SUPER, int MR>
    static inline __attribute__((always_inline)) void add_tile(Partial* partial,
                                                               const uint8_t* codes,
                                                               int64_t pair, const int8_t* x,
                                                               int64_t stride) {
        const __m256i* unit = (const __m256i*)(codes + pair * 16);
        const __m256i nibble = _mm256_set1_epi8(0x0f);
        for (int plane = 0; plane < 2; ++plane) {
            const __m256i lo = _mm256_and_si256(
                _mm256_srli_epi16(_mm256_loadu_si256(unit), 4 * plane), nibble);
            const __m256i hi = _mm256_and_si256(
                _mm256_srli_epi16(_mm256_loadu_si256(unit + 1), 4 * plane), nibble);
            for (int r = 0; r < MR; ++r) {
                const __m256i in = _mm256_set1_epi32(loaded<int32_t>(x + r * stride + 4 * plane));
                partial[r].lo = _mm256_add_epi16(partial[r].lo, _mm256_maddubs_epi16(lo, in));
                partial[r].hi = _mm256_add_epi16(partial[r].hi, _mm256_maddubs_epi16(hi, in));
                // Each sum in its register here: GCC would otherwise add the two planes'
                // products first, holding both planes' operands and spilling the sums.
                asm("" : "+x"(partial[r].lo), "+x"(partial[r].hi));
            }
        }
    }
};

// Eight-bit codes take the word path: Q8_0's are signed (as bytes they would need a sign trick
// per row).
template <int BITS, int OFFSET>
using PairMath = std::conditional_t<
    BITS == 8, WordPairs<BITS, OFFSET>,
    std::conditional_t<BITS == 4 || BITS == 6, NibblePairs<BITS, OFFSET>,
                       BytePairs<BITS, OFFSET>>>;
#endif

}  // namespace quant
