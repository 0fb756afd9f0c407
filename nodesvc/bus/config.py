"""Layered configuration: built-in defaults < TOML file < DLSHARE_* environment < flags.

Each component registers its section's defaults with :func:`register_section`
(usually at import of its CLI module).  Values are typed by their default: an
environment string is converted to the default's type, and a file or flag value
of the wrong type is an error that names the key.

Environment names are ``DLSHARE_<SECTION>_<KEY>`` in upper case, e.g.
``DLSHARE_NODE_INTERVAL=2``; keys of the ``[dlshare]`` section (shared by every
command) are plain ``DLSHARE_<KEY>``, e.g. ``DLSHARE_BROKER``.
"""

from __future__ import annotations

import copy
import json
import math
import os
import tomllib
from collections.abc import Mapping
from typing import Any

GLOBAL = "dlshare"
MAX_CONFIG_BYTES = 1 << 20  # a config file is a few hundred lines; more is the wrong file
# Every float setting is seconds, a percentage or a ratio: inf, nan or beyond 1e9 (31 years of
# seconds) is a unit mistake, refused rather than obeyed.
MAX_FLOAT_SETTING = 1e9

_SECTIONS: dict[str, dict[str, Any]] = {
    GLOBAL: {
        "broker": "mqtt://127.0.0.1:1883",
        "log_json": False,
        "log_level": "info",
    }
}


class ConfigError(ValueError):
    """A config file, environment variable or flag that cannot be used."""


def register_section(name: str, defaults: Mapping[str, Any]) -> None:
    """Declare a section and its defaults.  Re-registering merges new keys."""
    sec = _SECTIONS.setdefault(name, {})
    for k, v in defaults.items():
        sec.setdefault(k, v)


def defaults() -> dict[str, dict[str, Any]]:
    return copy.deepcopy(_SECTIONS)


def _coerce(value: Any, default: Any, where: str) -> Any:
    """Convert ``value`` to the type of ``default``; strings (environment) are parsed."""
    if default is None:
        return value
    kind = type(default)
    if isinstance(value, str) and kind is not str:
        text = value.strip()
        try:
            if kind is bool:
                low = text.lower()
                if low in ("1", "true", "yes", "on"):
                    return True
                if low in ("0", "false", "no", "off"):
                    return False
                raise ValueError(text)
            if kind is int:
                return int(text, 0)
            if kind is float:
                value = float(text)  # checked for range below
            if kind is list:
                parsed = json.loads(text) if text.startswith("[") else [p for p in text.split(",") if p]
                if not isinstance(parsed, list):
                    raise ValueError(text)
                return parsed
        except ValueError:
            raise ConfigError(f"{where}: expected {kind.__name__}, got {value!r}") from None
    if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            value = float(value)
        except OverflowError:
            value = math.inf
        if not (math.isfinite(value) and abs(value) <= MAX_FLOAT_SETTING):
            raise ConfigError(f"{where}: expected a finite number within +-{MAX_FLOAT_SETTING:g}, got {value!r}")
        return value
    if kind is bool and not isinstance(value, bool):
        raise ConfigError(f"{where}: expected bool, got {value!r}")
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ConfigError(f"{where}: expected int, got {value!r}")
    if not isinstance(value, kind):
        raise ConfigError(f"{where}: expected {kind.__name__}, got {type(value).__name__} {value!r}")
    return value


def _merge(cfg: dict[str, dict[str, Any]], data: Mapping[str, Any], where: str) -> None:
    for sec_name, sec_val in data.items():
        if sec_name not in cfg:
            raise ConfigError(f"{where}: unknown section [{sec_name}] (known: {', '.join(sorted(cfg))})")
        if not isinstance(sec_val, Mapping):
            raise ConfigError(f"{where}: [{sec_name}] must be a table")
        for key, value in sec_val.items():
            if key not in cfg[sec_name]:
                raise ConfigError(
                    f"{where}: unknown key {sec_name}.{key} (known: {', '.join(sorted(cfg[sec_name]))})"
                )
            cfg[sec_name][key] = _coerce(value, _SECTIONS[sec_name][key], f"{where}: {sec_name}.{key}")


def _env_layer(cfg: dict[str, dict[str, Any]], env: Mapping[str, str]) -> None:
    for name, raw in env.items():
        if not name.startswith("DLSHARE_") or name == "DLSHARE_DATA":
            continue
        rest = name[len("DLSHARE_"):].lower()
        target = None
        for sec in sorted(cfg, key=len, reverse=True):
            if sec != GLOBAL and rest.startswith(sec + "_") and rest[len(sec) + 1:] in cfg[sec]:
                target = (sec, rest[len(sec) + 1:])
                break
        if target is None and rest in cfg[GLOBAL]:
            target = (GLOBAL, rest)
        if target is None:
            continue  # other programs' variables, or DLSHARE_CONFIG
        sec, key = target
        cfg[sec][key] = _coerce(raw, _SECTIONS[sec][key], f"environment {name}")


def load(
    path: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    flags: Mapping[str, Mapping[str, Any]] | None = None,
) -> dict[str, dict[str, Any]]:
    """Build the effective config.  ``flags`` maps section -> {key: value}; None values are ignored."""
    env = os.environ if env is None else env
    cfg = defaults()
    path = path or env.get("DLSHARE_CONFIG")
    if path:
        _merge(cfg, _read_toml(path), f"config file {path}")
    _env_layer(cfg, env)
    for sec, values in (flags or {}).items():
        for key, value in values.items():
            if value is None:
                continue
            if sec not in cfg or key not in cfg[sec]:
                raise ConfigError(f"flag sets unknown key {sec}.{key}")
            cfg[sec][key] = _coerce(value, _SECTIONS[sec][key], f"flag --{key.replace('_', '-')}")
    return cfg


def _read_toml(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A config file's tables: UTF-8 TOML (a byte-order mark is ignored), at most MAX_CONFIG_BYTES."""
    try:
        with open(path, "rb") as fh:
            raw = fh.read(MAX_CONFIG_BYTES + 1)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except OSError as exc:
        raise ConfigError(f"config file {path}: cannot read: {exc.strerror or exc}") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(f"config file {path}: larger than {MAX_CONFIG_BYTES >> 10} KiB; is it the right file?")
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise ConfigError(f"config file {path}: line {line}: not UTF-8 text") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path}: {exc}") from None


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if v is None:
        return '""'
    raise TypeError(f"cannot write {type(v).__name__} as TOML")


def to_toml(cfg: Mapping[str, Mapping[str, Any]], sections: list[str] | None = None) -> str:
    """Render the effective config as TOML that :func:`load` reads back."""
    out: list[str] = []
    for sec in sections or list(cfg):
        out.append(f"[{sec}]")
        for key, value in cfg[sec].items():
            out.append(f"{key} = {_toml_value(value)}")
        out.append("")
    return "\n".join(out)
