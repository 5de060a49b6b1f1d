// The per-row kernels, written once over vec.h and compiled once per instruction set
// (cpu_kernels.cpp). Each function computes whole rows (a token, or a token and KV head) from
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

// Sixteen vectors to the sixteen sums of their lanes, in order, each summed by hsum's tree
// (lane i + lane i + 8, then + 4, + 2, + 1): a transpose and add, four levels of shuffles.
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

constexpr int kMaxChunks = 16;  // head_dim up to 256
constexpr int kMaxGroup = 16;   // query heads per KV head
constexpr int kPrefetch = 16;    // keys ahead: rows are scattered over the pool's blocks

// The partial softmax of one partition for the ``group`` query heads that share KV head
// ``kv_head``: keys ``lo .. hi - 1`` read in place through the block table. Writes the max
// ``m[g]``, the sum of exponentials ``s[g]`` and the unnormalised output ``acc[g][d]``.
// ``CH``, ``G``: head_dim / 16 and the group size when known at compile time (0: at run time);
// the per-output summation order is the same in every variant.
template <int CH, int G>
static void attend_partition_t(const float* q, int runtime_group, const PagedKv& kv, int kv_head,
                               const int32_t* table, int lo, int hi, float* scores, float* m,
                               float* s, float* acc) {
    const int d = kv.head_dim, chunks = CH ? CH : d / kLanes, n = hi - lo;
    const int group = G ? G : runtime_group;
    const int64_t stride = int64_t(kv.kv_heads) * d;
    const int padded = (n + kLanes - 1) / kLanes * kLanes;
    // Prefetches cover this head and the ones after it in the position's row: the row is read
    // from memory in one contiguous run, and the next heads' items find it in cache.
    const int rest_of_row = (kv.kv_heads - kv_head) * d * 2;
    int64_t offsets[kPartition];
    // Block by block: one division per call, not two per key.
    for (int j = 0, block = lo / kv.block_size, within = lo % kv.block_size; j < n; ++block) {
        const int64_t base = int64_t(table[block]) * kv.block_size * stride + int64_t(kv_head) * d;
        for (; within < kv.block_size && j < n; ++within, ++j) offsets[j] = base + within * stride;
        within = 0;
    }
    for (int j = 0; j < kPrefetch && j < n; ++j) {  // the loop below prefetches the rest
        const char* first = (const char*)(kv.keys + offsets[j]);
        for (int line = 0; line < rest_of_row; line += 64) __builtin_prefetch(first + line);
    }
    // Each key is loaded once for the whole group; its dot products wait, one vector per
    // (head, key), until sixteen keys are there to be summed together.
    vf partial[kMaxGroup * kLanes];
    for (int j0 = 0; j0 < padded; j0 += kLanes) {
        const int count = n - j0 < kLanes ? n - j0 : kLanes;
        for (int jj = 0; jj < count; ++jj) {
            const uint16_t* key = kv.keys + offsets[j0 + jj];
            if (j0 + jj + kPrefetch < n) {
                const char* ahead = (const char*)(kv.keys + offsets[j0 + jj + kPrefetch]);
                for (int line = 0; line < rest_of_row; line += 64) __builtin_prefetch(ahead + line);
            }
            {  // the value row too: it is read after this partition's softmax
                const char* later = (const char*)(kv.values + offsets[j0 + jj]);
                for (int line = 0; line < rest_of_row; line += 64) __builtin_prefetch(later + line);
            }
            vf k[kMaxChunks];
            for (int c = 0; c < chunks; ++c) k[c] = load_bf16(key + c * kLanes);
            for (int g = 0; g < group; ++g) {
                const float* qg = q + g * d;
                vf dot = load_f32(qg) * k[0];
                for (int c = 1; c < chunks; ++c) dot += load_f32(qg + c * kLanes) * k[c];
                partial[g * kLanes + jj] = dot;
            }
        }
        for (int g = 0; g < group; ++g) {
            for (int jj = count; jj < kLanes; ++jj) partial[g * kLanes + jj] = splat(0.0f);
            store_f32(scores + g * kPartition + j0, sum_lanes_of_16(partial + g * kLanes));
        }
    }
    for (int g = 0; g < group; ++g) {
        float* row = scores + g * kPartition;
        for (int j = n; j < padded; ++j) row[j] = -INFINITY;
        vf best = splat(-INFINITY);
        for (int j = 0; j < padded; j += kLanes) best = vmax(best, load_f32(row + j));
        const float mx = hmax(best);
        vf total = splat(0.0f);
        for (int j = 0; j < padded; j += kLanes) {
            vf p = vexp(load_f32(row + j) - mx);
            store_f32(row + j, p);
            total += p;
        }
        m[g] = mx;
        s[g] = hsum(total);
    }
    if constexpr (G > 0 && CH > 0 && G * CH <= 24) {
        // Every head's output in registers: each value row is loaded once for the group.
        vf out[G * CH];
        for (int i = 0; i < G * CH; ++i) out[i] = splat(0.0f);
        for (int j = 0; j < n; ++j) {
            const uint16_t* value = kv.values + offsets[j];
            if (j + kPrefetch < n) {
                const char* ahead = (const char*)(kv.values + offsets[j + kPrefetch]);
                for (int line = 0; line < d * 2; line += 64) __builtin_prefetch(ahead + line);
            }
            for (int c = 0; c < CH; ++c) {
                const vf v = load_bf16(value + c * kLanes);
                for (int g = 0; g < G; ++g) out[g * CH + c] += scores[g * kPartition + j] * v;
            }
        }
        for (int g = 0; g < G; ++g)
            for (int c = 0; c < CH; ++c) store_f32(acc + g * d + c * kLanes, out[g * CH + c]);
        return;
    }
    for (int g = 0; g < group; ++g) {
        const float* row = scores + g * kPartition;
        vf out[kMaxChunks];
        for (int c = 0; c < chunks; ++c) out[c] = splat(0.0f);
        for (int j = 0; j < n; ++j) {
            const uint16_t* value = kv.values + offsets[j];
            if (j + kPrefetch < n) {
                const char* ahead = (const char*)(kv.values + offsets[j + kPrefetch]);
                for (int line = 0; line < d * 2; line += 64) __builtin_prefetch(ahead + line);
            }
            const float p = row[j];
            for (int c = 0; c < chunks; ++c) out[c] += p * load_bf16(value + c * kLanes);
        }
        for (int c = 0; c < chunks; ++c) store_f32(acc + g * d + c * kLanes, out[c]);
    }
}

#define SLOTSERVE_ATTEND(CH, G) \
    attend_partition_t<CH, G>(q, group, kv, kv_head, table, lo, hi, scores, m, s, acc)

static void attend_partition(const float* q, int group, const PagedKv& kv, int kv_head,
                             const int32_t* table, int lo, int hi, float* scores, float* m,
                             float* s, float* acc) {
    switch (kv.head_dim / kLanes * 100 + group) {
        case 401: return SLOTSERVE_ATTEND(4, 1);
        case 402: return SLOTSERVE_ATTEND(4, 2);
        case 403: return SLOTSERVE_ATTEND(4, 3);
        case 404: return SLOTSERVE_ATTEND(4, 4);
        case 405: return SLOTSERVE_ATTEND(4, 5);
        case 406: return SLOTSERVE_ATTEND(4, 6);
        case 801: return SLOTSERVE_ATTEND(8, 1);
        case 802: return SLOTSERVE_ATTEND(8, 2);
        case 803: return SLOTSERVE_ATTEND(8, 3);
        case 1601: return SLOTSERVE_ATTEND(16, 1);
        default:
            switch (kv.head_dim / kLanes) {
                case 4: return SLOTSERVE_ATTEND(4, 0);
                case 8: return SLOTSERVE_ATTEND(8, 0);
                case 16: return SLOTSERVE_ATTEND(16, 0);
                default: return SLOTSERVE_ATTEND(0, 0);
            }
    }
}
#undef SLOTSERVE_ATTEND
// Merges a token's partitions in their order: out = Σ e^(m_i - M) acc_i / Σ e^(m_i - M) s_i.
static void merge_partitions(const float* m, const float* s, const float* acc, int parts,
                             int group, int d, int part_stride, uint16_t* out) {
    for (int g = 0; g < group; ++g) {
        float best = -INFINITY;
        for (int i = 0; i < parts; ++i) best = std::max(best, m[i * group + g]);
        float total = 0.0f;
        for (int i = 0; i < parts; ++i) total += sexp(m[i * group + g] - best) * s[i * group + g];
        for (int c = 0; c < d; c += kLanes) {
            vf sum = splat(0.0f);
            for (int i = 0; i < parts; ++i) {
                const float w = sexp(m[i * group + g] - best);
                sum += w * load_f32(acc + i * part_stride + g * d + c);
            }
            store_bf16(out + g * d + c, sum / total);
        }
    }
}
