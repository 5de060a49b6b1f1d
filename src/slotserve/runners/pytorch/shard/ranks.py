"""Tensor-parallel ranks 1 .. N-1: each a process of its own (``python -m`` this module),
started by rank 0's runner, which sends it every step's :class:`StepPlan` over a ZMQ PUSH
socket of its own; the tensors themselves move through the ranks' process group (a
``TCPStore`` on loopback, rank 0's, and a gloo or NCCL group built from it).

A rank loads its slice of the weights, joins the group, and then runs whatever plan comes,
taking part in every all-reduce and logits gather; rank 0 alone schedules and samples. A
rank exits when told to stop, when rank 0's process is gone (its parent changed), or on an
error, which then fails rank 0's next collective: the engine fails its requests as for any
runner error.

Subprocesses rather than ``multiprocessing``: the engine process is itself a daemonic
``multiprocessing`` child, which may not start children of its own.
"""

from __future__ import annotations

import datetime
import logging
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import torch
import torch.distributed as dist
import zmq
from torch._C._distributed_c10d import PrefixStore, TCPStore

from slotserve.runners.pytorch.load.checkpoint import open_checkpoint
from slotserve.runners.pytorch.load.settings import TorchLoadConfig
from slotserve.runners.pytorch.model.tensor_parallel import TensorParallel, shard_config
from slotserve.runners.pytorch.shard.model_shard import ModelShard
from slotserve.runners.pytorch.shard.step_plan import StepPlan

logger = logging.getLogger(__name__)

POLL_MS = 1000  # how often an idle rank checks that rank 0 is still there
# A step blocks in a collective while a peer computes; a peer that died turns into an error
# (its socket closes), so this only bounds a peer that hangs.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)
# Ranks join before loading any weight: only a rank that failed to start is this late.
JOIN_TIMEOUT = datetime.timedelta(minutes=2)


class Stop(msgspec.Struct, array_like=True, frozen=True, tag=True):
    pass


Message = StepPlan | Stop
_encoder = msgspec.msgpack.Encoder()


@dataclass
class RankProcess:
    rank: int
    process: subprocess.Popen[bytes]
    socket: zmq.Socket[bytes]


def start_ranks(
    load: TorchLoadConfig, device: torch.device, vocab_size: int
) -> tuple[TensorParallelRanks | None, TensorParallel | None]:
    """Rank 0's handle on the other ranks, started, and its place in their group (both None
    without tensor parallelism). Blocks until every rank joined: they load alongside."""
    size = load.tensor_parallel_size
    if size == 1:
        return None, None
    store = open_store(0, size, 0)
    ranks = TensorParallelRanks(load, store.port)
    try:
        return ranks, join_group(store, 0, size, device, vocab_size)
    except BaseException:
        ranks.close()
        raise


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
    torch.set_num_threads(load.rank_threads)
    device = rank_device(load.torch_device, rank, size)
    checkpoint = open_checkpoint(load.model_path, load.model_overrides)
    rank_config = shard_config(checkpoint.config, size)
    store = open_store(rank, size, store_port)
    tp = join_group(store, rank, size, device, checkpoint.config.vocab_size)
    shard = ModelShard(load, checkpoint, rank_config, device, tp)
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


def open_store(rank: int, size: int, port: int) -> TCPStore:
    """The group's rendezvous on loopback: rank 0 serves it (``port`` 0: any free port, read
    back from ``store.port``), the other ranks connect to it."""
    return TCPStore(
        "127.0.0.1",
        port,
        size,
        is_master=rank == 0,
        timeout=JOIN_TIMEOUT,
        wait_for_workers=False,
    )


def join_group(
    store: TCPStore, rank: int, size: int, device: torch.device, vocab_size: int
) -> TensorParallel:
    """Blocks until every rank joined. NCCL when every rank has a GPU of its own, else gloo
    (CPU; several ranks sharing one GPU)."""
    prefix = PrefixStore("slotserve-tp", store)
    group: Any
    if nccl_usable(device, size):
        torch.cuda.set_device(device)  # NCCL's communicator binds to the current device
        group = dist.ProcessGroupNCCL(prefix, rank, size)  # type: ignore[call-arg]
    else:
        group = dist.ProcessGroupGloo(prefix, rank, size, COLLECTIVE_TIMEOUT)
    return TensorParallel(rank, size, group, vocab_size, device)


def nccl_usable(device: torch.device, size: int) -> bool:
    return device.type == "cuda" and dist.is_nccl_available() and torch.cuda.device_count() >= size


def rank_device(device: torch.device, rank: int, size: int) -> torch.device:
    """A GPU per rank where there are enough of them, else every rank on the one device."""
    if device.type == "cuda" and torch.cuda.device_count() >= size:
        return torch.device("cuda", rank)
    return device


def main(argv: list[str]) -> None:
    settings, rank, store_port, plans, parent = argv
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s tp-rank-{rank} %(levelname)s %(message)s"
    )
    run_rank(_decode_load(settings), int(rank), int(store_port), plans, int(parent))


if __name__ == "__main__":
    main(sys.argv[1:])
