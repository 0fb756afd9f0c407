/* CRC-32C with the SSE4.2 crc32 instruction when the CPU has it, and a
 * slicing-by-8 table otherwise.  The choice is made once, at first call. */
#include "crc32c.h"

#include <string.h>

#define POLY 0x82F63B78u

static uint32_t table[8][256];
static int table_ready;

static void build_table(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = (c >> 1) ^ (POLY & (0u - (c & 1u)));
        table[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = table[0][i];
        for (int t = 1; t < 8; t++) {
            c = table[0][c & 0xff] ^ (c >> 8);
            table[t][i] = c;
        }
    }
    __atomic_store_n(&table_ready, 1, __ATOMIC_RELEASE);
}

uint32_t dls_crc32c_sw(uint32_t crc, const void *buf, size_t len) {
    if (!__atomic_load_n(&table_ready, __ATOMIC_ACQUIRE)) build_table();
    const unsigned char *p = buf;
    crc = ~crc;
    while (len >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        w ^= crc;
        crc = table[7][w & 0xff] ^ table[6][(w >> 8) & 0xff] ^ table[5][(w >> 16) & 0xff] ^
              table[4][(w >> 24) & 0xff] ^ table[3][(w >> 32) & 0xff] ^ table[2][(w >> 40) & 0xff] ^
              table[1][(w >> 48) & 0xff] ^ table[0][w >> 56];
        p += 8;
        len -= 8;
    }
    while (len--) crc = table[0][(crc ^ *p++) & 0xff] ^ (crc >> 8);
    return ~crc;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) static uint32_t crc32c_hw(uint32_t crc, const void *buf, size_t len) {
    const unsigned char *p = buf;
    uint64_t c = ~crc;
    while (len && ((uintptr_t)p & 7)) {
        c = __builtin_ia32_crc32qi((uint32_t)c, *p++);
        len--;
    }
    while (len >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        c = __builtin_ia32_crc32di(c, w);
        p += 8;
        len -= 8;
    }
    while (len--) c = __builtin_ia32_crc32qi((uint32_t)c, *p++);
    return ~(uint32_t)c;
}
#endif

static int hw_state = -1; /* -1 unknown, 0 table, 1 sse4.2 */

int dls_crc32c_hw(void) {
    int s = __atomic_load_n(&hw_state, __ATOMIC_ACQUIRE);
    if (s < 0) {
#if defined(__x86_64__)
        __builtin_cpu_init();
        s = __builtin_cpu_supports("sse4.2") ? 1 : 0;
#else
        s = 0;
#endif
        __atomic_store_n(&hw_state, s, __ATOMIC_RELEASE);
    }
    return s;
}

uint32_t dls_crc32c(uint32_t crc, const void *buf, size_t len) {
#if defined(__x86_64__)
    if (dls_crc32c_hw()) return crc32c_hw(crc, buf, len);
#endif
    return dls_crc32c_sw(crc, buf, len);
}
