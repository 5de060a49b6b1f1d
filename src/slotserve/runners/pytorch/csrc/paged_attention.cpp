// Paged attention over the pool, reading every key and value where it lies.
//
// Work unit: up to kTileRows consecutive positions of one sequence (a prefill chunk's rows, with
// no sliding window), or one row, times one KV head (a lone row past one partition: every KV
// head, attend_heads.h); its partitions computed by attend_tile (attend.h; attention.h states
// the arithmetic of a row) and merged per row in partition order. Units run token-major, so a
// cached prefix that rows share stays in the last-level cache between them, each thread taking
// a run of units' KV heads of about equal cost (keys read); a chunk's next tiles of one KV head
// on one thread share each partition's transposed keys. With few units, long contexts or one
// unit past a thread's share, the partitions themselves are spread over the threads that way
// and merged afterwards by the same merge. Lone rows whose sequences hold a whole partition in
// the same blocks (a prefix the cache shares) compute it as one tile of those rows, its keys
// read once for all. A row's bits do not depend on its unit, its thread, the split or its tile.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <numeric>

#include "attention_call.h"
#include "attention_plan.h"
#include "cpu_kernels.h"

namespace cpu {

// One paged_attention call: its checked inputs, its tokens cut into units, the shared tiles'
// results, and the two ways of spreading the units over the threads (see above).
class PagedAttention : AttentionCall {
public:
    PagedAttention(const at::Tensor& q, const at::Tensor& key_cache,
                   const at::Tensor& value_cache, const at::Tensor& block_tables,
                   const at::Tensor& token_seq, const at::Tensor& positions, int64_t block_size,
                   int64_t window, double scale)
        : AttentionCall(q, key_cache, value_cache, block_tables, token_seq, positions, block_size,
                        window),
          k_(usable()),
          scale_(scale) {
        const auto* keys = static_cast<const char*>(key_cache.data_ptr());
        const auto* values = static_cast<const char*>(value_cache.data_ptr());
        pool_ = {keys, values, block_size, kv_heads_ * (int8_ ? d_ + kKvScaleBytes : d_ * 2)};
        kv_ = {reinterpret_cast<const uint16_t*>(keys), reinterpret_cast<const uint16_t*>(values),
               int(kv_heads_), int(d_), int(block_size), int8_};
        out_ = at::empty({tokens_, heads_ * d_}, q.options());
        o_ = bf16_mut(out_);
        row_heads_ = int64_t(kTileRows) * group_;
        acc_size_ = int64_t(group_) * d_;
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
        unit_cost_.assign(units_, 0);  // one KV head's
        for (int64_t u = 0; u < units_; ++u)
            for (int part = 0; part < parts_of(unit_start_[u + 1] - 1); ++part)
                unit_cost_[u] += part_cost(u, part);
        for (int64_t u = 0; u < units_; ++u)
            if (whole_positions(u)) items_.push_back({u, -1});
        for (int64_t h = 0; h < kv_heads_; ++h)
            for (int64_t u = 0; u < units_; ++u)
                if (!whole_positions(u)) items_.push_back({u, h});
        threads_ = at::get_num_threads();
    }

    at::Tensor run() {
        if (!shared_.tiles.empty()) run_shared_tiles();
        if (max_parts_ > 1 && (int64_t(items_.size()) < 4 * threads_ || lopsided()))
            run_by_partitions();
        else
            run_by_items();
        return out_;
    }

private:
    // Whether one item would take more than a thread's share of the work.
    bool lopsided() const {
        std::vector<int64_t> cost;
        for (const auto& [u, h] : items_) cost.push_back(unit_cost_[u] * (h < 0 ? kv_heads_ : 1));
        return *std::max_element(cost.begin(), cost.end()) * threads_ >
               std::accumulate(cost.begin(), cost.end(), int64_t(0));
    }

    int64_t shared_at(int64_t h, int64_t u, int64_t part) const {
        return h * shared_per_head_ + (shared_.place[u] * max_parts_ + part) * group_;
    }

    // Unit u's partition ``part`` for KV head h, its queries at ``q``; ``ready``: see Tile.
    void attend(AttentionScratch& w, int64_t u, int64_t h, int64_t part, float* m, float* s,
                float* acc, const uint16_t* q, PartitionReady* ready) const {
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
                  w.scores, w.probs, w.vectors, ready,
                  w.vectors + kKeysBytes, m + ms, s + ms, acc + ms * d_};
        attend_tile(w, h, table_of(t0), tile);
    }

    // A lone row's (unit u's) partition ``part`` for every KV head, head h's results at
    // ``m + h * step``, ``s + h * step`` and ``acc + h * step * d``.
    void attend_heads(AttentionScratch& w, int64_t u, int64_t part, float* m, float* s,
                      float* acc, int64_t step) const {
        const int64_t t0 = unit_start_[u];
        if (shared_.covers(u, int(part))) {
            for (int64_t h = 0; h < kv_heads_; ++h)
                attend(w, u, h, part, m + h * step, s + h * step, acc + h * step * d_, w.q,
                       nullptr);
            return;
        }
        const int start = int(part) * kPartition;
        const int n[1] = {std::clamp(pos_[t0] + 1 - start, 0, kPartition)};
        if (n[0] == 0) return;
        for (int64_t h = 0; h < kv_heads_; ++h) load_query(w.q, t0, h, h);
        Tile tiles[kTileRows];
        auto tiles_from = [&](int first, int beyond) {
            for (int64_t h = 0; h < kv_heads_; ++h) {
                const int64_t rh = h * group_, ms = h * step + part * group_;
                tiles[h] = Tile{w.q + rh * q_stride_, q_stride_, group_, 1, n, first,
                                float(scale_), w.scores + rh * kScoreStride,
                                w.probs + rh * (kPartition + 2), w.vectors, nullptr,
                                w.vectors + kKeysBytes, m + ms, s + ms, acc + ms * d_, beyond};
            }
            return tiles;
        };
        const int32_t* table = table_of(t0);
        const int beyond = pos_[t0] + 1 - start - n[0];
        if (amx_ != AmxAttention::none)  // whole_positions: a shape it has
            return (void)k_.attend_amx_row_heads(kv_, table, tiles_from(start, beyond),
                                                 amx_ == AmxAttention::emulated);
        if (!int8_) return k_.attend_row_heads(kv_, table, tiles_from(start, beyond));
        // An int8 pool's rows are read in place where the kernels have the shape; else the
        // partition is read back into the scratch first, where its keys then start.
        if (k_.attend_int8_row_heads(kv_, table, tiles_from(start, beyond))) return;
        const PagedKv back =
            int8_rows(k_, pool_, kv_heads_, d_, table, start, n[0], 0, kv_heads_, w);
        k_.attend_row_heads(back, kOneBlock, tiles_from(0, 0));
    }

    // A tile's partition of KV head h (from an int8 pool: int8_partition's bfloat16 rows).
    void attend_tile(AttentionScratch& w, int64_t h, const int32_t* table, Tile tile) const {
        if (!int8_) return partition(kv_, int(h), table, tile);
        const PagedKv rows = int8_partition(k_, pool_, kv_heads_, d_, table, h, tile, w);
        partition(rows, 0, kOneBlock, tile);
    }

    void partition(const PagedKv& kv, int h, const int32_t* table, const Tile& tile) const {
        if (amx_ == AmxAttention::none) return k_.attend_tile(kv, h, table, tile);
        k_.attend_amx(kv, h, table, tile, amx_ == AmxAttention::emulated);  // attend_amx.h
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
        attend_tile(w, h, table_of(unit_start_[tile_units[0]]), tile);
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
            AttentionScratch w(row_heads_, q_stride_, 1, int8_ ? d_ : 0);
            std::vector<float> m(row_heads_), s(row_heads_), acc(row_heads_ * d_);
            for (int64_t task = first[begin], touched = -1; task < first[end]; ++task) {
                const auto [h, i] = tasks[task];
                const SharedTile& tile = shared_.tiles[i];
                const int64_t* rows = shared_.units.data() + tile.first;
                if (touched != i) touch_partition(pool_, table_of(unit_start_[rows[0]]), tile.part);
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
            if (whole_positions(u))
                order.emplace_back(u, -1);  // every KV head
            else
                for (int64_t h = 0; h < kv_heads_; ++h)
                    for (int64_t v = u; v < end; ++v) order.emplace_back(v, h);
            longest = std::max(longest, end - u);
            u = end;
        }
        std::vector<int64_t> cost{0};  // a unit's KV heads cost the same
        for (const auto& [u, h] : order)
            cost.push_back(cost.back() + unit_cost_[u] * (h < 0 ? kv_heads_ : 1));
        const std::vector<int64_t> first =
            balanced_runs(cost, std::min(threads_, int64_t(order.size())));
        if (!items_.empty() && items_[0].second < 0) longest = std::max(longest, kv_heads_);
        at::parallel_for(0, int64_t(first.size()) - 1, 1, [&](int64_t begin, int64_t end) {
            const FlushDenormals flush;
            AttentionScratch w(row_heads_, q_stride_, longest, int8_ ? kv_heads_ * d_ : 0);
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
        if (h < 0) {  // a lone row, every KV head
            for (int part = 0; part < parts_of(unit_start_[u + 1] - 1); ++part)
                attend_heads(w, u, part, m, s, acc, ms_slot_);
            for (int64_t x = 0; x < kv_heads_; ++x)
                merge(u, x, m + x * ms_slot_, s + x * ms_slot_, acc + x * acc_slot_);
            return 1;
        }
        int64_t run = 1;
        while (item + run < end && order[item + run].first == u + run &&
               order[item + run].second == h && continues[u + run])
            ++run;
        auto tile_q = [&](int64_t i) { return w.q + i * row_heads_ * q_stride_; };
        for (int64_t i = 0; i < run; ++i) load_queries(tile_q(i), u + i, h);
        for (int part = 0; part < parts_of(unit_start_[u + run] - 1); ++part) {
            PartitionReady ready;
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
        for (int64_t item = 0; item < int64_t(items_.size()); ++item) {
            const auto [u, h] = items_[item];
            for (int part = 0; part < parts_of(unit_start_[u + 1] - 1); ++part) {
                tasks.emplace_back(item, part);
                cost.push_back(cost.back() + part_cost(u, part) * (h < 0 ? kv_heads_ : 1));
            }
        }
        const std::vector<int64_t> first = balanced_runs(cost, threads_);
        at::parallel_for(0, int64_t(first.size()) - 1, 1, [&](int64_t begin, int64_t end) {
            const FlushDenormals flush;
            AttentionScratch w(row_heads_, q_stride_, 1, int8_ ? kv_heads_ * d_ : 0);
            for (int64_t task = first[begin], loaded = -1; task < first[end]; ++task) {
                const auto [item, part] = tasks[task];
                const auto [u, h] = items_[item];
                if (h < 0) {
                    const int64_t at = slot_of(0, u);
                    attend_heads(w, u, part, m.data() + at, s.data() + at, acc.data() + at * d_,
                                 head_floats);
                    loaded = -1;  // the queries' scratch now holds every head's
                    continue;
                }
                if (loaded != item) load_queries(w.q, u, h);
                loaded = item;
                const int64_t at = slot_of(h, u);
                attend(w, u, h, part, m.data() + at, s.data() + at, acc.data() + at * d_,
                       w.q, nullptr);
            }
        });
        at::parallel_for(0, int64_t(items_.size()), 1, [&](int64_t begin, int64_t end) {
            const FlushDenormals flush;
            for (int64_t item = begin; item < end; ++item) {
                const auto [u, one] = items_[item];  // one KV head, or -1: every one
                const int64_t first_head = std::max<int64_t>(one, 0);
                for (int64_t h = first_head; h < (one < 0 ? kv_heads_ : one + 1); ++h) {
                    const int64_t at = slot_of(h, u);
                    merge(u, h, m.data() + at, s.data() + at, acc.data() + at * d_);
                }
            }
        });
    }

    const Kernels& k_;
    const double scale_;
    PagedKv kv_{};
    PoolBytes pool_{};
    at::Tensor out_;
    uint16_t* o_ = nullptr;
    int64_t row_heads_ = 0, acc_size_ = 0, max_parts_ = 0, ms_slot_ = 0;
    int64_t acc_slot_ = 0, shared_per_head_ = 0, threads_ = 1;
    std::vector<std::pair<int64_t, int64_t>> items_;  // (unit, KV head, or -1: every one)
    std::vector<int64_t> unit_cost_;                   // one KV head's partitions, by unit
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

}  // namespace cpu
