// The projections: bfloat16 weights packed for the GEMM (AMX where the unit is verified,
// AVX512-BF16, or gemm_vec.h on the widest set the CPU runs) and quantized weights
// (quant_linear.cpp), spread over torch's threads; a row's bits depend on neither the other rows
// nor the threads.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/zeros.h>

#include <string>
#include <vector>

#include "cpu_kernels.h"
#include "gemm_amx.h"

namespace cpu {

bool runs_bf16_gemm() {
    __builtin_cpu_init();
    return runs_avx512() && __builtin_cpu_supports("avx512bf16");
}

// [n, k] bfloat16 rows → the packed layout of kernel_types.h at `dst` (zeroed, whole blocks).
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
    at::Tensor packed =
        huge_page_buffer({(n + 15) / 16, (k + 1) / 2, 16, 2}, at::kBFloat16).zero_();
    pack_rows(bf16(w), n, k, bf16_mut(packed));
    return packed;
}

// The widest register tile of any GEMM (gemm_vec.h): threads never take less than its blocks.
constexpr int64_t kTileRows = 6, kTileBlocks = 4;

// Rows times every block over torch's threads: threads take runs of whole 16-output blocks, at
// least a tile's worth each, or for a layer of few outputs and many rows whole rows and every
// output (no thread left a ragged share of a few blocks). A row's bits depend on neither.
void spread(const GemmOperands& op, int64_t rows, int64_t blocks, BlocksFn run) {
    const int64_t work = rows * op.k * 16;  // multiply-adds per block
    const int64_t grain = std::max<int64_t>(kTileBlocks, (1 << 16) / work);
    const int64_t threads = at::get_num_threads();
    if (blocks < 32 * threads && rows >= 2 * kTileRows * threads) {
        const int64_t per_thread = (rows + threads - 1) / threads;
        at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
            for (int64_t part = begin; part < end; ++part) {
                const int64_t m0 = part * per_thread, m1 = std::min(rows, m0 + per_thread);
                if (m0 >= m1) continue;
                GemmOperands rows_op = op;
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
        amx::CheckValues values{12345};
        for (auto& v : x) v = values.bf16();
        for (auto& v : w) v = values.bf16();
        for (int64_t o = 0; o < n; ++o)  // the padding past n stays zero
            bias[o] = float(int(values.next() % 17) - 8) / 8.0f;
        pack_rows(w.data(), n, k, packed.data());
        GemmOperands op{x.data(), k, k, packed.data(), k / 2 * 32, bias.data(), real.data(), n};
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

// The quantized projections take AMX tiles (quant_amx.h) where the unit's TDPBSSD gives the
// emulation's int32 sums on a sample of random bytes, two products into one C tile in the
// shapes the kernel configures: its sums are exact integers, so any difference is a fault.
bool amx_bytes_verified() {
    static const bool ok = [] {
        if (!amx_verified()) return false;
        alignas(64) int8_t a[2][16][32];
        alignas(64) int8_t b[2][8][64];
        alignas(64) int32_t real[16][16], emulated[16][16];
        amx::CheckValues values{4242};
        for (int8_t* v = &a[0][0][0]; v != &a[0][0][0] + sizeof(a); ++v)
            *v = int8_t(values.next() >> 24);
        for (int8_t* v = &b[0][0][0]; v != &b[0][0][0] + sizeof(b); ++v)
            *v = int8_t(values.next() >> 24);
        const auto run = [&](auto& t, int32_t (*c)[16]) {
            t.template zero<0>();
            for (int i = 0; i < 2; ++i) {
                t.template load<4>(a[i], 32);
                t.template load<6>(b[i], 64);
                t.template dot_bytes<0, 4, 6>();
            }
            t.template store<0>(c, 64);
        };
        {
            amx::Tiles unit(amx::byte_tiles(32));
            run(unit, real);
        }
        amx::EmulatedTiles emulation(amx::byte_tiles(32));
        run(emulation, emulated);
        return std::memcmp(real, emulated, sizeof(real)) == 0;
    }();
    return ok;
}

// Where a quantized projection's steps of whole tiles of rows form their sums: "amx" where the
// unit is verified, else "none" (the vector path alone); a test may choose "amx-emulated" on a
// CPU with AVX512-BF16 and VNNI (call before serving, never during a call). The bits are the
// vector path's on every choice.
std::string& quant_tiles_name() {
    static std::string name = amx_bytes_verified() ? "amx" : "none";
    return name;
}

std::string select_quant_tiles(const std::string& name) {
    TORCH_CHECK(name == "none" || (name == "amx" && amx_bytes_verified()) ||
                    (name == "amx-emulated" && runs_bf16_gemm()),
                "this CPU does not run the quantized projections on ", name, " tiles");
    quant_tiles_name() = name;
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
// rounding to bfloat16. `path`: the GEMM (gemm_name() when empty; "amx-emulated" for the tests).
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
    const GemmOperands op{bf16(x), x.stride(0), k, bf16(packed), (k + 1) / 2 * 32,
                          b,       bf16_mut(out), n};
    spread(op, rows, blocks, gemm_blocks_on(path.empty() ? gemm_name() : path, k));
    return out;
}

// The blocks of GEMM `chosen` (gemm_name()'s choices, or "amx-emulated" for the tests) for a
// layer of K inputs: the AMX GEMM takes a layer only when K is a multiple of 32.
BlocksFn gemm_blocks_on(const std::string& chosen, int64_t k) {
    if (chosen == "amx-emulated") {
        TORCH_CHECK(k % 32 == 0, "the AMX GEMM takes K a multiple of 32");
        return &amx::blocks<amx::EmulatedTiles>;
    }
    TORCH_CHECK(runs_gemm(chosen), "this CPU does not run the ", chosen, " GEMM");
    if (chosen == "amx" && k % 32 == 0) return &amx::blocks<amx::Tiles>;
    if (chosen == "amx" || chosen == "avx512bf16") return avx512bf16::table().gemm_blocks;
    if (chosen == "avx512") return avx512::table().gemm_blocks;
    return avx2::table().gemm_blocks;
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& packed,
                  const c10::optional<at::Tensor>& bias, int64_t n) {
    return linear_on(x, packed, bias, n, "");
}

bool runs_amx() {
    return amx::runs_amx();
}

}  // namespace cpu
