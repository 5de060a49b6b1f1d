// One paged_attention call's inputs, checked, and its tokens cut into units, with where each
// token's keys start, how many partitions they span and how its queries enter a tile (included
// once, by paged_attention.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstring>
#include <vector>

#include "cpu_kernels.h"

namespace cpu {

struct AttentionCall {
    AttentionCall(const at::Tensor& q, const at::Tensor& key_cache, const at::Tensor& value_cache,
                  const at::Tensor& block_tables, const at::Tensor& token_seq,
                  const at::Tensor& positions, int64_t block_size, int64_t window)
        : block_size_(block_size), window_(window) {
        check(q, key_cache, value_cache, block_tables, token_seq, positions);
        amx_ = amx_attention(usable(), d_);
        qin_ = bf16(q);
        q_stride_ = int((d_ / 2 + kLanes - 1) / kLanes * kLanes * 2);
        cut_units();
    }

    void check(const at::Tensor& q, const at::Tensor& key_cache, const at::Tensor& value_cache,
               const at::Tensor& block_tables, const at::Tensor& token_seq,
               const at::Tensor& positions) {
        TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && q.scalar_type() == at::kBFloat16,
                    "q must be contiguous bfloat16 [tokens, heads, head_dim]");
        TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(),
                    "caches: contiguous");
        int8_ = key_cache.scalar_type() == at::kByte;  // uint8 rows: kernel_types.h
        TORCH_CHECK(value_cache.scalar_type() == key_cache.scalar_type() &&
                        (int8_ || key_cache.scalar_type() == at::kBFloat16),
                    "caches: both bfloat16, or both uint8 rows of int8 codes and a scale");
        TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.is_contiguous() &&
                        block_tables.dim() == 2,
                    "block tables: int32 [sequences, blocks]");
        TORCH_CHECK(token_seq.scalar_type() == at::kInt && positions.scalar_type() == at::kInt,
                    "token sequences and positions must be int32");
        tokens_ = q.size(0), heads_ = q.size(1), d_ = q.size(2);
        kv_heads_ = key_cache.size(1);
        TORCH_CHECK(d_ % kLanes == 0 && d_ <= 256, "head_dim must be a multiple of ", kLanes,
                    " up to 256");
        const int64_t row = d_ + (int8_ ? kKvScaleBytes : 0);
        TORCH_CHECK(heads_ % kv_heads_ == 0 && key_cache.size(2) == row &&
                        value_cache.sizes() == key_cache.sizes(), "head shapes disagree");
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

    // Token t's query heads of KV head h as row r of the tile at ``q`` (rows q_stride_ apart).
    void load_query(uint16_t* q, int64_t t, int64_t r, int64_t h) const {
        for (int g = 0; g < group_; ++g)
            std::memcpy(q + (r * group_ + g) * q_stride_,
                        qin_ + (t * heads_ + h * group_ + g) * d_, sizeof(uint16_t) * d_);
    }

    void load_queries(uint16_t* q, int64_t u, int64_t h) const {
        for (int64_t t = unit_start_[u]; t < unit_start_[u + 1]; ++t)
            load_query(q, t, t - unit_start_[u], h);
    }

    // Whether unit u is a lone row that reads its partitions for every KV head at once
    // (attend_heads.h, or attend_amx_unit_row.h in the tiles' arithmetic for the shapes compiled
    // there; an int8 pool's rows in place): past one partition (a shorter context is spread
    // over the threads by its heads), no window.
    bool whole_positions(int64_t u) const {
        const int64_t t = unit_start_[u];
        return (amx_ == AmxAttention::none || compiled_attention_shape(d_, group_)) &&
               window_ <= 0 && kv_heads_ > 1 &&
               kv_heads_ <= kTileRows && unit_start_[u + 1] - t == 1 && pos_[t] >= kPartition;
    }

    const int64_t block_size_, window_;
    int64_t tokens_ = 0, heads_ = 0, d_ = 0, kv_heads_ = 0, table_width_ = 0;
    int group_ = 1, q_stride_ = 0;
    const int32_t *tables_ = nullptr, *seq_ = nullptr, *pos_ = nullptr;
    const uint16_t* qin_ = nullptr;
    bool int8_ = false;
    AmxAttention amx_ = AmxAttention::none;
    std::vector<int64_t> unit_start_;
    int64_t units_ = 0;
};

}  // namespace cpu
