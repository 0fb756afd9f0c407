/* Three-stream CRC-32C; see pagecrc.h. */
#include "pagecrc.h"

#include <string.h>

#include "crc32c.h"

#define POLY 0x82F63B78u /* CRC-32C, reflected */
#define X0 0x80000000u   /* the polynomial 1 in the reflected representation */
#define MIN_SPLIT 768    /* below this the serial loop wins */

/* a * b mod P, both in the reflected representation (bit 31 holds x^0). */
static uint32_t gf_mul(uint32_t a, uint32_t b) {
    uint32_t prod = 0;
    for (int i = 0; i < 32; i++) { /* branch-free: the bits of a are data */
        prod ^= b & (0u - (a >> 31));
        a <<= 1;                                 /* next power of x in a */
        b = (b >> 1) ^ (POLY & (0u - (b & 1u))); /* b *= x */
    }
    return prod;
}

/* x^e mod P */
static uint32_t x_pow(uint64_t e) {
    uint32_t result = X0, base = X0 >> 1; /* x^1 */
    while (e) {
        if (e & 1u) result = gf_mul(result, base);
        base = gf_mul(base, base);
        e >>= 1;
    }
    return result;
}

uint32_t dls_crc32c_shift(uint32_t state, uint64_t nbytes) { return gf_mul(x_pow(8 * nbytes), state); }

#if defined(__x86_64__)
#include <immintrin.h>

/* k * s * x^32 mod P in a few instructions: the carry-less product of two
 * reflected 32-bit values, shifted into a reflected 64-bit one, is reduced by
 * the crc32 instruction, which also multiplies by x^32.  The constants are
 * therefore stored as x^(8n - 32), so that the result is s * x^(8n). */
__attribute__((target("sse4.2,pclmul"))) static uint32_t shift_clmul(uint32_t k, uint32_t s) {
    __m128i p = _mm_clmulepi64_si128(_mm_cvtsi32_si128((int)k), _mm_cvtsi32_si128((int)s), 0);
    return (uint32_t)_mm_crc32_u64(0, (uint64_t)_mm_cvtsi128_si64(p) << 1);
}

/* the shift constants of the last length seen, per thread: pages repeat their length */
static __thread size_t cached_len;
static __thread uint32_t cached_k_bc, cached_k_c;

__attribute__((target("sse4.2,pclmul"))) static uint32_t crc3(uint32_t crc, const unsigned char *p, size_t len) {
    size_t part = (len / 3) & ~(size_t)7;
    size_t tail = len - 3 * part; /* C takes the remainder serially */
    if (cached_len != len) {
        cached_k_bc = x_pow(8 * (part + part + tail) - 32);
        cached_k_c = x_pow(8 * (part + tail) - 32);
        cached_len = len;
    }
    uint64_t a = (uint32_t)~crc, b = 0, c = 0;
    const unsigned char *pa = p, *pb = p + part, *pc = p + 2 * part;
    for (size_t i = 0; i < part; i += 8) {
        uint64_t wa, wb, wc;
        memcpy(&wa, pa + i, 8);
        memcpy(&wb, pb + i, 8);
        memcpy(&wc, pc + i, 8);
        a = __builtin_ia32_crc32di(a, wa);
        b = __builtin_ia32_crc32di(b, wb);
        c = __builtin_ia32_crc32di(c, wc);
    }
    const unsigned char *t = pc + part;
    size_t n = tail;
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, t, 8);
        c = __builtin_ia32_crc32di(c, w);
        t += 8;
        n -= 8;
    }
    while (n--) c = __builtin_ia32_crc32qi((uint32_t)c, *t++);
    uint32_t raw = shift_clmul(cached_k_bc, (uint32_t)a) ^ shift_clmul(cached_k_c, (uint32_t)b) ^ (uint32_t)c;
    return ~raw;
}

static int clmul_state = -1;

static int have_clmul(void) {
    int s = __atomic_load_n(&clmul_state, __ATOMIC_ACQUIRE);
    if (s < 0) {
        __builtin_cpu_init();
        s = dls_crc32c_hw() && __builtin_cpu_supports("pclmul");
        __atomic_store_n(&clmul_state, s, __ATOMIC_RELEASE);
    }
    return s;
}
#endif

uint32_t dls_crc32c_pages(uint32_t crc, const void *buf, size_t len) {
#if defined(__x86_64__)
    if (len >= MIN_SPLIT && have_clmul()) return crc3(crc, buf, len);
#endif
    return dls_crc32c(crc, buf, len);
}
