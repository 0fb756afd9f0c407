"""Floor 3: the scheduler's commands on the ``dlshare`` command line.

- :mod:`~scheduler.cli.sim`: ``dlshare sim`` (and ``sim predictor``), ``dlshare data``;
- :mod:`~scheduler.cli.service`: ``dlshare sched``;
- :mod:`~scheduler.cli.jobs`: ``dlshare job`` and ``dlshare token`` (registered with ``sched``);
- :mod:`~scheduler.cli.tour`: the scheduler's part of ``dlshare up --tour``.

May import anything below it; nothing imports it except the command registry (by name).
"""
