"""One worker per provider: ``worker(problem, device, budget, emit, refs)`` times its
methods on one problem and emits one row each. Their heavy imports are inside them."""

from __future__ import annotations

from . import flash_peer, geomloss_peer, ott_peer, ours, reference

WORKERS = {
    "ours": ours.worker,
    "ott": ott_peer.worker,
    "geomloss": geomloss_peer.worker,
    "flash-sinkhorn": flash_peer.worker,
}
#: the reference solves (``--worker ref``)
REFERENCE = reference.worker


def versions(provider: str) -> dict:
    """The versions of the peer's libraries (empty where it is not installed)."""
    out = {}
    try:
        if provider == "ott":
            import jax
            import ott

            out = {"ott-jax": getattr(ott, "__version__", "?"), "jax": jax.__version__}
        elif provider == "geomloss":
            import geomloss

            out = {"geomloss": getattr(geomloss, "__version__", "?")}
        elif provider == "flash-sinkhorn":
            import flash_sinkhorn

            out = {"flash-sinkhorn": getattr(flash_sinkhorn, "__version__", "?")}
    except Exception:  # noqa: BLE001
        pass
    return out
