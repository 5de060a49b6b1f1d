// CPU kernels of the PyTorch runner: paged attention reading the KV pool in place, the fused
// per-row work around the projections (RMSNorm with the residual add, q/k norm with the rotary
// embedding and the K/V write, SiLU·mul), and the projections' GEMM on CPUs with AVX512-BF16
// (gemm512 below). bfloat16 in and out, float32 inside.
//
// kernels.h holds the computations, compiled three times, one translation unit each (built in
// parallel): for AVX512-BF16, for AVX-512 (F/BW/VL) and for AVX2+FMA, all giving the same bits
// (the first does attention's bfloat16 dot products in one instruction, the others in two fused
// steps); the set is chosen once at load from the CPU (`isa()`), never built with
// -march=native. This file holds the choice and the bindings. The threads are torch's own
// (at::parallel_for); how rows are spread over them never changes a row's bits (kernels.h).

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <string>
#include <tuple>
#include <vector>

#include "kernel_types.h"

#include "gemm_avx512.h"
#include "gemm_amx.h"

namespace {

// Attention's head dimensions come in whole vectors of this many lanes on every instruction set.
constexpr int kLanes = 16;

bool runs_avx512() {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
}

bool runs_avx2() {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

bool runs_avx512_bf16() {
    return runs_avx512() && __builtin_cpu_supports("avx512bf16");
}

Kernels select_kernels() {
    if (runs_avx512_bf16()) return avx512bf16_kernels();
    if (runs_avx512()) return avx512_kernels();
    if (runs_avx2()) return avx2_kernels();
    return Kernels{"none",  nullptr, nullptr, nullptr, nullptr, nullptr,
                   nullptr, nullptr, nullptr, nullptr, nullptr};
}

Kernels& kernels() {
    static Kernels k = select_kernels();
    return k;
}

// A narrower set on a CPU that runs several: how the tests reach the other paths on one
// machine. Call before serving, never during a call.
std::string select_isa(const std::string& name) {
    if (name == "avx512bf16" && runs_avx512_bf16())
        kernels() = avx512bf16_kernels();
    else if (name == "avx512" && runs_avx512())
        kernels() = avx512_kernels();
    else if (name == "avx2" && runs_avx2())
        kernels() = avx2_kernels();
    else
        TORCH_CHECK(false, "this CPU does not run ", name);
    return kernels().name;
}

const Kernels& usable() {
    const Kernels& k = kernels();
    TORCH_CHECK(k.norm_bf16_row != nullptr, "this CPU has neither AVX-512 nor AVX2 with FMA");
    return k;
}

const uint16_t* bf16(const at::Tensor& t) {
    return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>());
}

uint16_t* bf16_mut(at::Tensor& t) {
    return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>());
}

void check_rows(const at::Tensor& t, const char* what) {
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kBFloat16,
                what, " must be a bfloat16 CPU tensor");
    TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, what, " must be [rows, n] with unit stride");
}

// Rows per task so a task carries ~32k elements: one row of a small model stays on one thread.
int64_t grain(int64_t n) {
    return std::max<int64_t>(1, 32768 / std::max<int64_t>(1, n));
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, bool plus_one) {
    const Kernels& k = usable();
    check_rows(x, "x");
    const int64_t rows = x.size(0), n = x.size(1);
    at::Tensor out = at::empty({rows, n}, x.options());
    const uint16_t *in = bf16(x), *w = bf16(weight);
    uint16_t* o = bf16_mut(out);
    const int64_t stride = x.stride(0);
    at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
        std::vector<float> scratch(n);
        for (int64_t r = begin; r < end; ++r)
            k.norm_bf16_row(in + r * stride, n, w, float(eps), plus_one, o + r * n,
                            scratch.data());
    });
    return out;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps,
                                                bool plus_one) {
    const Kernels& k = usable();
    check_rows(x, "x");
    check_rows(residual, "residual");
    TORCH_CHECK(x.sizes() == residual.sizes(), "x and residual differ in shape");
    const int64_t rows = x.size(0), n = x.size(1);
    at::Tensor out = at::empty({rows, n}, x.options());
    at::Tensor summed = at::empty({rows, n}, x.options());
    const uint16_t *a = bf16(x), *b = bf16(residual), *w = bf16(weight);
    uint16_t *o = bf16_mut(out), *s = bf16_mut(summed);
    const int64_t sa = x.stride(0), sb = residual.stride(0);
    at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
        std::vector<float> scratch(n);
        for (int64_t r = begin; r < end; ++r)
            k.add_norm_row(a + r * sa, b + r * sb, n, w, float(eps), plus_one, s + r * n,
                           o + r * n, scratch.data());
    });
    return {out, summed};
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
    const Kernels& k = usable();
    check_rows(gate_up, "gate_up");
    const int64_t rows = gate_up.size(0), n = gate_up.size(1) / 2;
    at::Tensor out = at::empty({rows, n}, gate_up.options());
    const uint16_t* in = bf16(gate_up);
    uint16_t* o = bf16_mut(out);
    const int64_t stride = gate_up.stride(0);
    at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r)
            k.silu_mul_row(in + r * stride, in + r * stride + n, n, o + r * n);
    });
    return out;
}

at::Tensor rotary_write(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                        const at::Tensor& positions, const at::Tensor& cache_rows,
                        at::Tensor& key_cache, at::Tensor& value_cache, int64_t heads,
                        int64_t kv_heads, int64_t head_dim, bool gated,
                        const c10::optional<at::Tensor>& q_norm,
                        const c10::optional<at::Tensor>& k_norm, double eps, bool plus_one) {
    const Kernels& k = usable();
    check_rows(qkv, "qkv");
    const int64_t tokens = qkv.size(0);
    const int64_t q_cols = heads * head_dim * (gated ? 2 : 1);
    TORCH_CHECK(qkv.size(1) >= q_cols + 2 * kv_heads * head_dim, "qkv is too narrow");
    TORCH_CHECK(positions.scalar_type() == at::kInt && cache_rows.scalar_type() == at::kInt,
                "positions and cache rows must be int32");
    TORCH_CHECK(positions.numel() == tokens && cache_rows.numel() == tokens,
                "one position and one cache row per token");
    TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "caches: contiguous");
    TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous(), "rotary tables: contiguous");
    const int64_t rotary_dim = cos.size(1);
    const int64_t cache_rows_total = key_cache.size(0);
    HeadLayout layout{int(heads),
                      int(kv_heads),
                      int(head_dim),
                      int(rotary_dim),
                      gated,
                      q_norm ? bf16(*q_norm) : nullptr,
                      k_norm ? bf16(*k_norm) : nullptr,
                      float(eps),
                      plus_one};
    at::Tensor q = at::empty({tokens, heads, head_dim}, qkv.options());
    const uint16_t *in = bf16(qkv), *c = bf16(cos), *s = bf16(sin);
    uint16_t *qo = bf16_mut(q), *kc = bf16_mut(key_cache), *vc = bf16_mut(value_cache);
    const int32_t *pos = positions.data_ptr<int32_t>(), *rows = cache_rows.data_ptr<int32_t>();
    const int64_t stride = qkv.stride(0), row_size = kv_heads * head_dim;
    for (int64_t t = 0; t < tokens; ++t)
        TORCH_CHECK(rows[t] >= 0 && rows[t] < cache_rows_total && pos[t] >= 0 &&
                        pos[t] < cos.size(0),
                    "a cache row or position is out of range");
    at::parallel_for(0, tokens, grain((heads + kv_heads) * head_dim * 4),
                     [&](int64_t begin, int64_t end) {
                         std::vector<float> scratch(2 * head_dim);
                         for (int64_t t = begin; t < end; ++t)
                             k.rotary_token(in + t * stride, layout, c + pos[t] * rotary_dim,
                                            s + pos[t] * rotary_dim, qo + t * heads * head_dim,
                                            kc + rows[t] * row_size, vc + rows[t] * row_size,
                                            scratch.data());
                     });
    return q;
}

// Cuts ``cost`` (running totals over n jobs: cost[0] = 0, cost[n] the whole) into ``runs``
// consecutive runs of about equal cost, each boundary where the running total comes nearest
// its share: the first job of each run, then n.
static std::vector<int64_t> balanced_runs(const std::vector<int64_t>& cost, int64_t runs) {
    const int64_t n = int64_t(cost.size()) - 1;
    runs = std::max<int64_t>(1, std::min(runs, n));
    std::vector<int64_t> first{0};
    for (int64_t r = 1, j = 0; r < runs; ++r) {
        const double share = double(cost[n]) * double(r) / double(runs);
        while (j < n && double(cost[j + 1]) <= share) ++j;
        if (j < n && double(cost[j + 1]) - share < share - double(cost[j])) ++j;
        first.push_back(std::max(j, first.back()));
    }
    first.push_back(n);
    return first;
}

// The entries [first, end) of a block table that hold partition ``part``'s positions.
static std::pair<int64_t, int64_t> partition_blocks(int part, int64_t block_size) {
    return {int64_t(part) * kPartition / block_size,
            (int64_t(part + 1) * kPartition - 1) / block_size + 1};
}

// Lone rows (decode tokens) of several sequences that reach past a whole partition held in the
// same blocks by each: the prefix cache gives sequences one copy of a common prefix. Each tile
// is one partition of up to kTileRows such rows.
struct SharedTile {
    int part;
    int64_t first, rows;  // SharedPartitions::units[first, first + rows)
};
struct SharedPartitions {
    std::vector<SharedTile> tiles;
    std::vector<int64_t> units;  // the tiles' rows, as units
    std::vector<std::pair<int64_t, int>> covered;  // (unit, partition), sorted
    std::vector<int64_t> place;  // per unit: its place among the units in tiles, or -1
    int64_t lone_rows = 0;       // units in tiles
    bool covers(int64_t unit, int part) const {
        return !place.empty() && place[unit] >= 0 &&
               std::binary_search(covered.begin(), covered.end(), std::make_pair(unit, part));
    }
};

static SharedPartitions shared_partitions(const std::vector<int64_t>& unit_start,
                                          const int32_t* pos, const int32_t* tables,
                                          const int32_t* seq, int64_t table_width,
                                          int64_t block_size) {
    // (partition, hash of its blocks, unit) for every whole partition of a lone row.
    struct Candidate {
        int part;
        uint64_t hash;
        int64_t unit;
        bool operator<(const Candidate& o) const {
            return std::tie(part, hash, unit) < std::tie(o.part, o.hash, o.unit);
        }
    };
    std::vector<Candidate> candidates;
    const int64_t units = int64_t(unit_start.size()) - 1;
    SharedPartitions shared;
    int64_t reaching = 0;  // lone rows past a whole partition: two are needed to share one
    for (int64_t u = 0; u < units && reaching < 2; ++u)
        reaching += unit_start[u + 1] - unit_start[u] == 1 && pos[unit_start[u]] + 1 >= kPartition;
    if (reaching < 2) return shared;
    auto blocks_of = [&](int64_t u, int part) {
        const int32_t* table = tables + seq[unit_start[u]] * table_width;
        const auto [first, end] = partition_blocks(part, block_size);
        return std::make_pair(table + first, table + end);
    };
    for (int64_t u = 0; u < units; ++u) {
        if (unit_start[u + 1] - unit_start[u] != 1) continue;
        const int whole = (pos[unit_start[u]] + 1) / kPartition;
        for (int part = 0; part < whole; ++part) {
            uint64_t hash = 1469598103934665603ull;  // FNV-1a over the block ids
            const auto [b, e] = blocks_of(u, part);
            for (const int32_t* block = b; block < e; ++block)
                hash = (hash ^ uint32_t(*block)) * 1099511628211ull;
            candidates.push_back({part, hash, u});
        }
    }
    std::sort(candidates.begin(), candidates.end());
    for (size_t i = 0; i < candidates.size();) {
        size_t j = i + 1;
        while (j < candidates.size() && candidates[j].part == candidates[i].part &&
               candidates[j].hash == candidates[i].hash)
            ++j;
        // The same hash and, checked, the same blocks as the group's first row.
        const auto [b, e] = blocks_of(candidates[i].unit, candidates[i].part);
        std::vector<int64_t> rows{candidates[i].unit};
        for (size_t c = i + 1; c < j; ++c) {
            const auto [cb, ce] = blocks_of(candidates[c].unit, candidates[c].part);
            if (std::equal(b, e, cb, ce)) rows.push_back(candidates[c].unit);
        }
        // Tiles of two rows or more: one row left over reads the partition on its own.
        for (size_t r = 0; r + 1 < rows.size(); r += kTileRows) {
            const int64_t count = std::min<int64_t>(kTileRows, int64_t(rows.size() - r));
            shared.tiles.push_back({candidates[i].part, int64_t(shared.units.size()), count});
            for (int64_t x = 0; x < count; ++x) {
                shared.units.push_back(rows[r + x]);
                shared.covered.emplace_back(rows[r + x], candidates[i].part);
            }
        }
        i = j;
    }
    std::sort(shared.covered.begin(), shared.covered.end());
    shared.place.assign(units, -1);
    for (const auto& [unit, part] : shared.covered)
        if (shared.place[unit] < 0) shared.place[unit] = shared.lone_rows++;
    return shared;
}

// Reads one byte of every cache line of a partition's keys and values, all KV heads. A shared
// tile of a few decode rows computes little per key, and each KV head reads only its part of
// every position's row, scattered over the pool's blocks: memory latency, not arithmetic, sets
// its pace. Swept in address order, a block is what the hardware's prefetchers stream, into
// the cache for all the KV heads; kSweepStreams blocks swept side by side, line by line, keep
// that many streams in flight. (Software prefetches in the tile, near or one partition ahead,
// left its time unchanged; sweeping one block at a time, or all of a partition's side by side,
// left it ~1.3x slower than this.)
constexpr int kSweepStreams = 16;

static void touch_partition(const PagedKv& kv, const int32_t* table, int part) {
    const int64_t block_bytes = int64_t(kv.block_size) * kv.kv_heads * kv.head_dim * 2;
    const char* regions[2 * kPartition];  // keys and values of each block
    int count = 0;
    const auto [first_block, end_block] = partition_blocks(part, kv.block_size);
    for (int64_t b = first_block; b < end_block; ++b)
        for (const uint16_t* base : {kv.keys, kv.values})
            regions[count++] = reinterpret_cast<const char*>(base) + table[b] * block_bytes;
    uint8_t sink = 0;
    for (int first = 0; first < count; first += kSweepStreams)
        for (int64_t line = 0; line < block_bytes; line += 64)
            for (int r = first; r < std::min(count, first + kSweepStreams); ++r)
                sink ^= *reinterpret_cast<const volatile uint8_t*>(regions[r] + line);
    asm volatile("" ::"r"(sink));
}

// Paged attention over the pool, reading every key and value where it lies.
//
// Work unit: up to kTileRows consecutive positions of one sequence (a prefill chunk's rows, with
// no sliding window), or one row, times one KV head; its partitions computed by attend_tile
// (kernels.h, which states the arithmetic of a row) and merged per row in partition order. Units
// run token-major, so a cached prefix that rows share stays in the last-level cache between
// them, each thread taking a run of units' KV heads of about equal cost (keys read); a chunk's
// next tiles of one KV head on one thread share each partition's transposed keys. With few
// units and long contexts, the partitions themselves are spread over the threads that way and
// merged afterwards by the same merge. Lone rows whose sequences hold a whole partition in the
// same blocks (a prefix the cache shares) compute it as one tile of those rows, its keys read
// once for all. A row's bits do not depend on its unit, its thread, the split or its tile.
// A thread's scratch for one call: ``tiles`` tiles' queries (zeroed: their padding past
// head_dim is read), a tile's probabilities and scores, and the vector scratch of attend_tile
// (kernels.h), each from a 64-byte boundary (the others uninitialised: each is written before
// it is read). The memory is the thread's own, kept for its later calls and grown when one
// needs more: a decode step makes a call per layer, and allocating and zeroing ~300 KB per
// thread each time cost as much as a short context's attention.
struct AttentionScratch {
    uint16_t* q;
    uint16_t* probs;
    float* scores;
    char* vectors;
    AttentionScratch(int64_t row_heads, int q_stride, int64_t tiles) {
        auto whole_lines = [](int64_t bytes) { return (bytes + 63) / 64 * 64; };
        const int64_t q_bytes = whole_lines(tiles * row_heads * q_stride * 2);
        const int64_t probs_bytes = whole_lines(row_heads * (kPartition + 2) * 2);
        const int64_t scores_bytes = whole_lines(row_heads * kScoreStride * 4);
        const int64_t total = q_bytes + probs_bytes + scores_bytes + whole_lines(kVectorScratch);
        thread_local std::unique_ptr<char, decltype(&std::free)> kept(nullptr, &std::free);
        thread_local int64_t capacity = 0;
        if (capacity < total) {
            kept.reset(static_cast<char*>(std::aligned_alloc(64, total)));
            TORCH_CHECK(kept != nullptr, "out of memory for attention scratch");
            capacity = total;
        }
        char* at = kept.get();
        q = reinterpret_cast<uint16_t*>(at);
        std::memset(q, 0, q_bytes);
        probs = reinterpret_cast<uint16_t*>(at += q_bytes);
        scores = reinterpret_cast<float*>(at += probs_bytes);
        vectors = at + scores_bytes;
    }
};

// One paged_attention call: its checked inputs, its tokens cut into units, the shared tiles'
// results, and the two ways of spreading the units over the threads (see above).
class PagedAttention {
public:
    PagedAttention(const at::Tensor& q, const at::Tensor& key_cache,
                   const at::Tensor& value_cache, const at::Tensor& block_tables,
                   const at::Tensor& token_seq, const at::Tensor& positions, int64_t block_size,
                   int64_t window, double scale)
        : k_(usable()), block_size_(block_size), window_(window), scale_(scale) {
        check(q, key_cache, value_cache, block_tables, token_seq, positions);
        kv_ = PagedKv{bf16(key_cache), bf16(value_cache), int(kv_heads_), int(d_),
                      int(block_size)};
        out_ = at::empty({tokens_, heads_ * d_}, q.options());
        qin_ = bf16(q);
        o_ = bf16_mut(out_);
        cut_units();
        row_heads_ = int64_t(kTileRows) * group_;
        acc_size_ = int64_t(group_) * d_;
        q_stride_ = int((d_ / 2 + kLanes - 1) / kLanes * kLanes * 2);
        for (int64_t t = 0; t < tokens_; ++t)
            max_parts_ = std::max<int64_t>(max_parts_, parts_of(t));
        // A unit's results: m and s [part][row-head], acc [part][row-head][d]; a thread's
        // buffers hold a whole tile's.
        ms_slot_ = max_parts_ * row_heads_;
        acc_slot_ = ms_slot_ * d_;
        if (window_ <= 0)
            shared_ =
                shared_partitions(unit_start_, pos_, tables_, seq_, table_width_, block_size_);
        // The shared tiles' results, per KV head, row of a tile and partition: m and s [group],
        // acc [group][d]; uninitialised: every slot a task reads, a shared tile wrote.
        shared_per_head_ = shared_.lone_rows * max_parts_ * group_;
        const int64_t shared_floats = kv_heads_ * shared_per_head_;
        shared_m_.reset(new float[shared_floats]);
        shared_s_.reset(new float[shared_floats]);
        shared_acc_.reset(new float[shared_floats * d_]);
        items_ = kv_heads_ * units_;
        threads_ = at::get_num_threads();
    }

    at::Tensor run() {
        if (!shared_.tiles.empty()) run_shared_tiles();
        if (max_parts_ > 1 && items_ < 4 * threads_)
            run_by_partitions();
        else
            run_by_items();
        return out_;
    }

private:
    void check(const at::Tensor& q, const at::Tensor& key_cache, const at::Tensor& value_cache,
               const at::Tensor& block_tables, const at::Tensor& token_seq,
               const at::Tensor& positions) {
        TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && q.scalar_type() == at::kBFloat16,
                    "q must be contiguous bfloat16 [tokens, heads, head_dim]");
        TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(),
                    "caches: contiguous");
        TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.is_contiguous() &&
                        block_tables.dim() == 2,
                    "block tables: int32 [sequences, blocks]");
        TORCH_CHECK(token_seq.scalar_type() == at::kInt && positions.scalar_type() == at::kInt,
                    "token sequences and positions must be int32");
        tokens_ = q.size(0), heads_ = q.size(1), d_ = q.size(2);
        kv_heads_ = key_cache.size(1);
        TORCH_CHECK(d_ % kLanes == 0 && d_ <= 256, "head_dim must be a multiple of ", kLanes,
                    " up to 256");
        TORCH_CHECK(heads_ % kv_heads_ == 0 && key_cache.size(2) == d_, "head shapes disagree");
        group_ = int(heads_ / kv_heads_);
        TORCH_CHECK(group_ <= 16, "at most 16 query heads per KV head");
        const int64_t num_blocks = key_cache.size(0) / block_size_;
        table_width_ = block_tables.size(1);
        tables_ = block_tables.data_ptr<int32_t>();
        seq_ = token_seq.data_ptr<int32_t>();
        pos_ = positions.data_ptr<int32_t>();
        // Every block a token may read exists: checked per sequence up to its furthest token.
        std::vector<int64_t> furthest(block_tables.size(0), -1);
        for (int64_t t = 0; t < tokens_; ++t) {
            TORCH_CHECK(seq_[t] >= 0 && seq_[t] < block_tables.size(0),
                        "token sequence out of range");
            TORCH_CHECK(pos_[t] >= 0 && pos_[t] / block_size_ < table_width_,
                        "position past its table");
            furthest[seq_[t]] = std::max<int64_t>(furthest[seq_[t]], pos_[t]);
        }
        for (size_t sq = 0; sq < furthest.size(); ++sq)
            for (int64_t b = 0; b <= furthest[sq] / block_size_ && furthest[sq] >= 0; ++b) {
                const int32_t block = tables_[sq * table_width_ + b];
                TORCH_CHECK(block >= 0 && block < num_blocks, "block id out of range");
            }
    }

    // Units of rows [unit_start_[u], unit_start_[u + 1]).
    void cut_units() {
        unit_start_.push_back(0);
        for (int64_t t = 0; t < tokens_;) {
            int64_t end = t + 1;
            while (window_ <= 0 && end < tokens_ && end - t < kTileRows && seq_[end] == seq_[t] &&
                   pos_[end] == pos_[t] + (end - t))
                ++end;
            unit_start_.push_back(end);
            t = end;
        }
        units_ = int64_t(unit_start_.size()) - 1;
    }

    int first_key(int64_t t) const {
        return window_ > 0 ? int(std::max<int64_t>(0, pos_[t] - window_ + 1)) : 0;
    }

    int parts_of(int64_t t) const { return pos_[t] / kPartition - first_key(t) / kPartition + 1; }

    const int32_t* table_of(int64_t t) const { return tables_ + seq_[t] * table_width_; }

    // Token t's query heads of KV head h as row r of the tile at ``q``.
    void load_query(uint16_t* q, int64_t t, int64_t r, int64_t h) const {
        for (int g = 0; g < group_; ++g)
            std::memcpy(q + (r * group_ + g) * q_stride_,
                        qin_ + (t * heads_ + h * group_ + g) * d_, sizeof(uint16_t) * d_);
    }

    void load_queries(uint16_t* q, int64_t u, int64_t h) const {
        for (int64_t t = unit_start_[u]; t < unit_start_[u + 1]; ++t)
            load_query(q, t, t - unit_start_[u], h);
    }

    int64_t shared_at(int64_t h, int64_t u, int64_t part) const {
        return h * shared_per_head_ + (shared_.place[u] * max_parts_ + part) * group_;
    }

    // Unit u's partition ``part`` for KV head h, its queries at ``q``; ``keys_ready``: see Tile.
    void attend(AttentionScratch& w, int64_t u, int64_t h, int64_t part, float* m, float* s,
                float* acc, const uint16_t* q, int* keys_ready) const {
        const int64_t t0 = unit_start_[u], rows = unit_start_[u + 1] - t0;
        if (shared_.covers(u, int(part))) {  // a lone row: its shared tile computed it
            const int64_t from = shared_at(h, u, part), to = part * group_;
            std::memcpy(m + to, shared_m_.get() + from, sizeof(float) * group_);
            std::memcpy(s + to, shared_s_.get() + from, sizeof(float) * group_);
            std::memcpy(acc + to * d_, shared_acc_.get() + from * d_, sizeof(float) * group_ * d_);
            return;
        }
        const int p0 = int(first_key(t0) / kPartition + part) * kPartition;
        const int start = std::max(p0, first_key(t0));  // a window's first partition is clipped
        int n[kTileRows];
        for (int64_t r = 0; r < rows; ++r)
            n[r] = int(std::clamp<int64_t>(pos_[t0 + r] + 1 - start, 0, p0 + kPartition - start));
        if (n[rows - 1] == 0) return;
        const int64_t ms = part * rows * group_;
        Tile tile{q, q_stride_, group_, int(rows), n, start, float(scale_),
                  w.scores, w.probs, w.vectors, keys_ready,
                  w.vectors + kKeysBytes, m + ms, s + ms, acc + ms * d_};
        k_.attend_tile(kv_, int(h), table_of(t0), tile);
    }

    void merge(int64_t u, int64_t h, const float* m, const float* s, const float* acc) const {
        const int64_t t0 = unit_start_[u], rows = unit_start_[u + 1] - t0;
        for (int64_t r = 0; r < rows; ++r)
            k_.merge_partitions(m + r * group_, s + r * group_, acc + r * acc_size_,
                                parts_of(t0 + r), group_, int(d_), int(rows * group_),
                                int(rows * acc_size_), o_ + ((t0 + r) * heads_ + h * group_) * d_);
    }

    // The cost of a unit's partition: keys read, plus a fixed cost per row.
    int64_t part_cost(int64_t u, int part) const {
        if (shared_.covers(u, part)) return 1;  // a copy of its shared tile's results
        const int64_t t0 = unit_start_[u];
        const int64_t lo = int64_t(first_key(t0) / kPartition + part) * kPartition;
        int64_t keys = 0;
        for (int64_t t = t0; t < unit_start_[u + 1]; ++t)
            keys += std::clamp<int64_t>(pos_[t] + 1 - std::max<int64_t>(lo, first_key(t)), 0,
                                        kPartition) + 32;
        return keys;
    }

    // A shared tile: its lone rows' queries, one tile over the partition's keys, results
    // [row * group + g] (acc times head_dim).
    void attend_shared(AttentionScratch& w, const SharedTile& st, const int64_t* tile_units,
                       int64_t h, float* m, float* s, float* acc) const {
        int n[kTileRows];
        for (int64_t r = 0; r < st.rows; ++r) {
            load_query(w.q, unit_start_[tile_units[r]], r, h);
            n[r] = kPartition;
        }
        Tile tile{w.q, q_stride_, group_, int(st.rows), n, st.part * kPartition,
                  float(scale_), w.scores, w.probs, w.vectors, nullptr,
                  w.vectors + kKeysBytes, m, s, acc};
        k_.attend_tile(kv_, int(h), table_of(unit_start_[tile_units[0]]), tile);
    }

    // The shared tiles first, in runs of about equal cost (their rows' keys), a tile's KV heads
    // one after another: the first one a thread computes brings the partition into the cache
    // for all (touch_partition).
    void run_shared_tiles() {
        std::vector<std::pair<int64_t, int64_t>> tasks;  // (KV head, tile)
        std::vector<int64_t> cost{0};
        for (int64_t i = 0; i < int64_t(shared_.tiles.size()); ++i)
            for (int64_t h = 0; h < kv_heads_; ++h) {
                tasks.emplace_back(h, i);
                cost.push_back(cost.back() + shared_.tiles[i].rows * (kPartition + 32));
            }
        const std::vector<int64_t> first =
            balanced_runs(cost, std::min<int64_t>(threads_, int64_t(tasks.size())));
        at::parallel_for(0, int64_t(first.size()) - 1, 1, [&](int64_t begin, int64_t end) {
            const FlushDenormals flush;
            AttentionScratch w(row_heads_, q_stride_, 1);
            std::vector<float> m(row_heads_), s(row_heads_), acc(row_heads_ * d_);
            for (int64_t task = first[begin], touched = -1; task < first[end]; ++task) {
                const auto [h, i] = tasks[task];
                const SharedTile& tile = shared_.tiles[i];
                const int64_t* rows = shared_.units.data() + tile.first;
                if (touched != i) touch_partition(kv_, table_of(unit_start_[rows[0]]), tile.part);
                touched = i;
                attend_shared(w, tile, rows, h, m.data(), s.data(), acc.data());
                for (int64_t r = 0; r < tile.rows; ++r) {
                    const int64_t at = shared_at(h, rows[r], tile.part);
                    std::memcpy(shared_m_.get() + at, m.data() + r * group_,
                                sizeof(float) * group_);
                    std::memcpy(shared_s_.get() + at, s.data() + r * group_,
                                sizeof(float) * group_);
                    std::memcpy(shared_acc_.get() + at * d_, acc.data() + r * acc_size_,
                                sizeof(float) * acc_size_);
                }
            }
        });
    }

    // Items (unit, KV head), unit by unit; but a chunk's tiles (units of the next positions of
    // one sequence) in runs of up to kRunTiles, each run KV head by KV head, so that a thread
    // computes a run's tiles of one KV head partition by partition, transposing each
    // partition's keys once for them all. Each thread a run of whole items of about equal cost:
    // contexts differ, so equal counts would leave one thread idle.
    void run_by_items() {
        std::vector<char> continues(units_, 0);  // unit u is the tile after unit u - 1
        for (int64_t u = 1; u < units_; ++u) {
            const int64_t t = unit_start_[u];
            continues[u] = window_ <= 0 && unit_start_[u + 1] - t > 1 &&
                           t - unit_start_[u - 1] > 1 && seq_[t] == seq_[t - 1] &&
                           pos_[t] == pos_[t - 1] + 1;
        }
        std::vector<std::pair<int64_t, int64_t>> order;  // (unit, KV head)
        int64_t longest = 1;
        for (int64_t u = 0; u < units_;) {
            int64_t end = u + 1;
            while (end < units_ && continues[end] && end - u < kRunTiles) ++end;
            for (int64_t h = 0; h < kv_heads_; ++h)
                for (int64_t v = u; v < end; ++v) order.emplace_back(v, h);
            longest = std::max(longest, end - u);
            u = end;
        }
        std::vector<int64_t> cost{0};  // a unit's KV heads cost the same
        std::vector<int64_t> unit_cost(units_, 0);
        for (int64_t u = 0; u < units_; ++u)
            for (int part = 0; part < parts_of(unit_start_[u + 1] - 1); ++part)
                unit_cost[u] += part_cost(u, part);
        for (const auto& [u, h] : order) cost.push_back(cost.back() + unit_cost[u]);
        const std::vector<int64_t> first = balanced_runs(cost, std::min(threads_, items_));
        at::parallel_for(0, int64_t(first.size()) - 1, 1, [&](int64_t begin, int64_t end) {
            const FlushDenormals flush;
            AttentionScratch w(row_heads_, q_stride_, longest);
            // Uninitialised: a unit's merge reads only what its partitions wrote.
            const std::unique_ptr<float[]> m(new float[longest * ms_slot_]),
                s(new float[longest * ms_slot_]), acc(new float[longest * acc_slot_]);
            for (int64_t item = first[begin]; item < first[end];)
                item += run_tiles(w, order, item, first[end], continues, m.get(), s.get(),
                                  acc.get());
        });
    }

    // From ``order[item]``: this thread's next tiles of one chunk and KV head (before
    // ``end``), partition by partition, then merged; returns how many.
    int64_t run_tiles(AttentionScratch& w, const std::vector<std::pair<int64_t, int64_t>>& order,
                      int64_t item, int64_t end, const std::vector<char>& continues, float* m,
                      float* s, float* acc) const {
        const auto [u, h] = order[item];
        int64_t run = 1;
        while (item + run < end && order[item + run].first == u + run &&
               order[item + run].second == h && continues[u + run])
            ++run;
        auto tile_q = [&](int64_t i) { return w.q + i * row_heads_ * q_stride_; };
        for (int64_t i = 0; i < run; ++i) load_queries(tile_q(i), u + i, h);
        for (int part = 0; part < parts_of(unit_start_[u + run] - 1); ++part) {
            int ready = 0;
            for (int64_t i = 0; i < run; ++i)
                if (part < parts_of(unit_start_[u + i + 1] - 1))
                    attend(w, u + i, h, part, m + i * ms_slot_, s + i * ms_slot_,
                           acc + i * acc_slot_, tile_q(i), run > 1 ? &ready : nullptr);
        }
        for (int64_t i = 0; i < run; ++i)
            merge(u + i, h, m + i * ms_slot_, s + i * ms_slot_, acc + i * acc_slot_);
        return run;
    }

    // Few items and long contexts: the (item, partition) tasks in runs of about equal cost,
    // then the same merge. A unit's results sit at its first row's place, each unit sized by
    // its own rows.
    void run_by_partitions() {
        const int64_t head_floats = tokens_ * max_parts_ * group_;
        auto slot_of = [&](int64_t h, int64_t u) {
            return h * head_floats + unit_start_[u] * max_parts_ * group_;
        };
        std::vector<float> m(kv_heads_ * head_floats), s(kv_heads_ * head_floats);
        std::vector<float> acc(kv_heads_ * head_floats * d_);
        std::vector<std::pair<int64_t, int>> tasks;  // (item, partition)
        std::vector<int64_t> cost{0};
        for (int64_t item = 0; item < items_; ++item) {
            const int64_t u = item % units_;
            for (int part = 0; part < parts_of(unit_start_[u + 1] - 1); ++part) {
                tasks.emplace_back(item, part);
                cost.push_back(cost.back() + part_cost(u, part));
            }
        }
        const std::vector<int64_t> first = balanced_runs(cost, threads_);
        at::parallel_for(0, int64_t(first.size()) - 1, 1, [&](int64_t begin, int64_t end) {
            const FlushDenormals flush;
            AttentionScratch w(row_heads_, q_stride_, 1);
            for (int64_t task = first[begin], loaded = -1; task < first[end]; ++task) {
                const auto [item, part] = tasks[task];
                const int64_t h = item / units_, u = item % units_;
                if (loaded != item) load_queries(w.q, u, h);
                loaded = item;
                const int64_t at = slot_of(h, u);
                attend(w, u, h, part, m.data() + at, s.data() + at, acc.data() + at * d_,
                       w.q, nullptr);
            }
        });
        at::parallel_for(0, items_, 1, [&](int64_t begin, int64_t end) {
            const FlushDenormals flush;
            for (int64_t item = begin; item < end; ++item) {
                const int64_t h = item / units_, u = item % units_;
                const int64_t at = slot_of(h, u);
                merge(u, h, m.data() + at, s.data() + at, acc.data() + at * d_);
            }
        });
    }

    const Kernels& k_;
    const int64_t block_size_, window_;
    const double scale_;
    int64_t tokens_ = 0, heads_ = 0, d_ = 0, kv_heads_ = 0, table_width_ = 0;
    int group_ = 1;
    const int32_t *tables_ = nullptr, *seq_ = nullptr, *pos_ = nullptr;
    PagedKv kv_{};
    at::Tensor out_;
    const uint16_t* qin_ = nullptr;
    uint16_t* o_ = nullptr;
    std::vector<int64_t> unit_start_;
    int64_t units_ = 0, row_heads_ = 0, acc_size_ = 0, max_parts_ = 0, ms_slot_ = 0;
    int64_t acc_slot_ = 0, shared_per_head_ = 0, items_ = 0, threads_ = 1;
    int q_stride_ = 0;
    SharedPartitions shared_;
    std::unique_ptr<float[]> shared_m_, shared_s_, shared_acc_;
};

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& key_cache,
                           const at::Tensor& value_cache, const at::Tensor& block_tables,
                           const at::Tensor& token_seq, const at::Tensor& positions,
                           int64_t block_size, int64_t window, double scale) {
    return PagedAttention(q, key_cache, value_cache, block_tables, token_seq, positions,
                          block_size, window, scale)
        .run();
}

bool runs_bf16_gemm() {
    __builtin_cpu_init();
    return runs_avx512() && __builtin_cpu_supports("avx512bf16");
}

// [n, k] bfloat16 rows → gemm512's packed layout at `dst` (zeroed, whole blocks).
void pack_rows(const uint16_t* src, int64_t n, int64_t k, uint16_t* dst) {
    const int64_t blocks = (n + 15) / 16, k_pairs = (k + 1) / 2;
    at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
        for (int64_t b = begin; b < end; ++b)
            for (int64_t lane = 0; lane < 16 && b * 16 + lane < n; ++lane) {
                const uint16_t* row = src + (b * 16 + lane) * k;
                uint16_t* block = dst + b * k_pairs * 32 + lane * 2;
                for (int64_t i = 0; i < k; ++i) block[(i / 2) * 32 + i % 2] = row[i];
            }
    });
}

// [N, K] bfloat16 → the packed layout every GEMM reads, zero-padded to whole blocks.
at::Tensor pack_weight(const at::Tensor& weight) {
    usable();
    TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 &&
                    weight.device().is_cpu(),
                "weight must be a bfloat16 CPU matrix");
    const at::Tensor w = weight.contiguous();
    const int64_t n = w.size(0), k = w.size(1);
    at::Tensor packed = at::zeros({(n + 15) / 16, (k + 1) / 2, 16, 2}, w.options());
    pack_rows(bf16(w), n, k, bf16_mut(packed));
    return packed;
}

using BlocksFn = void (*)(const gemm512::Operands&, int64_t rows, int64_t b0, int64_t b1);

// Rows times every block over torch's threads: threads take runs of whole 16-output blocks, at
// least a tile's worth each, or for a layer of few outputs and many rows whole rows and every
// output (no thread left a ragged share of a few blocks). A row's bits depend on neither.
void spread(const gemm512::Operands& op, int64_t rows, int64_t blocks, BlocksFn run) {
    const int64_t work = rows * op.k * 16;  // multiply-adds per block
    const int64_t grain = std::max<int64_t>(gemm512::kBlocksPerTile, (1 << 16) / work);
    const int64_t threads = at::get_num_threads();
    if (blocks < 32 * threads && rows >= 2 * gemm512::kRowsPerTile * threads) {
        const int64_t per_thread = (rows + threads - 1) / threads;
        at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
            for (int64_t part = begin; part < end; ++part) {
                const int64_t m0 = part * per_thread, m1 = std::min(rows, m0 + per_thread);
                if (m0 >= m1) continue;
                gemm512::Operands rows_op = op;
                rows_op.x = op.x + m0 * op.x_stride;
                rows_op.out = op.out + m0 * op.n;
                run(rows_op, m1 - m0, 0, blocks);
            }
        });
        return;
    }
    at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
        run(op, rows, begin, end);
    });
}

// The AMX GEMM serves only where the unit gives its documented arithmetic's bits on a small
// problem (rows past a whole group, two block pairs' worth of outputs less a ragged block, two
// tiles of K, a bias): checked once, in this process, before the first call.
bool amx_verified() {
    static const bool ok = [] {
        if (!amx::runs_amx() || !runs_bf16_gemm()) return false;
        constexpr int64_t m = 40, k = 64, n = 56, blocks = (n + 15) / 16;
        std::vector<uint16_t> x(m * k), w(n * k), packed(blocks * 16 * k, 0);
        std::vector<uint16_t> real(m * n), emulated(m * n);
        std::vector<float> bias(blocks * 16, 0.0f);
        uint32_t state = 12345;
        auto next = [&state] { return state = state * 1664525u + 1013904223u; };
        // bfloat16 with exponents near 1 and mixed signs: every product matters to the sum.
        for (auto& v : x) v = uint16_t(0x3c00 + (next() >> 20) % 0x0400) | (next() & 0x8000);
        for (auto& v : w) v = uint16_t(0x3c00 + (next() >> 20) % 0x0400) | (next() & 0x8000);
        for (int64_t o = 0; o < n; ++o) bias[o] = float(int(next() % 17) - 8) / 8.0f;
        pack_rows(w.data(), n, k, packed.data());
        gemm512::Operands op{x.data(), k, k, packed.data(), k / 2 * 32, bias.data(), real.data(), n};
        amx::blocks<amx::Tiles>(op, m, 0, blocks);
        op.out = emulated.data();
        amx::blocks<amx::EmulatedTiles>(op, m, 0, blocks);
        return real == emulated;
    }();
    return ok;
}

// The GEMM every projection runs on: "amx" where the unit is verified, else "avx512bf16" where
// the CPU has it, else gemm_vec.h on the widest set it runs ("avx512", "avx2"), with the same
// bits; a test may narrow it (call before serving, never during a call).
std::string& gemm_name() {
    static std::string name = amx_verified()     ? "amx"
                              : runs_bf16_gemm() ? "avx512bf16"
                                                 : std::string(kernels().name);
    return name;
}

bool runs_gemm(const std::string& name) {
    if (name == "amx") return amx_verified();
    if (name == "avx512bf16") return runs_bf16_gemm();
    if (name == "avx512") return runs_avx512();
    return name == "avx2" && runs_avx2();
}

std::string select_gemm(const std::string& name) {
    TORCH_CHECK(runs_gemm(name), "this CPU does not run the ", name, " GEMM");
    gemm_name() = name;
    return name;
}

// x [M, K] bfloat16 (unit inner stride) times a packed weight of N outputs, plus an optional
// bias (any float dtype; float32 spares a conversion per call), added in float32 before the one
// rounding to bfloat16. `path`: the GEMM (gemm_name() when empty; "amx-emulated" for the tests);
// the AMX GEMM takes a layer only when K is a multiple of 32, a fixed choice per layer.
at::Tensor linear_on(const at::Tensor& x, const at::Tensor& packed,
                     const c10::optional<at::Tensor>& bias, int64_t n, const std::string& path) {
    check_rows(x, "x");
    TORCH_CHECK(packed.dim() == 4 && packed.size(2) == 16 && packed.size(3) == 2 &&
                    packed.scalar_type() == at::kBFloat16 && packed.is_contiguous(),
                "packed weight: [N/16, K/2, 16, 2] bfloat16 from pack_weight");
    const int64_t rows = x.size(0), k = x.size(1), blocks = packed.size(0);
    TORCH_CHECK(packed.size(1) == (k + 1) / 2 && (n + 15) / 16 == blocks,
                "x and the packed weight disagree in shape");
    at::Tensor out = at::empty({rows, n}, x.options());
    if (rows == 0) return out;
    at::Tensor bias32;
    if (bias) {
        bias32 = bias->to(at::kFloat).contiguous();  // no copy for a float32 bias
        TORCH_CHECK(bias32.numel() == n, "one bias per output");
        if (blocks * 16 != n) bias32 = at::constant_pad_nd(bias32, {0, blocks * 16 - n});
    }
    const float* b = bias ? bias32.data_ptr<float>() : nullptr;
    const gemm512::Operands op{bf16(x), x.stride(0), k, bf16(packed), (k + 1) / 2 * 32,
                               b,       bf16_mut(out), n};
    const std::string& chosen = path.empty() ? gemm_name() : path;
    if (chosen == "amx-emulated") {
        TORCH_CHECK(k % 32 == 0, "the AMX GEMM takes K a multiple of 32");
        spread(op, rows, blocks, &amx::blocks<amx::EmulatedTiles>);
        return out;
    }
    TORCH_CHECK(runs_gemm(chosen), "this CPU does not run the ", chosen, " GEMM");
    if (chosen == "amx" && k % 32 == 0)
        spread(op, rows, blocks, &amx::blocks<amx::Tiles>);
    else if (chosen == "amx" || chosen == "avx512bf16")
        spread(op, rows, blocks, &gemm512::blocks);
    else if (chosen == "avx512")
        spread(op, rows, blocks, avx512_kernels().gemm_blocks);
    else
        spread(op, rows, blocks, avx2_kernels().gemm_blocks);
    return out;
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& packed,
                  const c10::optional<at::Tensor>& bias, int64_t n) {
    return linear_on(x, packed, bias, n, "");
}

// x [M, K] bfloat16 times a quantized weight of N outputs packed by quant/packing.py in the
// format described by the integers (quant_gemm.h's Format), plus an optional bias added in
// float32 before the one rounding to bfloat16. On every instruction set the same bits.
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n, int64_t bits,
                        int64_t offset, bool has_min, int64_t sub, int64_t super,
                        const c10::optional<at::Tensor>& bias) {
    const Kernels& k = usable();
    check_rows(x, "x");
    const int64_t rows = x.size(0), inputs = x.size(1), groups = (n + 15) / 16;
    const QuantFormat f{int(bits), int(offset), has_min, int(sub), int(super)};
    TORCH_CHECK(bits == 4 || bits == 5 || bits == 8, "codes of 4, 5 or 8 bits");
    TORCH_CHECK((sub == 16 || sub == 32) && super % sub == 0 && inputs % super == 0,
                "the inputs must be whole super-blocks of whole sub-blocks");
    TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                    packed.numel() == groups * (inputs / super) * f.record_bytes(),
                "packed weight: uint8 records of quant/packing.py for this shape and format");
    at::Tensor out = at::empty({rows, n}, x.options());
    if (rows == 0) return out;
    TORCH_CHECK(inputs % 32 == 0, "the inputs must be whole blocks of 32");
    // The rounded inputs in one allocation (a decode step makes hundreds of these calls):
    // [rows][k] int16, [rows][k] int8, [rows][k / 32] float steps, [rows][k / 16] int32 sums.
    const int64_t values = rows * inputs;
    const at::Tensor scratch = at::empty({values * 3 + values / 32 * 4 + values / 16 * 4},
                                         x.options().dtype(at::kByte));
    uint8_t* const base = scratch.data_ptr<uint8_t>();
    int16_t* const xq = reinterpret_cast<int16_t*>(base);
    int8_t* const xq8 = reinterpret_cast<int8_t*>(base + values * 2);
    float* const xstep = reinterpret_cast<float*>(base + values * 3);
    int32_t* const xsum = reinterpret_cast<int32_t*>(base + values * 3 + values / 32 * 4);
    // Rows per task as the per-row kernels take them: a decode step's few rows are rounded
    // inline, not across a fork and join of every thread.
    at::parallel_for(0, rows, grain(inputs), [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r)
            k.quantize_row(bf16(x) + r * x.stride(0), inputs, xq + r * inputs, xq8 + r * inputs,
                           xstep + r * (inputs / 32), xsum + r * (inputs / 16));
    });
    at::Tensor bias32;
    if (bias) {
        bias32 = bias->to(at::kFloat).contiguous();
        TORCH_CHECK(bias32.numel() == n, "one bias per output");
        if (groups * 16 != n) bias32 = at::constant_pad_nd(bias32, {0, groups * 16 - n});
    }
    const QuantOperands op{xq,
                           xq8,
                           xstep,
                           xsum,
                           inputs,
                           packed.data_ptr<uint8_t>(),
                           f,
                           bias ? bias32.data_ptr<float>() : nullptr,
                           bf16_mut(out),
                           n};
    // Groups per task: at least ~2^18 multiply-adds, so one row's step still splits its
    // outputs over the threads (and a task is never a single small group).
    const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 18) / (16 * rows * inputs));
    at::parallel_for(0, groups, grain, [&](int64_t begin, int64_t end) {
        k.quant_groups(op, rows, begin, end);
    });
    return out;
}

// Rows (outputs) `rows` of a packed quantized weight of `k` inputs as bfloat16 [len, k]: an
// embedding table's lookups, the dequantized path's values.
at::Tensor quant_rows(const at::Tensor& packed, const at::Tensor& rows, int64_t n, int64_t k,
                      int64_t bits, int64_t offset, bool has_min, int64_t sub, int64_t super) {
    const Kernels& kern = usable();
    const QuantFormat f{int(bits), int(offset), has_min, int(sub), int(super)};
    TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                    packed.numel() == (n + 15) / 16 * (k / super) * f.record_bytes(),
                "packed weight: uint8 records of quant/packing.py for this shape and format");
    const at::Tensor ids = rows.to(at::kLong).contiguous();
    TORCH_CHECK(ids.dim() == 1 && (ids.numel() == 0 || (ids.min().item<int64_t>() >= 0 &&
                                                        ids.max().item<int64_t>() < n)),
                "row ids out of range");
    at::Tensor out = at::empty({ids.numel(), k}, packed.options().dtype(at::kBFloat16));
    const QuantOperands op{nullptr, nullptr, nullptr, nullptr, k, packed.data_ptr<uint8_t>(),
                           f,       nullptr, nullptr, n};
    at::parallel_for(0, ids.numel(), 16, [&](int64_t begin, int64_t end) {
        kern.quant_rows(op, ids.data_ptr<int64_t>() + begin, end - begin,
                        bf16_mut(out) + begin * k);
    });
    return out;
}

std::string isa() {
    return kernels().name;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("isa", &isa, "the instruction set the kernels run on: avx512, avx2 or none");
    m.def("select_isa", &select_isa);
    m.def("rms_norm", &rms_norm);
    m.def("add_rms_norm", &add_rms_norm);
    m.def("silu_mul", &silu_mul);
    m.def("rotary_write", &rotary_write);
    m.def("paged_attention", &paged_attention);
    m.def("has_gemm", [] { return kernels().gemm_blocks != nullptr; }, "a GEMM of ours serves");
    m.def("pack_weight", &pack_weight);
    m.def("linear", &linear);
    m.def("linear_on", &linear_on);
    m.def("gemm", [] { return gemm_name(); }, "the GEMM the projections run on");
    m.def("select_gemm", &select_gemm);
    m.def("runs_gemm", &runs_gemm, "whether this CPU runs the named GEMM");
    m.def("quant_linear", &quant_linear);
    m.def("quant_rows", &quant_rows);
    m.def("runs_amx", &amx::runs_amx);
}
