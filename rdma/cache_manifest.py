"""The manifest of a named sample cache: where its index and segments live on donors, sealed with
the cache's secret.  Pure: no I/O (rdma.sample_cache publishes and reads it over MQTT).

The job that fills a named cache publishes its manifest, retained, on
``dlshare/v1/cache/<name>/manifest``.  The slab tokens in it are what lets a reader reach the
bytes on the donors, so the document is encrypted and authenticated with keys derived from the
secret; without the secret a reader learns the cache's name and size and nothing else.

Sealing uses the standard library only: keys are HMAC-SHA256(secret, label | name); the body is
XORed with SHAKE-256(key | nonce) (a keyed extendable-output function used as a stream cipher) and
authenticated with HMAC-SHA256 over the name, nonce and ciphertext (encrypt-then-MAC), compared in
constant time.  A fresh 16-byte nonce per publication.

:func:`check_manifest` validates an opened document field by field (types, ranges, sizes): a
manifest is input from another job and never trusted further than that.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import re
from dataclasses import dataclass
from typing import Any

VERSION = 1
MAX_MANIFEST = 1 << 20  # an MQTT payload above 1 MiB is refused by the bus anyway
MAX_SEGMENTS = 1 << 16
MAX_REPLICAS = 8
MAX_SLOTS = 1 << 31
_SECRET_RE = re.compile(r"[\x21-\x7e]{8,256}\Z")
COPY_STATES = ("live", "rebuilding", "evicting")
_ADDR_RE = re.compile(r"[A-Za-z0-9_.:\[\]-]{1,255}:[0-9]{1,5}\Z")


class ManifestError(ValueError):
    """A manifest that cannot be used: malformed, for another cache, or not opened by the secret."""


def check_secret(secret: str) -> str:
    if not isinstance(secret, str) or not _SECRET_RE.match(secret):
        raise ValueError("a cache secret is 8-256 printable ASCII characters without spaces "
                         "(e.g. `openssl rand -hex 16`)")
    return secret


def _keys(name: str, secret: str) -> tuple[bytes, bytes]:
    s = check_secret(secret).encode()
    enc = hmac.new(s, b"dlshare cache manifest enc|" + name.encode(), hashlib.sha256).digest()
    mac = hmac.new(s, b"dlshare cache manifest mac|" + name.encode(), hashlib.sha256).digest()
    return enc, mac


def _xor(data: bytes, key: bytes, nonce: bytes) -> bytes:
    stream = hashlib.shake_256(key + nonce).digest(len(data))
    return (int.from_bytes(data, "little") ^ int.from_bytes(stream, "little")).to_bytes(len(data), "little")


def seal(doc: dict[str, Any], name: str, secret: str, nonce: bytes | None = None,
         public: dict[str, Any] | None = None) -> dict[str, Any]:
    """The outer message (a JSON object) carrying ``doc`` sealed for ``name`` with ``secret``; ``public``:
    what anyone may read (``dlshare status`` shows it: owner, slots, donor bytes), authenticated too."""
    enc, mac = _keys(name, secret)
    nonce = os.urandom(16) if nonce is None else nonce
    body = json.dumps(doc, separators=(",", ":"), sort_keys=True).encode()
    box = _xor(body, enc, nonce)
    pub = json.dumps(public or {}, separators=(",", ":"), sort_keys=True).encode()
    tag = hmac.new(mac, name.encode() + b"|" + nonce + box + b"|" + pub, hashlib.sha256).hexdigest()
    return {"v": VERSION, "cache": name, "nonce": nonce.hex(), "box": base64.b64encode(box).decode(), "mac": tag,
            "public": public or {}}


def open_sealed(msg: Any, name: str, secret: str) -> dict[str, Any]:
    """The document inside the outer message ``msg``; :class:`ManifestError` if it is malformed,
    for another cache, or the secret does not open it."""
    if not isinstance(msg, dict):
        raise ManifestError("a manifest is a JSON object")
    if msg.get("v") != VERSION:
        raise ManifestError(f"manifest version {msg.get('v')!r}, this reader knows {VERSION}")
    if msg.get("cache") != name:
        raise ManifestError(f"a manifest for {msg.get('cache')!r}, not {name!r}")
    nonce_hex, box_b64, tag = msg.get("nonce"), msg.get("box"), msg.get("mac")
    if not all(isinstance(x, str) for x in (nonce_hex, box_b64, tag)):
        raise ManifestError("manifest fields nonce, box and mac must be strings")
    if len(box_b64) > 2 * MAX_MANIFEST or len(nonce_hex) != 32 or len(tag) != 64:
        raise ManifestError("manifest fields of the wrong size")
    try:
        nonce = bytes.fromhex(nonce_hex)
        box = base64.b64decode(box_b64, validate=True)
    except ValueError:
        raise ManifestError("manifest nonce or box is not hex / base64") from None
    public = msg.get("public", {})
    if not isinstance(public, dict):
        raise ManifestError("manifest field public must be an object")
    pub = json.dumps(public, separators=(",", ":"), sort_keys=True).encode()
    enc, mac = _keys(name, secret)
    want = hmac.new(mac, name.encode() + b"|" + nonce + box + b"|" + pub, hashlib.sha256).hexdigest()
    if not hmac.compare_digest(want, tag):
        raise ManifestError(f"the secret does not open cache {name!r} (or its manifest was altered)")
    try:
        doc = json.loads(_xor(box, enc, nonce))
    except ValueError:
        raise ManifestError("the sealed manifest is not JSON") from None
    if not isinstance(doc, dict):
        raise ManifestError("the sealed manifest is not a JSON object")
    return doc


# --- the document -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class CopyRef:
    """One copy of a slab: the slab server's address, the slab id and its token."""

    addr: str
    slab: int
    token: bytes
    state: str = "live"  # "live"; "rebuilding": written, never read; "evicting": read only when no live copy is


@dataclass(frozen=True)
class ExtentRef:
    first_page: int
    npages: int
    copies: tuple[CopyRef, ...]


@dataclass(frozen=True)
class SegmentRef:
    gen: int
    copies: tuple[CopyRef, ...]


@dataclass(frozen=True)
class Manifest:
    owner: str
    slots: int
    page: int
    seg_bytes: int
    rsegs: int
    version: int
    index: tuple[ExtentRef, ...]  # the slot table on donors, as the pages of one buffer
    segments: dict[int, SegmentRef]


def _int(doc: dict, key: str, lo: int, hi: int) -> int:
    v = doc.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise ManifestError(f"manifest field {key!r} must be a whole number in [{lo}, {hi}], got {v!r}")
    return v


def _copies(raw: Any, where: str) -> tuple[CopyRef, ...]:
    if not isinstance(raw, list) or not 1 <= len(raw) <= MAX_REPLICAS:
        raise ManifestError(f"{where}: copies must be a list of 1-{MAX_REPLICAS}")
    out = []
    for c in raw:
        if not (isinstance(c, list) and len(c) == 4 and isinstance(c[0], str) and _ADDR_RE.match(c[0])
                and isinstance(c[1], int) and not isinstance(c[1], bool) and 0 <= c[1] < 1 << 32
                and isinstance(c[2], str) and len(c[2]) == 32 and c[3] in COPY_STATES):
            raise ManifestError(f"{where}: a copy must be [addr, slab, token hex, state], got {c!r}"[:200])
        try:
            token = bytes.fromhex(c[2])
        except ValueError:
            raise ManifestError(f"{where}: token is not hex") from None
        out.append(CopyRef(c[0], c[1], token, c[3]))
    return tuple(out)


def copy_list(copies: tuple[CopyRef, ...] | list[CopyRef]) -> list[list[Any]]:
    return [[c.addr, c.slab, c.token.hex(), c.state] for c in copies]


def check_manifest(doc: Any) -> Manifest:
    """A validated :class:`Manifest` from an opened document (:class:`ManifestError` if unusable)."""
    if not isinstance(doc, dict):
        raise ManifestError("a manifest is a JSON object")
    owner = doc.get("owner")
    if not isinstance(owner, str) or not 0 < len(owner) <= 128:
        raise ManifestError("manifest field 'owner' must be a short string")
    slots = _int(doc, "slots", 1, MAX_SLOTS)
    page = _int(doc, "page", 4096, 1 << 20)
    seg_bytes = _int(doc, "seg_bytes", page, 1 << 40)
    rsegs = _int(doc, "rsegs", 0, MAX_SEGMENTS)
    version = _int(doc, "version", 0, 1 << 62)
    raw_index = doc.get("index")
    if not isinstance(raw_index, list) or not 1 <= len(raw_index) <= MAX_SEGMENTS:
        raise ManifestError("manifest field 'index' must be a non-empty list of extents")
    index, next_page = [], 0
    for i, e in enumerate(raw_index):
        if not isinstance(e, dict):
            raise ManifestError(f"index extent {i} is not an object")
        first, n = _int(e, "first_page", 0, 1 << 40), _int(e, "npages", 1, 1 << 40)
        if first != next_page:
            raise ManifestError(f"index extent {i} starts at page {first}, expected {next_page}")
        next_page = first + n
        index.append(ExtentRef(first, n, _copies(e.get("copies"), f"index extent {i}")))
    if next_page * page < slots * 64:
        raise ManifestError(f"the index holds {next_page} pages, {slots} slots need more")
    raw_segs = doc.get("segments")
    if not isinstance(raw_segs, dict) or len(raw_segs) > MAX_SEGMENTS:
        raise ManifestError(f"manifest field 'segments' must be an object of at most {MAX_SEGMENTS}")
    segs: dict[int, SegmentRef] = {}
    for k, s in raw_segs.items():
        if not (isinstance(k, str) and k.isascii() and k.isdigit() and len(k) <= 6 and int(k) < rsegs) or not isinstance(s, dict):
            raise ManifestError(f"segment {k!r}: bad id or body"[:200])
        segs[int(k)] = SegmentRef(_int(s, "gen", 0, (1 << 32) - 1), _copies(s.get("copies"), f"segment {k}"))
    return Manifest(owner, slots, page, seg_bytes, rsegs, version, tuple(index), segs)


__all__ = ["seal", "open_sealed", "check_manifest", "check_secret", "Manifest", "SegmentRef", "ExtentRef", "CopyRef",
           "ManifestError", "copy_list"]
