// The projections whose weights stay quantized (quant_gemm.h's records), spread over torch's
// threads. A row multiplies in one of two arithmetics, chosen by what the row is and never by
// its batch: a generated token's row (a decode step, a draft, an output recomputed) in
// quant_gemm.h's integer sums, which stream the weight once for a step's few rows; a prompt
// token's row in the bfloat16 GEMM over the weight dequantized panel by panel (quant_panel.h):
// the dequantized path's values, so its bits, at the GEMM's speed for a prompt chunk's many rows.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/empty.h>

#include <cstring>
#include <string>
#include <vector>

#include "cpu_kernels.h"

namespace cpu {

namespace {

QuantTiles quant_tiles(const std::string& name) {
    if (name == "amx" && amx_bytes_verified()) return QuantTiles::unit;
    if (name == "amx-emulated") return QuantTiles::emulated;
    TORCH_CHECK(name == "none" || name == "amx", "unknown quantized tiles ", name);
    return QuantTiles::none;
}

// Rows of x (unit stride) times the weight in quant_gemm.h's integer arithmetic into `out`
// ([rows, n]); `op` holds the weight, its format, bias and tiles.
void integer_rows(const Kernels& k, const at::Tensor& x, QuantOperands op, at::Tensor& out) {
    const int64_t rows = x.size(0), inputs = x.size(1), groups = (op.n + 15) / 16;
    // The rounded inputs in one allocation (a decode step makes hundreds of these calls):
    // [rows][k] int16, [rows][k] int8, then per block of 32 a float step, −Σ q as a float and
    // Σ q, and Σ q per 16 (InputBlocks).
    const int64_t values = rows * inputs, blocks = values / 32;
    const at::Tensor scratch = at::empty({values * 3 + blocks * 3 * 4 + blocks * 2 * 4},
                                         x.options().dtype(at::kByte));
    uint8_t* const base = scratch.data_ptr<uint8_t>();
    int16_t* const xq = reinterpret_cast<int16_t*>(base);
    int8_t* const xq8 = reinterpret_cast<int8_t*>(base + values * 2);
    float* const per_block = reinterpret_cast<float*>(base + values * 3);
    const InputBlocks in{per_block, per_block + blocks,
                         reinterpret_cast<int32_t*>(per_block + 2 * blocks),
                         reinterpret_cast<int32_t*>(per_block + 3 * blocks), rows};
    // Rows per task as the per-row kernels take them: a decode step's few rows are rounded
    // inline, not across a fork and join of every thread.
    at::parallel_for(0, rows, grain(inputs), [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r)
            k.quantize_row(bf16(x) + r * x.stride(0), inputs, xq + r * inputs, xq8 + r * inputs,
                           in, r);
    });
    op.xq = xq;
    op.xq8 = xq8;
    op.blocks = in;
    op.out = bf16_mut(out);
    // Groups per task: at least ~2^18 multiply-adds, so one row's step still splits its
    // outputs over the threads (and a task is never a single small group).
    const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 18) / (16 * rows * inputs));
    at::parallel_for(0, groups, grain, [&](int64_t begin, int64_t end) {
        k.quant_groups(op, rows, begin, end);
    });
}

// Rows of x times the weight dequantized a panel of groups at a time into the GEMM's packed
// layout, each panel multiplied by gemm_name()'s GEMM for every row while it stays in the
// level-2 cache; a row's bits are linear()'s over the dequantized weight, whatever the panels.
void dequantized_rows(const Kernels& k, const at::Tensor& x, const QuantOperands& op,
                      at::Tensor& out) {
    const int64_t rows = x.size(0), inputs = x.size(1), n = op.n, groups = (n + 15) / 16;
    const BlocksFn gemm = gemm_blocks_on(gemm_name(), inputs);
    // Groups per panel: about 512 KiB of bfloat16, at least four panels a thread, and an even
    // count (the AMX GEMM takes blocks two by two; a lone block runs at half its rate).
    const int64_t group_values = inputs * 16, threads = at::get_num_threads();
    const int64_t cached = (int64_t(512) << 10) / (group_values * 2);
    const int64_t per_panel =
        std::max<int64_t>(2, std::min(cached, groups / (4 * threads)) / 2 * 2);
    const int64_t panels = (groups + per_panel - 1) / per_panel;
    at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
        thread_local std::vector<uint16_t> panel, part;  // kept from call to call
        panel.resize(per_panel * group_values);
        part.resize(rows * per_panel * 16);
        for (int64_t p = begin; p < end; ++p) {
            const int64_t g0 = p * per_panel, g1 = std::min(groups, g0 + per_panel);
            const int64_t width = (g1 - g0) * 16, valid = std::min(width, n - g0 * 16);
            k.quant_panel(op, g0, g1, panel.data());
            const GemmOperands panel_op{bf16(x), x.stride(0), inputs, panel.data(), inputs * 16,
                                        op.bias ? op.bias + g0 * 16 : nullptr, part.data(), width};
            gemm(panel_op, rows, 0, g1 - g0);
            for (int64_t r = 0; r < rows; ++r)
                std::memcpy(bf16_mut(out) + r * n + g0 * 16, part.data() + r * width,
                            valid * sizeof(uint16_t));
        }
    });
}

// x's rows `which` side by side.
at::Tensor rows_of(const at::Tensor& x, const std::vector<int64_t>& which) {
    at::Tensor taken = at::empty({int64_t(which.size()), x.size(1)}, x.options());
    for (size_t i = 0; i < which.size(); ++i)
        std::memcpy(bf16_mut(taken) + i * x.size(1), bf16(x) + which[i] * x.stride(0),
                    x.size(1) * sizeof(uint16_t));
    return taken;
}

}  // namespace

// x [M, K] bfloat16 times a quantized weight of N outputs packed by quant_pack.cpp in the
// format described by the integers (quant_gemm.h's Format), plus an optional bias added in
// float32 before the one rounding to bfloat16. `prompt_rows` (bool [M], or none: no row is)
// marks the rows of prompt tokens, which take the dequantized arithmetic (above). On every
// instruction set the same bits, with or without tiles (`tiles`: quant_tiles_name()'s
// choices, the process's own when empty).
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n, int64_t bits,
                        int64_t offset, bool has_min, int64_t sub, int64_t super,
                        const c10::optional<at::Tensor>& bias, const std::string& tiles,
                        const c10::optional<at::Tensor>& prompt_rows) {
    const Kernels& k = usable();
    check_rows(x, "x");
    const int64_t rows = x.size(0), inputs = x.size(1), groups = (n + 15) / 16;
    const QuantFormat f{int(bits), int(offset), has_min, int(sub), int(super)};
    TORCH_CHECK(bits == 4 || bits == 5 || bits == 6 || bits == 8, "codes of 4, 5, 6 or 8 bits");
    TORCH_CHECK((sub == 16 || sub == 32) && super % sub == 0 && inputs % super == 0,
                "the inputs must be whole super-blocks of whole sub-blocks");
    TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                    packed.numel() == groups * (inputs / super) * f.record_bytes(),
                "packed weight: uint8 records of quant_pack for this shape and format");
    at::Tensor out = at::empty({rows, n}, x.options());
    if (rows == 0) return out;
    TORCH_CHECK(inputs % 32 == 0, "the inputs must be whole blocks of 32");
    at::Tensor bias32;
    if (bias) {
        bias32 = bias->to(at::kFloat).contiguous();
        TORCH_CHECK(bias32.numel() == n, "one bias per output");
        if (groups * 16 != n) bias32 = at::constant_pad_nd(bias32, {0, groups * 16 - n});
    }
    const QuantOperands op{nullptr,
                           nullptr,
                           {},
                           inputs,
                           packed.data_ptr<uint8_t>(),
                           f,
                           bias ? bias32.data_ptr<float>() : nullptr,
                           nullptr,
                           n,
                           quant_tiles(tiles.empty() ? quant_tiles_name() : tiles)};
    std::vector<int64_t> prompt, generated;
    if (prompt_rows) {
        TORCH_CHECK(prompt_rows->scalar_type() == at::kBool && prompt_rows->is_contiguous() &&
                        prompt_rows->numel() == rows,
                    "prompt_rows: one bool per row");
        const bool* is_prompt = prompt_rows->data_ptr<bool>();
        for (int64_t r = 0; r < rows; ++r) (is_prompt[r] ? prompt : generated).push_back(r);
    }
    if (prompt.empty()) {
        integer_rows(k, x, op, out);
    } else if (generated.empty()) {
        dequantized_rows(k, x, op, out);
    } else {  // each kind's rows apart, then back in their places
        for (const bool prompts : {true, false}) {
            const std::vector<int64_t>& which = prompts ? prompt : generated;
            const at::Tensor taken = rows_of(x, which);
            at::Tensor part = at::empty({int64_t(which.size()), n}, x.options());
            if (prompts)
                dequantized_rows(k, taken, op, part);
            else
                integer_rows(k, taken, op, part);
            for (size_t i = 0; i < which.size(); ++i)
                std::memcpy(bf16_mut(out) + which[i] * n, bf16(part) + i * n,
                            n * sizeof(uint16_t));
        }
    }
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
                "packed weight: uint8 records of quant_pack for this shape and format");
    const at::Tensor ids = rows.to(at::kLong).contiguous();
    TORCH_CHECK(ids.dim() == 1 && (ids.numel() == 0 || (ids.min().item<int64_t>() >= 0 &&
                                                        ids.max().item<int64_t>() < n)),
                "row ids out of range");
    at::Tensor out = at::empty({ids.numel(), k}, packed.options().dtype(at::kBFloat16));
    const QuantOperands op{nullptr, nullptr, {},      k, packed.data_ptr<uint8_t>(),
                           f,       nullptr, nullptr, n};
    at::parallel_for(0, ids.numel(), 16, [&](int64_t begin, int64_t end) {
        kern.quant_rows(op, ids.data_ptr<int64_t>() + begin, end - begin,
                        bf16_mut(out) + begin * k);
    });
    return out;
}

}  // namespace cpu
