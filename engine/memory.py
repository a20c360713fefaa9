"""How much memory the engine plans for, and so how many KV tokens it may admit.

On unified memory (a Mac) the weights, the radix cache and the KV of every running
request share one pool with the system; past the device's recommended working set macOS
starts paging the GPU's memory and everything stalls, or Metal fails an allocation. So
the engine plans, before it admits anything:

    limit >= weights + radix cache budget + headroom + kv_bytes_per_token * tokens

where `tokens` counts prompt + max_tokens of every admitted request (its KV can grow that
far: a cache hit is copied into the request's own buffer, so the tree's copy does not
count for it). A request that alone exceeds what is left is refused at submit; requests
that together exceed it wait. Nothing here imports MLX: `python -m engine.memory` prints
the plan for the Mac Studio configurations in docs/memory.md, from the same function.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.api import EngineConfig, SpeculationConfig

# The radix cache never gets less than this, whatever the fraction gives.
MIN_CACHE_BYTES = 64 * 1024 * 1024
# A step's activations beyond the KV: buffers, the attention scores of a prefill chunk,
# MLX's own bookkeeping. The logits of a chunk are counted separately (they scale with
# the vocabulary: 2048 tokens x 128k entries x 4 bytes is 1 GiB).
BASE_HEADROOM_BYTES = 512 * 1024 * 1024
# On the CPU the limit is this share of RAM: the OS and other processes keep the rest.
CPU_MEMORY_FRACTION = 0.9


class MemoryPlanError(ValueError):
    """The model does not fit the memory limit at all."""


@dataclass(frozen=True)
class MemoryPlan:
    limit_bytes: int
    weight_bytes: int
    cache_bytes: int  # the radix tree's budget
    headroom_bytes: int
    kv_bytes_per_token: int
    # What a token takes in the prefix cache: less than `kv_bytes_per_token` where the
    # cache is quantized (kv_quant.py; the running KV stays in the model's dtype).
    cached_bytes_per_token: int

    @property
    def kv_bytes(self) -> int:
        """What is left for the KV of running requests."""
        return self.limit_bytes - self.weight_bytes - self.cache_bytes - self.headroom_bytes

    @property
    def cached_tokens(self) -> int:
        """Tokens the prefix cache's budget holds."""
        return self.cache_bytes // self.cached_bytes_per_token

    @property
    def kv_tokens(self) -> int:
        """Prompt + max_tokens, summed over running requests, that fit in `kv_bytes`."""
        return self.kv_bytes // self.kv_bytes_per_token


def headroom(prefill_chunk_tokens: int, vocab_size: int, kv_bytes_per_token: int,
             verify_positions: int) -> int:
    """Room for one step beyond the planned KV, on top of the base: a prefill chunk's
    float32 logits, twice (the logits and their log-softmax), and the KV of a speculative
    verify step's extra positions. A verify pads every row of the batch to the longest
    draft, whatever each request's own mode, so `verify_positions` is rows x the longest
    draft (a request may ask for speculation on a server whose default is off)."""
    return (BASE_HEADROOM_BYTES + 2 * 4 * prefill_chunk_tokens * vocab_size
            + verify_positions * kv_bytes_per_token)


def plan_memory(
    *, limit_bytes: int, weight_bytes: int, kv_bytes_per_token: int, headroom_bytes: int,
    cache_bytes: int | None = None, cache_fraction: float = 0.5,
    cached_bytes_per_token: int | None = None,
) -> MemoryPlan:
    """The plan for one model. The radix cache gets `cache_bytes`, or else
    `cache_fraction` of the limit less the weights (at least MIN_CACHE_BYTES); the
    running requests' KV gets the rest. Raises MemoryPlanError when nothing is left.
    `cached_bytes_per_token`: a cached token's size (None: `kv_bytes_per_token`)."""
    if cache_bytes is None:
        cache_bytes = max(int(limit_bytes * cache_fraction) - weight_bytes, MIN_CACHE_BYTES)
    plan = MemoryPlan(limit_bytes, weight_bytes, cache_bytes, headroom_bytes,
                      max(kv_bytes_per_token, 1),
                      max(cached_bytes_per_token or kv_bytes_per_token, 1))
    if plan.kv_tokens < 1:
        gib = 2**30
        raise MemoryPlanError(
            f"the memory limit of {limit_bytes / gib:.1f} GiB leaves no room for KV: the "
            f"weights take {weight_bytes / gib:.1f} GiB, the prefix cache "
            f"{cache_bytes / gib:.1f} GiB and a step's activations {headroom_bytes / gib:.1f}"
            f" GiB (lower cache_bytes or cache_fraction, or raise memory_limit_bytes)")
    return plan


def describe(plan: MemoryPlan) -> str:
    """The plan in one log line."""
    gib = 2**30
    return (f"memory plan: limit {plan.limit_bytes / gib:.1f} GiB = weights "
            f"{plan.weight_bytes / gib:.1f} + prefix cache {plan.cache_bytes / gib:.1f} "
            f"({plan.cached_tokens} tokens at {plan.cached_bytes_per_token} B/token) + "
            f"headroom {plan.headroom_bytes / gib:.1f} + KV {plan.kv_bytes / gib:.1f} GiB "
            f"({plan.kv_tokens} tokens at {plan.kv_bytes_per_token} B/token)")


# -- the documented configurations ---------------------------------------------------------

GB = 10**9


@dataclass(frozen=True)
class Machine:
    name: str
    memory_bytes: int

    @property
    def working_set_bytes(self) -> int:
        # What Metal reports as recommendedMaxWorkingSetSize on Macs of 64 GB and more:
        # three quarters of RAM (`sudo sysctl iogpu.wired_limit_mb=...` raises it).
        return self.memory_bytes * 3 // 4


@dataclass(frozen=True)
class Model:
    name: str
    weight_bytes: int
    layers: int
    kv_heads: int
    head_dim: int
    vocab_size: int

    @property
    def kv_bytes_per_token(self) -> int:
        return self.layers * self.kv_heads * self.head_dim * 2 * 2  # K and V, float16


MACHINES = (Machine("Mac Studio 64 GB", 64 * GB), Machine("Mac Studio 192 GB", 192 * GB))
# mlx-community's 4-bit conversions (group size 64: 4.5 bits per weight with scales).
MODELS = (
    Model("Llama 3.1 8B Instruct 4-bit", int(4.52 * GB), 32, 8, 128, 128256),
    Model("Llama 3.3 70B Instruct 4-bit", int(39.7 * GB), 80, 8, 128, 128256),
)
DOC_PREFILL_CHUNK = 2048
# A verify step of the default batch, every row drafting the longest draft allowed.
DOC_VERIFY_POSITIONS = EngineConfig.max_batch_size * SpeculationConfig.max_draft


def documented_plans() -> list[tuple[Machine, Model, MemoryPlan | str]]:
    rows: list[tuple[Machine, Model, MemoryPlan | str]] = []
    for machine in MACHINES:
        for model in MODELS:
            try:
                plan: MemoryPlan | str = plan_memory(
                    limit_bytes=machine.working_set_bytes, weight_bytes=model.weight_bytes,
                    kv_bytes_per_token=model.kv_bytes_per_token,
                    headroom_bytes=headroom(DOC_PREFILL_CHUNK, model.vocab_size,
                                            model.kv_bytes_per_token, DOC_VERIFY_POSITIONS))
            except MemoryPlanError as error:
                plan = str(error)
            rows.append((machine, model, plan))
    return rows


def documented_table() -> str:
    """The Markdown table in docs/memory.md."""
    header = ("| machine | model | working set | weights | prefix cache | headroom | "
              "KV for requests | KV tokens in flight |")
    lines = [header, "|---|---|---:|---:|---:|---:|---:|---:|"]
    for machine, model, plan in documented_plans():
        if isinstance(plan, str):
            lines.append(f"| {machine.name} | {model.name} | does not fit: {plan} |")
            continue
        sizes = (plan.limit_bytes, plan.weight_bytes, plan.cache_bytes, plan.headroom_bytes,
                 plan.kv_bytes)
        cells = " | ".join(f"{size / GB:.1f} GB" for size in sizes)
        lines.append(f"| {machine.name} | {model.name} | {cells} | {plan.kv_tokens:,} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(documented_table())
