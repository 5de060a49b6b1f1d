// Which arithmetic attention runs in: AMX tiles (attend_amx.h) on a host whose unit gives its
// documented bits on a small attention problem, else the vector arithmetic that every
// instruction set shares (attention.h). One choice per process, so every row of a model has one
// arithmetic; the tests may narrow it before serving ("vector", or "amx-emulated": the tile
// code over tiles emulated in scalar code, on any CPU with AVX512-BF16).

#include <string>
#include <vector>

#include "amx_tiles.h"
#include "attention_plan.h"
#include "cpu_kernels.h"

namespace cpu {

namespace {

// One partition of a small problem through attend_amx, real or emulated: a tile of three rows
// (nine row-heads: a whole A tile and a partial one) over 48 keys in three scattered blocks;
// the bits of every row-head's m, s and acc.
std::vector<float> amx_sample(const Kernels& k, bool emulated) {
    constexpr int kDim = 64, kGroup = 3, kRowsOf = 3, kKeys = 48, kHeads = kGroup * kRowsOf;
    std::vector<uint16_t> keys(4 * 16 * kDim), values(4 * 16 * kDim);
    amx::CheckValues sample{2024};
    for (auto& v : keys) v = sample.bf16();
    for (auto& v : values) v = sample.bf16();
    const int32_t table[3] = {2, 0, 3};
    const PagedKv kv{keys.data(), values.data(), 1, kDim, 16};
    AttentionScratch w(kHeads, kDim, 1);
    for (int i = 0; i < kHeads * kDim; ++i) w.q[i] = sample.bf16();
    const int n[kRowsOf] = {kKeys - 7, kKeys - 2, kKeys};
    std::vector<float> result(kHeads * (kDim + 2));
    float* m = result.data();
    Tile tile{w.q, kDim, kGroup, kRowsOf, n, 0, 0.125f, w.scores, w.probs, w.vectors, nullptr,
              w.vectors + kKeysBytes, m, m + kHeads, m + 2 * kHeads};
    const FlushDenormals flush;
    k.attend_amx(kv, 0, table, tile, emulated);
    return result;
}

bool amx_attention_verified() {
    static const bool ok = [] {
        if (!amx_verified()) return false;  // the unit is there, usable, and right for GEMMs
        const Kernels k = avx512bf16::table();
        const std::vector<float> real = amx_sample(k, false), emulated = amx_sample(k, true);
        return std::memcmp(real.data(), emulated.data(), sizeof(float) * real.size()) == 0;
    }();
    return ok;
}

}  // namespace

std::string& attention_name() {
    static std::string name = amx_attention_verified() ? "amx" : "vector";
    return name;
}

bool runs_attention(const std::string& name) {
    if (name == "amx") return amx_attention_verified();
    if (name == "amx-emulated") return kernels().attend_amx != nullptr;
    return name == "vector";
}

std::string select_attention(const std::string& name) {
    TORCH_CHECK(runs_attention(name), "this CPU does not run attention on ", name);
    attention_name() = name;
    return name;
}

AmxAttention amx_attention(const Kernels& k, int64_t head_dim) {
    const std::string& name = attention_name();
    if (k.attend_amx == nullptr || head_dim % 32 != 0 || name == "vector")
        return AmxAttention::none;
    return name == "amx" ? AmxAttention::tiles : AmxAttention::emulated;
}

}  // namespace cpu
