"""dlshare node service: what runs on every node of the cluster, and the one ``dlshare`` command.

The package spans the floors (README, Development), one sub-package or module per floor:

- floor 0, :mod:`nodesvc.bus`: the control-plane substrate (MQTT bus, codec, command/reply
  correlator, broker, config, logs, process and port helpers);
- floor 1, the node's libraries and pure cores: :mod:`~nodesvc.cgroups` (enforcement),
  :mod:`~nodesvc.telemetry` and :mod:`~nodesvc.gpu` (collectors), :mod:`~nodesvc.node_core`
  (command validation and idempotence), :mod:`~nodesvc.reclaim` (the donor's reclaim core),
  :mod:`~nodesvc.extension` (the daemon's extension interface), :mod:`~nodesvc.netns`;
- floor 2, :mod:`nodesvc.daemon`: the node daemon shell (donor included);
- floor 3, :mod:`nodesvc.cli`: ``dlshare`` and its commands (``node``, ``broker``, ``status``,
  ``up``, the tour).

May import: each module only the floors below its own (floor-1 modules: :mod:`nodesvc.bus`,
``rdma``, each other).  This ``__init__`` imports nothing, so ``import nodesvc.bus`` loads
floor 0 alone.
"""

__version__ = "0.1.0"
