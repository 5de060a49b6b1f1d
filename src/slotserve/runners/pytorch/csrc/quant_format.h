// What quant_gemm.h reads (included by kernel_types.h, before the per-ISA builds): a
// quantized weight's format and the operands of one projection. quant_gemm.h describes the
// arithmetic and the packed layout.
#pragma once

struct QuantFormat {
    int bits;         // 4, 5, 6 or 8
    int offset;       // subtracted from a code: v = code − offset
    bool has_min;     // weights scale · v − dmin · m
    int sub;          // inputs per sub-block (one sc, m): 16 or 32
    int super;        // inputs per super-block (one d, dmin): 32 or 256

    int sub_blocks() const { return super / sub; }
    // sc and m are stored only where a super-block has sub-blocks (a 32-input type's are one).
    bool sub_scales() const { return sub != super; }
    int64_t header_bytes() const {
        const int per_output = has_min ? 2 : 1;
        return 32 * per_output + (sub_scales() ? int64_t(16) * sub_blocks() * per_output : 0);
    }
    int64_t code_bytes() const {
        const int64_t pairs = super / 2;
        if (bits == 8) return pairs * 32;
        // The low four bits, then the high bits' plane: one bit a code per 4 pairs' 16 bytes,
        // or two per 4 pairs' 32.
        return pairs * 16 + (bits == 5 ? pairs / 4 * 16 : bits == 6 ? pairs / 4 * 32 : 0);
    }
    int64_t record_bytes() const { return header_bytes() + code_bytes(); }
};

// What each row's inputs hold per block of 32 (and per 16), block-major ([blocks][rows]): a
// tile's rows side by side, so that the kernels find a block's values for all of them at one
// address plus constant offsets.
struct InputBlocks {
    float* step;     // [k / 32][rows] each block's step
    float* neg_sum;  // [k / 32][rows] −Σ q of each block, as a float (exact: |Σ q| < 2^24)
    int32_t* sum32;  // [k / 32][rows] Σ q of each block
    int32_t* sum16;  // [k / 16][rows] Σ q of each 16 inputs
    int64_t rows;
};

// Where a step of whole tiles of rows may form its integer sums (quant_amx.h): nowhere but the
// vector path, the AMX unit, or its emulation (tests).
enum class QuantTiles { none, unit, emulated };

struct QuantOperands {
    const int16_t* xq;    // [rows][k] the inputs as integers per block of 32 (quant_gemm.h)
    const int8_t* xq8;    // [rows][k] the same integers as bytes
    InputBlocks blocks;   // their steps and sums
    int64_t k;
    const uint8_t* w;     // [groups][k / super] records
    QuantFormat f;
    const float* bias;    // padded to whole groups, or null
    uint16_t* out;        // [rows][n] bfloat16
    int64_t n;
    QuantTiles tiles = QuantTiles::none;
};
