"""The C reduction kernels against numpy/torch references, on both code paths."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from aggregator import kernel
from aggregator.protocol import DType


@pytest.fixture(params=["simd", "scalar"])
def path(request):
    kernel.force_scalar(request.param == "scalar")
    if request.param == "simd" and not kernel.uses_simd():
        pytest.fail("this x86-64 CPU has AVX2+F16C; the SIMD path must be selected")
    yield request.param
    kernel.force_scalar(False)


def _bf16_bits(x: np.ndarray) -> np.ndarray:
    return torch.from_numpy(x.astype(np.float32)).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def _bf16_float(bits: np.ndarray) -> np.ndarray:
    return torch.from_numpy(bits.view(np.int16).copy()).view(torch.bfloat16).float().numpy()


def _make(dtype: DType, n: int, rng) -> tuple[np.ndarray, np.ndarray]:
    """(raw buffer, its exact float32 values)."""
    vals = (rng.standard_normal(n) * rng.choice([1e-6, 1.0, 1e3], n)).astype(np.float32)
    if dtype is DType.F32:
        return vals.copy(), vals
    if dtype is DType.F16:
        raw = vals.astype(np.float16)
        return raw, raw.astype(np.float32)
    raw = _bf16_bits(vals)
    return raw, _bf16_float(raw)


def _ref(dtype: DType, floats: list[np.ndarray], divisor: float) -> np.ndarray:
    acc = floats[0].copy()
    for f in floats[1:]:
        acc += f  # rank order, fp32, as the kernel
    if divisor != 1.0:
        acc /= np.float32(divisor)
    if dtype is DType.F32:
        return acc
    if dtype is DType.F16:
        return acc.astype(np.float16)
    return _bf16_bits(acc)


@pytest.mark.parametrize("dtype", list(DType))
@pytest.mark.parametrize("nsrc", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("n", [1, 7, 8, 31, 33, 1000, 4099])
def test_reduce_sum_matches_reference_bit_for_bit(path, dtype, nsrc, n):
    rng = np.random.default_rng(n * 31 + nsrc)
    pairs = [_make(dtype, n, rng) for _ in range(nsrc)]
    for divisor in (1.0, float(nsrc), 3.0):
        raws = [p[0].copy() for p in pairs]
        expect = _ref(dtype, [p[1] for p in pairs], divisor)
        out = np.empty_like(raws[0])
        kernel.reduce_sum(dtype, out, raws, divisor)
        np.testing.assert_array_equal(out.view(np.uint8), expect.view(np.uint8))
        kernel.reduce_sum(dtype, raws[0], raws, divisor)  # dst aliasing srcs[0]
        np.testing.assert_array_equal(raws[0].view(np.uint8), expect.view(np.uint8))


@pytest.mark.parametrize("dtype", list(DType))
def test_add_and_scale_in_place(path, dtype):
    rng = np.random.default_rng(7)
    (a, af), (b, bf) = _make(dtype, 1037, rng), _make(dtype, 1037, rng)
    kernel.add_(dtype, a, b)
    np.testing.assert_array_equal(a.view(np.uint8), _ref(dtype, [af, bf], 1.0).view(np.uint8))
    c, cf = _make(dtype, 1037, rng)
    kernel.scale_(dtype, c, 4.0)
    np.testing.assert_array_equal(c.view(np.uint8), _ref(dtype, [cf], 4.0).view(np.uint8))


def test_fp16_rounding_edges(path):
    """Ties to even, overflow to infinity, subnormals, signed zero, inf-inf, against numpy's cast."""
    pairs = [(1.0, 2**-11), (1.0, 3 * 2**-11), (65504.0, 16.0), (65504.0, 8.0), (-65504.0, -32.0),
             (2**-24, 2**-24), (2**-24, -(2**-24)), (-0.0, -0.0), (6.1e-5, 2**-24), (np.inf, -np.inf),
             (np.inf, 1.0), (0.1, 0.2), (2**-14, -(2**-24)), (1024.0, 0.5), (1024.0, 1.5), (2048.0, 1.0)]
    a = np.array([p[0] for p in pairs] * 3, np.float16)
    b = np.array([p[1] for p in pairs] * 3, np.float16)
    dst = np.empty_like(a)
    kernel.reduce_sum(DType.F16, dst, [a, b])
    with np.errstate(invalid="ignore", over="ignore"):
        expect = (a.astype(np.float32) + b.astype(np.float32)).astype(np.float16)
    np.testing.assert_array_equal(dst.view(np.uint16) & 0x7DFF, expect.view(np.uint16) & 0x7DFF)  # any NaN payload
    assert np.isnan(dst[9]) and np.isposinf(dst[2]) and dst.view(np.uint16)[7] == 0x8000


def test_bf16_nan_and_inf(path):
    raw = _bf16_bits(np.array([np.nan, np.inf, -np.inf, 3.0e38, 1.0] * 4, np.float32))
    out = np.empty_like(raw)
    kernel.reduce_sum(DType.BF16, out, [raw, raw])
    f = _bf16_float(out)
    assert np.isnan(f[0]) and out[0] == 0x7FC0
    assert np.isposinf(f[1]) and np.isneginf(f[2]) and np.isposinf(f[3]) and f[4] == 2.0


def test_simd_and_scalar_paths_agree_on_large_random_inputs():
    rng = np.random.default_rng(3)
    for dtype in DType:
        pairs = [_make(dtype, 100_003, rng) for _ in range(4)]
        outs = []
        for scalar in (False, True):
            kernel.force_scalar(scalar)
            out = np.empty_like(pairs[0][0])
            kernel.reduce_sum(dtype, out, [p[0] for p in pairs], 4.0)
            outs.append(out)
        kernel.force_scalar(False)
        np.testing.assert_array_equal(outs[0].view(np.uint8), outs[1].view(np.uint8))


def test_bad_arguments_raise():
    a = np.zeros(8, np.float32)
    with pytest.raises(ValueError):
        kernel.reduce_sum(DType.F32, a, [])
    with pytest.raises(ValueError):
        kernel.reduce_sum(DType.F32, a, [np.zeros(4, np.float32)])
    with pytest.raises(ValueError):
        kernel.scale_(DType.F32, a, 0.0)
    with pytest.raises(ValueError):
        kernel.add_(DType.F32, np.zeros(3, np.uint8), np.zeros(3, np.uint8))


@pytest.mark.parametrize("dtype", [DType.F16, DType.BF16])
def test_convert_narrows_as_torch_does_and_widens_exactly(path, dtype):
    """The compressed wire's conversions: bit for bit torch's .to(), subnormals, overflow and signed
    zeros included, with a ragged tail for the scalar remainder of the SIMD path."""
    rng = np.random.default_rng(3)
    n = 10_007
    with np.errstate(over="ignore"):  # 1e39 overflows float32 to inf, on purpose
        x = (rng.standard_normal(n) * rng.choice([1e-42, 1e-38, 1e-8, 1e-5, 1.0, 7e4, 1e39], n)).astype(np.float32)
    x[:5] = [np.inf, -np.inf, 0.0, -0.0, 65519.996]
    tdt = {DType.F16: torch.float16, DType.BF16: torch.bfloat16}[dtype]
    narrow = np.empty(n, np.uint16)
    kernel.convert(dtype, narrow, DType.F32, x)
    want = torch.from_numpy(x).to(tdt).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(narrow, want)
    wide = np.empty(n, np.float32)
    kernel.convert(DType.F32, wide, dtype, narrow)
    np.testing.assert_array_equal(wide.view(np.uint32),
                                  torch.from_numpy(want.view(np.int16).copy()).view(tdt).float().numpy().view(np.uint32))
    with pytest.raises(ValueError):
        kernel.convert(dtype, np.empty(n - 1, np.uint16), DType.F32, x)
