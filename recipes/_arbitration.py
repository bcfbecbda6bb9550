"""The recipes' refusal of an engine that cannot keep two holders' work apart."""

from __future__ import annotations

import queen_sync as qs

# What each recipe needs of its engine, and why: without either, two holders' work overlaps.
_NEEDED = {
    "fencing": "tokens that only rise, and guarded writes atomic with their check",
    "engine_clock_expiry": "expiry judged by one clock, not by each client's",
}


def require_arbitration(client: qs.Queen, where: str) -> None:
    """Refuse ``client`` when its engine lacks ``fencing`` or ``engine_clock_expiry``.

    Raises:
        UnsupportedOperationError: naming the first capability missing (``capability``).
    """
    capabilities = client.capabilities
    for capability, why in _NEEDED.items():
        if not getattr(capabilities, capability):
            raise qs.UnsupportedOperationError(
                f"{where}() needs an engine with {capability} ({why}); the engine at "
                f"{client.url} lacks it", capability=capability)
