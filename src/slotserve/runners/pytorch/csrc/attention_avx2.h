// A tile's inner loops for the AVX2 build (attention.h includes this there alone): the scores of
// sixteen transposed keys (score_keys) and the value pass (value_pair over a block), with their
// running sums held as two eight-lane halves. Without AVX-512 there is no register for a
// sixteen-lane vector, and GCC keeps one that lives across iterations in memory, round trips
// through general registers included; halves of __m256 stay in registers. Every lane runs the
// operations of score_keys and value_pair in their order: the bits are theirs (the tests hold a
// tile's rows against the same rows alone, which take attend_row_t).

struct Halves {
    __m256 lo, hi;
};

static inline __attribute__((always_inline)) Halves halves_load(const void* p) {
    const float* f = static_cast<const float*>(p);
    return {_mm256_loadu_ps(f), _mm256_loadu_ps(f + 8)};
}

static inline __attribute__((always_inline)) Halves halves_add(Halves a, Halves b) {
    return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)};
}

// dot_pairs over a lone row's pair chunks: x advanced chunk by chunk from zero by the query's
// pairs (``q``) with the key's (``k``), as attend_row_t computes each key's x.
static inline __attribute__((always_inline)) vf dot_pairs_halves(const uint16_t* q, const vi* k,
                                                                 int pair_chunks) {
    const __m256i high = _mm256_set1_epi32(int32_t(0xffff0000u));
    __m256 x0 = _mm256_setzero_ps(), x1 = _mm256_setzero_ps();
    for (int c = 0; c < pair_chunks; ++c) {
        const __m256i* qc = reinterpret_cast<const __m256i*>(q + 2 * c * kLanes);
        const __m256i* kc = reinterpret_cast<const __m256i*>(&k[c]);
        for (int h = 0; h < 2; ++h) {
            const __m256i a = _mm256_loadu_si256(qc + h), b = _mm256_loadu_si256(kc + h);
            __m256& x = h ? x1 : x0;
            x = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(a, high)),
                                _mm256_castsi256_ps(_mm256_and_si256(b, high)), x);
            x = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(a, 16)),
                                _mm256_castsi256_ps(_mm256_slli_epi32(b, 16)), x);
        }
    }
    const Halves both = {x0, x1};
    vf out;
    std::memcpy(&out, &both, sizeof(out));
    return out;
}

// score_keys' x_l, pair, quad and tree, for R row-heads: x_l advanced by dot_pairs (the high
// bfloat16 of each pair first, then the low one, each a fused step), the key's two halves split
// once for all R rows.
template <int R>
static inline __attribute__((always_inline)) void score_keys_halves(const uint16_t* q, int stride,
                                                                    int pair_chunks, const vi* kt,
                                                                    float scale, float* out) {
    const __m256i high = _mm256_set1_epi32(int32_t(0xffff0000u));
    auto x = [&](int l, Halves* X) {
        for (int r = 0; r < R; ++r) X[r] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
        for (int c = 0; c < pair_chunks; ++c) {
            const __m256i* k = reinterpret_cast<const __m256i*>(&kt[c * kLanes + l]);
            const __m256i k0 = _mm256_loadu_si256(k), k1 = _mm256_loadu_si256(k + 1);
            const __m256 kh0 = _mm256_castsi256_ps(_mm256_and_si256(k0, high));
            const __m256 kh1 = _mm256_castsi256_ps(_mm256_and_si256(k1, high));
            const __m256 kl0 = _mm256_castsi256_ps(_mm256_slli_epi32(k0, 16));
            const __m256 kl1 = _mm256_castsi256_ps(_mm256_slli_epi32(k1, 16));
            for (int r = 0; r < R; ++r) {
                uint32_t pair;
                std::memcpy(&pair, q + r * stride + 2 * (c * kLanes + l), sizeof(pair));
                const __m256 qh = _mm256_castsi256_ps(_mm256_set1_epi32(int32_t(pair & 0xffff0000u)));
                const __m256 ql = _mm256_castsi256_ps(_mm256_set1_epi32(int32_t(pair << 16)));
                X[r].lo = _mm256_fmadd_ps(ql, kl0, _mm256_fmadd_ps(qh, kh0, X[r].lo));
                X[r].hi = _mm256_fmadd_ps(ql, kl1, _mm256_fmadd_ps(qh, kh1, X[r].hi));
            }
        }
    };
    auto pair = [&](int l, Halves* P) {
        Halves a[R], b[R];
        x(l, a);
        x(l + 8, b);
        for (int r = 0; r < R; ++r) P[r] = halves_add(a[r], b[r]);
    };
    auto quad = [&](int l, Halves* Q) {
        Halves a[R], b[R];
        pair(l, a);
        pair(l + 4, b);
        for (int r = 0; r < R; ++r) Q[r] = halves_add(a[r], b[r]);
    };
    Halves w0[R], w1[R], t[R];
    quad(0, w0);
    quad(2, t);
    for (int r = 0; r < R; ++r) w0[r] = halves_add(w0[r], t[r]);
    quad(1, w1);
    quad(3, t);
    const __m256 s = _mm256_set1_ps(scale);
    for (int r = 0; r < R; ++r) {
        const Halves sum = halves_add(w0[r], halves_add(w1[r], t[r]));
        _mm256_storeu_ps(out + r * kScoreStride, _mm256_mul_ps(sum.lo, s));
        _mm256_storeu_ps(out + r * kScoreStride + 8, _mm256_mul_ps(sum.hi, s));
    }
}

// One query head's accumulators (``acc``: ``chunks`` vectors of sixteen dimensions) advanced by
// value_pair over ``whole`` key pairs of ``values``, then, with ``half``, the next pair's even key
// alone: acc = fma(p_even, v_even, fma(p_odd, v_odd, acc)), the odd value zero for a half pair.
template <int CH, typename Values>
static inline __attribute__((always_inline)) void value_pairs_halves(float* acc, int chunks,
                                                                     const uint16_t* probs,
                                                                     const Values* values,
                                                                     int whole, bool half) {
    constexpr int kMax = CH ? CH : kMaxChunks;
    const int n = CH ? CH : chunks;
    __m256 o[2 * kMax];
    for (int c = 0; c < 2 * n; ++c) o[c] = _mm256_loadu_ps(acc + 8 * c);
    auto step = [&](int i, bool even_only) {
        const __m256 pe = _mm256_set1_ps(bf16_to_f32(probs[2 * i]));
        const __m256 po = _mm256_set1_ps(bf16_to_f32(probs[2 * i + 1]));
        for (int c = 0; c < n; ++c) {
            const Halves even = halves_load(&values[i].even[c]);
            const Halves odd = even_only ? Halves{_mm256_setzero_ps(), _mm256_setzero_ps()}
                                         : halves_load(&values[i].odd[c]);
            o[2 * c] = _mm256_fmadd_ps(pe, even.lo, _mm256_fmadd_ps(po, odd.lo, o[2 * c]));
            o[2 * c + 1] = _mm256_fmadd_ps(pe, even.hi, _mm256_fmadd_ps(po, odd.hi, o[2 * c + 1]));
        }
    };
    for (int i = 0; i < whole; ++i) step(i, false);
    if (half) step(whole, true);
    for (int c = 0; c < 2 * n; ++c) _mm256_storeu_ps(acc + 8 * c, o[c]);
}

// softmax_rows' passes over one row-head's scores (``padded``: a whole number of sixteens).
// The largest: two running maxima, even and odd sixteens, as softmax_rows keeps them
// (``a > b ? a : b`` is _mm256_max_ps, NaN and signed zeros included).
static inline float row_max_halves(const float* row, int padded) {
    Halves even = halves_load(row);
    Halves odd = {_mm256_set1_ps(-INFINITY), _mm256_set1_ps(-INFINITY)};
    auto max = [](Halves a, Halves b) -> Halves {
        return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)};
    };
    int j = kLanes;
    for (; j + 2 * kLanes <= padded; j += 2 * kLanes) {
        odd = max(odd, halves_load(row + j));
        even = max(even, halves_load(row + j + kLanes));
    }
    if (j < padded) odd = max(odd, halves_load(row + j));
    const Halves both = max(even, odd);
    vf v;
    std::memcpy(&v, &both, sizeof(v));
    return hmax(v);
}

// exp_nonpositive_n's steps for eight lanes (the scale built from n's bits: 2^n is normal).
static inline __attribute__((always_inline)) __m256 exp_nonpositive(__m256 x) {
    const __m256 lo = _mm256_set1_ps(kExpLowest), round = _mm256_set1_ps(kExpRound);
    const __m256 high = _mm256_set1_ps(kLog2eHigh);
    const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_blendv_ps(x, lo, under);
    const __m256 n = _mm256_sub_ps(_mm256_fmadd_ps(x, high, round), round);
    const __m256 f = _mm256_fmadd_ps(x, _mm256_set1_ps(kLog2eLow), _mm256_fmsub_ps(x, high, n));
    __m256 p = _mm256_fmadd_ps(_mm256_set1_ps(kExp2Poly[5]), f, _mm256_set1_ps(kExp2Poly[4]));
    for (int k = 3; k >= 0; --k) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kExp2Poly[k]));
    const __m256i scale =
        _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(scale)));
}

// round_bf16's bits for eight lanes (a NaN becomes the canonical quiet NaN).
static inline __attribute__((always_inline)) __m256i rounded_bf16_bits(__m256 x) {
    const __m256i bits = _mm256_castps_si256(x);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i up = _mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7fff)), odd);
    const __m256i rounded = _mm256_slli_epi32(_mm256_srli_epi32(up, 16), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_NEQ_UQ));
    return _mm256_or_si256(_mm256_andnot_si256(nan, rounded),
                           _mm256_and_si256(nan, _mm256_set1_epi32(0x7fc00000)));
}

// probabilities' pass for one row-head: p_j = bf16(exp(score_j - mx)) stored, and their sum
// lane-wise in sixteens from j = 0, then by hsum's tree.
static inline float probabilities_halves(const float* row, int padded, float mx, uint16_t* probs) {
    const __m256 m = _mm256_set1_ps(mx);
    __m256 total_lo = _mm256_setzero_ps(), total_hi = _mm256_setzero_ps();
    for (int j = 0; j < padded; j += kLanes) {
        const __m256i lo = rounded_bf16_bits(exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(row + j), m)));
        const __m256i hi =
            rounded_bf16_bits(exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(row + j + 8), m)));
        const __m256i narrow = _mm256_packus_epi32(_mm256_srli_epi32(lo, 16), _mm256_srli_epi32(hi, 16));
        _mm256_storeu_si256((__m256i*)(probs + j), _mm256_permute4x64_epi64(narrow, 0xd8));
        total_lo = _mm256_add_ps(total_lo, _mm256_castsi256_ps(lo));
        total_hi = _mm256_add_ps(total_hi, _mm256_castsi256_ps(hi));
    }
    const Halves total = {total_lo, total_hi};
    vf v;
    std::memcpy(&v, &total, sizeof(v));
    return hsum(v);
}
