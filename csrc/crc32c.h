#ifndef DLSHARE_CRC32C_H
#define DLSHARE_CRC32C_H
#include <stddef.h>
#include <stdint.h>

/* CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), as used by iSCSI,
 * ext4 and RDMA iWARP.  `crc` is the running value: pass 0 for a fresh buffer,
 * or a previous result to continue over a following buffer. */
uint32_t dls_crc32c(uint32_t crc, const void *buf, size_t len);
/* The table-driven implementation, exposed so tests can compare both paths. */
uint32_t dls_crc32c_sw(uint32_t crc, const void *buf, size_t len);
/* 1 when the SSE4.2 crc32 instruction is used by dls_crc32c. */
int dls_crc32c_hw(void);
#endif
