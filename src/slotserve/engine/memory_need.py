"""What building a runner will take (:class:`MemoryNeed`), for the server's memory pre-flight
before it loads a model."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MemoryNeed:
    """What building a runner will take, estimated from the model's metadata before any
    weight is read (the server's pre-flight before loading a model)."""

    weights_bytes: int
    kv_bytes: int
    kv_tokens: int
    overhead_bytes: int  # compute buffers, logits
    # Of the weights and KV, the part in GPU memory: 1 on the PyTorch runner on CUDA (its
    # buffers too), the offloaded layers' part on llama.cpp (--n-gpu-layers).
    device_share: float = 0.0

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.kv_bytes + self.overhead_bytes

    @property
    def device_bytes(self) -> int:
        if not self.device_share:
            return 0
        held = round((self.weights_bytes + self.kv_bytes) * self.device_share)
        return held + self.overhead_bytes

    @property
    def host_bytes(self) -> int:
        return self.total_bytes - self.device_bytes

    def describe(self) -> str:
        gib = 2**30
        where = "RAM"
        if self.device_share >= 1:
            where = "GPU memory"
        elif self.device_share:
            where = f"memory, {self.device_bytes / gib:.2f} GiB of it on the GPU"
        return (
            f"{self.total_bytes / gib:.2f} GiB of {where} "
            f"(weights {self.weights_bytes / gib:.2f} GiB + KV cache {self.kv_bytes / gib:.2f} "
            f"GiB for {self.kv_tokens} tokens + buffers {self.overhead_bytes / gib:.2f} GiB)"
        )
