// CPU kernels of the PyTorch runner: paged attention reading the KV pool in place, the fused
// per-row work around the projections (RMSNorm with the residual add, q/k norm with the rotary
// embedding and the K/V write, SiLU·mul), and the projections' GEMM, bfloat16 and quantized.
// bfloat16 in and out, float32 inside.
//
// rowwise.h, attention.h and attend.h hold the computations, compiled three times, one
// translation unit each (built in parallel): for AVX512-BF16, for AVX-512 (F/BW/VL) and for
// AVX2+FMA, all giving the same bits (the first does attention's bfloat16 dot products in one
// instruction, the others in two fused steps); the set is chosen once at load from the CPU
// (`isa()`), never built with -march=native. The ops over torch tensors are row_ops.cpp,
// paged_attention.cpp, linear.cpp and quant_pack.cpp, huge_pages.cpp the streamed buffers,
// layer_stack.cpp a decoder's layers chained in one call; this file holds the choice and the
// bindings, the one translation unit that compiles torch's Python headers. The threads are
// torch's own (at::parallel_for); how rows are spread over them never changes a row's bits.

#include <torch/csrc/utils/pybind.h>

#include <string>

#include "cpu_kernels.h"
#include "layer_stack.h"

namespace cpu {

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
    return runs_avx512() && __builtin_cpu_supports("avx512bf16") &&
           __builtin_cpu_supports("avx512vnni");
}

Kernels select_kernels() {
    if (runs_avx512_bf16()) return avx512bf16::table();
    if (runs_avx512()) return avx512::table();
    if (runs_avx2()) return avx2::table();
    return Kernels{"none",  nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
                   nullptr, nullptr, nullptr, nullptr, nullptr, nullptr};
}

Kernels& kernels() {
    static Kernels k = select_kernels();
    return k;
}

// A narrower set on a CPU that runs several: how the tests reach the other paths on one
// machine. Call before serving, never during a call.
std::string select_isa(const std::string& name) {
    if (name == "avx512bf16" && runs_avx512_bf16())
        kernels() = avx512bf16::table();
    else if (name == "avx512" && runs_avx512())
        kernels() = avx512::table();
    else if (name == "avx2" && runs_avx2())
        kernels() = avx2::table();
    else
        TORCH_CHECK(false, "this CPU does not run ", name);
    return kernels().name;
}

const Kernels& usable() {
    const Kernels& k = kernels();
    TORCH_CHECK(k.norm_bf16_row != nullptr, "this CPU has neither AVX-512 nor AVX2 with FMA");
    return k;
}

std::string isa() {
    return kernels().name;
}

}  // namespace cpu

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("isa", &cpu::isa, "the instruction set the kernels run on: avx512, avx2 or none");
    m.def("select_isa", &cpu::select_isa);
    m.def("rms_norm", &cpu::rms_norm);
    m.def("add_rms_norm", &cpu::add_rms_norm);
    m.def("silu_mul", &cpu::silu_mul);
    m.def("rotary_write", &cpu::rotary_write);
    m.def("paged_attention", &cpu::paged_attention);
    m.def("attention", [] { return cpu::attention_name(); }, "attention's arithmetic");
    m.def("select_attention", &cpu::select_attention);
    m.def(
        "has_gemm", [] { return cpu::kernels().gemm_blocks != nullptr; }, "a GEMM of ours serves");
    m.def("pack_weight", &cpu::pack_weight);
    m.def("linear", &cpu::linear);
    m.def("linear_on", &cpu::linear_on);
    m.def("gemm", [] { return cpu::gemm_name(); }, "the GEMM the projections run on");
    m.def("select_gemm", &cpu::select_gemm);
    m.def("runs_gemm", &cpu::runs_gemm, "whether this CPU runs the named GEMM");
    using pybind11::arg;
    m.def("quant_linear", &cpu::quant_linear, arg("x"), arg("packed"), arg("n"), arg("bits"),
          arg("offset"), arg("has_min"), arg("sub"), arg("super"), arg("bias"), arg("tiles") = "",
          arg("prompt_rows") = pybind11::none());
    m.def(
        "quant_tiles", [] { return cpu::quant_tiles_name(); },
        "where the quantized projections' steps of whole row tiles form their sums");
    m.def("select_quant_tiles", &cpu::select_quant_tiles);
    m.def("quant_rows", &cpu::quant_rows);
    m.def("quant_pack", &cpu::quant_pack);
    m.def("huge_page_buffer",
          [](int64_t bytes) { return cpu::huge_page_buffer({bytes}, at::kByte); });
    m.def("runs_amx", &cpu::runs_amx);
    // The step's ops make no Python calls: other threads (the server's) run meanwhile.
    pybind11::class_<cpu::LayerStack>(m, "LayerStack", pybind11::module_local())
        .def(pybind11::init<int64_t, int64_t, int64_t, double, bool, double, int64_t>())
        .def("add_layer", &cpu::LayerStack::add_layer)
        .def("add_part", &cpu::LayerStack::add_part)
        .def("run", &cpu::LayerStack::run, pybind11::call_guard<pybind11::gil_scoped_release>());
}
