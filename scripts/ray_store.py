"""What Ray's object store holds on this (one-node) Ray: the reading the soaks sample
(scripts/soak.py, scripts/node_loss.py, scripts/memory_soak.py)."""


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
