"""The error every remote-memory operation raises."""

from __future__ import annotations

from rdma import wire


class RemoteMemoryError(OSError):
    """A remote-memory operation failed; ``code`` is a wire status (rdma.wire): the status a donor
    answered (positive), or a local failure (a negative errno: ``wire.E_IO``, ``wire.E_TIMEOUT``, ...)."""

    def __init__(self, code: int, what: str = "") -> None:
        self.code = code
        self.status = wire.status_name(code)
        super().__init__(f"{what}: {self.status} ({code})" if what else f"{self.status} ({code})")
