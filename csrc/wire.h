#ifndef DLSHARE_WIRE_H
#define DLSHARE_WIRE_H
/* The remote-memory wire format: framing, parsing and validation, pure (no I/O).
 *
 * All integers are little-endian.  A request is
 *   header (40 bytes): u32 magic, u8 version, u8 op, u16 flags, u64 req_id,
 *                      u32 slab, u32 nseg, u8 token[16]
 *   nseg segment descriptors (16 bytes each): u64 offset, u32 length, u32 crc
 *   WRITE only: the payload, the segments' bytes back to back.
 * A response is
 *   header (24 bytes): u32 magic, u8 version, u8 op, u8 flags, u8 status,
 *                      u64 req_id, u32 body_len, u32 nseg
 *   body: READ with status OK: (flags & CRC) nseg u32 crcs, then the data.
 * The descriptor's crc is the writer's CRC-32C of that segment when the
 * request carries DLS_F_CRC; it is ignored otherwise. */
#include <stddef.h>
#include <stdint.h>

#define DLS_WIRE_MAGIC 0x4D534C44u /* "DLSM" */
#define DLS_WIRE_VERSION 1
#define DLS_REQ_HDR_LEN 40
#define DLS_RESP_HDR_LEN 24
#define DLS_SEG_LEN 16
#define DLS_TOKEN_LEN 16
#define DLS_MAX_SEGS 1024
#define DLS_MAX_SEG_BYTES (1u << 20)
#define DLS_MAX_PAYLOAD (16u << 20)
#define DLS_MAX_REQ_FRAME (DLS_REQ_HDR_LEN + DLS_SEG_LEN * DLS_MAX_SEGS + DLS_MAX_PAYLOAD)

#define DLS_OP_READ 1
#define DLS_OP_WRITE 2
#define DLS_OP_PING 3
#define DLS_F_CRC 1u
#define DLS_F_KNOWN (DLS_F_CRC)

/* Status codes: 0 ok; 1..63 sent by the server in responses (the donor's answer,
 * on the wire); negative ones are local outcomes, each a negative errno, as every
 * C function of dlshare returns them (README, Development: the C core).  The
 * numbers are spelled out for cffi; wire.c checks each against <errno.h>.
 * DLS_NEED_MORE is the parser asking for more bytes (-EAGAIN). */
#define DLS_OK 0
#define DLS_E_MAGIC 1
#define DLS_E_VERSION 2
#define DLS_E_OP 3
#define DLS_E_FLAGS 4
#define DLS_E_NSEG 5
#define DLS_E_SEGLEN 6
#define DLS_E_SIZE 7
#define DLS_E_NOSLAB 8
#define DLS_E_TOKEN 9
#define DLS_E_BOUNDS 10
#define DLS_E_CRC 11
#define DLS_E_INTERNAL 12
#define DLS_NEED_MORE (-11)      /* -EAGAIN */
#define DLS_E_IO (-5)            /* -EIO: the connection failed, or no copy could serve */
#define DLS_E_TIMEOUT (-110)     /* -ETIMEDOUT */
#define DLS_E_PROTO (-71)        /* -EPROTO: the peer broke the protocol */
#define DLS_E_ARG (-22)          /* -EINVAL */
#define DLS_E_CLOSED (-108)      /* -ESHUTDOWN: the object is closed */
#define DLS_E_UNSUPPORTED (-95)  /* -EOPNOTSUPP */

typedef struct dls_req_view {
    uint8_t version, op;
    uint16_t flags;
    uint64_t req_id;
    uint32_t slab, nseg;
    const uint8_t *token;   /* 16 bytes inside the parsed buffer */
    const uint8_t *segs;    /* nseg descriptors inside the parsed buffer */
    const uint8_t *payload; /* WRITE payload inside the parsed buffer, else NULL */
    uint64_t payload_len;   /* sum of segment lengths */
    uint64_t frame_len;     /* total bytes of this request */
    /* when the result is an error, whether the frame length is still known
     * (the stream can continue after skipping frame_len bytes) */
    int resync;
} dls_req_view;

typedef struct dls_resp_view {
    uint8_t version, op, flags, status;
    uint64_t req_id;
    uint32_t body_len, nseg;
} dls_resp_view;

/* Parse one request from buf[0:len].  Returns DLS_OK (v describes a whole frame
 * of v->frame_len <= len bytes), DLS_NEED_MORE (v->frame_len is the length
 * needed so far, at least len+1), or an error code (v->resync says whether
 * v->frame_len can be skipped to reach the next frame). */
int dls_wire_parse_req(const uint8_t *buf, size_t len, dls_req_view *v);
/* Descriptor i of a parsed request. */
void dls_wire_seg(const dls_req_view *v, uint32_t i, uint64_t *off, uint32_t *len, uint32_t *crc);
/* Check every segment of v against a slab of slab_size bytes. */
int dls_wire_check_bounds(const dls_req_view *v, uint64_t slab_size);
/* Parse a response header (24 bytes); DLS_NEED_MORE when len is short. */
int dls_wire_parse_resp(const uint8_t *buf, size_t len, dls_resp_view *r);
void dls_wire_put_req_hdr(uint8_t *buf, uint8_t op, uint16_t flags, uint64_t req_id, uint32_t slab,
                          uint32_t nseg, const uint8_t *token);
void dls_wire_put_seg(uint8_t *buf, uint64_t off, uint32_t len, uint32_t crc);
void dls_wire_put_resp_hdr(uint8_t *buf, uint8_t op, uint8_t flags, uint8_t status, uint64_t req_id,
                           uint32_t body_len, uint32_t nseg);
/* A short, stable name for a status code ("bad_token", ...). */
const char *dls_status_name(int code);
/* Constant-time comparison of two tokens. */
int dls_token_equal(const uint8_t *a, const uint8_t *b);

static inline uint16_t dls_ld16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }
static inline uint32_t dls_ld32(const uint8_t *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}
static inline uint64_t dls_ld64(const uint8_t *p) { return (uint64_t)dls_ld32(p) | ((uint64_t)dls_ld32(p + 4) << 32); }
static inline void dls_st16(uint8_t *p, uint16_t v) { p[0] = (uint8_t)v; p[1] = (uint8_t)(v >> 8); }
static inline void dls_st32(uint8_t *p, uint32_t v) {
    p[0] = (uint8_t)v; p[1] = (uint8_t)(v >> 8); p[2] = (uint8_t)(v >> 16); p[3] = (uint8_t)(v >> 24);
}
static inline void dls_st64(uint8_t *p, uint64_t v) { dls_st32(p, (uint32_t)v); dls_st32(p + 4, (uint32_t)(v >> 32)); }
#endif
