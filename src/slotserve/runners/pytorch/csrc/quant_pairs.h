// The integer half of quant_gemm.h's arithmetic, compiled once per instruction set before it
// (kernels_<isa>.cpp): a packed input pair's codes decoded in registers, and the exact sums
// Σ v · q of a sub-block, by whichever instructions suit the codes and the instruction set.
// Every path yields the same int32 sums (they are exact), so the paths never change a bit.

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

template <int BITS, int OFFSET, int SUPER, bool RAW = false>
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
    static constexpr bool kRawCodes = false;  // the offset is taken off each code
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

#if SLOTSERVE_AVX512
// The nibble path (AVX-512, codes of 4 bits): one 64-byte load holds four pairs' raw codes,
// each 128-bit lane one pair's (`lo` its outputs 0-7's (even, odd) codes, `hi` 8-15's), met by
// vpmaddubsw with that pair's two int8 inputs (four broadcast, one shuffle): an int16 lane sums
// every fourth pair's products, 32 pairs before it must be widened (codes ≤ 15, |q| ≤ 127). Four
// times the products per instruction of the word path, which the nibbles' unpacking outweighed;
// the offset comes off once per sub-block as offset · Σ q.
struct Nibbles {
    __m512i lo, hi;
};
template <int OFFSET>
struct NibblePairs {
    using Operand = Nibbles;
    struct Partial {
        __m512i lo, hi;  // int16: pair p's, p + 1's, p + 2's, p + 3's sums; outputs 0-7, 8-15
    };
    static constexpr bool kRawCodes = true;
    static constexpr int kPairsPerOperand = 4;
    static constexpr int kFlush = 4 * (32767 / (2 * kLargestInput * 15));
    template <int SUPER>
    static inline __attribute__((always_inline)) Operand decode(const uint8_t* codes,
                                                                int64_t pair) {
        const __m512i all = _mm512_loadu_si512((const void*)(codes + pair * 16));
        const __m512i nibble = _mm512_set1_epi8(0x0f);
        return {_mm512_and_si512(all, nibble),
                _mm512_and_si512(_mm512_srli_epi16(all, 4), nibble)};
    }
    static inline __attribute__((always_inline)) Partial zero() {
        return {_mm512_setzero_si512(), _mm512_setzero_si512()};
    }
    static const int8_t* inputs(const Operands& op) { return op.xq8; }
    // + the products with a row's eight inputs at x: lane L takes inputs 2L and 2L + 1.
    static inline __attribute__((always_inline)) Partial add(Partial s, Operand w,
                                                             const int8_t* x) {
        const __m512i spread = _mm512_set_epi32(
            0x07060706, 0x07060706, 0x07060706, 0x07060706, 0x05040504, 0x05040504, 0x05040504,
            0x05040504, 0x03020302, 0x03020302, 0x03020302, 0x03020302, 0x01000100, 0x01000100,
            0x01000100, 0x01000100);
        const __m512i eight =
            _mm512_shuffle_epi8(_mm512_set1_epi64(loaded<int64_t>(x)), spread);
        return {_mm512_add_epi16(s.lo, _mm512_maddubs_epi16(w.lo, eight)),
                _mm512_add_epi16(s.hi, _mm512_maddubs_epi16(w.hi, eight))};
    }
    // Eight outputs' int32 sums: the four lanes' int16 sums of each output added.
    static inline __attribute__((always_inline)) __m256i lanes_summed(__m512i lanes) {
        const __m512i wide = _mm512_add_epi32(
            _mm512_cvtepi16_epi32(_mm512_castsi512_si256(lanes)),
            _mm512_cvtepi16_epi32(_mm512_extracti64x4_epi64(lanes, 1)));
        return _mm256_add_epi32(_mm512_castsi512_si256(wide),
                                _mm512_extracti64x4_epi64(wide, 1));
    }
    static inline __attribute__((always_inline)) Sums widen(Partial p) {
        return {_mm512_inserti64x4(_mm512_castsi256_si512(lanes_summed(p.lo)),
                                   lanes_summed(p.hi), 1)};
    }
};

// Five and eight bits take the word path: vpmaddwd's 512 bits decode them faster than bytes.
template <int BITS, int OFFSET>
using PairMath = std::conditional_t<BITS == 4, NibblePairs<OFFSET>, WordPairs<BITS, OFFSET>>;
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
    static constexpr bool kRawCodes = true;
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
// The nibble path (AVX2, codes of 4 bits): the byte path over two pairs at once, each 32-byte
// load holding pair p's codes and pair p + 1's. `lo` is [p's outputs 0-7 | p + 1's], `hi` the
// same for outputs 8-15; each half meets its own pair's inputs (one broadcast, one shuffle), so
// an int16 lane sums every other pair's products, 16 pairs before it must be widened.
struct Nibbles {
    __m256i lo, hi;
};
template <int OFFSET>
struct NibblePairs {
    using Operand = Nibbles;
    struct Partial {
        __m256i lo, hi;  // int16: [pair p's sums | pair p + 1's], outputs 0-7 and 8-15
    };
    static constexpr bool kRawCodes = true;
    static constexpr int kPairsPerOperand = 2;
    static constexpr int kFlush = 2 * (32767 / (2 * kLargestInput * 15));
    template <int SUPER>
    static inline __attribute__((always_inline)) Operand decode(const uint8_t* codes,
                                                                int64_t pair) {
        const __m256i both = _mm256_loadu_si256((const __m256i*)(codes + pair * 16));
        const __m256i nibble = _mm256_set1_epi8(0x0f);
        return {_mm256_and_si256(both, nibble),
                _mm256_and_si256(_mm256_srli_epi16(both, 4), nibble)};
    }
    static inline __attribute__((always_inline)) Partial zero() {
        return {_mm256_setzero_si256(), _mm256_setzero_si256()};
    }
    static const int8_t* inputs(const Operands& op) { return op.xq8; }
    // + the products with a row's four inputs at x: the first two spread over the low half,
    // the others over the high one.
    static inline __attribute__((always_inline)) Partial add(Partial s, Operand w,
                                                             const int8_t* x) {
        const __m256i spread = _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1,
                                                2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3);
        const __m256i four = _mm256_shuffle_epi8(_mm256_set1_epi32(loaded<int32_t>(x)), spread);
        return {_mm256_add_epi16(s.lo, _mm256_maddubs_epi16(w.lo, four)),
                _mm256_add_epi16(s.hi, _mm256_maddubs_epi16(w.hi, four))};
    }
    static inline __attribute__((always_inline)) __m256i halves_summed(__m256i halves) {
        return _mm256_add_epi32(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(halves)),
                                _mm256_cvtepi16_epi32(_mm256_extracti128_si256(halves, 1)));
    }
    static inline __attribute__((always_inline)) Sums widen(Partial p) {
        return {halves_summed(p.lo), halves_summed(p.hi)};
    }
};

// Eight-bit codes take the word path: Q8_0's are signed (as bytes they would need a sign trick
// per row) and Q6_K's six bits fill an int16 lane in two pairs, too often to widen it.
template <int BITS, int OFFSET>
using PairMath = std::conditional_t<
    BITS == 8, WordPairs<BITS, OFFSET>,
    std::conditional_t<BITS == 4, NibblePairs<OFFSET>, BytePairs<BITS, OFFSET>>>;
#endif

}  // namespace quant
