"""Built-in plugins; importing this package registers them with :mod:`scheduler.framework`."""

from scheduler.plugins import allocation, ordering, placement  # noqa: F401
