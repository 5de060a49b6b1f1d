#!/usr/bin/env bash
# The CUDA path's tests and benchmarks in one run on a lent GPU machine (well under 10 minutes):
#
#   bash benchmarks/gpu_check.sh OUT_DIR [quick]   # quick: the host's CPU, the CUDA tests, decode
#
# The machine has torch, transformers and Triton but none of our other dependencies and no
# network: wheels of the missing packages sit in .whl/ and tokenizer plus config folders of the
# benchmarked shapes in .gpu/ (both ignored by git, carried with the call; made by
# `python benchmarks/gpu_inputs.py`). Each step has its own time limit, so one that hangs
# leaves the others their figures; everything lands in OUT_DIR.
set -u
out=${1:?OUT_DIR}
quick=${2:-}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src:$PWD
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv | tee "$out/gpu.txt"
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, \
transformers.__version__)" | tee -a "$out/gpu.txt"

# The host's CPU first (it may have AVX-512 or AMX, which the CI machines may not): its flags,
# the CPU kernels' tests on every instruction set it runs, its limits on 2 threads as on the
# project's own machines, and the quantized projections' widest build against their AVX2 one.
lscpu >"$out/lscpu.txt" 2>&1  # its Flags line names every AVX-512 and AMX extension
grep -o -w -E 'avx512_bf16|amx_bf16|amx_int8' /proc/cpuinfo | sort -u | tr '\n' ' '
timeout 120 python3 -m slotserve.runners.pytorch.cpu_kernels 2>&1 | tail -n 2
timeout 120 python3 -m pytest -q -p no:cacheprovider \
    tests/runner/test_cpu_gemm.py tests/runner/test_cpu_kernels.py \
    tests/runner/test_quant_kernels.py 2>&1 | tee "$out/test-cpu-kernels.log" | tail -n 12
timeout 60 python3 benchmarks/cpu_limits.py --threads 2 --shapes >"$out/cpu-limits.json" 2>&1
tail -n 12 "$out/cpu-limits.json"
timeout 80 python3 benchmarks/quant_ab.py --base-isa avx2 --threads 2 --pairs 3 \
    --json "$out/quant-isa.json" 2>&1 | tail -n 33

bench() {  # seconds, then gpu_throughput.py's arguments
    local limit=$1
    shift
    timeout "$limit" python3 benchmarks/gpu_throughput.py "$@" --json "$out/bench.json" \
        2>&1 | tail -n 4
}

SLOTSERVE_TEST_TOKENIZER=.gpu/tokenizer timeout 200 python3 -m pytest -q -s -p no:cacheprovider \
    tests/runner/test_torch_cuda.py 2>&1 | tee "$out/test-torch-cuda.log" | tail -n 25

small=.gpu/smollm2-135m
variants=("--attention-backend triton" "--batch-invariant")
[ "$quick" = quick ] || variants=("--attention-backend torch --enforce-eager" \
    "--attention-backend triton --enforce-eager" "${variants[@]}")
for variant in "${variants[@]}"; do
    # shellcheck disable=SC2086
    bench 45 $small decode $variant
done

[ "$quick" = quick ] && exit 0
bench 150 .gpu/qwen3-0.6b nano --attention-backend triton --kv-memory 0 --hf
bench 45 $small prefill --input-len 6000 --attention-backend triton
bench 60 .gpu/qwen35-shapes prefill --input-len 6000
