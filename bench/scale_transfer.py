"""What crosses Ray's object store, timed on a CPU: a scored batch to another worker and a drafter weight publish,
each the replaced way beside the new one. bench/scale.py runs it once, on the data path's first target.

- the object store's rate for the new `ScoredBatch` (zero-copy) against default torch pickling of the same
  tensors, `--transfer-length`-token responses, 8 sequences, `--repeats` round trips;
- a weight publish + landing at Qwen3-4B drafter size (5 layers, ~1 GB bf16): copy + checksum + put, then
  get + verify — blake2b and torch pickling (replaced) against CRC-32 and zero-copy (new).
"""

from __future__ import annotations

import argparse
import hashlib
import time
from types import ModuleType

import torch
from projection import GB  # bench/projection.py, beside this script
from rich.console import Console
from scale_data_path import N_FEATURES, K, as_bf16, pickled_bytes, records  # bench/scale_data_path.py

from opd.distill.replay import score
from opd.models.target import Target
from opd.train.messages import WeightSnapshot

DRAFTER_LAYERS = 5  # the Qwen3-4B drafter whose publish is timed


def object_store_rates(target: Target, args: argparse.Namespace) -> dict:
    """GB/s of put + get in another worker for a scored batch: zero-copy ScoredBatch vs torch pickling; then the
    weight publish times. Ray is imported here, so that importing this module starts nothing."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False, configure_logging=False, log_to_driver=False)

    @ray.remote
    class Sink:
        def take(self, wrapped: list) -> int:
            value = ray.get(wrapped[0])
            return sum(t.numel() for t in (value.values() if isinstance(value, dict) else vars(value).values()))

    sink = Sink.remote()
    batch = as_bf16(score(target, records(args.transfer_length, args.prompt, args.tau, count=8), block_size=K))
    as_torch = dict(vars(batch))
    size = pickled_bytes(batch)
    out = {"payload_gb": size / GB}
    for name, payload in (("zero_copy", batch), ("torch_pickle", as_torch)):
        ray.get(sink.take.remote([ray.put(payload)]))  # warm the worker
        t0 = time.perf_counter()
        for _ in range(args.repeats):
            ray.get(sink.take.remote([ray.put(payload)]))
        out[f"{name}_gb_per_s"] = size * args.repeats / (time.perf_counter() - t0) / GB
    out.update(publish_times(ray))
    ray.shutdown()
    return out


def drafter_state() -> dict[str, torch.Tensor]:
    """A Qwen3-4B-sized drafter's weights (5 layers of hidden 2560, MLP 9728, fc 5H->H), random bf16."""
    h, inter = 2560, 9728
    shapes = {"fc.weight": (h, N_FEATURES * h)}
    for i in range(DRAFTER_LAYERS):
        shapes |= {f"layers.{i}.self_attn.q_proj.weight": (4096, h), f"layers.{i}.self_attn.k_proj.weight": (1024, h),
                   f"layers.{i}.self_attn.v_proj.weight": (1024, h), f"layers.{i}.self_attn.o_proj.weight": (h, 4096),
                   f"layers.{i}.mlp.gate_proj.weight": (inter, h), f"layers.{i}.mlp.up_proj.weight": (inter, h),
                   f"layers.{i}.mlp.down_proj.weight": (h, inter)}
    return {k: torch.empty(s, dtype=torch.bfloat16).normal_() for k, s in shapes.items()}


def blake2b(tensors: dict[str, torch.Tensor]) -> str:
    """The replaced checksum, as it was computed (tobytes copies)."""
    digest = hashlib.blake2b(digest_size=16)
    for name in sorted(tensors):
        digest.update(tensors[name].contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def old_publish(ray: ModuleType, state: dict[str, torch.Tensor]) -> dict:
    """The replaced publish: a CPU copy, blake2b, torch pickling into the store; landing gets and re-hashes it."""
    t0 = time.perf_counter()
    cpu = {k: v.to("cpu", copy=True) for k, v in state.items()}
    digest = blake2b(cpu)
    ref = ray.put(cpu)
    t1 = time.perf_counter()
    landed = ray.get(ref)
    assert blake2b(landed) == digest
    t2 = time.perf_counter()
    return {"publish_old_s": t1 - t0, "land_old_s": t2 - t1}


def new_publish(ray: ModuleType, state: dict[str, torch.Tensor]) -> dict:
    """The new publish: a `WeightSnapshot` (CRC-32, zero-copy) put; landing gets and verifies it."""
    t0 = time.perf_counter()
    snapshot = WeightSnapshot.of(state, 1)
    ref = ray.put(snapshot)
    t1 = time.perf_counter()
    ray.get(ref).verified(1)
    t2 = time.perf_counter()
    return {"publish_new_s": t1 - t0, "land_new_s": t2 - t1}


def publish_times(ray: ModuleType) -> dict:
    """One publish + landing of a Qwen3-4B-sized drafter, the replaced way and the new."""
    state = drafter_state()
    out = {"drafter_gb": sum(t.nbytes for t in state.values()) / GB}
    out |= old_publish(ray, state)
    return out | new_publish(ray, state)


def print_transfer(once: dict) -> None:
    """The object store's rates and the publish times, one line each."""
    console = Console()
    console.print(f"object store, {once['payload_gb']:.2f} GB scored batch to another worker: zero-copy "
                  f"{once['zero_copy_gb_per_s']:.2f} GB/s, torch pickling {once['torch_pickle_gb_per_s']:.2f} GB/s "
                  f"({once['zero_copy_gb_per_s'] / once['torch_pickle_gb_per_s']:.0f}x)")
    console.print(f"weight publish, {once['drafter_gb']:.2f} GB Qwen3-4B drafter: publish "
                  f"{once['publish_old_s']:.2f} s -> {once['publish_new_s']:.2f} s, landing + verify "
                  f"{once['land_old_s']:.2f} s -> {once['land_new_s']:.2f} s")
