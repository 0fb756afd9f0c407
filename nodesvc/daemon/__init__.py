"""Floor 2, the node daemon (``dlshare node``): the I/O shell around the node's cores.

- :mod:`~nodesvc.daemon.node`: :class:`NodeDaemon` (telemetry, commands, enforcement, extensions);
- :mod:`~nodesvc.daemon.jobs`: the processes it starts and adopts;
- :mod:`~nodesvc.daemon.metrics`: the Prometheus endpoint;
- :mod:`~nodesvc.daemon.donor`: the remote-memory donor extension (slabs, leases, reclaim);
- :mod:`~nodesvc.daemon.donor_shell`: a donor-only daemon for tests and development.

May import: :mod:`nodesvc.bus` (floor 0) and the libraries and cores of floor 1 (the node's own
``nodesvc.cgroups``, ``telemetry``, ``gpu``, ``node_core``, ``reclaim``, ``extension``; and ``rdma``).
Never the command line (:mod:`nodesvc.cli`), ``bench`` or another shell.
"""
