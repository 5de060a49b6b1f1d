// A GGUF tensor's blocks repacked into the records quant_gemm.h streams (its comment states
// the layout): each block's codes, scales and minimums read from the file's bit layout (as
// gguf-py's and ggml's decoders read them), then written per group of 16 outputs. Plain scalar
// code for every CPU: it runs once per weight at load, on torch's threads, one group per task,
// so the bytes do not depend on the thread count.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <cstring>

#include "cpu_kernels.h"

namespace cpu {
namespace {

// GGML's type ids (gguf-py's GGMLQuantizationType) of the formats the kernels multiply, and
// past them our own (quant/formats.py's OwnType).
enum GgmlType : int64_t {
    kQ4_0 = 2,
    kQ4_1 = 3,
    kQ5_0 = 6,
    kQ5_1 = 7,
    kQ8_0 = 8,
    kQ4_K = 12,
    kQ5_K = 13,
    kQ6_K = 14,
    // Per 128 inputs: an fp16 scale s, a zero z per 32 inputs (uint8), then each 32's nibbles
    // as Q4_0's: w = s · (q − z), AWQ's and GPTQ's weights exactly (quant/int4_blocks.py).
    kQ4_ZP = 1024
};

// Bytes of one block (one super-block of the format) in the file.
int64_t block_bytes(int64_t type) {
    switch (type) {
        case kQ4_0: return 18;
        case kQ4_1: return 20;
        case kQ5_0: return 22;
        case kQ5_1: return 24;
        case kQ8_0: return 34;
        case kQ4_K: return 144;
        case kQ5_K: return 176;
        case kQ6_K: return 210;
        case kQ4_ZP: return 70;
        default: return 0;
    }
}

// One output's super-block as integers: codes (the file's unsigned codes; Q8_0's int8 as its
// bytes), the fp16 bits of d and dmin, and sc and m per sub-block.
struct Decoded {
    uint8_t codes[256];
    uint16_t d, dmin;
    uint8_t sc[16], m[16];
};

uint16_t fp16_at(const uint8_t* p) {
    uint16_t v;
    std::memcpy(&v, p, 2);
    return v;
}

// A 32-input block's nibbles: input i's low nibble of byte i, input 16 + i's high one; five
// bits take bit i of the 32-bit ``high`` as their fifth.
void legacy_codes(const uint8_t* qs, const uint8_t* high, uint8_t* codes) {
    uint32_t h = 0;
    if (high != nullptr) std::memcpy(&h, high, 4);
    for (int i = 0; i < 16; ++i) {
        codes[i] = uint8_t((qs[i] & 0x0F) | (((h >> i) & 1) << 4));
        codes[16 + i] = uint8_t((qs[i] >> 4) | (((h >> (16 + i)) & 1) << 4));
    }
}

// Q4_K's and Q5_K's twelve bytes of six-bit scales and minimums of eight sub-blocks.
void k_scales(const uint8_t* s, uint8_t* sc, uint8_t* m) {
    for (int j = 0; j < 4; ++j) {
        sc[j] = s[j] & 0x3F;
        m[j] = s[4 + j] & 0x3F;
        sc[4 + j] = uint8_t((s[8 + j] & 0x0F) | ((s[j] >> 2) & 0x30));
        m[4 + j] = uint8_t((s[8 + j] >> 4) | ((s[4 + j] >> 2) & 0x30));
    }
}

void decode_block(int64_t type, const uint8_t* b, Decoded& out) {
    switch (type) {
        case kQ4_0: out.d = fp16_at(b); legacy_codes(b + 2, nullptr, out.codes); break;
        case kQ5_0: out.d = fp16_at(b); legacy_codes(b + 6, b + 2, out.codes); break;
        case kQ4_1:
        case kQ5_1:
            // w = d · q + m: a minimum of −m (its sign bit flipped, as a negation does).
            out.d = fp16_at(b);
            out.dmin = fp16_at(b + 2) ^ 0x8000;
            legacy_codes(type == kQ4_1 ? b + 4 : b + 8, type == kQ4_1 ? nullptr : b + 4,
                         out.codes);
            break;
        case kQ8_0: out.d = fp16_at(b); std::memcpy(out.codes, b + 2, 32); break;
        case kQ4_ZP:
            // scale = d · 1 and min = d · z per sub-block: both exact in float32.
            out.d = out.dmin = fp16_at(b);
            for (int s = 0; s < 4; ++s) {
                out.sc[s] = 1;
                out.m[s] = b[2 + s];
                legacy_codes(b + 6 + 16 * s, nullptr, out.codes + 32 * s);
            }
            break;
        case kQ4_K:
        case kQ5_K: {
            out.d = fp16_at(b);
            out.dmin = fp16_at(b + 2);
            k_scales(b + 4, out.sc, out.m);
            // Sub-block 2c + h: byte 32c + l's nibble h (and bit 2c + h of byte l of qh).
            const uint8_t* qh = type == kQ5_K ? b + 16 : nullptr;
            const uint8_t* qs = type == kQ5_K ? b + 48 : b + 16;
            for (int c = 0; c < 4; ++c)
                for (int h = 0; h < 2; ++h)
                    for (int l = 0; l < 32; ++l) {
                        const int sub = 2 * c + h;
                        const int low = (qs[32 * c + l] >> (4 * h)) & 0x0F;
                        const int high = qh != nullptr ? ((qh[l] >> sub) & 1) << 4 : 0;
                        out.codes[32 * sub + l] = uint8_t(low | high);
                    }
            break;
        }
        case kQ6_K: {
            // Per half n of 128 inputs, quarter u, position l: the low four bits from ql (byte
            // 64n + 32(u % 2) + l, nibble u / 2), the high two from qh (byte 32n + l, bits 2u).
            const uint8_t *ql = b, *qh = b + 128;
            for (int n = 0; n < 2; ++n)
                for (int u = 0; u < 4; ++u)
                    for (int l = 0; l < 32; ++l) {
                        const int low = (ql[64 * n + 32 * (u % 2) + l] >> (4 * (u / 2))) & 0x0F;
                        const int high = (qh[32 * n + l] >> (2 * u)) & 3;
                        out.codes[128 * n + 32 * u + l] = uint8_t(low | (high << 4));
                    }
            std::memcpy(out.sc, b + 192, 16);
            out.d = fp16_at(b + 208);
            break;
        }
    }
}

// The codes of 16 outputs over one super-block in the record's code area (quant_gemm.h).
void write_codes(const Decoded* rows, const QuantFormat& f, uint8_t* r) {
    const int pairs = f.super / 2;
    uint8_t* high = r + int64_t(pairs) * 16;  // five and six bits: the high bits after the nibbles
    if (f.bits == 4 || f.bits == 6) {
        // Per unit of 8 inputs: byte 4j + i, inputs i and 4 + i of output j; six bits' high two
        // in byte 4j + i of the unit's pair's 64 high-plane bytes: an even unit's at bits 4-5
        // (input i's) and 6-7, an odd one's at 0-1 and 2-3.
        if (f.bits == 6) std::memset(high, 0, pairs / 4 * 32);
        for (int u = 0; u < f.super / 8; ++u)
            for (int j = 0; j < 16; ++j)
                for (int i = 0; i < 4; ++i) {
                    const int at = 4 * j + i;
                    const uint8_t a = rows[j].codes[8 * u + i], b = rows[j].codes[8 * u + 4 + i];
                    r[64 * u + at] = uint8_t((a & 0x0F) | ((b & 0x0F) << 4));
                    if (f.bits == 6)
                        high[64 * (u / 2) + at] |=
                            uint8_t(((a >> 4) | ((b >> 4) << 2)) << (u % 2 == 0 ? 4 : 0));
                }
        return;
    }
    // Per input pair, vpmaddwd's words: outputs 0-7's (even, odd) codes ("lo"), then 8-15's.
    if (f.bits == 5) std::memset(high, 0, pairs / 4 * 16);
    for (int p = 0; p < pairs; ++p)
        for (int j = 0; j < 8; ++j)
            for (int e = 0; e < 2; ++e) {
                const int w = 2 * j + e;
                const uint8_t lo = rows[j].codes[2 * p + e], hi = rows[8 + j].codes[2 * p + e];
                if (f.bits == 8) {
                    r[32 * p + w] = lo;
                    r[32 * p + 16 + w] = hi;
                } else {
                    r[16 * p + w] = uint8_t((lo & 0x0F) | ((hi & 0x0F) << 4));
                    high[16 * (p / 4) + w] |= uint8_t((((lo >> 4) & 1) << (2 * (p % 4))) |
                                                      (((hi >> 4) & 1) << (2 * (p % 4) + 1)));
                }
            }
}

// Group g's record of super-block b (16 outputs; rows past n stay zero, as the record's
// padding).
void write_record(const Decoded* rows, const QuantFormat& f, uint8_t* r) {
    for (int j = 0; j < 16; ++j) std::memcpy(r + 2 * j, &rows[j].d, 2);
    r += 32;
    if (f.has_min) {
        for (int j = 0; j < 16; ++j) std::memcpy(r + 2 * j, &rows[j].dmin, 2);
        r += 32;
    }
    if (f.sub_scales()) {
        const int subs = f.sub_blocks();
        for (int s = 0; s < subs; ++s)
            for (int j = 0; j < 16; ++j) r[16 * s + j] = rows[j].sc[s];
        r += 16 * subs;
        if (f.has_min) {
            for (int s = 0; s < subs; ++s)
                for (int j = 0; j < 16; ++j) r[16 * s + j] = rows[j].m[s];
            r += 16 * subs;
        }
    }
    write_codes(rows, f, r);
}

}  // namespace

// raw [rows, k / super · block bytes] uint8, rows of GGUF blocks of ``type``, as the records of
// ``format`` (whole groups of 16 outputs), output j being row ``order[j]`` (int64; none: row
// j), written into ``out`` (uint8, exactly their size: a slice of a larger buffer for a
// projection fused from several tensors).
void quant_pack(const at::Tensor& raw, const c10::optional<at::Tensor>& order, int64_t type,
                int64_t k, int64_t bits, int64_t offset, bool has_min, int64_t sub,
                int64_t super, const at::Tensor& out) {
    const QuantFormat f{int(bits), int(offset), has_min, int(sub), int(super)};
    const int64_t bytes = block_bytes(type);
    TORCH_CHECK(bytes > 0, "GGML type ", type, " is not one the quantized kernels take");
    TORCH_CHECK(k > 0 && k % super == 0, "the inputs must be whole super-blocks");
    TORCH_CHECK(raw.scalar_type() == at::kByte && raw.dim() == 2 && raw.is_contiguous() &&
                    raw.size(1) == k / super * bytes,
                "raw: uint8 rows of whole blocks, contiguous");
    const int64_t* rows = nullptr;
    if (order) {
        TORCH_CHECK(order->scalar_type() == at::kLong && order->dim() == 1 &&
                        order->is_contiguous(),
                    "order: int64 row numbers, contiguous");
        TORCH_CHECK(order->numel() == 0 || (order->min().item<int64_t>() >= 0 &&
                                            order->max().item<int64_t>() < raw.size(0)),
                    "order: row numbers out of range");
        rows = order->data_ptr<int64_t>();
    }
    const int64_t n = rows ? order->numel() : raw.size(0), groups = (n + 15) / 16;
    const int64_t supers = k / super;
    const int64_t record = f.record_bytes();
    TORCH_CHECK(out.scalar_type() == at::kByte && out.is_contiguous() &&
                    out.numel() == groups * supers * record,
                "out: uint8 of the records' size, contiguous");
    const uint8_t* in = raw.data_ptr<uint8_t>();
    uint8_t* records = out.data_ptr<uint8_t>();
    at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
        Decoded outputs[16];
        for (int64_t g = begin; g < end; ++g)
            for (int64_t b = 0; b < supers; ++b) {
                std::memset(outputs, 0, sizeof(outputs));
                for (int64_t j = 0; j < 16 && g * 16 + j < n; ++j) {
                    const int64_t row = rows ? rows[g * 16 + j] : g * 16 + j;
                    decode_block(type, in + (row * supers + b) * bytes, outputs[j]);
                }
                write_record(outputs, f, records + (g * supers + b) * record);
            }
    });
}

}  // namespace cpu
