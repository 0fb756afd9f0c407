/* Gradient reduction kernels for the shared aggregation service.
 *
 * Memory-bound sums of fp32, fp16 and bf16 buffers.  Every dtype is accumulated
 * in fp32 and summed in source (rank) order, so a result never depends on
 * arrival order or on the code path: the AVX2 path and the scalar path give the
 * same bits.  The AVX2+F16C path is chosen at run time. */
#include "reduce.h"

#include <errno.h>
#include <string.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

/* ---- scalar conversions (IEEE binary16 and bfloat16, round to nearest even) ---- */

static inline float bits_f(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static inline uint32_t f_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static inline float h2f(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    if (exp == 0) {
        if (man == 0) return bits_f(sign);
        exp = 113; /* normalise a subnormal half */
        while (!(man & 0x400u)) {
            man <<= 1;
            exp--;
        }
        return bits_f(sign | (exp << 23) | ((man & 0x3ffu) << 13));
    }
    if (exp == 31) return bits_f(sign | 0x7f800000u | (man << 13));
    return bits_f(sign | ((exp + 112) << 23) | (man << 13));
}

static inline uint16_t f2h(float x) {
    uint32_t u = f_bits(x);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    uint32_t a = u & 0x7fffffffu;
    if (a >= 0x7f800000u) return sign | 0x7c00u | (a > 0x7f800000u ? 0x200u : 0u);
    if (a >= 0x477ff000u) return sign | 0x7c00u; /* >= 65520 rounds to infinity */
    if (a < 0x38800000u) {                        /* half subnormal or zero */
        if (a <= 0x33000000u) return sign;        /* <= 2^-25 rounds to (even) zero */
        uint32_t e = a >> 23, m = (a & 0x7fffffu) | 0x800000u, shift = 126 - e;
        uint32_t hm = m >> shift, rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
        if (rem > half || (rem == half && (hm & 1u))) hm++;
        return sign | (uint16_t)hm;
    }
    uint32_t r = a - 0x38000000u, hm = r >> 13, rem = r & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (hm & 1u))) hm++;
    return sign | (uint16_t)hm;
}

static inline float b2f(uint16_t b) { return bits_f((uint32_t)b << 16); }

static inline uint16_t f2b(float x) {
    uint32_t u = f_bits(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0u; /* quiet NaN, as torch */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline float load_s(int dt, const void *p, size_t i) {
    switch (dt) {
    case DLS_DT_F32: return ((const float *)p)[i];
    case DLS_DT_F16: return h2f(((const uint16_t *)p)[i]);
    default: return b2f(((const uint16_t *)p)[i]);
    }
}
static inline void store_s(int dt, void *p, size_t i, float v) {
    switch (dt) {
    case DLS_DT_F32: ((float *)p)[i] = v; break;
    case DLS_DT_F16: ((uint16_t *)p)[i] = f2h(v); break;
    default: ((uint16_t *)p)[i] = f2b(v); break;
    }
}

static void sum_scalar(int dt, void *dst, const void *const *srcs, size_t nsrc, size_t from, size_t count,
                       float divisor) {
    int scale = divisor != 1.0f;
    for (size_t i = from; i < count; i++) {
        float acc = load_s(dt, srcs[0], i);
        for (size_t s = 1; s < nsrc; s++) acc += load_s(dt, srcs[s], i);
        if (scale) acc /= divisor;
        store_s(dt, dst, i, acc);
    }
}

/* ---- AVX2 + F16C ---- */
#if defined(__x86_64__)
#define SIMD __attribute__((target("avx2,f16c")))

SIMD static inline __m256 load8(int dt, const void *p, size_t i) {
    if (dt == DLS_DT_F32) return _mm256_loadu_ps((const float *)p + i);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i));
    if (dt == DLS_DT_F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

SIMD static inline void store8(int dt, void *p, size_t i, __m256 v) {
    if (dt == DLS_DT_F32) {
        _mm256_storeu_ps((float *)p + i, v);
        return;
    }
    __m128i out;
    if (dt == DLS_DT_F16) {
        out = _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    } else {
        __m256i u = _mm256_castps_si256(v);
        __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
        __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
        __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
        r = _mm256_castps_si256(
            _mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc0)), nan));
        __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
        out = _mm256_castsi256_si128(packed);
    }
    _mm_storeu_si128((__m128i *)((uint16_t *)p + i), out);
}

SIMD static size_t sum_avx2(int dt, void *dst, const void *const *srcs, size_t nsrc, size_t count, float divisor) {
    const int scale = divisor != 1.0f;
    const __m256 d = _mm256_set1_ps(divisor);
    size_t i = 0;
    for (; i + 32 <= count; i += 32) {
        __m256 a0 = load8(dt, srcs[0], i), a1 = load8(dt, srcs[0], i + 8);
        __m256 a2 = load8(dt, srcs[0], i + 16), a3 = load8(dt, srcs[0], i + 24);
        for (size_t s = 1; s < nsrc; s++) {
            const void *p = srcs[s];
            a0 = _mm256_add_ps(a0, load8(dt, p, i));
            a1 = _mm256_add_ps(a1, load8(dt, p, i + 8));
            a2 = _mm256_add_ps(a2, load8(dt, p, i + 16));
            a3 = _mm256_add_ps(a3, load8(dt, p, i + 24));
        }
        if (scale) {
            a0 = _mm256_div_ps(a0, d);
            a1 = _mm256_div_ps(a1, d);
            a2 = _mm256_div_ps(a2, d);
            a3 = _mm256_div_ps(a3, d);
        }
        store8(dt, dst, i, a0);
        store8(dt, dst, i + 8, a1);
        store8(dt, dst, i + 16, a2);
        store8(dt, dst, i + 24, a3);
    }
    for (; i + 8 <= count; i += 8) {
        __m256 a = load8(dt, srcs[0], i);
        for (size_t s = 1; s < nsrc; s++) a = _mm256_add_ps(a, load8(dt, srcs[s], i));
        if (scale) a = _mm256_div_ps(a, d);
        store8(dt, dst, i, a);
    }
    return i;
}

SIMD static size_t convert_avx2(int dst_dt, void *dst, int src_dt, const void *src, size_t count) {
    size_t i = 0;
    for (; i + 8 <= count; i += 8) store8(dst_dt, dst, i, load8(src_dt, src, i));
    return i;
}
#endif

static int simd_state = -1; /* -1 unknown, 0 scalar, 1 avx2+f16c */
static int force_scalar;

int dls_reduce_simd(void) {
    int s = __atomic_load_n(&simd_state, __ATOMIC_ACQUIRE);
    if (s < 0) {
#if defined(__x86_64__)
        __builtin_cpu_init();
        s = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c") ? 1 : 0;
#else
        s = 0;
#endif
        __atomic_store_n(&simd_state, s, __ATOMIC_RELEASE);
    }
    return s && !__atomic_load_n(&force_scalar, __ATOMIC_ACQUIRE);
}

void dls_reduce_force_scalar(int on) { __atomic_store_n(&force_scalar, on ? 1 : 0, __ATOMIC_RELEASE); }

int dls_reduce_sum(int dtype, void *dst, const void *const *srcs, size_t nsrc, size_t count, float divisor) {
    if (dtype != DLS_DT_F32 && dtype != DLS_DT_F16 && dtype != DLS_DT_BF16) return -EINVAL;
    if (nsrc == 0 || divisor == 0.0f) return -EINVAL;
    size_t done = 0;
#if defined(__x86_64__)
    if (dls_reduce_simd()) done = sum_avx2(dtype, dst, srcs, nsrc, count, divisor);
#endif
    sum_scalar(dtype, dst, srcs, nsrc, done, count, divisor);
    return 0;
}

int dls_reduce_add(int dtype, void *dst, const void *src, size_t count) {
    const void *srcs[2] = {dst, src};
    return dls_reduce_sum(dtype, dst, srcs, 2, count, 1.0f);
}

int dls_reduce_scale(int dtype, void *dst, size_t count, float divisor) {
    const void *srcs[1] = {dst};
    return dls_reduce_sum(dtype, dst, srcs, 1, count, divisor);
}

int dls_reduce_convert(int dst_dt, void *dst, int src_dt, const void *src, size_t count) {
    if (dst_dt < DLS_DT_F32 || dst_dt > DLS_DT_BF16 || src_dt < DLS_DT_F32 || src_dt > DLS_DT_BF16) return -EINVAL;
    size_t i = 0;
#if defined(__x86_64__)
    if (dls_reduce_simd()) i = convert_avx2(dst_dt, dst, src_dt, src, count);
#endif
    for (; i < count; i++) store_s(dst_dt, dst, i, load_s(src_dt, src, i));
    return 0;
}
