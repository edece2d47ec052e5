"""What Ray's object store holds on this (one-node) Ray: the reading the soaks sample
(scripts/soak.py, scripts/node_loss.py, scripts/memory_soak.py)."""


def store_usage() -> dict:
    """Object-store bytes in use and objects held on this (one-node) Ray."""
    import ray
    from ray._private.internal_api import get_memory_info_reply, get_state_from_address
    stats = get_memory_info_reply(
        get_state_from_address(ray.get_runtime_context().gcs_address)).store_stats
    return {"bytes": int(stats.object_store_bytes_used), "objects": int(stats.num_local_objects)}
