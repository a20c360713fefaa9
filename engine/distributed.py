"""Tensor parallelism: one model sharded over the ranks of an `mlx.launch` group.

Every rank loads the model and shards it with mlx-lm's own `model.shard(group)` (attention
heads and MLP columns split N ways, an all-reduce after each layer's output projections;
embeddings and the LM head stay whole, so every rank computes the same logits). Every rank
runs the same scheduler (scheduler.py) over its own radix tree, whose segments hold that
rank's heads of every KV span.

How the ranks agree on every step: a replicated scheduler fed one input stream, as
mlx-lm's own server does it. Only rank 0 takes requests. At every turn of its loop it
broadcasts what came in since the last one (new requests with their tokens and sampling
parameters, cancels, cache clears, stop; nothing when idle, as a heartbeat) and every rank
applies that same list at the same point of the same loop. The scheduler is deterministic
given its inputs (no clocks, no per-rank randomness: rank 0 fixes the seed of a request that
named none, and its memory plan is every rank's), so the ranks make the same admissions,
matches, evictions and forward passes, and their trees keep the same topology without any
node ids crossing the wire. A broadcast step plan (rank 0 naming the nodes to reuse and
free) would have had to mirror the tree's ids and every scheduling decision in a protocol.

A rank that dies breaks the next collective that sends to it (the ring backend raises
"connection to a peer was lost"; a receive from it spins forever), and mlx.launch tells the
others (server/launch/tensor_parallel.py); a rank that hangs is caught by a watchdog.
Either way the engine fails (rank 0's /health says `failed`, open requests get an error)
instead of waiting forever.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import socket
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx import nn
from mlx_lm.utils import load_model

# Model config keys whose value every rank must split evenly (heads, MLP width).
_SPLIT_KEYS = ("num_attention_heads", "num_key_value_heads", "intermediate_size")
# Weights up to this share of one GPU's memory leave that GPU room for a useful KV cache.
_FITS_ONE_GPU = 0.75


@dataclass(frozen=True)
class Announcement:
    """A value rank 0 has started to share (`RankGroup.announce`): its length, in flight."""

    size: mx.array
    data: bytes  # rank 0's pickle; empty on the others
    value: Any  # rank 0's value itself


class TensorParallelError(ValueError):
    """The model cannot be sharded over the group: a one-line reason."""


class RankGroup:
    """The ranks of one tensor-parallel server and the one thing they exchange besides
    the model's own all-reduces: rank 0's inputs, broadcast to every rank."""

    def __init__(self, group: mx.distributed.Group) -> None:
        self.group = group
        self.rank = group.rank()
        self.size = group.size()

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def share(self, value: Any) -> Any:
        """Rank 0's `value` on every rank (the others pass anything, usually None), now."""
        return self.receive(self.announce(value))

    def announce(self, value: Any) -> Announcement:
        """Start sharing rank 0's `value`: its pickle's length as an all-sum with which the
        others join with zeros, queued without waiting. A decoding loop announces at one
        turn and receives at the next, so the device runs the step in between while the
        host builds the next one: reading the length at once would wait for every step
        queued before it, as a heartbeat at every turn did (tensor-parallel decode then
        ran at ~0.6x bare mlx-lm's on two GPUs)."""
        data = pickle.dumps(value) if self.leader and value is not None else b""
        size = mx.distributed.all_sum(mx.array(len(data)), group=self.group)
        mx.async_eval(size)
        return Announcement(size, data, value)

    def receive(self, announcement: Announcement) -> Any:
        """An announced value on every rank: the pickle itself as a second all-sum, only
        when there is one (None, the usual heartbeat, costs the length alone)."""
        size = announcement.size.item()
        if size == 0:
            return None
        payload = (mx.array(np.frombuffer(announcement.data, np.uint8)) if self.leader
                   else mx.zeros(size, mx.uint8))
        # Evaluated on rank 0 too: a collective is only joined when it is computed.
        shared = np.array(mx.distributed.all_sum(payload, group=self.group))
        return announcement.value if self.leader else pickle.loads(shared.tobytes())

    def smallest_share(self, domain: str, memory_bytes: int) -> int:
        """Every rank names the memory it plans on (`domain`, memory_domain()) and how
        much of it it may use; the ranks that name the same memory split it evenly, and
        all of them get the smallest of those splits. Gathered as an all-sum of int32 rows
        (each rank fills its own), the collective and type `share` already relies on."""
        key = int.from_bytes(hashlib.sha256(domain.encode()).digest()[:4], "big") >> 1
        rows = np.zeros((self.size, 3), np.int32)
        rows[self.rank] = (key, memory_bytes >> 31, memory_bytes & (2**31 - 1))
        rows = np.array(mx.distributed.all_sum(mx.array(rows), group=self.group))
        keys = rows[:, 0]
        return min((int(high) << 31 | int(low)) // int((keys == key).sum())
                   for key, high, low in rows)


def memory_domain() -> str:
    """The memory this process plans on: a CUDA GPU's own (the device mlx.launch's
    CUDA_VISIBLE_DEVICES leaves it, its first when unset), else its host's, which the CPU
    and a Mac's GPU share. A host is its name and its hardware address (two hosts may
    share a name), unless Python found none and made one up (the multicast bit marks it:
    it would differ from process to process)."""
    node = uuid.getnode()
    host = socket.gethostname() + ("" if node & 1 << 40 else f"/{node:012x}")
    if mx.default_device() == mx.gpu and mx.cuda.is_available():
        return f"{host}/cuda:{os.environ.get('CUDA_VISIBLE_DEVICES', '')}"
    return host


def join_group(size: int) -> RankGroup:
    """This process's rank in the group `mlx.launch` started; the group must have `size`
    ranks."""
    group = mx.distributed.init(strict=True)
    if group.size() != size:
        raise TensorParallelError(
            f"--tensor-parallel is {size} but the launch started {group.size()} ranks")
    return RankGroup(group)


def default_backend() -> str:
    """The backend mlx.launch picks when neither its flags nor the hostfile name one."""
    return "nccl" if mx.cuda.is_available() else "ring"


def check_shardable(model: nn.Module, config: dict[str, Any], size: int) -> None:
    """Raise TensorParallelError unless mlx-lm can shard `model` `size` ways."""
    model_type = config.get("model_type", type(model).__name__)
    if not hasattr(model, "shard"):
        raise TensorParallelError(
            f"mlx-lm cannot shard {model_type} models for tensor parallelism")
    text_config = config.get("text_config") or config
    for key in _SPLIT_KEYS:
        value = text_config.get(key)
        if isinstance(value, int) and value % size:
            raise TensorParallelError(
                f"{model_type}: {key} = {value} does not split {size} ways")


def shard(model: nn.Module, config: dict[str, Any], group: RankGroup) -> None:
    """Shard a lazily loaded model in place; its weights are read (only this rank's
    slices stay) by the caller's next eval."""
    check_shardable(model, config, group.size)
    model.shard(group.group)


def one_gpu_would_be_faster(shard_bytes: int, size: int, gpu_bytes: int,
                            cuda: bool) -> str | None:
    """Why one GPU would serve this model better than `size` ranks, where it would; else
    None. On CUDA, MLX's NCCL all-reduces (two per layer per step) cost more than reading
    half the weights saves: on H200s an 8B model decoded at 0.3-0.5x one GPU's rate over
    2 and 4 GPUs, and only cold prefill gained (1.4-1.6x; docs/scale-out.md)."""
    whole = shard_bytes * size
    if not cuda or whole > _FITS_ONE_GPU * gpu_bytes:
        return None
    return (f"tensor parallelism over {size} CUDA GPUs for {whole / 2**30:.1f} GiB of "
            f"weights, which fit one GPU: sharded, an 8B model decoded at 0.3-0.5x one "
            "GPU's rate on H200s (docs/scale-out.md); for throughput, run a replica per GPU "
            "(radix-mlx replicas --cuda-devices)")


def check_model(path: str, size: int) -> None:
    """Raise TensorParallelError unless the model in local directory `path` can be
    sharded `size` ways; reads its config and builds it lazily (no weights are read)."""
    model, config = load_model(Path(path), lazy=True, strict=False)
    check_shardable(model, config, size)
