// Paged attention's arithmetic and its vector pieces: the scores' lane tree, the transpose,
// value pairs and the softmax of a partition (rowwise.h states the invariance argument; attend.h
// computes a partition from these).

// ---- Paged attention ------------------------------------------------------------------------
//
// One row is one query head of one token against positions lo .. hi - 1 of its sequence, reduced
// in partitions of kPartition absolute positions and merged in partition order. Within a
// partition whose first key is ``start`` (keys j = 0, 1, ... from there), for a row with n keys:
//
//   x_l(j)  = dot_pairs over the pair chunks c in order: q pair 16c + l with k_j pair 16c + l
//   score_j = scale * ((((x_0 + x_8) + (x_4 + x_12)) + ((x_2 + x_10) + (x_6 + x_14)))
//                     + (((x_1 + x_9) + (x_5 + x_13)) + ((x_3 + x_11) + (x_7 + x_15))))
//   p_j     = bf16(exp(score_j - m)), m the partition's largest score
//   s       = the p_j summed lane-wise in sixteens from j = 0, then by hsum's tree
//   acc     = dot_pairs over the key pairs (0, 1), (2, 3), ...: (p_j, p_j+1) with (v_j, v_j+1),
//             sixteen dimensions a vector (the odd key of a row's last pair, past its end, has p and
//             v zero)
//
// Nothing in it depends on the other rows of a call: a row has the same bits alone, in a tile,
// on any thread and in any split. A lone row (a decode token) reads its keys in place: lane l
// of its dot_pairs vector is x_l, and sum_lanes_of_16 adds the lanes by that tree. A tile (up
// to kTileRows consecutive positions of one sequence) transposes sixteen keys once for all its
// rows, so x_l for sixteen keys is one vector and the tree is plain vector adds.

constexpr int kMaxChunks = 16;  // head_dim up to 256, in 16-dimension vectors
constexpr int kMaxGroup = 16;   // query heads per KV head
constexpr int kPrefetch = 16;       // keys ahead, to level 1, in a lone row (RowPrefetch)
constexpr int kFarPrefetch = 96;    // keys ahead, to level 2
constexpr int kValuePrefetch = 32;  // values ahead, to level 2, during the scores

// exp(x) for a softmax's x = score - m <= 0 (or NaN), whose result is rounded to bfloat16:
// x log2(e) = n + f with n whole and f in [-1/2, 1/2] (log2(e) in two parts), 2^f by a degree-5
// minimax polynomial (relative error ~2e-7 in float32, as Cephes' expf), times 2^n; 0 below
// the smallest normal's logarithm. Every step is one fused or exact operation, so the AVX2
// build's exp_nonpositive has these bits.
constexpr float kExpLowest = -87.3365447504f;
constexpr float kExpRound = 12582912.0f;  // 1.5 * 2^23: added to |t| < 2^22, rounds it whole
constexpr float kLog2eHigh = 1.44269502162933349609375f, kLog2eLow = 1.925963033500011e-08f;
constexpr float kExp2Poly[6] = {1.0000001192092896f,   0.6931469440460205f,
                                0.24022120237350464f,  0.05550713092088699f,
                                0.009675540961325169f, 0.0013276472454890609f};

#if SLOTSERVE_AVX512
template <int N>
static inline __attribute__((always_inline)) void exp_nonpositive_n(vf* x) {
    const vf lo = splat(kExpLowest), round = splat(kExpRound);
    __mmask16 keep[N];
    vf n[N], f[N], p[N];
    for (int i = 0; i < N; ++i) {
        keep[i] = _mm512_cmp_ps_mask((__m512)x[i], (__m512)lo, _CMP_NLT_UQ);
        x[i] = x[i] < lo ? lo : x[i];
        n[i] = vfma(x[i], splat(kLog2eHigh), round) - round;
    }
    for (int i = 0; i < N; ++i)
        f[i] = vfma(x[i], splat(kLog2eLow), vfma(x[i], splat(kLog2eHigh), -n[i]));
    for (int i = 0; i < N; ++i) p[i] = vfma(splat(kExp2Poly[5]), f[i], splat(kExp2Poly[4]));
    for (int k = 3; k >= 0; --k)
        for (int i = 0; i < N; ++i) p[i] = vfma(p[i], f[i], splat(kExp2Poly[k]));
    for (int i = 0; i < N; ++i)
        x[i] = (vf)_mm512_maskz_scalef_ps(keep[i], (__m512)p[i], (__m512)n[i]);
}
#else
#include "attention_avx2.h"
#endif

// Sixteen vectors to the sixteen sums of their lanes, in order, each summed by the tree above
// (lane l + lane l + 8, then + 4, + 2, + 1): a transpose and add, four rounds of shuffles.
static inline __attribute__((always_inline)) vf sum_lanes_of_16(const vf* v) {
    const vi lo8 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
    const vi hi8 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
    const vi lo4 = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
    const vi hi4 = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
    const vi lo2 = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
    const vi hi2 = {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31};
    const vi lo1 = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
    const vi hi1 = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
    vf a[8], b[4], c[2];
    for (int i = 0; i < 8; ++i)
        a[i] = __builtin_shuffle(v[2 * i], v[2 * i + 1], lo8) +
               __builtin_shuffle(v[2 * i], v[2 * i + 1], hi8);
    for (int i = 0; i < 4; ++i)
        b[i] = __builtin_shuffle(a[2 * i], a[2 * i + 1], lo4) +
               __builtin_shuffle(a[2 * i], a[2 * i + 1], hi4);
    for (int i = 0; i < 2; ++i)
        c[i] = __builtin_shuffle(b[2 * i], b[2 * i + 1], lo2) +
               __builtin_shuffle(b[2 * i], b[2 * i + 1], hi2);
    return __builtin_shuffle(c[0], c[1], lo1) + __builtin_shuffle(c[0], c[1], hi1);
}

// Sixteen rows of sixteen lanes transposed in place (row i lane j → row j lane i), in four
// rounds of two-source shuffles swapping blocks of 8, 4, 2 and 1 lanes.
static inline __attribute__((always_inline)) void transpose_16(vi* r) {
    const vi lo8 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
    const vi hi8 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
    const vi lo4 = {0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27};
    const vi hi4 = {4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31};
    const vi lo2 = {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29};
    const vi hi2 = {2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31};
    const vi lo1 = {0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30};
    const vi hi1 = {1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31};
    auto round = [&](int dist, const vi& lo, const vi& hi) {
        for (int g = 0; g < kLanes; g += 2 * dist)
            for (int i = g; i < g + dist; ++i) {
                const vi a = r[i], b = r[i + dist];
                r[i] = __builtin_shuffle(a, b, lo);
                r[i + dist] = __builtin_shuffle(a, b, hi);
            }
    };
    round(8, lo8, hi8);
    round(4, lo4, hi4);
    round(2, lo2, hi2);
    round(1, lo1, hi1);
}

// Pairs 16c .. 16c + 15 of a head's row (zero past head_dim: a partial chunk must not read the
// next head).
static inline __attribute__((always_inline)) vi pair_chunk(const uint16_t* row, int c, int pairs) {
    const int width = pairs - c * kLanes;
    if (width >= kLanes) return load_pairs(row + 2 * c * kLanes);
    vi v = vi{};
    std::memcpy(&v, row + 2 * c * kLanes, sizeof(int32_t) * width);
    return v;
}

// The values of a key pair in the form value_pair reads, up to C vectors of sixteen dimensions:
// for the instruction, dimension d's lane holds (v_j[d], v_j+1[d]); for the emulation, both
// rows in float32. ``odd`` null: zero.
template <int C>
struct ValuePairOf {
#if SLOTSERVE_BF16
    vi pairs[C];
#else
    vf even[C], odd[C];
#endif
};
using ValuePair = ValuePairOf<kMaxChunks>;

#if SLOTSERVE_BF16
// Thirty-two dimensions of two rows (``a``, ``b``, bfloat16) as two of load_value_pair's vectors:
// lane l of the first (second) holds dimension l (16 + l) of both.
static inline __attribute__((always_inline)) void interleave_rows(__m512i a, __m512i b, vi& first,
                                                                  vi& second) {
    const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9,
                                        40, 8, 39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1,
                                        32, 0);
    first = (vi)_mm512_permutex2var_epi16(a, lo, b);
    second = (vi)_mm512_permutex2var_epi16(a, _mm512_add_epi16(lo, _mm512_set1_epi16(16)), b);
}
#endif

template <int C>
static inline __attribute__((always_inline)) void load_value_pair(const uint16_t* even,
                                                                  const uint16_t* odd,
                                                                  int chunks,
                                                                  ValuePairOf<C>& out) {
#if SLOTSERVE_BF16
    int c = 0;
    for (; c + 2 <= chunks; c += 2)
        interleave_rows(_mm512_loadu_si512(even + c * kLanes),
                        odd ? _mm512_loadu_si512(odd + c * kLanes) : _mm512_setzero_si512(),
                        out.pairs[c], out.pairs[c + 1]);
    if (c < chunks) {  // a last sixteen dimensions
        const __m512i a = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(even + c * kLanes)));
        const __m512i b = odd ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(odd + c * kLanes)))
                              : _mm512_setzero_si512();
        out.pairs[c] = (vi)_mm512_or_si512(a, _mm512_slli_epi32(b, 16));
    }
#else
    for (int c = 0; c < chunks; ++c) {
        out.even[c] = load_bf16(even + c * kLanes);
        out.odd[c] = odd ? load_bf16(odd + c * kLanes) : splat(0.0f);
    }
#endif
}

#if SLOTSERVE_AVX512
// An int8 pool's row (kernel_types.h) read in registers as kv_rows_bf16 reads it back: value i
// is bfloat16(code_i · scale), so the pool's lone rows (attend_heads.h) see the bits every other
// path sees in the read-back rows.
static inline __attribute__((always_inline)) vf int8_scale(const uint8_t* row, int d) {
    return splat(int8_row_scale(row, d));
}

// Sixteen codes from ``codes`` times the row's scale, in float32 (not yet rounded).
static inline __attribute__((always_inline)) vf int8_products(const uint8_t* codes, vf scale) {
    return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)codes))) *
           scale;
}

// Dimensions 32c .. 32c + 31 of the row as bfloat16 pairs: pair_chunk's vector c.
static inline __attribute__((always_inline)) vi int8_pair_chunk(const uint8_t* row, int c,
                                                                vf scale) {
    const vf lo = int8_products(row + 32 * c, scale), hi = int8_products(row + 32 * c + 16, scale);
#if SLOTSERVE_BF16
    return (vi)_mm512_cvtne2ps_pbh((__m512)hi, (__m512)lo);
#else
    const __m256i a = _mm512_cvtepi32_epi16((__m512i)((vu)round_bf16(lo) >> 16));
    const __m256i b = _mm512_cvtepi32_epi16((__m512i)((vu)round_bf16(hi) >> 16));
    return (vi)_mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
#endif
}

// load_value_pair from two rows of an int8 pool (``d`` dimensions, C vectors of sixteen, C even).
template <int C>
static inline __attribute__((always_inline)) void load_int8_value_pair(const uint8_t* even,
                                                                       const uint8_t* odd, int d,
                                                                       ValuePairOf<C>& out) {
    const vf se = int8_scale(even, d), so = odd ? int8_scale(odd, d) : splat(0.0f);
#if SLOTSERVE_BF16
    for (int c = 0; c < C; c += 2)
        interleave_rows((__m512i)int8_pair_chunk(even, c / 2, se),
                        odd ? (__m512i)int8_pair_chunk(odd, c / 2, so) : _mm512_setzero_si512(),
                        out.pairs[c], out.pairs[c + 1]);
#else
    for (int c = 0; c < C; ++c) {
        out.even[c] = round_bf16(int8_products(even + c * kLanes, se));
        out.odd[c] = odd ? round_bf16(int8_products(odd + c * kLanes, so)) : splat(0.0f);
    }
#endif
}
#endif

// acc[c] (dimensions 16c ..) advanced by one dot_pairs step with the probability pair at ``p``:
// the odd key first, as the instruction. ``even_only``: the pair's odd value taken as zero.
template <int C>
static inline __attribute__((always_inline)) void value_pair(vf* acc, int chunks,
                                                             const uint16_t* p,
                                                             const ValuePairOf<C>& v,
                                                             bool even_only = false) {
#if SLOTSERVE_BF16
    const vi pp = splat_pair(p), keep = vi{} + (even_only ? 0xffff : -1);
    for (int c = 0; c < chunks; ++c) acc[c] = dot_pairs(acc[c], pp, v.pairs[c] & keep);
#else
    const vf pe = splat(bf16_to_f32(p[0])), po = splat(bf16_to_f32(p[1]));
    for (int c = 0; c < chunks; ++c)
        acc[c] = vfma(pe, v.even[c], vfma(po, even_only ? splat(0.0f) : v.odd[c], acc[c]));
#endif
}

#if SLOTSERVE_AVX512
// N vectors of bfloat16 probabilities exp(score - mx), added to ``total`` in order; with
// ``Raw`` the scores are sums S and score = scale * S, rounded before the difference.
template <int N, bool Raw = false>
static inline __attribute__((always_inline)) vf probabilities(const float* scores, float mx,
                                                              float scale, uint16_t* probs,
                                                              vf total) {
    vf e[N];
    for (int i = 0; i < N; ++i) {
        e[i] = load_f32(scores + i * kLanes);
        if constexpr (Raw)  // no contraction into the difference: the product is rounded
            e[i] = (vf)_mm512_mul_round_ps((__m512)e[i], (__m512)splat(scale),
                                           _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        e[i] -= mx;
    }
    exp_nonpositive_n<N>(e);
    for (int i = 0; i < N; ++i) e[i] = store_rounded_bf16(probs + i * kLanes, e[i]);
    for (int i = 0; i < N; ++i) total += e[i];
    return total;
}
#endif

// Each row-head's largest score, its bfloat16 probabilities and their sum (from the rounded
// values), over its n keys; its acc zeroed (``acc`` null: left alone). ``raw_scale`` > 0: the
// rows hold the sums S whose scores are raw_scale * S (the AMX tiles store them as the unit
// leaves them); rounding is monotonic, so the largest score is raw_scale times the largest S,
// and every score has the bits a scaled row would hold.
static inline void softmax_rows(float* scores, uint16_t* probs, int heads, int group,
                                const int* n, int d, float* m, float* s, float* acc,
                                float raw_scale = 0.0f) {
    const bool raw = raw_scale > 0.0f;
    // Every row-head's largest score first: each exp pass waits on its maximum, and these
    // reductions run side by side.
    for (int rh = 0; rh < heads; ++rh) {
        const int keys = n[rh / group];
        if (keys <= 0) continue;
        const int padded = (keys + kLanes - 1) / kLanes * kLanes;
        float* row = scores + int64_t(rh) * kScoreStride;
        for (int j = keys; j < padded; ++j) row[j] = -INFINITY;
#if SLOTSERVE_AVX512
        vf even = load_f32(row), odd = splat(-INFINITY);
        int j = kLanes;
        for (; j + 2 * kLanes <= padded; j += 2 * kLanes) {
            odd = vmax(odd, load_f32(row + j));
            even = vmax(even, load_f32(row + j + kLanes));
        }
        if (j < padded) odd = vmax(odd, load_f32(row + j));
        m[rh] = hmax(vmax(even, odd));
        if (raw) m[rh] *= raw_scale;
#else
        if (raw)  // (only the AMX build's tiles pass sums)
            for (int j = 0; j < keys; ++j) row[j] *= raw_scale;
        m[rh] = row_max_halves(row, padded);
#endif
    }
    for (int rh = 0; rh < heads; ++rh) {
        const int keys = n[rh / group];
        if (keys <= 0) continue;
        const int padded = (keys + kLanes - 1) / kLanes * kLanes;
        const float* row = scores + int64_t(rh) * kScoreStride;
        uint16_t* p = probs + int64_t(rh) * (kPartition + 2);
#if SLOTSERVE_AVX512
        vf total = splat(0.0f);
        int j = 0;
        if (raw) {
            for (; j + 4 * kLanes <= padded; j += 4 * kLanes)
                total = probabilities<4, true>(row + j, m[rh], raw_scale, p + j, total);
            for (; j < padded; j += kLanes)
                total = probabilities<1, true>(row + j, m[rh], raw_scale, p + j, total);
        } else {
            for (; j + 4 * kLanes <= padded; j += 4 * kLanes)
                total = probabilities<4>(row + j, m[rh], 1.0f, p + j, total);
            for (; j < padded; j += kLanes)
                total = probabilities<1>(row + j, m[rh], 1.0f, p + j, total);
        }
        s[rh] = hsum(total);
#else
        s[rh] = probabilities_halves(row, padded, m[rh], p);
#endif
        if (acc)
            for (int c = 0; c < d; c += kLanes) store_f32(acc + int64_t(rh) * d + c, splat(0.0f));
    }
}
