// How a paged_attention call cuts its work: balanced runs of jobs, the blocks of a partition,
// the partitions that decode rows of several sequences share, the sweep that brings a shared
// partition into the cache, and each thread's scratch (paged_attention.cpp;
// attention_choice.cpp for its scratch).
#pragma once

#include <c10/util/Exception.h>

#include <vector>

#include "kernel_types.h"

namespace cpu {

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

// The pool's keys and values (`position_bytes` a position: every KV head's row) in blocks of
// `block_size` positions.
struct PoolBytes {
    const char *keys, *values;
    int64_t block_size, position_bytes;
};

static void touch_partition(const PoolBytes& pool, const int32_t* table, int part) {
    const int64_t block_bytes = pool.block_size * pool.position_bytes;
    const char* regions[2 * kPartition];  // keys and values of each block
    int count = 0;
    const auto [first_block, end_block] = partition_blocks(part, pool.block_size);
    for (int64_t b = first_block; b < end_block; ++b)
        for (const char* base : {pool.keys, pool.values})
            regions[count++] = base + table[b] * block_bytes;
    uint8_t sink = 0;
    for (int first = 0; first < count; first += kSweepStreams)
        for (int64_t line = 0; line < block_bytes; line += 64)
            for (int r = first; r < std::min(count, first + kSweepStreams); ++r)
                sink ^= *reinterpret_cast<const volatile uint8_t*>(regions[r] + line);
    asm volatile("" ::"r"(sink));
}

// A thread's scratch for one call: ``tiles`` tiles' queries (zeroed: their padding past
// head_dim is read), a tile's probabilities and scores, the vector scratch of attend_tile
// (attend.h) and, from an int8 pool (``kv_head_dim`` > 0), a partition's keys and values in
// bfloat16, each from a 64-byte boundary (the others uninitialised: each is written before it
// is read). The memory is the thread's own, kept for its later calls and grown when one
// needs more: a decode step makes a call per layer, and allocating and zeroing ~300 KB per
// thread each time cost as much as a short context's attention.
struct AttentionScratch {
    uint16_t* q;
    uint16_t* probs;
    float* scores;
    char* vectors;
    uint16_t *keys, *values;  // [kPartition][kv_head_dim]
    AttentionScratch(int64_t row_heads, int q_stride, int64_t tiles, int64_t kv_head_dim = 0) {
        auto whole_lines = [](int64_t bytes) { return (bytes + 63) / 64 * 64; };
        const int64_t q_bytes = whole_lines(tiles * row_heads * q_stride * 2);
        const int64_t probs_bytes = whole_lines(row_heads * (kPartition + 2) * 2);
        const int64_t scores_bytes = whole_lines(row_heads * kScoreStride * 4);
        const int64_t vector_bytes = whole_lines(kVectorScratch);
        const int64_t kv_bytes = whole_lines(kPartition * kv_head_dim * 2);
        const int64_t total = q_bytes + probs_bytes + scores_bytes + vector_bytes + 2 * kv_bytes;
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
        vectors = at += scores_bytes;
        keys = reinterpret_cast<uint16_t*>(at += vector_bytes);
        values = reinterpret_cast<uint16_t*>(at + kv_bytes);
    }
};

// The block table of int8_rows' pool.
constexpr int32_t kOneBlock[1] = {0};

// Positions start .. start + n - 1 of a sequence (its block table) in an int8 pool, KV heads
// first_head .. first_head + heads - 1, read back as bfloat16 into the thread's scratch: a pool
// of one block (kOneBlock) of ``heads`` heads, that the kernels read as they read the bfloat16
// pool, so every path sees the same values. Position by position, each position's rows in the
// order the pool holds them: a lone row's partition (where attend_int8_row_heads does not
// serve) reads every head in one stream through memory. The scratch holds kPartition * heads * d values.
static PagedKv int8_rows(const Kernels& k, const PoolBytes& pool, int64_t kv_heads, int64_t d,
                         const int32_t* table, int start, int n, int64_t first_head,
                         int64_t heads, AttentionScratch& w) {
    const int64_t row_bytes = d + kKvScaleBytes, size = pool.block_size;
    thread_local std::vector<int64_t> offsets;
    offsets.resize(size_t(n * heads));
    for (int j = 0; j < n; ++j) {
        const int64_t p = start + j;
        const int64_t first = (int64_t(table[p / size]) * size + p % size) * kv_heads + first_head;
        for (int64_t h = 0; h < heads; ++h) offsets[j * heads + h] = (first + h) * row_bytes;
    }
    const int rows = int(n * heads);
    k.kv_rows_bf16(reinterpret_cast<const uint8_t*>(pool.keys), offsets.data(), rows, int(d),
                   w.keys);
    k.kv_rows_bf16(reinterpret_cast<const uint8_t*>(pool.values), offsets.data(), rows, int(d),
                   w.values);
    return PagedKv{w.keys, w.values, int(heads), int(d), kPartition};
}

// A tile's partition of KV head h in an int8 pool (int8_rows): the tile's first key is then
// the block's first.
static PagedKv int8_partition(const Kernels& k, const PoolBytes& pool, int64_t kv_heads,
                              int64_t d, const int32_t* table, int64_t h, Tile& tile,
                              AttentionScratch& w) {
    const PagedKv rows =
        int8_rows(k, pool, kv_heads, d, table, tile.start, tile.n[tile.rows - 1], h, 1, w);
    tile.start = 0;
    return rows;
}

}  // namespace cpu
