"""The runner's compute ceiling: raw llama.cpp decode and prefill rates, nothing else.

Decode: one context, one ``llama_decode`` per step over ``batch`` sequences, numpy argmax.
Prefill: one 512-token chunk per ``llama_decode``. Each measurement runs in a fresh process
(``python -m slotserve.bench.ceiling``) so the two never share a warm cache or a thread pool.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

PROMPT = "Once upon a time"


def _context(model: str, batch: int, threads: int, flash_attn: bool) -> tuple[object, ...]:
    import llama_cpp as llama

    from slotserve.runners.llama_cpp.backend import init_llama_backend

    init_llama_backend()
    m = llama.llama_model_load_from_file(model.encode(), llama.llama_model_default_params())
    params = llama.llama_context_default_params()
    params.n_ctx = batch * 1024
    params.n_batch = params.n_ubatch = 512
    params.n_seq_max = batch
    params.kv_unified = False
    params.n_threads = params.n_threads_batch = threads
    params.flash_attn_type = (
        llama.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn else llama.LLAMA_FLASH_ATTN_TYPE_DISABLED
    )
    ctx = llama.llama_init_from_model(m, params)
    return m, ctx


def measure(
    model: str, batch: int, tokens: int, threads: int, flash_attn: bool, what: str
) -> float:
    """Tokens/s of plain batched decoding (``what="decode"``) or of 512-token prefill."""
    import llama_cpp as llama
    import numpy as np

    m, ctx = _context(model, batch, threads, flash_attn)
    vocab = llama.llama_model_get_vocab(m)
    n_vocab = llama.llama_vocab_n_tokens(vocab)
    b = llama.llama_batch_init(512, 0, 1)

    def decode(entries: list[tuple[int, int, int, bool]]) -> None:
        for i, (token, pos, seq, logits) in enumerate(entries):
            b.token[i], b.pos[i], b.n_seq_id[i] = token, pos, 1
            b.seq_id[i][0], b.logits[i] = seq, logits
        b.n_tokens = len(entries)
        assert llama.llama_decode(ctx, b) == 0

    def argmax(row: int) -> int:
        logits = np.ctypeslib.as_array(llama.llama_get_logits_ith(ctx, row), shape=(n_vocab,))
        return int(logits.argmax())

    if what == "prefill":
        chunk = [(1000 + (i * 7) % 5000, i, 0, i == 511) for i in range(512)]
        decode(chunk)  # warm-up
        llama.llama_memory_seq_rm(llama.llama_get_memory(ctx), 0, -1, -1)
        started = time.perf_counter()
        decode(chunk)
        return 512 / (time.perf_counter() - started)
    buf = (llama.llama_token * 64)()
    n_prompt = llama.llama_tokenize(vocab, PROMPT.encode(), len(PROMPT), buf, 64, True, True)
    prompt = list(buf[:n_prompt])
    last = []
    for seq in range(batch):
        decode([(t, p, seq, p == n_prompt - 1) for p, t in enumerate(prompt)])
        last.append(argmax(n_prompt - 1))
    started = time.perf_counter()
    for step in range(tokens):
        decode([(last[s], n_prompt + step, s, True) for s in range(batch)])
        last = [argmax(s) for s in range(batch)]
    return batch * tokens / (time.perf_counter() - started)


def measure_in_subprocess(
    model: Path, batch: int, tokens: int, threads: int, flash_attn: bool, what: str = "decode"
) -> float:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "slotserve.bench.ceiling",
            str(model),
            "--batch",
            str(batch),
            "--tokens",
            str(tokens),
            "--threads",
            str(threads),
            "--what",
            what,
            "--flash-attn" if flash_attn else "--no-flash-attn",
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    return float(json.loads(out.stdout.strip().splitlines()[-1])["tokens_per_s"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("model")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--what", choices=["decode", "prefill"], default="decode")
    parser.add_argument("--flash-attn", action=argparse.BooleanOptionalAction, default=True)
    args = parser.parse_args()
    rate = measure(args.model, args.batch, args.tokens, args.threads, args.flash_attn, args.what)
    print(json.dumps({"what": args.what, "batch": args.batch, "tokens_per_s": rate}))


if __name__ == "__main__":
    main()
