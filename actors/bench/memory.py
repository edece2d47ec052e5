"""What a Ray run holds in memory, as the soaks read and judge it (scripts/soak.py,
scripts/node_loss.py, scripts/memory_soak.py): the object store of this (one-node) Ray, the
objects some process still references, and which figure grew past a bound between two samples.
"""
from __future__ import annotations


def store_usage() -> dict:
    """Object-store bytes in use and objects held on this (one-node) Ray."""
    import ray
    from ray._private.internal_api import get_memory_info_reply, get_state_from_address
    stats = get_memory_info_reply(
        get_state_from_address(ray.get_runtime_context().gcs_address)).store_stats
    return {"bytes": int(stats.object_store_bytes_used), "objects": int(stats.num_local_objects)}


def referenced_objects() -> dict[bytes, int]:
    """{object id: bytes} of the objects some process of this (one-node) Ray still holds a
    reference to, each object once: what a leak of object references grows.

    The store's bytes in use (`store_usage`) also count objects already released, which Ray
    deletes a while later, and buffers a worker still maps after `ray.get`; those come and go
    with timing (0.4 to 10 MiB in the memory soak, in any order between two samples).

    Read from the raylet's node stats, not Ray's state API (`ray.util.state.list_objects`),
    which asks the dashboard's API server: the soaks run their Ray without a dashboard."""
    import ray
    from ray._private.internal_api import node_stats
    node = next(n for n in ray.nodes() if n["Alive"])
    reply = node_stats(node["NodeManagerAddress"], node["NodeManagerPort"])
    sizes: dict[bytes, int] = {}
    for worker in reply.core_workers_stats:
        for ref in worker.object_refs:
            sizes[ref.object_id] = max(sizes.get(ref.object_id, 0), int(ref.object_size))
    return sizes


def referenced_bytes() -> int:
    """The bytes of `referenced_objects`."""
    return sum(referenced_objects().values())


def growth(before: dict[str, float], after: dict[str, float], bound: float,
           floor_mb: float = 32.0) -> list[str]:
    """The roles whose figure grew by more than `bound` (a fraction) from `before` to `after`;
    the object store is judged against `floor_mb` MiB at least: what it holds at a sample is
    the step's pieces and weights in flight (0.4-5 MiB here), which come and go."""
    bad = []
    for k, b in before.items():
        a = after.get(k)
        if a is None:
            continue
        base = max(b, floor_mb) if k == "object_store" else b
        if a - b > bound * base:
            bad.append(f"{k}: {b:.1f} -> {a:.1f} MiB (+{100 * (a - b) / base:.1f} %)")
    return bad
