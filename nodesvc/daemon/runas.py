"""Running a job as its owner: the user's credentials, its private directory, the environment,
and the step between fork and exec that puts the process in its cgroup and drops root.

The ``run`` command names the owner by user name; the daemon resolves uid, gid and supplementary
groups from the node's own user database (``getpwnam``, ``getgrouplist``), as slurmd does, so a
uid is never taken from the wire.  The policy: uid 0 only when ``node.allow_root_jobs``; other
uids from ``node.min_job_uid`` up (system accounts such as the broker's own user are refused);
and a daemon that is not root starts jobs only as itself.

Between fork and exec, still root, the child writes its pid into the job's ``cgroup.procs``
files (so nothing escapes the allocation by forking early), then sets its groups, gid and uid,
sets ``no_new_privs`` (no setuid binary can give privileges back) and enters its working
directory as the user (so it reaches only what the user may).  Only then is the job's program
executed, with the job's environment: no program runs as root with variables a launcher chose.
"""

from __future__ import annotations

import ctypes
import errno
import os
import pwd
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

PR_SET_NO_NEW_PRIVS = 38
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
EXIT_CANNOT_START = 126  # the shells' "found but cannot run": the job's own setup failed (its log says why)


class RunAsError(ValueError):
    """A run the node refuses on account of its owner (the message says why)."""


@dataclass(frozen=True)
class JobCredentials:
    """Whom a job runs as: resolved on this node from the user name."""

    user: str
    uid: int
    gid: int
    groups: tuple[int, ...]
    home: str
    shell: str

    def base_env(self) -> dict[str, str]:
        return {"HOME": self.home, "USER": self.user, "LOGNAME": self.user, "SHELL": self.shell or "/bin/sh"}


def resolve(user: str | None, allow_root: bool, min_uid: int) -> JobCredentials:
    """The credentials of ``user`` (None: the daemon's own user) under the node's policy."""
    me = os.geteuid()
    try:
        pw = pwd.getpwuid(me) if user is None else pwd.getpwnam(user)
    except KeyError:
        raise RunAsError(f"no user {user!r} on this node (jobs run as their owner; create the account, "
                         "or give the owner's token to a user this node has)") from None
    if pw.pw_uid == 0 and not allow_root:
        raise RunAsError(f"jobs may not run as root (uid 0) on this node; user {pw.pw_name!r} is uid 0 "
                         "(node.allow_root_jobs = true allows it)")
    if 0 < pw.pw_uid < min_uid and pw.pw_uid != me:
        raise RunAsError(f"user {pw.pw_name!r} is uid {pw.pw_uid}, a system account: jobs run as uids from "
                         f"{min_uid} up (node.min_job_uid)")
    if me != 0 and pw.pw_uid != me:
        raise RunAsError(f"this node daemon runs as uid {me}, so it starts jobs only as itself, not as "
                         f"{pw.pw_name!r} (uid {pw.pw_uid}); run it as root to start jobs as their owners")
    try:
        groups = tuple(sorted(set(os.getgrouplist(pw.pw_name, pw.pw_gid))))
    except OSError as exc:
        raise RunAsError(f"cannot list the groups of {pw.pw_name!r}: {exc.strerror}") from None
    return JobCredentials(pw.pw_name, pw.pw_uid, pw.pw_gid, groups, pw.pw_dir, pw.pw_shell)


def job_environment(creds: JobCredentials, request_env: dict[str, str], daemon_env: dict[str, str],
                    inherit: list[str], own: dict[str, str]) -> dict[str, str]:
    """A job's whole environment, built from nothing: the daemon's variables named in ``inherit``
    (globs, e.g. PATH, LANG, LC_*), the user's HOME/USER/LOGNAME/SHELL, the launcher's variables
    (already checked against the allow list), then the daemon's own ``own`` (DLSHARE_*, which
    nothing overrides).  Nothing else of the daemon's environment (its broker credentials, its
    configuration) reaches a job."""
    import fnmatch

    env = {k: v for k, v in daemon_env.items() if any(fnmatch.fnmatchcase(k, p) for p in inherit)}
    env.setdefault("PATH", DEFAULT_PATH)
    env.update(creds.base_env())
    env.update(request_env)
    env.update(own)
    return env


def _open_dir(parent_fd: int, name: str) -> int:
    return os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent_fd)


def job_root(path: str | os.PathLike[str]) -> Path:
    """Create the directory that holds every job's own directory: the daemon's, mode 0711 (users
    reach their own job's directory by name, and cannot list the others)."""
    p = Path(path)
    p.mkdir(mode=0o711, parents=True, exist_ok=True)
    st = os.lstat(p)
    if not stat.S_ISDIR(st.st_mode):
        raise RuntimeError(f"job directory root {p} is not a plain directory")
    if st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise RuntimeError(f"job directory root {p} must be owned by uid {os.geteuid()} and not group/world-writable")
    if stat.S_IMODE(st.st_mode) != 0o711:
        os.chmod(p, 0o711)
    return p


def prepare_job_dir(root: Path, job: str, creds: JobCredentials) -> tuple[Path, int]:
    """The job's private directory under ``root`` (made and given to the user, mode 0700; kept
    across runs, so a requeued job finds its checkpoints) and its log file, open for appending:
    returns (directory, log fd).

    The daemon (root) writes the log; the user owns the directory.  So the log is opened without
    following a symbolic link, without blocking on a FIFO, and used only when it is a regular file
    of the user's (or new) with one link: a user cannot point the daemon's writes anywhere else."""
    root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        try:
            os.mkdir(job, 0o700, dir_fd=root_fd)
        except FileExistsError:
            pass
        dfd = _open_dir(root_fd, job)
    except OSError as exc:
        os.close(root_fd)
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise RunAsError(f"job directory {root / job} is not a plain directory") from None
        raise
    os.close(root_fd)
    try:
        st = os.fstat(dfd)
        if st.st_uid not in (creds.uid, os.geteuid()):
            raise RunAsError(f"job directory {root / job} belongs to uid {st.st_uid}, not to {creds.user} "
                             f"(uid {creds.uid}): a job id is one owner's")
        try:
            fd = os.open("job.log", os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK
                         | os.O_CLOEXEC, 0o600, dir_fd=dfd)
        except OSError as exc:  # ELOOP: a symbolic link; ENXIO: a FIFO nobody reads; ...
            why = "it is a symbolic link" if exc.errno == errno.ELOOP else exc.strerror
            raise RunAsError(f"cannot open {root / job / 'job.log'}: {why} (a job's log must be a regular file)") \
                from None
        try:
            lst = os.fstat(fd)
            if not stat.S_ISREG(lst.st_mode) or lst.st_nlink != 1 or lst.st_uid not in (creds.uid, os.geteuid()):
                raise RunAsError(f"{root / job / 'job.log'} is not a regular file of {creds.user}'s with one link")
            os.set_blocking(fd, True)
            if os.geteuid() == 0:
                os.fchown(fd, creds.uid, creds.gid)
                os.fchown(dfd, creds.uid, creds.gid)
            os.fchmod(dfd, 0o700)
        except BaseException:
            os.close(fd)
            raise
    finally:
        os.close(dfd)
    return root / job, fd


def _libc_prctl() -> Callable[..., int]:
    libc = ctypes.CDLL(None, use_errno=True)
    fn = libc.prctl
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    return fn


_PRCTL = _libc_prctl()


def child_setup(creds: JobCredentials, cgroup_procs: list[str], cwd: str) -> Callable[[], None]:
    """The function the child runs between fork and exec (``subprocess.Popen(preexec_fn=...)``).

    Everything it needs is computed here, in the daemon; the child only makes system calls.  A
    failure that is the node's (the cgroup, the credentials) raises, so the ``run`` command fails;
    one that is the job's own (its working directory) is written to the job's log and ends the
    child with 126, so the job fails with a reason instead of being retried forever."""
    procs = [p.encode() for p in cgroup_procs]
    drop = os.geteuid() == 0  # root sets the job's groups, gid and uid (for a root job too: its own groups)
    where = cwd.encode()

    def setup() -> None:
        pid = str(os.getpid()).encode()
        for path in procs:  # still root: the job's cgroup before anything of the job runs
            fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
            try:
                os.write(fd, pid)
            finally:
                os.close(fd)
        if drop:
            os.setgroups(list(creds.groups))
            os.setresgid(creds.gid, creds.gid, creds.gid)
            os.setresuid(creds.uid, creds.uid, creds.uid)
        if _PRCTL(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
        try:
            os.chdir(where)
        except OSError as exc:
            os.write(2, b"dlshare: job cannot enter its working directory " + where + b" as " + creds.user.encode()
                     + b": " + (exc.strerror or "error").encode() + b"\n")
            os._exit(EXIT_CANNOT_START)

    return setup
