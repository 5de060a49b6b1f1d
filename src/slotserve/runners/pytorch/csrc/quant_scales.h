// The float half of quant_gemm.h's arithmetic, compiled once per instruction set after
// quant_pairs.h (kernels_<isa>.cpp): a sub-block's scale and minimum per output, and a row's
// running sum after the sub-block. The vector path (quant_gemm.h) and the tiles (quant_amx.h)
// both take these, so their rows' bits agree.

namespace quant {

// Sub-block s's scale (d · sc) and minimum (dmin · m) per output, of the super-block whose
// record is at `record` and whose d and dmin are widened; without sub-blocks sc and m are one:
// d and dmin are the scale and the minimum.
struct SubBlockScales {
    Acc scale, min;
};
template <bool MIN, int SUB, int SUPER>
static inline __attribute__((always_inline)) SubBlockScales sub_block_scales(const uint8_t* record,
                                                                             Acc d, Acc dmin,
                                                                             int s) {
    constexpr int kSubBlocks = SUPER / SUB;
    const uint8_t* sc = record + 32 * (MIN ? 2 : 1);
    SubBlockScales w{d, acc_zero()};
    if constexpr (kSubBlocks > 1)
        w.scale = acc_mul(d, widen_i8(_mm_loadu_si128((const __m128i*)(sc + 16 * s))));
    if constexpr (MIN) {
        w.min = dmin;
        if constexpr (kSubBlocks > 1) {
            const __m128i m = _mm_loadu_si128((const __m128i*)(sc + 16 * (kSubBlocks + s)));
            w.min = acc_mul(w.min, widen_u8(m));
        }
    }
    return w;
}

// A row's running sum after one sub-block: its int32 sums scaled in the two fused steps
// quant_gemm.h's comment states.
template <bool MIN>
static inline __attribute__((always_inline)) Acc scaled_into(Acc running, Sums sums,
                                                             const SubBlockScales& w, float step,
                                                             float neg_sum) {
    const Acc sum = acc_fma_v(acc_mul(w.scale, broadcast(step)), sums_float(sums), running);
    if constexpr (MIN) return acc_fma(broadcast(neg_sum), acc_mul(w.min, broadcast(step)), sum);
    return sum;
}

}  // namespace quant
