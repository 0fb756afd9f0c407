"""The job fields dlshare reads from a Slurm job: its ``--comment`` key=value form, or its name.

The documented form (README, "Slurm")::

    sbatch -p dlshare --gres=gpu:1 --comment "model=ResNet-50 batch_size=64 batch_sizes=32,64,128" train.sh
    sbatch -p dlshare --gres=gpu:1 -J ResNet-50@64 train.sh          # the same from the job name

Comment fields are separated by whitespace or ``;``.  Keys:

* ``model``: the model name (as in Gavel's and Synergy's tables: ``ResNet-50``, ``Transformer``...);
* ``batch_size`` (or ``bs``): a positive integer;
* ``batch_sizes`` (or ``bs_allowed``): the batch sizes the job may run at, comma-separated positive
  integers (``batch_size``, when given too, must be one of them);
* ``gpu_mem``: the job's per-GPU memory footprint, ``12G``, ``800M`` or plain bytes.

A comment with no ``=`` at all is free text and is ignored (the name is used).  A comment that has
fields must have only well-formed, known ones: anything else raises :class:`CommentError` with a
reason the shell writes back onto the job.  A name of the form ``MODEL@BATCH_SIZE`` gives the model
and batch size; any other name is taken as the model name.  Comment fields win over the name.

dlshare writes its own status after the user's part as `` | dlshare: ...``; :func:`user_part`
strips it, so a job parses the same before and after dlshare touched it.

Pure: no I/O.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

STATUS_MARK = "dlshare:"
_STATUS_RE = re.compile(r"(?:^|\s\|\s)dlshare:.*\Z", re.S)
_KEYS = {"model": "model", "batch_size": "batch_size", "bs": "batch_size", "batch_sizes": "batch_sizes",
         "bs_allowed": "batch_sizes", "gpu_mem": "gpu_mem"}
_MODEL_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+()/-]{0,127}\Z")
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
MAX_BATCH = 1 << 24  # larger is a typo, not a batch size


class CommentError(ValueError):
    """A comment or job name dlshare cannot use; ``str(exc)`` is the reason shown on the job."""


@dataclass(frozen=True)
class JobFields:
    """What dlshare learned about a job from its comment and name."""

    model: str
    batch_size: int = 0
    batch_sizes: tuple[int, ...] = ()
    gpu_memory_bytes: int = 0


def user_part(comment: str) -> str:
    """The user's comment without the status dlshare appended (`` | dlshare: ...``)."""
    return _STATUS_RE.sub("", comment or "").strip()


def with_status(comment: str, status: str) -> str:
    """``comment``'s user part followed by dlshare's ``status`` (one line, no ``|``)."""
    user = user_part(comment)
    status = " ".join(status.replace("|", "/").split())
    tail = f"{STATUS_MARK} {status}" if status else STATUS_MARK
    return f"{user} | {tail}" if user else tail


def _positive_int(key: str, raw: str) -> int:
    if not (raw.isascii() and raw.isdigit()) or len(raw) > 9:  # str.isdigit() takes '²', int() does not
        raise CommentError(f"{key}={raw!r}: expected a positive whole number")
    v = int(raw)
    if not 0 < v <= MAX_BATCH:
        raise CommentError(f"{key}={raw!r}: must be between 1 and {MAX_BATCH}")
    return v


def _bytes(key: str, raw: str) -> int:
    m = re.fullmatch(r"(\d{1,15})([KMGT]?)(?:i?B)?", raw.strip(), re.I)
    if not m:
        raise CommentError(f"{key}={raw!r}: expected a size such as 12G, 800M or a number of bytes")
    v = int(m.group(1)) * _UNITS[m.group(2).upper()]
    if v <= 0 or v > 1 << 50:
        raise CommentError(f"{key}={raw!r}: out of range")
    return v


def _model(where: str, raw: str) -> str:
    if not _MODEL_RE.match(raw):
        raise CommentError(f"{where}{raw!r}: a model name is 1-128 letters, digits and ._+()/- "
                           "(starting with a letter or digit)")
    return raw


def parse_comment(comment: str) -> dict[str, object]:
    """The fields of ``comment`` (the user part) as a dict with canonical keys; {} for free text."""
    text = user_part(comment)
    if "=" not in text:
        return {}
    out: dict[str, object] = {}
    for tok in re.split(r"[\s;]+", text):
        if not tok:
            continue
        key, eq, raw = tok.partition("=")
        if not eq:
            raise CommentError(f"comment field {tok!r}: expected key=value (keys: {', '.join(sorted(_KEYS))})")
        canon = _KEYS.get(key.lower())
        if canon is None:
            raise CommentError(f"comment field {key!r}: unknown key (known: {', '.join(sorted(_KEYS))})")
        if canon in out:
            raise CommentError(f"comment field {key!r}: given twice")
        if canon == "model":
            out[canon] = _model("model=", raw)
        elif canon == "batch_size":
            out[canon] = _positive_int(key, raw)
        elif canon == "batch_sizes":
            parts = raw.split(",")
            if not raw or any(not p for p in parts):
                raise CommentError(f"{key}={raw!r}: expected comma-separated batch sizes, e.g. 32,64,128")
            out[canon] = tuple(sorted({_positive_int(key, p) for p in parts}))
        else:
            out[canon] = _bytes(key, raw)
    return out


def parse_name(name: str) -> dict[str, object]:
    """``MODEL@BATCH_SIZE`` -> model and batch size; any other name -> the model only."""
    name = (name or "").strip()
    if not name:
        return {}
    if "@" in name:
        model, _, bs = name.rpartition("@")
        return {"model": _model("job name model ", model), "batch_size": _positive_int("job name batch size", bs)}
    try:
        return {"model": _model("", name)}
    except CommentError:
        return {}  # a free-form name (spaces, symbols) names no model


def job_fields(comment: str, name: str) -> JobFields:
    """Fields from the comment, completed from the name; :class:`CommentError` when unusable."""
    given = parse_comment(comment)
    try:
        from_name = parse_name(name) if not ("model" in given and "batch_size" in given) else {}
    except CommentError:
        if "model" not in given:
            raise
        from_name = {}  # the comment names the model: a name that is not MODEL@BS does not matter
    fields = {**from_name, **given}
    model = fields.get("model")
    if not model:
        raise CommentError("no model: give --comment \"model=NAME batch_size=N\" or a job name MODEL@BATCH_SIZE")
    bs = int(fields.get("batch_size", 0))  # type: ignore[arg-type]
    allowed = tuple(fields.get("batch_sizes", ()))  # type: ignore[arg-type]
    if bs and allowed and bs not in allowed:
        raise CommentError(f"batch_size={bs} is not one of batch_sizes={','.join(map(str, allowed))}")
    if not bs and allowed:
        bs = allowed[0]
    return JobFields(str(model), bs, allowed, int(fields.get("gpu_mem", 0)))  # type: ignore[arg-type]


def format_fields(f: JobFields) -> str:
    """The comment that :func:`job_fields` reads back as ``f`` (for submitters and tests)."""
    parts = [f"model={f.model}"]
    if f.batch_size:
        parts.append(f"batch_size={f.batch_size}")
    if f.batch_sizes:
        parts.append("batch_sizes=" + ",".join(map(str, f.batch_sizes)))
    if f.gpu_memory_bytes:
        parts.append(f"gpu_mem={f.gpu_memory_bytes}")
    return " ".join(parts)
