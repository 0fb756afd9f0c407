#ifndef DLSHARE_PAGECRC_H
#define DLSHARE_PAGECRC_H
/* CRC-32C of a page-sized buffer, faster than one serial stream: the buffer is
 * cut in three, the three parts are checksummed in interleaved SSE4.2 streams
 * (the crc32 instruction has a latency of 3 cycles and a throughput of 1), and
 * the three results are combined by multiplication modulo the polynomial.
 * Same value and calling convention as dls_crc32c (crc32c.h). */
#include <stddef.h>
#include <stdint.h>

uint32_t dls_crc32c_pages(uint32_t crc, const void *buf, size_t len);
/* x^(8n) mod P applied to a raw CRC state: the state after n more zero bytes. */
uint32_t dls_crc32c_shift(uint32_t state, uint64_t nbytes);
#endif
