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
    if constexpr (BITS == 4) {  // from the pair's unit of 8 inputs, byte by byte: rows looked up
        const uint8_t* unit = codes + pair / 4 * 64;
        const int first = int(pair % 2) * 2, shift = int(pair % 4) / 2 * 4;
        alignas(16) uint8_t bytes[32];  // outputs 0-7's (even, odd) codes, then 8-15's
        for (int j = 0; j < 16; ++j)
            for (int e = 0; e < 2; ++e) bytes[2 * j + e] = unit[4 * j + first + e] >> shift;
        v.lo = _mm_and_si128(_mm_load_si128((const __m128i*)bytes), nibble);
        v.hi = _mm_and_si128(_mm_load_si128((const __m128i*)(bytes + 16)), nibble);
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

#if SLOTSERVE_AVX512
// The nibble path (AVX-512, codes of 4 bits): one 64-byte load holds a unit of 8 inputs, byte
// 4j + i output j's codes of inputs i (low nibble) and 4 + i (high one), so each nibble plane
// holds four inputs' codes in every output's 32-bit lane. With VNNI, vpdpbusd sums each
// lane's four products into it as int32; without, vpmaddubsw sums two into each int16 half,
// 32 pairs before they must be widened (codes ≤ 15, |q| ≤ 127). The offset comes off once per
// sub-block as offset · Σ q.
struct Nibbles {
    __m512i first, last;  // inputs 0-3's codes and 4-7's; output j in lane j
};
template <int OFFSET>
struct NibblePairs {
    using Operand = Nibbles;
    struct Partial {
        __m512i first, last;  // each plane's sums: int32 with VNNI, else int16 halves
    };
    static constexpr int kCodeOffset = OFFSET;
    static constexpr int kPairsPerOperand = 4;
#if SLOTSERVE_VNNI
    static constexpr int kFlush = 1 << 20;  // int32 lanes: the sub-block never overflows one
#else
    static constexpr int kFlush = 4 * (32767 / (2 * kLargestInput * 15));
#endif
    template <int SUPER>
    static inline __attribute__((always_inline)) Operand decode(const uint8_t* codes,
                                                                int64_t pair) {
        const __m512i unit = _mm512_loadu_si512((const void*)(codes + pair * 16));
        const __m512i nibble = _mm512_set1_epi8(0x0f);
        return {_mm512_and_si512(unit, nibble),
                _mm512_and_si512(_mm512_srli_epi16(unit, 4), nibble)};
    }
    static inline __attribute__((always_inline)) Partial zero() {
        return {_mm512_setzero_si512(), _mm512_setzero_si512()};
    }
    static const int8_t* inputs(const Operands& op) { return op.xq8; }
    // + the products with a row's eight inputs at x, four broadcast to each plane.
    static inline __attribute__((always_inline)) Partial add(Partial s, Operand w,
                                                             const int8_t* x) {
        const __m512i first = _mm512_set1_epi32(loaded<int32_t>(x));
        const __m512i last = _mm512_set1_epi32(loaded<int32_t>(x + 4));
#if SLOTSERVE_VNNI
        return {_mm512_dpbusd_epi32(s.first, w.first, first),
                _mm512_dpbusd_epi32(s.last, w.last, last)};
#else
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
// lane. vpdpbusd's codes are unsigned: Q6_K's are (0-63), Q8_0's signed ones become so with their
// sign bit flipped (+128). The offset comes off once per sub-block as offset · Σ q.
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
        return _mm512_dpbusd_epi32(s, w, _mm512_set1_epi32(loaded<int32_t>(x)));
    }
    static inline __attribute__((always_inline)) Sums widen(Partial p) { return {p}; }
};
#endif

// Five bits take the word path (vpmaddwd's 512 bits decode them faster than bytes), and eight
// without VNNI.
template <int BITS, int OFFSET>
#if SLOTSERVE_VNNI
using PairMath = std::conditional_t<
    BITS == 4, NibblePairs<OFFSET>,
    std::conditional_t<BITS == 8, QuadPairs<OFFSET>, WordPairs<BITS, OFFSET>>>;
#else
using PairMath = std::conditional_t<BITS == 4, NibblePairs<OFFSET>, WordPairs<BITS, OFFSET>>;
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
// The nibble path (AVX2, codes of 4 bits): a unit of 8 inputs is two 32-byte loads, outputs
// 0-7's and 8-15's, laid out as AVX-512's (byte 4j + i: output j's codes of inputs i and 4 + i).
// vpmaddubsw sums two products into each int16 half of an output's 32-bit lane, both nibble
// planes into the same halves, 16 pairs before they must be widened.
struct Nibbles {
    __m256i first_lo, last_lo, first_hi, last_hi;  // inputs 0-3's and 4-7's; outputs 0-7, 8-15
};
template <int OFFSET>
struct NibblePairs {
    using Operand = Nibbles;
    struct Partial {
        __m256i lo, hi;  // int16 halves of outputs 0-7's lanes and 8-15's
    };
    static constexpr int kCodeOffset = OFFSET;
    static constexpr int kPairsPerOperand = 4;
    static constexpr int kFlush = 4 * (32767 / (2 * 2 * kLargestInput * 15));
    template <int SUPER>
    static inline __attribute__((always_inline)) Operand decode(const uint8_t* codes,
                                                                int64_t pair) {
        const __m256i lo = _mm256_loadu_si256((const __m256i*)(codes + pair * 16));
        const __m256i hi = _mm256_loadu_si256((const __m256i*)(codes + pair * 16 + 32));
        const __m256i nibble = _mm256_set1_epi8(0x0f);
        return {_mm256_and_si256(lo, nibble), _mm256_and_si256(_mm256_srli_epi16(lo, 4), nibble),
                _mm256_and_si256(hi, nibble), _mm256_and_si256(_mm256_srli_epi16(hi, 4), nibble)};
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
};

// Eight-bit codes take the word path: Q8_0's are signed (as bytes they would need a sign trick
// per row) and Q6_K's six bits fill an int16 lane in two pairs, too often to widen it.
template <int BITS, int OFFSET>
using PairMath = std::conditional_t<
    BITS == 8, WordPairs<BITS, OFFSET>,
    std::conditional_t<BITS == 4, NibblePairs<OFFSET>, BytePairs<BITS, OFFSET>>>;
#endif

}  // namespace quant
