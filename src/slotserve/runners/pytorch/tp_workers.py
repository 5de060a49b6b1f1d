"""Tensor-parallel ranks 1 .. N-1: each a process of its own (``python -m`` this module),
started by rank 0's runner, which sends it every step's :class:`StepPlan` over a ZMQ PUSH
socket of its own; the tensors themselves move through the ranks' process group.

A rank loads its slice of the weights, joins the group, and then runs whatever plan comes,
taking part in every all-reduce and logits gather; rank 0 alone schedules and samples. A
rank exits when told to stop, when rank 0's process is gone (its parent changed), or on an
error, which then fails rank 0's next collective: the engine fails its requests as for any
runner error.

Subprocesses rather than ``multiprocessing``: the engine process is itself a daemonic
``multiprocessing`` child, which may not start children of its own.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import torch
import zmq

from slotserve.runners.pytorch.load.checkpoint import TorchLoadConfig, read_model_config
from slotserve.runners.pytorch.load.gguf_file import open_gguf
from slotserve.runners.pytorch.model.tensor_parallel import join_group, open_store, rank_device
from slotserve.runners.pytorch.shard import ModelShard, StepPlan

logger = logging.getLogger(__name__)

POLL_MS = 1000  # how often an idle rank checks that rank 0 is still there


class Stop(msgspec.Struct, array_like=True, frozen=True, tag=True):
    pass


Message = StepPlan | Stop
_encoder = msgspec.msgpack.Encoder()


@dataclass
class RankProcess:
    rank: int
    process: subprocess.Popen[bytes]
    socket: zmq.Socket[bytes]


class TensorParallelRanks:
    """Rank 0's handle on the other ranks: start them, send each step's plan, stop them."""

    def __init__(self, load: TorchLoadConfig, store_port: int) -> None:
        self._context = zmq.Context()
        self.ranks: list[RankProcess] = []
        settings = _encode_load(load)
        try:
            for rank in range(1, load.tensor_parallel_size):
                socket = self._context.socket(zmq.PUSH)
                socket.setsockopt(zmq.LINGER, 0)
                port = socket.bind_to_random_port("tcp://127.0.0.1")
                command = [
                    sys.executable,
                    "-m",
                    __name__,
                    settings,
                    str(rank),
                    str(store_port),
                    f"tcp://127.0.0.1:{port}",
                    str(os.getpid()),
                ]
                self.ranks.append(RankProcess(rank, subprocess.Popen(command), socket))
        except BaseException:
            self.close()
            raise

    def send(self, plan: StepPlan) -> None:
        """Hands the step to every rank (before rank 0 runs it: they meet in its collectives).
        A rank that already exited fails the step here rather than hanging a collective."""
        for rank in self.ranks:
            code = rank.process.poll()
            if code is not None:
                raise RuntimeError(f"tensor-parallel rank {rank.rank} exited with code {code}")
        payload = _encoder.encode(plan)
        for rank in self.ranks:
            rank.socket.send(payload, copy=False)

    def close(self, timeout: float = 10.0) -> None:
        stop = _encoder.encode(Stop())
        for rank in self.ranks:
            if rank.process.poll() is None:
                rank.socket.send(stop)
        for rank in self.ranks:
            try:
                rank.process.wait(timeout)
            except subprocess.TimeoutExpired:
                rank.process.kill()
                rank.process.wait()
            rank.socket.close()
        self.ranks.clear()
        self._context.term()


def _encode_load(load: TorchLoadConfig) -> str:
    return msgspec.json.encode(load, enc_hook=str).decode()


def _decode_load(text: str) -> TorchLoadConfig:
    def dec_hook(kind: type, value: Any) -> Any:
        if kind is Path:
            return Path(value)
        raise NotImplementedError(kind)

    return msgspec.json.decode(text, type=TorchLoadConfig, dec_hook=dec_hook)


def run_rank(load: TorchLoadConfig, rank: int, store_port: int, plans: str, parent: int) -> None:
    """A rank's life: join the group, load its slice, run plans until told to stop."""
    size = load.tensor_parallel_size
    torch.set_num_threads(rank_threads(load))
    device = rank_device(load.torch_device(), rank, size)
    reader = open_gguf(load.model_path) if load.model_path.is_file() else None
    config = read_model_config(load.model_path, reader)
    max_seq_len = load.sequence_length(config)
    store = open_store(rank, size, store_port)
    tp = join_group(store, rank, size, device, config.vocab_size)
    shard = ModelShard(load, config, reader, device, load.torch_dtype, max_seq_len, tp)
    context = zmq.Context()
    socket = context.socket(zmq.PULL)
    socket.connect(plans)
    decoder = msgspec.msgpack.Decoder(Message)
    try:
        with torch.inference_mode():
            while True:
                if not socket.poll(POLL_MS):
                    if os.getppid() != parent:
                        logger.error("rank %d: rank 0's process is gone; exiting", rank)
                        return
                    continue
                message = decoder.decode(socket.recv())
                if isinstance(message, Stop):
                    return
                hidden = shard.forward(message)
                for rows in message.logit_rows:  # rank 0 samples; here only the gather
                    shard.logits(hidden, rows)
    finally:
        socket.close(linger=0)
        context.term()
        shard.close()


def rank_threads(load: TorchLoadConfig) -> int:
    """``--threads`` for each rank, else the cores shared evenly between the ranks."""
    return load.threads or max(1, (os.cpu_count() or 1) // load.tensor_parallel_size)


def main(argv: list[str]) -> None:
    settings, rank, store_port, plans, parent = argv
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s tp-rank-{rank} %(levelname)s %(message)s"
    )
    run_rank(_decode_load(settings), int(rank), int(store_port), plans, int(parent))


if __name__ == "__main__":
    main(sys.argv[1:])
