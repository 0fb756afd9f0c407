import zlib

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from rdma import crc32c
from rdma.native import crc32c_table, crc32c_uses_sse42

# RFC 3720 (iSCSI) appendix B.4 test vectors, plus the common "123456789" check value.
VECTORS = [
    (b"", 0x00000000),
    (b"123456789", 0xE3069283),
    (bytes(32), 0x8A9136AA),
    (b"\xff" * 32, 0x62A8AB43),
    (bytes(range(32)), 0x46DD794E),
    (bytes(range(31, -1, -1)), 0x113FDB5C),
]


def test_known_vectors_both_paths():
    for data, want in VECTORS:
        assert crc32c(data) == want, data
        assert crc32c_table(data) == want, data


def test_is_castagnoli_not_ieee():
    assert crc32c(b"123456789") != zlib.crc32(b"123456789")


def test_numpy_and_unaligned_views():
    buf = np.arange(10_000, dtype=np.uint8)
    assert crc32c(buf) == crc32c(buf.tobytes())
    mv = memoryview(buf.tobytes())[3:]  # unaligned start
    assert crc32c(mv) == crc32c_table(mv)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=5000), st.integers(0, 5000))
def test_hardware_equals_table_and_continues(data, cut):
    cut = min(cut, len(data))
    assert crc32c(data) == crc32c_table(data)
    assert crc32c(data[cut:], crc32c(data[:cut])) == crc32c(data)


def test_reports_which_path():
    assert isinstance(crc32c_uses_sse42(), bool)
