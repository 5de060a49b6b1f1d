// Portable 16-lane float vectors (GCC vector extensions) and the bfloat16 conversions every
// kernel uses. Included once per instruction set, inside that set's `#pragma GCC target`
// region and namespace (kernels_<isa>.cpp): the same source compiles to one zmm or two ymm
// operations, so both paths share one definition of every computation.
//
// NOTE: nothing here may depend on how many rows a call holds or which thread runs it. Every
// reduction below runs in an order fixed by the vector width and the length reduced.

typedef float vf __attribute__((vector_size(64)));
typedef uint32_t vu __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));

constexpr int kLanes = 16;

static inline __attribute__((always_inline)) vf splat(float x) {
    return vf{} + x;
}

// The widening and narrowing in intrinsics: GCC lowers __builtin_convertvector between these
// sizes through 128-bit halves.
static inline __attribute__((always_inline)) vf load_bf16(const uint16_t* p) {
#if SLOTSERVE_AVX512
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p));
    return (vf)_mm512_slli_epi32(wide, 16);
#else
    const __m256i lo = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16);
    const __m256i hi =
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(p + 8))), 16);
    vf v;
    std::memcpy(&v, &lo, 32);
    std::memcpy(reinterpret_cast<char*>(&v) + 32, &hi, 32);
    return v;
#endif
}

static inline __attribute__((always_inline)) void store_u16(uint16_t* p, vu x) {
#if SLOTSERVE_AVX512
    _mm256_storeu_si256((__m256i*)p, _mm512_cvtepi32_epi16((__m512i)x));
#else
    __m256i lo, hi;
    std::memcpy(&lo, &x, 32);
    std::memcpy(&hi, reinterpret_cast<const char*>(&x) + 32, 32);
    _mm256_storeu_si256((__m256i*)p, _mm256_permute4x64_epi64(_mm256_packus_epi32(lo, hi), 0xd8));
#endif
}

static inline __attribute__((always_inline)) vf load_f32(const float* p) {
    vf v;
    std::memcpy(&v, p, sizeof(v));
    return v;
}

static inline __attribute__((always_inline)) void store_f32(float* p, vf v) {
    std::memcpy(p, &v, sizeof(v));
}

// Round to nearest even, as c10::BFloat16 does (NaN becomes the canonical quiet NaN).
static inline __attribute__((always_inline)) void store_bf16(uint16_t* p, vf x) {
    vu bits = (vu)x;
    vu rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    vu nan = (vu)(x != x);
    store_u16(p, (rounded & ~nan) | (0x7fc0u & nan));
}

static inline __attribute__((always_inline)) float bf16_to_f32(uint16_t h) {
    uint32_t bits = uint32_t(h) << 16;
    float x;
    std::memcpy(&x, &bits, sizeof(x));
    return x;
}

static inline __attribute__((always_inline)) uint16_t f32_to_bf16(float x) {
    if (x != x) return 0x7fc0;
    uint32_t bits;
    std::memcpy(&bits, &x, sizeof(bits));
    return uint16_t((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

static inline __attribute__((always_inline)) float round_bf16(float x) {
    return bf16_to_f32(f32_to_bf16(x));
}

static inline __attribute__((always_inline)) vf round_bf16(vf x) {
    vu bits = (vu)x;
    vu rounded = ((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16) << 16;
    vu nan = (vu)(x != x);
    return (vf)((rounded & ~nan) | (0x7fc00000u & nan));
}

// x rounded to bfloat16 (as round_bf16), stored at p, and returned as float32. With
// AVX512-BF16 one instruction rounds and narrows. It stores a NaN as a quiet NaN of x's sign, not
// the canonical one, and reads denormal inputs as zero: for values kept inside a kernel, computed
// under FlushDenormals (a NaN stays a NaN to the output's store_bf16).
static inline __attribute__((always_inline)) vf store_rounded_bf16(uint16_t* p, vf x) {
#if SLOTSERVE_BF16
    const __m256i narrow = (__m256i)_mm512_cvtneps_pbh((__m512)x);
    _mm256_storeu_si256((__m256i*)p, narrow);
    return (vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32(narrow), 16);
#else
    x = round_bf16(x);
    store_u16(p, (vu)x >> 16);  // rounded already: its high half
    return x;
#endif
}

typedef float vf8 __attribute__((vector_size(32)));
typedef float vf4 __attribute__((vector_size(16)));
typedef float vf2 __attribute__((vector_size(8)));

// The low and high halves of a vector.
template <typename Half, typename Whole>
static inline __attribute__((always_inline)) void halves(const Whole& v, Half& lo, Half& hi) {
    std::memcpy(&lo, &v, sizeof(Half));
    std::memcpy(&hi, reinterpret_cast<const char*>(&v) + sizeof(Half), sizeof(Half));
}

// A fixed pairwise tree over the lanes: lane i + lane i + 8, then + 4, + 2, + 1, kept in
// registers.
static inline __attribute__((always_inline)) float hsum(vf v) {
    vf8 a, b;
    halves(v, a, b);
    vf4 c, d;
    halves(a + b, c, d);
    vf2 e, f;
    halves(c + d, e, f);
    const vf2 g = e + f;
    return g[0] + g[1];
}

// The largest lane (by the same tree: the maximum of finite lanes does not depend on order).
static inline __attribute__((always_inline)) float hmax(vf v) {
    vf8 a, b;
    halves(v, a, b);
    vf4 c, d;
    a = a > b ? a : b;
    halves(a, c, d);
    c = c > d ? c : d;
    vf2 e, f;
    halves(c, e, f);
    e = e > f ? e : f;
    return e[0] > e[1] ? e[0] : e[1];
}

static inline __attribute__((always_inline)) vf vmax(vf a, vf b) {
    return a > b ? a : b;
}

// exp(x) in float32: Cody-Waite range reduction and a degree-6 polynomial (Cephes' expf
// coefficients, ~1 ulp); 0 below the smallest normal's logarithm.
static inline __attribute__((always_inline)) vf vexp(vf x) {
    const vf hi = splat(88.0f), lo = splat(-87.3365447504f);
    const vf magic = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
    const vi under = x < lo;
    x = x > hi ? hi : x;
    x = x < lo ? lo : x;
    const vf n = (x * 1.44269504088896341f + magic) - magic;
    vf r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    vf p = splat(1.9875691500e-4f) * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
#if SLOTSERVE_AVX512
    // p * 2^n in one instruction, zeroed where x was under: n is a whole number in
    // [-126, 127], so 2^n is the scale below and the one rounding is the product's.
    const __mmask16 keep = _mm512_cmpeq_epi32_mask((__m512i)under, _mm512_setzero_si512());
    return (vf)_mm512_maskz_scalef_ps(keep, (__m512)p, (__m512)n);
#else
    const vi scale = (__builtin_convertvector(n, vi) + 127) << 23;
    return (vf)((vi)(p * (vf)scale) & ~under);
#endif
}

static inline __attribute__((always_inline)) float sexp(float x) {
    float l[kLanes] = {x};
    vf v = vexp(load_f32(l));
    std::memcpy(l, &v, sizeof(l));
    return l[0];
}

// a * b + c with one rounding, in every build (the emulated dot product below depends on it).
static inline __attribute__((always_inline)) vf vfma(vf a, vf b, vf c) {
#if SLOTSERVE_AVX512
    return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#else
    __m256 h[3][2];
    std::memcpy(h[0], &a, 64);
    std::memcpy(h[1], &b, 64);
    std::memcpy(h[2], &c, 64);
    const __m256 r[2] = {_mm256_fmadd_ps(h[0][0], h[1][0], h[2][0]),
                         _mm256_fmadd_ps(h[0][1], h[1][1], h[2][1])};
    vf out;
    std::memcpy(&out, r, 64);
    return out;
#endif
}

// ---- bfloat16 pairs -------------------------------------------------------------------------
// Sixteen 32-bit lanes, each two bfloat16 with the even element in the low half: the operand
// of AVX512-BF16's `vdpbf16ps`.

static inline __attribute__((always_inline)) vi load_pairs(const uint16_t* p) {
    vi v;
    std::memcpy(&v, p, sizeof(v));
    return v;
}

static inline __attribute__((always_inline)) vi splat_pair(const uint16_t* p) {
    int32_t pair;
    std::memcpy(&pair, p, sizeof(pair));
    return vi{} + pair;
}

// Each lane's even (low) or odd (high) bfloat16 as a float32.
static inline __attribute__((always_inline)) vf even_halves(vi pairs) {
    return (vf)(pairs << 16);
}

static inline __attribute__((always_inline)) vf odd_halves(vi pairs) {
    return (vf)(pairs & (vi{} + int32_t(0xffff0000u)));
}

// acc + a_odd * b_odd, then + a_even * b_even, lane by lane, each step fused: `vdpbf16ps`
// where the CPU has it, else the same two steps (bfloat16 products are exact in float32, so
// the fused steps round as the instruction does). The instruction treats denormals as zero
// whatever MXCSR says; the emulation matches it only under DAZ and FTZ (FlushDenormals).
static inline __attribute__((always_inline)) vf dot_pairs(vf acc, vi a, vi b) {
#if SLOTSERVE_BF16
    return (vf)_mm512_dpbf16_ps((__m512)acc, (__m512bh)a, (__m512bh)b);
#else
    acc = vfma(odd_halves(a), odd_halves(b), acc);
    return vfma(even_halves(a), even_halves(b), acc);
#endif
}

// dot_pairs(acc, the pair at ``p`` in every lane, b). With the instruction, the pair is the
// instruction's broadcast memory operand: one operation where a broadcast and a dot product
// would be two (GCC does not fold the broadcast itself). The products commute, so the bits are
// dot_pairs'.
static inline __attribute__((always_inline)) vf dot_pairs_splat(vf acc, const uint16_t* p, vi b) {
#if SLOTSERVE_BF16
    asm("vdpbf16ps %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(b), "m"(*(const int32_t*)p));
    return acc;
#else
    return dot_pairs(acc, splat_pair(p), b);
#endif
}
