// The per-row kernels, written once over vec.h and compiled once per instruction set
// (kernels_<isa>.cpp), as are attention.h and attend.h. Each function computes whole rows (a
// token, or a token and KV head) from raw pointers; the caller decides which rows run on which
// thread. A row's result depends on its own inputs and on fixed constants (vector width,
// attention partition size) only: never on the other rows of the call, their lengths, or the
// thread count. That is the batch-invariance argument for these three files.

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
