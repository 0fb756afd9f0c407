"""Floor 2: the Slurm shell.  ``dlshare slurm`` lets dlshare's core schedule the GPU jobs of a Slurm partition.

Slurm stays the authority on what runs; dlshare decides where and when.  Jobs of the partition wait
held (``deploy/slurm/job_submit.lua``, or ``sbatch --hold``); the shell follows the queue with
``squeue --json``/``sinfo --json``, feeds the same core and plugins as the simulator and the service
(:class:`scheduler.SchedulerState`), and carries out its decisions with ``scontrol``.

Pure parts (unit-tested, fuzzed): :mod:`~scheduler.slurm.comment` (the ``--comment`` key=value
form), :mod:`~scheduler.slurm.squeue` (Slurm's JSON), :mod:`~scheduler.slurm.book` (Slurm's queue
-> core events), :mod:`~scheduler.slurm.plan` (core state -> ``scontrol`` lines),
:mod:`~scheduler.slurm.core_io` (the one place that names the core's event fields).
I/O: :mod:`~scheduler.slurm.runner` (subprocess), :mod:`~scheduler.slurm.shell_log` (its log),
:mod:`~scheduler.slurm.shell` (the loop), :mod:`~scheduler.slurm.testbed` (a throwaway Slurm on
one host, for tests, the benchmark and trying it out).

May import the scheduler core (floor 1) and ``nodesvc.bus`` (floor 0); no other shell, nothing above.
"""
