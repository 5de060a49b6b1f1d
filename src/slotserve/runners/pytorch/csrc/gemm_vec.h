// The projections' GEMM, y = x Wᵀ (+ bias), over vec.h, compiled once per instruction set
// (kernels_<isa>.cpp): AVX512-BF16, AVX-512, AVX2 with FMA (gemm_amx.h serves where AMX is).
//
// The weight is packed once as [N/16][K/2][16 outputs][2 inputs] (zero-padded), the operand
// layout of `vdpbf16ps`: one 64-byte load holds two k-steps of sixteen outputs. Every output is
// one float32 accumulator fed k-pair by k-pair from k = 0 upwards by `dot_pairs` (vdpbf16ps
// where the CPU has it, else its two fused steps under FlushDenormals, which round as the
// instruction does), the bias added, rounded once to bfloat16. A host with AVX2 alone gives the
// tokens an AVX512-BF16 host gives.
//
// Invariant by construction, for every K (no split-K): a row's accumulation order depends on K
// alone; tiles, passes, panels (partial sums stored and reloaded exactly) and threads
// (splitting outputs or rows, never K) decide only which instructions run when.

namespace gemmv {

// Accumulators in registers: AVX-512 has 32 vector registers of 16 lanes, AVX2 16 of 8 (a
// 16-lane vector is two of them), so its tiles are smaller. The shape never changes a bit.
#if SLOTSERVE_AVX512
constexpr int kRowsPerTile = 6;
constexpr int kBlocksPerTile = 4;
#else
constexpr int kRowsPerTile = 4;
constexpr int kBlocksPerTile = 1;
#endif
constexpr int kMaxBlocksPerTile = 4;  // the partial sums' row stride, whatever the tile
constexpr int kRowsPerPass = 96;       // rows whose inputs stay in L2 while a panel is reused
constexpr int64_t kPairsPerPanel = 1024;

using Operands = GemmOperands;

// Sixteen float32 accumulators in registers: one zmm, or two ymm (GCC's 64-byte vector types
// go through memory on AVX2, so the inner loop spells its instructions out).
#if SLOTSERVE_AVX512
struct Acc {
    __m512 v;
};
static inline __attribute__((always_inline)) Acc acc_load(const float* p) {
    return {_mm512_loadu_ps(p)};
}
static inline __attribute__((always_inline)) void acc_store(float* p, Acc a) {
    _mm512_storeu_ps(p, a.v);
}
static inline __attribute__((always_inline)) Acc acc_zero() { return {_mm512_setzero_ps()}; }
// acc + x * w, lane by lane, fused.
static inline __attribute__((always_inline)) Acc acc_fma(__m512 x, Acc w, Acc acc) {
    return {_mm512_fmadd_ps(x, w.v, acc.v)};
}
static inline __attribute__((always_inline)) __m512 broadcast(float x) {
    return _mm512_set1_ps(x);
}
// A block's sixteen pairs at `p` as their odd and their even elements, in float32.
static inline __attribute__((always_inline)) void split_pairs(const uint16_t* p, Acc& odd,
                                                              Acc& even) {
    const vi pairs = load_pairs(p);
    odd = {(__m512)odd_halves(pairs)};
    even = {(__m512)even_halves(pairs)};
}
#else
struct Acc {
    __m256 lo, hi;
};
static inline __attribute__((always_inline)) Acc acc_load(const float* p) {
    return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)};
}
static inline __attribute__((always_inline)) void acc_store(float* p, Acc a) {
    _mm256_storeu_ps(p, a.lo);
    _mm256_storeu_ps(p + 8, a.hi);
}
static inline __attribute__((always_inline)) Acc acc_zero() {
    return {_mm256_setzero_ps(), _mm256_setzero_ps()};
}
static inline __attribute__((always_inline)) Acc acc_fma(__m256 x, Acc w, Acc acc) {
    return {_mm256_fmadd_ps(x, w.lo, acc.lo), _mm256_fmadd_ps(x, w.hi, acc.hi)};
}
static inline __attribute__((always_inline)) __m256 broadcast(float x) {
    return _mm256_set1_ps(x);
}
static inline __attribute__((always_inline)) void split_pairs(const uint16_t* p, Acc& odd,
                                                              Acc& even) {
    const __m256i lo = _mm256_loadu_si256((const __m256i*)p);
    const __m256i hi = _mm256_loadu_si256((const __m256i*)(p + 16));
    const __m256i high = _mm256_set1_epi32(int(0xffff0000u));
    odd = {_mm256_castsi256_ps(_mm256_and_si256(lo, high)),
           _mm256_castsi256_ps(_mm256_and_si256(hi, high))};
    even = {_mm256_castsi256_ps(_mm256_slli_epi32(lo, 16)),
            _mm256_castsi256_ps(_mm256_slli_epi32(hi, 16))};
}
#endif

// The input pair (x[2kp], x[2kp + 1]) of a row, a zero beside the last input of an odd K (the
// packed weight holds a zero there too).
static inline __attribute__((always_inline)) const uint16_t* pair_at(const uint16_t* row,
                                                                    int64_t kp, int64_t k,
                                                                    uint16_t* spare) {
    if (2 * kp + 1 < k) return row + 2 * kp;
    spare[0] = row[2 * kp];
    spare[1] = 0;
    return spare;
}

// Rows [m, m + MR) against NB blocks from block b, input pairs [kp0, kp1); between panels the
// accumulators wait in `partial` (float32, exact). `valid`: outputs of the last block that exist.
template <int MR, int NB>
static void tile(const Operands& op, int64_t m, int64_t b, int64_t kp0, int64_t kp1,
                 float* partial, int valid) {
    const int64_t k_pairs = (op.k + 1) / 2;
    const uint16_t* x = op.x + m * op.x_stride;
    const uint16_t* w = op.w + b * op.block_stride;
    constexpr int kStride = kMaxBlocksPerTile * kLanes;
    uint16_t spare[MR][2];
#if SLOTSERVE_BF16
    vf acc[MR][NB];
    for (int r = 0; r < MR; ++r)
        for (int j = 0; j < NB; ++j)
            acc[r][j] = kp0 == 0 ? splat(0.0f) : load_f32(partial + r * kStride + j * kLanes);
    for (int64_t kp = kp0; kp < kp1; ++kp) {
        vi wv[NB];
        for (int j = 0; j < NB; ++j) wv[j] = load_pairs(w + j * op.block_stride + kp * 32);
        for (int r = 0; r < MR; ++r) {
            // The pair broadcast to a register, not dot_pairs_splat's asm memory operand: the
            // asm statements keep GCC from scheduling this tile's 24 dot products well.
            const vi a = splat_pair(pair_at(x + r * op.x_stride, kp, op.k, spare[r]));
            for (int j = 0; j < NB; ++j) acc[r][j] = dot_pairs(acc[r][j], a, wv[j]);
        }
    }
#else
    // dot_pairs' two fused steps (the odd elements first), the weights split once for every
    // row of the tile and a row's pair once for every block.
    Acc sums[MR][NB];
    for (int r = 0; r < MR; ++r)
        for (int j = 0; j < NB; ++j)
            sums[r][j] = kp0 == 0 ? acc_zero() : acc_load(partial + r * kStride + j * kLanes);
    for (int64_t kp = kp0; kp < kp1; ++kp) {
        Acc odd[NB], even[NB];
        for (int j = 0; j < NB; ++j) split_pairs(w + j * op.block_stride + kp * 32, odd[j], even[j]);
        for (int r = 0; r < MR; ++r) {
            const uint16_t* pair = pair_at(x + r * op.x_stride, kp, op.k, spare[r]);
            const auto x_odd = broadcast(bf16_to_f32(pair[1]));
            const auto x_even = broadcast(bf16_to_f32(pair[0]));
            for (int j = 0; j < NB; ++j)
                sums[r][j] = acc_fma(x_even, even[j], acc_fma(x_odd, odd[j], sums[r][j]));
        }
    }
    vf acc[MR][NB];
    for (int r = 0; r < MR; ++r)
        for (int j = 0; j < NB; ++j) {
            alignas(64) float lanes[kLanes];
            acc_store(lanes, sums[r][j]);
            acc[r][j] = load_f32(lanes);
        }
#endif
    if (kp1 < k_pairs) {
        for (int r = 0; r < MR; ++r)
            for (int j = 0; j < NB; ++j) store_f32(partial + r * kStride + j * kLanes, acc[r][j]);
        return;
    }
    for (int r = 0; r < MR; ++r)
        for (int j = 0; j < NB; ++j) {
            vf v = acc[r][j];
            if (op.bias != nullptr) v += load_f32(op.bias + (b + j) * kLanes);
            uint16_t* out = op.out + (m + r) * op.n + (b + j) * kLanes;
            const int lanes = j == NB - 1 ? valid : kLanes;
            if (lanes == kLanes) {
                store_bf16(out, v);
            } else {
                uint16_t whole[kLanes];
                store_bf16(whole, v);
                std::memcpy(out, whole, lanes * sizeof(uint16_t));
            }
        }
}

template <int NB>
static void rows_tile(int rows, const Operands& op, int64_t m, int64_t b, int64_t kp0,
                      int64_t kp1, float* partial, int valid) {
    switch (rows) {
        case 6:
            if constexpr (kRowsPerTile >= 6) return tile<6, NB>(op, m, b, kp0, kp1, partial, valid);
            [[fallthrough]];
        case 5:
            if constexpr (kRowsPerTile >= 5) return tile<5, NB>(op, m, b, kp0, kp1, partial, valid);
            [[fallthrough]];
        case 4: return tile<4, NB>(op, m, b, kp0, kp1, partial, valid);
        case 3: return tile<3, NB>(op, m, b, kp0, kp1, partial, valid);
        case 2: return tile<2, NB>(op, m, b, kp0, kp1, partial, valid);
        default: return tile<1, NB>(op, m, b, kp0, kp1, partial, valid);
    }
}

// A tile of `nb` blocks (at most kBlocksPerTile: larger shapes are never instantiated where
// they would not fit the registers).
static void any_tile(int nb, int rows, const Operands& op, int64_t m, int64_t b, int64_t kp0,
                     int64_t kp1, float* partial, int valid) {
    if constexpr (kBlocksPerTile >= 4)
        if (nb == 4) return rows_tile<4>(rows, op, m, b, kp0, kp1, partial, valid);
    if constexpr (kBlocksPerTile >= 3)
        if (nb == 3) return rows_tile<3>(rows, op, m, b, kp0, kp1, partial, valid);
    if constexpr (kBlocksPerTile >= 2)
        if (nb == 2) return rows_tile<2>(rows, op, m, b, kp0, kp1, partial, valid);
    rows_tile<1>(rows, op, m, b, kp0, kp1, partial, valid);
}

// Output blocks [b0, b1) for every row: passes of rows, and within a pass each tile's weight
// panel (up to kPairsPerPanel input pairs) reused by every row of the pass.
static void blocks(const Operands& op, int64_t rows, int64_t b0, int64_t b1) {
    FlushDenormals flush;  // the emulated dot product's rounding rule (vec.h)
    const int64_t k_pairs = (op.k + 1) / 2;
    std::vector<float> partial(kRowsPerPass * kMaxBlocksPerTile * kLanes);
    for (int64_t m0 = 0; m0 < rows; m0 += kRowsPerPass) {
        const int64_t m1 = std::min(rows, m0 + kRowsPerPass);
        for (int64_t b = b0; b < b1; b += kBlocksPerTile) {
            const int nb = int(std::min<int64_t>(kBlocksPerTile, b1 - b));
            const int valid = int(std::min<int64_t>(kLanes, op.n - (b + nb - 1) * kLanes));
            for (int64_t kp0 = 0; kp0 < k_pairs; kp0 += kPairsPerPanel) {
                const int64_t kp1 = std::min(k_pairs, kp0 + kPairsPerPanel);
                for (int64_t m = m0; m < m1; m += kRowsPerTile) {
                    const int mr = int(std::min<int64_t>(kRowsPerTile, m1 - m));
                    float* part = partial.data() + (m - m0) * kMaxBlocksPerTile * kLanes;
                    any_tile(nb, mr, op, m, b, kp0, kp1, part, valid);
                }
            }
        }
    }
}

}  // namespace gemmv
