// The per-row kernels, written once over vec.h and compiled once per instruction set
// (kernels_<isa>.cpp). Each function computes whole rows (a token, or a token and KV head) from
// raw pointers; the caller decides which rows run on which thread. A row's result depends on
// its own inputs and on fixed constants (vector width, attention partition size) only: never on
// the other rows of the call, their lengths, or the thread count. That is the batch-invariance
// argument for everything in this file.

// ---- RMSNorm --------------------------------------------------------------------------------

// 1 / sqrt(mean(x²) + eps) over one row, summed lane-wise then by a fixed tree.
static inline float inverse_rms(const float* x, int n, float eps) {
    vf acc = splat(0.0f);
    int i = 0;
    for (; i + kLanes <= n; i += kLanes) {
        vf v = load_f32(x + i);
        acc += v * v;
    }
    float total = hsum(acc);
    for (; i < n; ++i) total += x[i] * x[i];
    return 1.0f / std::sqrt(total / float(n) + eps);
}

// The norm of a float32 row into bfloat16, rounded as the reference rounds: Llama-style weights
// multiply the bfloat16-rounded normalised value (``w * x.to(bf16)``), ``plus_one`` weights
// (Gemma, Qwen3.5) multiply ``1 + w`` in float32.
static void norm_row(const float* x, int n, const uint16_t* weight, float eps, bool plus_one,
                     uint16_t* out) {
    const float r = inverse_rms(x, n, eps);
    int i = 0;
    for (; i + kLanes <= n; i += kLanes) {
        vf normed = load_f32(x + i) * r;
        vf w = load_bf16(weight + i);
        store_bf16(out + i, plus_one ? normed * (w + 1.0f) : round_bf16(normed) * w);
    }
    for (; i < n; ++i) {
        float normed = x[i] * r, w = bf16_to_f32(weight[i]);
        out[i] = f32_to_bf16(plus_one ? normed * (w + 1.0f) : round_bf16(normed) * w);
    }
}

// residual' = bf16(x + residual) (kept for the next layer), out = norm(residual').
static void add_norm_row(const uint16_t* x, const uint16_t* residual, int n,
                         const uint16_t* weight, float eps, bool plus_one, uint16_t* residual_out,
                         uint16_t* out, float* scratch) {
    int i = 0;
    for (; i + kLanes <= n; i += kLanes) {
        vf sum = round_bf16(load_bf16(x + i) + load_bf16(residual + i));
        store_bf16(residual_out + i, sum);
        store_f32(scratch + i, sum);
    }
    for (; i < n; ++i) {
        float sum = round_bf16(bf16_to_f32(x[i]) + bf16_to_f32(residual[i]));
        residual_out[i] = f32_to_bf16(sum);
        scratch[i] = sum;
    }
    norm_row(scratch, n, weight, eps, plus_one, out);
}

static void norm_bf16_row(const uint16_t* x, int n, const uint16_t* weight, float eps,
                          bool plus_one, uint16_t* out, float* scratch) {
    int i = 0;
    for (; i + kLanes <= n; i += kLanes) store_f32(scratch + i, load_bf16(x + i));
    for (; i < n; ++i) scratch[i] = bf16_to_f32(x[i]);
    norm_row(scratch, n, weight, eps, plus_one, out);
}

// ---- SiLU(gate) · up ------------------------------------------------------------------------

// bf16(silu(g)) * up, rounded after each operator as ``F.silu(g) * up`` is in bfloat16.
static void silu_mul_row(const uint16_t* gate, const uint16_t* up, int n, uint16_t* out) {
    int i = 0;
    for (; i + kLanes <= n; i += kLanes) {
        vf g = load_bf16(gate + i);
        vf silu = round_bf16(g / (vexp(-g) + 1.0f));
        store_bf16(out + i, silu * load_bf16(up + i));
    }
    for (; i < n; ++i) {
        float g = bf16_to_f32(gate[i]);
        float silu = round_bf16(g / (sexp(-g) + 1.0f));
        out[i] = f32_to_bf16(silu * bf16_to_f32(up[i]));
    }
}

// ---- Rotary embedding, q/k norms, the K/V write ---------------------------------------------

// One head of one token: optional RMSNorm over the head, then rotate-half rotary embedding on
// its first ``rotary_dim`` dims (HF's convention), rounded to bfloat16 once per step as the
// reference rounds each operator: norm, then the rotary in float32 from the rounded values.
static void rotate_head(const uint16_t* in, const uint16_t* norm, const HeadLayout& l,
                        const uint16_t* cos, const uint16_t* sin, uint16_t* out, float* scratch) {
    const int d = l.head_dim;
    float* x = scratch;
    for (int i = 0; i < d; ++i) x[i] = bf16_to_f32(in[i]);
    if (norm != nullptr) {
        uint16_t* normed = reinterpret_cast<uint16_t*>(scratch + d);
        norm_row(x, d, norm, l.eps, l.plus_one, normed);
        for (int i = 0; i < d; ++i) x[i] = bf16_to_f32(normed[i]);
    }
    const int half = l.rotary_dim / 2;
    int i = 0;
    if (half % kLanes == 0) {
        for (; i < half; i += kLanes) {
            vf a = load_f32(x + i), b = load_f32(x + half + i);
            vf c1 = load_bf16(cos + i), s1 = load_bf16(sin + i);
            vf c2 = load_bf16(cos + half + i), s2 = load_bf16(sin + half + i);
            store_bf16(out + i, a * c1 - b * s1);
            store_bf16(out + half + i, b * c2 + a * s2);
        }
    }
    for (; i < half; ++i) {
        float a = x[i], b = x[half + i];
        out[i] = f32_to_bf16(a * bf16_to_f32(cos[i]) - b * bf16_to_f32(sin[i]));
        out[half + i] =
            f32_to_bf16(b * bf16_to_f32(cos[half + i]) + a * bf16_to_f32(sin[half + i]));
    }
    for (int j = l.rotary_dim; j < d; ++j) out[j] = f32_to_bf16(x[j]);
}

// One token: its query heads into ``q_out`` ([heads, head_dim]), its key heads (normed,
// rotated) and value heads into the pool row ``cache_row`` ([kv_heads, head_dim] each).
static void rotary_token(const uint16_t* qkv, const HeadLayout& l, const uint16_t* cos,
                         const uint16_t* sin, uint16_t* q_out, uint16_t* key_row,
                         uint16_t* value_row, float* scratch) {
    const int d = l.head_dim;
    const int q_stride = l.gated ? 2 * d : d;
    for (int h = 0; h < l.heads; ++h)
        rotate_head(qkv + h * q_stride, l.q_norm, l, cos, sin, q_out + h * d, scratch);
    const uint16_t* keys = qkv + l.heads * q_stride;
    const uint16_t* values = keys + l.kv_heads * d;
    for (int h = 0; h < l.kv_heads; ++h)
        rotate_head(keys + h * d, l.k_norm, l, cos, sin, key_row + h * d, scratch);
    std::memcpy(value_row, values, sizeof(uint16_t) * l.kv_heads * d);
}

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
constexpr int kPrefetch = 16;       // keys ahead, to level 1, in a lone row (attend_row_t)
constexpr int kFarPrefetch = 96;    // keys ahead, to level 2
constexpr int kValuePrefetch = 32;  // values ahead, to level 2, during the scores

#if !SLOTSERVE_AVX512
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

template <int C>
static inline __attribute__((always_inline)) void load_value_pair(const uint16_t* even,
                                                                  const uint16_t* odd,
                                                                  int chunks,
                                                                  ValuePairOf<C>& out) {
#if SLOTSERVE_BF16
    // Lane l of the low (high) result: dimension l (16 + l) of ``even`` and of ``odd``.
    const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9,
                                        40, 8, 39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1,
                                        32, 0);
    const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    int c = 0;
    for (; c + 2 <= chunks; c += 2) {
        const __m512i a = _mm512_loadu_si512(even + c * kLanes);
        const __m512i b = odd ? _mm512_loadu_si512(odd + c * kLanes) : _mm512_setzero_si512();
        out.pairs[c] = (vi)_mm512_permutex2var_epi16(a, lo, b);
        out.pairs[c + 1] = (vi)_mm512_permutex2var_epi16(a, hi, b);
    }
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

// N vectors of bfloat16 probabilities exp(score - mx), added to ``total`` in order.
template <int N>
static inline __attribute__((always_inline)) void probabilities(const float* scores, float mx,
                                                                uint16_t* probs, vf& total) {
    vf e[N];
    for (int i = 0; i < N; ++i) e[i] = load_f32(scores + i * kLanes) - mx;
    vexp_n<N, true>(e);
    for (int i = 0; i < N; ++i) e[i] = store_rounded_bf16(probs + i * kLanes, e[i]);
    for (int i = 0; i < N; ++i) total += e[i];
}

// Each row-head's largest score, its bfloat16 probabilities and their sum (from the rounded
// values), over its n keys; its acc zeroed.
static inline void softmax_rows(float* scores, uint16_t* probs, int heads, int group,
                                const int* n, int d, float* m, float* s, float* acc) {
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
#else
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
        for (; j + 4 * kLanes <= padded; j += 4 * kLanes)
            probabilities<4>(row + j, m[rh], p + j, total);
        for (; j < padded; j += kLanes) probabilities<1>(row + j, m[rh], p + j, total);
        s[rh] = hsum(total);
#else
        s[rh] = probabilities_halves(row, padded, m[rh], p);
#endif
        for (int c = 0; c < d; c += kLanes) store_f32(acc + int64_t(rh) * d + c, splat(0.0f));
    }
}

// A tile's rows, scratch and results for one partition (kernel_types.h's Tile), and the pool
// offsets of the partition's keys.
static inline void key_offsets(const PagedKv& kv, int kv_head, const int32_t* table, int start,
                               int count, int64_t* offsets) {
    const int64_t stride = int64_t(kv.kv_heads) * kv.head_dim;
    for (int j = 0, block = start / kv.block_size, within = start % kv.block_size; j < count;
         ++block) {
        const int64_t base =
            int64_t(table[block]) * kv.block_size * stride + int64_t(kv_head) * kv.head_dim;
        for (; within < kv.block_size && j < count; ++within, ++j) offsets[j] = base + within * stride;
        within = 0;
    }
}

// One row (``t.rows`` == 1) of ``G`` query heads (0: ``t.group``) reading its keys in place.
template <int CH, int G>
static void attend_row_t(const PagedKv& kv, int kv_head, const int32_t* table, const Tile& t) {
    const int d = CH ? CH * kLanes : kv.head_dim, chunks = d / kLanes, group = G ? G : t.group;
    const int pairs = d / 2, pair_chunks = (pairs + kLanes - 1) / kLanes, n = t.n[0];
    int64_t offsets[kPartition];
    key_offsets(kv, kv_head, table, t.start, n, offsets);
    // Keys and values are scattered over the pool's blocks, which defeats the hardware's
    // prefetchers, and a lone row computes too little per key to hide a memory access: keys
    // are fetched to the level-2 cache kFarPrefetch ahead and to level 1 kPrefetch ahead,
    // values to level 2 kValuePrefetch ahead while the scores are computed.
    auto prefetch = [&](const uint16_t* base, int j) {
        const char* row = (const char*)(base + offsets[j]);
        for (int line = 0; line < d * 2; line += 64) __builtin_prefetch(row + line);
    };
    auto prefetch_far = [&](const uint16_t* base, int j) {
        const char* row = (const char*)(base + offsets[j]);
        for (int line = 0; line < d * 2; line += 64) __builtin_prefetch(row + line, 0, 1);
    };
    for (int j = 0; j < kPrefetch && j < n; ++j) prefetch(kv.keys, j);
    for (int j = kPrefetch; j < kFarPrefetch && j < n; ++j) prefetch_far(kv.keys, j);
    for (int j = 0; j < kValuePrefetch && j < n; ++j) prefetch_far(kv.values, j);
    vf partial[kMaxGroup * kLanes];
    for (int j0 = 0; j0 < n; j0 += kLanes) {
        const int count = std::min(kLanes, n - j0);
        for (int jj = 0; jj < count; ++jj) {
            const int j = j0 + jj;
            if (j + kPrefetch < n) prefetch(kv.keys, j + kPrefetch);
            if (j + kFarPrefetch < n) prefetch_far(kv.keys, j + kFarPrefetch);
            if (j + kValuePrefetch < n) prefetch_far(kv.values, j + kValuePrefetch);
            const uint16_t* key = kv.keys + offsets[j];
            vi k[kMaxPairChunks];
            for (int c = 0; c < pair_chunks; ++c) k[c] = pair_chunk(key, c, pairs);
#if SLOTSERVE_AVX512
            for (int g = 0; g < group; ++g) {
                const uint16_t* q = t.q + int64_t(g) * t.q_stride;
                vf x = splat(0.0f);
                for (int c = 0; c < pair_chunks; ++c)
                    x = dot_pairs(x, load_pairs(q + 2 * c * kLanes), k[c]);
                partial[g * kLanes + jj] = x;
            }
#else
            for (int g = 0; g < group; ++g)
                partial[g * kLanes + jj] =
                    dot_pairs_halves(t.q + int64_t(g) * t.q_stride, k, pair_chunks);
#endif
        }
        for (int g = 0; g < group; ++g) {
            for (int jj = count; jj < kLanes; ++jj) partial[g * kLanes + jj] = splat(0.0f);
            store_f32(t.scores + int64_t(g) * kScoreStride + j0,
                      sum_lanes_of_16(partial + g * kLanes) * t.scale);
        }
    }
    softmax_rows(t.scores, t.probs, group, group, t.n, d, t.m, t.s, t.acc);
    ValuePair v;
#if !SLOTSERVE_AVX512
    // softmax_rows zeroed t.acc (a lone row has keys in each partition it is given): each
    // head's sums run there, a key pair at a time.
    for (int j = 0; j < n; j += 2) {
        load_value_pair(kv.values + offsets[j], j + 1 < n ? kv.values + offsets[j + 1] : nullptr,
                        chunks, v);
        for (int g = 0; g < group; ++g)
            value_pairs_halves<CH>(t.acc + g * d, chunks, t.probs + g * (kPartition + 2) + j, &v,
                                   1, false);
    }
#else
    if constexpr (G > 0 && CH > 0 && G * CH <= 24) {
        vf out[G][CH];
        for (int g = 0; g < G; ++g)
            for (int c = 0; c < CH; ++c) out[g][c] = splat(0.0f);
        for (int j = 0; j < n; j += 2) {
            load_value_pair(kv.values + offsets[j], j + 1 < n ? kv.values + offsets[j + 1] : nullptr,
                            CH, v);
            for (int g = 0; g < G; ++g) value_pair(out[g], CH, t.probs + g * (kPartition + 2) + j, v);
        }
        for (int g = 0; g < G; ++g)
            for (int c = 0; c < CH; ++c) store_f32(t.acc + g * d + c * kLanes, out[g][c]);
    } else {
        for (int g = 0; g < group; ++g) {
            vf out[kMaxChunks];
            for (int c = 0; c < chunks; ++c) out[c] = splat(0.0f);
            for (int j = 0; j < n; j += 2) {
                load_value_pair(kv.values + offsets[j],
                                j + 1 < n ? kv.values + offsets[j + 1] : nullptr, chunks, v);
                value_pair(out, chunks, t.probs + g * (kPartition + 2) + j, v);
            }
            for (int c = 0; c < chunks; ++c) store_f32(t.acc + g * d + c * kLanes, out[c]);
        }
    }
#endif
}

// Scores of sixteen transposed keys (``kt``: vector 16c + l holds pair 16c + l of each key) for
// R row-heads (``q``: R rows ``stride`` apart), written R rows of kScoreStride apart: the x_l of
// R row-heads at a time, so each key vector is loaded once, then the tree as vector adds.
template <int R>
static inline __attribute__((always_inline)) void score_keys(const uint16_t* q, int stride,
                                                             int pair_chunks, const vi* kt,
                                                             float scale, float* out) {
    auto x = [&](int l, vf* X) {
        for (int r = 0; r < R; ++r) X[r] = splat(0.0f);
        for (int c = 0; c < pair_chunks; ++c) {
            const vi k = kt[c * kLanes + l];
            for (int r = 0; r < R; ++r)
                X[r] = dot_pairs_splat(X[r], q + r * stride + 2 * (c * kLanes + l), k);
        }
    };
    auto pair = [&](int l, vf* P) {
        vf a[R], b[R];
        x(l, a);
        x(l + 8, b);
        for (int r = 0; r < R; ++r) P[r] = a[r] + b[r];
    };
    auto quad = [&](int l, vf* Q) {
        vf a[R], b[R];
        pair(l, a);
        pair(l + 4, b);
        for (int r = 0; r < R; ++r) Q[r] = a[r] + b[r];
    };
    vf w0[R], w1[R], t[R];
    quad(0, w0);
    quad(2, t);
    for (int r = 0; r < R; ++r) w0[r] = w0[r] + t[r];
    quad(1, w1);
    quad(3, t);
    for (int r = 0; r < R; ++r) store_f32(out + r * kScoreStride, (w0[r] + (w1[r] + t[r])) * scale);
}

// A tile of rows (see Tile), ``G`` query heads each (0: ``t.group``).
template <int CH, int G>
static void attend_tile_t(const PagedKv& kv, int kv_head, const int32_t* table, const Tile& t) {
    const int d = CH ? CH * kLanes : kv.head_dim, chunks = d / kLanes, group = G ? G : t.group;
    const int pairs = d / 2, pair_chunks = (pairs + kLanes - 1) / kLanes;
    const int rows = t.rows, heads = rows * group, n_max = t.n[rows - 1];
    vi* const keys_t = static_cast<vi*>(t.keys_t);
    // With ``keys_ready``, the partition's keys stay transposed in ``keys_t`` (sixteen at a
    // place) for the next tile of the same rows' chunk, which transposes only the keys past
    // those: every whole group of sixteen this tile read.
    const int ready = t.keys_ready ? *t.keys_ready : 0;
    // The value pass takes the keys in blocks of kBlockPairs pairs (their values ~8 KiB, in
    // the level-1 cache beside a row's accumulators): each row's accumulators are loaded and
    // stored once a block.
    using Values = ValuePairOf<CH ? CH : kMaxChunks>;
    constexpr int kBlockPairs = std::clamp<int>(8192 / int(sizeof(Values)), 8, 32);
    constexpr int kBlockKeys = 2 * kBlockPairs;
    static_assert(kBlockPairs * sizeof(Values) <= kVectorScratch - kKeysBytes,
                  "a block of key pairs' values fits the vector scratch");
    Values* values = static_cast<Values*>(t.values);
    int64_t offsets[kPartition];
    key_offsets(kv, kv_head, table, t.start, n_max, offsets);
    // Keys and values are scattered over the pool's blocks: each pass prefetches the next
    // sixteen rows it reads.
    auto prefetch = [&](const uint16_t* base, int j0) {
        for (int j = j0; j < std::min(j0 + kLanes, n_max); ++j)
            for (int line = 0; line < d * 2; line += 64)
                __builtin_prefetch((const char*)(base + offsets[j]) + line);
    };
    if (ready == 0) prefetch(kv.keys, 0);
    // Scores, sixteen keys at a time (rows that end before a group skip it).
    for (int j0 = 0, first = 0; j0 < n_max; j0 += kLanes) {
        const int count = std::min(kLanes, n_max - j0);
        vi* kt = t.keys_ready ? keys_t + j0 / kLanes * pair_chunks * kLanes : keys_t;
        if (j0 + kLanes >= ready) prefetch(kv.keys, j0 + kLanes);
        for (int c = 0; c < pair_chunks && j0 >= ready; ++c) {
            vi block[kLanes];
            for (int jj = 0; jj < kLanes; ++jj)
                block[jj] = jj < count ? pair_chunk(kv.keys + offsets[j0 + jj], c, pairs) : vi{};
            transpose_16(block);
            for (int l = 0; l < kLanes; ++l) kt[c * kLanes + l] = block[l];
        }
        while (t.n[first] <= j0) ++first;
        int rh = first * group;
        const uint16_t* q = t.q + int64_t(rh) * t.q_stride;
        float* out = t.scores + int64_t(rh) * kScoreStride + j0;
#if SLOTSERVE_AVX512
        for (; rh + 4 <= heads; rh += 4, q += 4 * t.q_stride, out += 4 * kScoreStride)
            score_keys<4>(q, t.q_stride, pair_chunks, kt, t.scale, out);
        switch (heads - rh) {
            case 3: score_keys<3>(q, t.q_stride, pair_chunks, kt, t.scale, out); break;
            case 2: score_keys<2>(q, t.q_stride, pair_chunks, kt, t.scale, out); break;
            case 1: score_keys<1>(q, t.q_stride, pair_chunks, kt, t.scale, out); break;
        }
#else
        for (; rh + 2 <= heads; rh += 2, q += 2 * t.q_stride, out += 2 * kScoreStride)
            score_keys_halves<2>(q, t.q_stride, pair_chunks, kt, t.scale, out);
        if (rh < heads) score_keys_halves<1>(q, t.q_stride, pair_chunks, kt, t.scale, out);
#endif
    }
    if (t.keys_ready) *t.keys_ready = std::max(ready, n_max / kLanes * kLanes);
    softmax_rows(t.scores, t.probs, heads, group, t.n, d, t.m, t.s, t.acc);
    // Values, a block at a time, each sixteen keys prefetched while the sixteen before them
    // are read. A row whose keys end inside a pair takes it with no odd value, as the row alone
    // does.
    prefetch(kv.values, 0);
    for (int j0 = 0, first = 0; j0 < n_max; j0 += kBlockKeys) {
        const int count = std::min(kBlockKeys, n_max - j0);
        for (int i = 0; 2 * i < count; ++i) {
            if (i % (kLanes / 2) == 0) prefetch(kv.values, j0 + 2 * i + kLanes);
            load_value_pair(kv.values + offsets[j0 + 2 * i],
                            2 * i + 1 < count ? kv.values + offsets[j0 + 2 * i + 1] : nullptr,
                            chunks, values[i]);
        }
        while (t.n[first] <= j0) ++first;
        for (int r = first; r < rows; ++r) {
            const int mine = std::min(count, t.n[r] - j0), whole = mine / 2;
            const bool half = mine % 2 != 0;
            const uint16_t* probs = t.probs + int64_t(r) * group * (kPartition + 2) + j0;
            float* acc = t.acc + int64_t(r) * group * d;
#if !SLOTSERVE_AVX512
            for (int g = 0; g < group; ++g)
                value_pairs_halves<CH>(acc + g * d, chunks, probs + g * (kPartition + 2), values,
                                       whole, half);
#else
            if constexpr (G > 0 && CH > 0 && G * CH <= 24) {
                vf out[G][CH];
                for (int g = 0; g < G; ++g)
                    for (int c = 0; c < CH; ++c) out[g][c] = load_f32(acc + g * d + c * kLanes);
                for (int i = 0; i < whole; ++i)
                    for (int g = 0; g < G; ++g)
                        value_pair(out[g], CH, probs + g * (kPartition + 2) + 2 * i, values[i]);
                if (half)
                    for (int g = 0; g < G; ++g)
                        value_pair(out[g], CH, probs + g * (kPartition + 2) + 2 * whole,
                                   values[whole], true);
                for (int g = 0; g < G; ++g)
                    for (int c = 0; c < CH; ++c) store_f32(acc + g * d + c * kLanes, out[g][c]);
            } else {
                for (int g = 0; g < group; ++g) {
                    vf out[kMaxChunks];
                    for (int c = 0; c < chunks; ++c) out[c] = load_f32(acc + g * d + c * kLanes);
                    const uint16_t* p = probs + g * (kPartition + 2);
                    for (int i = 0; i < whole; ++i) value_pair(out, chunks, p + 2 * i, values[i]);
                    if (half) value_pair(out, chunks, p + 2 * whole, values[whole], true);
                    for (int c = 0; c < chunks; ++c) store_f32(acc + g * d + c * kLanes, out[c]);
                }
            }
#endif
        }
    }
}

#define SLOTSERVE_ATTEND(CH, G) \
    return t.rows == 1 ? attend_row_t<CH, G>(kv, kv_head, table, t) \
                       : attend_tile_t<CH, G>(kv, kv_head, table, t)

// One partition of a tile or a lone row: every row-head's m, s and acc (see Tile).
static void attend_tile(const PagedKv& kv, int kv_head, const int32_t* table, const Tile& t) {
    switch (kv.head_dim / kLanes * 100 + t.group) {
        case 401: SLOTSERVE_ATTEND(4, 1);
        case 402: SLOTSERVE_ATTEND(4, 2);
        case 403: SLOTSERVE_ATTEND(4, 3);
        case 404: SLOTSERVE_ATTEND(4, 4);
        case 405: SLOTSERVE_ATTEND(4, 5);
        case 406: SLOTSERVE_ATTEND(4, 6);
        case 801: SLOTSERVE_ATTEND(8, 1);
        case 802: SLOTSERVE_ATTEND(8, 2);
        case 803: SLOTSERVE_ATTEND(8, 3);
        case 1601: SLOTSERVE_ATTEND(16, 1);
        default: SLOTSERVE_ATTEND(0, 0);
    }
}
#undef SLOTSERVE_ATTEND

// Merges a token's partitions in their order: out = Σ e^(m_i - M) acc_i / Σ e^(m_i - M) s_i.
// ``m`` and ``s``: ``ms_stride`` floats from one partition to the next; ``acc``: ``part_stride``.
static void merge_partitions(const float* m, const float* s, const float* acc, int parts,
                             int group, int d, int ms_stride, int part_stride, uint16_t* out) {
    const int chunks = d / kLanes;
    for (int g = 0; g < group; ++g) {
        float best = -INFINITY;
        for (int i = 0; i < parts; ++i) best = std::max(best, m[i * ms_stride + g]);
        float total = 0.0f;
        vf sum[kMaxChunks];
        for (int c = 0; c < chunks; ++c) sum[c] = splat(0.0f);
        // The weights sixteen partitions at a time, each lane as sexp would give it.
        for (int i0 = 0; i0 < parts; i0 += kLanes) {
            const int count = std::min(kLanes, parts - i0);
            float w[kLanes] = {};
            for (int i = 0; i < count; ++i) w[i] = m[(i0 + i) * ms_stride + g] - best;
            store_f32(w, vexp(load_f32(w)));
            for (int i = 0; i < count; ++i) {
                const int64_t part = i0 + i;
                total += w[i] * s[part * ms_stride + g];
                for (int c = 0; c < chunks; ++c)
                    sum[c] += w[i] * load_f32(acc + part * part_stride + g * d + c * kLanes);
            }
        }
        for (int c = 0; c < chunks; ++c) store_bf16(out + g * d + c * kLanes, sum[c] / total);
    }
}
