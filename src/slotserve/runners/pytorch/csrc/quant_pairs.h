// The integer half of quant_gemm.h's arithmetic, compiled once per instruction set before it
// (kernels_<isa>.cpp): a packed input pair's codes decoded in registers, and the exact sums
// Σ v · q of a sub-block, by whichever instructions suit the codes and the instruction set: the
// word path here, the byte paths in quant_byte_pairs.h. Every path yields the same int32 sums
// (they are exact), so the paths never change a bit.

namespace quant {

using gemmv::Acc;
using gemmv::acc_fma;
using gemmv::acc_store;
using gemmv::acc_zero;
using gemmv::broadcast;

using Format = QuantFormat;
using Operands = QuantOperands;

constexpr int kInputBlock = 32;  // inputs sharing one step
constexpr int kLargestInput = 127;  // |q|: an input fits a signed byte

// The T at p, read whole: a row's next two int16 inputs, or its next two or four int8 ones.
template <class T>
static inline __attribute__((always_inline)) T loaded(const void* p) {
    T v;
    std::memcpy(&v, p, sizeof(v));
    return v;
}

// The 16 outputs' values of one input pair as int8 (v = code − offset; with RAW, the codes
// themselves), in word order: `lo` holds outputs 0-7's (even, odd) values, `hi` outputs 8-15's.
// The format's constants are template arguments: the decoding compiles to a few byte operations.
struct PairValues {
    __m128i lo, hi;
};

// Sixteen codes of one 32-byte half of a 4- or 6-bit unit (outputs 0-7 or 8-15), the pair's two
// inputs of each output side by side, by byte shuffles (pair_values's 4- and 6-bit codes).
template <int BITS, int SUPER>
static inline __attribute__((always_inline)) __m128i unit_half(const uint8_t* codes, int64_t pair,
                                                              int half) {
    const int first = int(pair % 2) * 2, shift = int(pair % 4) / 2 * 4;
    const __m256i unit = _mm256_loadu_si256((const __m256i*)(codes + pair / 4 * 64 + 32 * half));
    __m256i v = _mm256_and_si256(_mm256_srli_epi16(unit, shift), _mm256_set1_epi8(0x0f));
    if constexpr (BITS == 6) {
        const __m256i h = _mm256_loadu_si256(
            (const __m256i*)(codes + SUPER / 2 * 16 + pair / 8 * 64 + 32 * half));
        const int high_at = (pair / 4 % 2 == 0 ? 4 : 0) + int(pair % 4) / 2 * 2;
        // The two bits at high_at moved to bits 4-5: a 16-bit shift carries bits across a byte
        // boundary only where the mask then drops them.
        const __m256i moved = high_at >= 4 ? _mm256_srli_epi16(h, high_at - 4)
                                           : _mm256_slli_epi16(h, 4 - high_at);
        v = _mm256_or_si256(v, _mm256_and_si256(moved, _mm256_set1_epi8(0x30)));
    }
    // Bytes 4j + first and 4j + first + 1 of each 128-bit lane's four outputs, then the lanes'
    // eight bytes side by side (the upper eight of each lane are dropped).
    const __m256i pick = _mm256_add_epi8(
        _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 0, 1, 4, 5, 8, 9, 12, 13, 0, 1, 4, 5, 8, 9, 12,
                         13, 0, 1, 4, 5, 8, 9, 12, 13),
        _mm256_set1_epi8(char(first)));
    return _mm256_castsi256_si128(
        _mm256_permute4x64_epi64(_mm256_shuffle_epi8(v, pick), 0x08));  // qwords 0 and 2
}

template <int BITS, int OFFSET, int SUPER, bool RAW = false>
static inline __attribute__((always_inline)) PairValues pair_values(const uint8_t* codes,
                                                                   int64_t pair) {
    static_assert(BITS != 8 || OFFSET == 0, "eight-bit codes are Q8_0's, signed");
    PairValues v;
    if constexpr (BITS == 8) {  // Q8_0's: signed, no offset
        v.lo = _mm_loadu_si128((const __m128i*)(codes + pair * 32));
        v.hi = _mm_loadu_si128((const __m128i*)(codes + pair * 32 + 16));
        return v;
    }
    const __m128i nibble = _mm_set1_epi8(0x0f);
    if constexpr (BITS == 4 || BITS == 6) {
        // From the pair's unit of 8 inputs (six bits take their high two from the high plane).
        v.lo = unit_half<BITS, SUPER>(codes, pair, 0);
        v.hi = unit_half<BITS, SUPER>(codes, pair, 1);
    } else {  // five bits: the low four as the pair's nibbles, the fifth from the high bits
        const __m128i both = _mm_loadu_si128((const __m128i*)(codes + pair * 16));
        v.lo = _mm_and_si128(both, nibble);
        v.hi = _mm_and_si128(_mm_srli_epi16(both, 4), nibble);
        // The high bits moved into place with one shift and one mask each: a shift within
        // 16-bit lanes carries bits across the byte boundary only where the mask then drops
        // them. `pair`'s place in its group is a constant once the caller's loop is unrolled.
        const uint8_t* high = codes + SUPER / 2 * 16;  // the high bits' plane
        const __m128i h = _mm_loadu_si128((const __m128i*)(high + pair / 4 * 16));
        const __m128i bit4 = _mm_set1_epi8(0x10);
        const int j = int(pair % 4) * 2;  // lo at bit j, hi at bit j + 1; both go to bit 4
        const __m128i e = j <= 4 ? _mm_slli_epi16(h, 4 - j) : _mm_srli_epi16(h, j - 4);
        const __m128i o = j <= 2 ? _mm_slli_epi16(h, 3 - j) : _mm_srli_epi16(h, j - 3);
        v.lo = _mm_or_si128(v.lo, _mm_and_si128(e, bit4));
        v.hi = _mm_or_si128(v.hi, _mm_and_si128(o, bit4));
    }
    if constexpr (OFFSET != 0 && !RAW) {
        const __m128i offset = _mm_set1_epi8(char(OFFSET));
        v.lo = _mm_sub_epi8(v.lo, offset);
        v.hi = _mm_sub_epi8(v.hi, offset);
    }
    return v;
}

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
static inline __attribute__((always_inline)) Sums sums_plus(Sums s, Sums t) {
    return {_mm512_add_epi32(s.v, t.v)};
}
static inline __attribute__((always_inline)) Sums sums_less(Sums s, int32_t v) {
    return {_mm512_sub_epi32(s.v, _mm512_set1_epi32(v))};
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
static inline __attribute__((always_inline)) Sums sums_plus(Sums s, Sums t) {
    return {_mm256_add_epi32(s.lo, t.lo), _mm256_add_epi32(s.hi, t.hi)};
}
static inline __attribute__((always_inline)) Sums sums_less(Sums s, int32_t v) {
    const __m256i x = _mm256_set1_epi32(v);
    return {_mm256_sub_epi32(s.lo, x), _mm256_sub_epi32(s.hi, x)};
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


// The word path: each output's two products with a pair of inputs summed into its int32 lane by
// vpmaddwd, the codes less their offset widened to int16 words once per pair.
template <int BITS, int OFFSET>
struct WordPairs {
    using Operand = Words;
    using Partial = Sums;
    static constexpr int kCodeOffset = 0;  // the offset is taken off each code
    static constexpr int kPairsPerOperand = 1;
    static constexpr int kFlush = 1 << 20;  // int32 lanes: the sub-block never overflows one
    template <int SUPER>
    static inline __attribute__((always_inline)) Operand decode(const uint8_t* codes,
                                                                int64_t pair) {
        return words_of(pair_values<BITS, OFFSET, SUPER>(codes, pair));
    }
    static const int16_t* inputs(const Operands& op) { return op.xq; }
    static inline __attribute__((always_inline)) Partial zero() { return sums_zero(); }
    // + the products with a row's two inputs at x.
    static inline __attribute__((always_inline)) Partial add(Partial s, Operand w,
                                                             const int16_t* x) {
        return sums_add(s, w, loaded<int32_t>(x));
    }
    static inline __attribute__((always_inline)) Sums widen(Partial p) { return p; }
};

}  // namespace quant
