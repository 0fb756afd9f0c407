/* Wire framing and validation of remote-memory requests; see wire.h. */
#include "wire.h"

#include <errno.h>
#include <string.h>

/* The local outcomes are negative errnos (wire.h spells the numbers out for cffi). */
_Static_assert(DLS_NEED_MORE == -EAGAIN && DLS_E_IO == -EIO && DLS_E_TIMEOUT == -ETIMEDOUT &&
                   DLS_E_PROTO == -EPROTO && DLS_E_ARG == -EINVAL && DLS_E_CLOSED == -ESHUTDOWN &&
                   DLS_E_UNSUPPORTED == -EOPNOTSUPP,
               "wire.h's local status codes must be the negative errnos they name");

int dls_wire_parse_req(const uint8_t *buf, size_t len, dls_req_view *v) {
    memset(v, 0, sizeof *v);
    if (len < DLS_REQ_HDR_LEN) {
        /* Reject a wrong magic as early as its bytes arrive. */
        uint8_t m[4];
        dls_st32(m, DLS_WIRE_MAGIC);
        if (len > 0 && memcmp(buf, m, len < 4 ? len : 4) != 0) return DLS_E_MAGIC;
        v->frame_len = DLS_REQ_HDR_LEN;
        return DLS_NEED_MORE;
    }
    if (dls_ld32(buf) != DLS_WIRE_MAGIC) return DLS_E_MAGIC;
    v->version = buf[4];
    v->op = buf[5];
    v->flags = dls_ld16(buf + 6);
    v->req_id = dls_ld64(buf + 8);
    v->slab = dls_ld32(buf + 16);
    v->nseg = dls_ld32(buf + 20);
    v->token = buf + 24;
    if (v->version != DLS_WIRE_VERSION) return DLS_E_VERSION;
    if (v->nseg > DLS_MAX_SEGS) return DLS_E_NSEG;
    uint64_t desc_end = DLS_REQ_HDR_LEN + (uint64_t)DLS_SEG_LEN * v->nseg;
    if (len < desc_end) {
        v->frame_len = desc_end;
        return DLS_NEED_MORE;
    }
    v->segs = buf + DLS_REQ_HDR_LEN;
    uint64_t total = 0;
    for (uint32_t i = 0; i < v->nseg; i++) {
        uint32_t sl = dls_ld32(v->segs + (size_t)i * DLS_SEG_LEN + 8);
        if (sl == 0 || sl > DLS_MAX_SEG_BYTES) return DLS_E_SEGLEN;
        total += sl;
    }
    if (total > DLS_MAX_PAYLOAD) return DLS_E_SIZE;
    v->payload_len = total;
    /* From here on the frame's extent is known even if its content is wrong. */
    uint64_t frame = desc_end + (v->op == DLS_OP_WRITE ? total : 0);
    v->frame_len = frame;
    if (v->op != DLS_OP_READ && v->op != DLS_OP_WRITE && v->op != DLS_OP_PING) {
        /* An unknown op may carry a payload of unknown length: the stream
         * cannot be trusted past it. */
        v->frame_len = 0;
        return DLS_E_OP;
    }
    if (len < frame) return DLS_NEED_MORE;
    v->resync = 1;
    if (v->flags & ~DLS_F_KNOWN) return DLS_E_FLAGS;
    if (v->op == DLS_OP_PING && v->nseg != 0) return DLS_E_NSEG;
    if (v->op != DLS_OP_PING && v->nseg == 0) return DLS_E_NSEG;
    if (v->op == DLS_OP_WRITE) v->payload = buf + desc_end;
    return DLS_OK;
}

void dls_wire_seg(const dls_req_view *v, uint32_t i, uint64_t *off, uint32_t *len, uint32_t *crc) {
    const uint8_t *d = v->segs + (size_t)i * DLS_SEG_LEN;
    *off = dls_ld64(d);
    *len = dls_ld32(d + 8);
    *crc = dls_ld32(d + 12);
}

int dls_wire_check_bounds(const dls_req_view *v, uint64_t slab_size) {
    for (uint32_t i = 0; i < v->nseg; i++) {
        uint64_t off;
        uint32_t sl, crc;
        dls_wire_seg(v, i, &off, &sl, &crc);
        /* written so that no sum can overflow */
        if (off > slab_size || sl > slab_size - off) return DLS_E_BOUNDS;
    }
    return DLS_OK;
}

int dls_wire_parse_resp(const uint8_t *buf, size_t len, dls_resp_view *r) {
    memset(r, 0, sizeof *r);
    if (len < DLS_RESP_HDR_LEN) return DLS_NEED_MORE;
    if (dls_ld32(buf) != DLS_WIRE_MAGIC) return DLS_E_MAGIC;
    r->version = buf[4];
    r->op = buf[5];
    r->flags = buf[6];
    r->status = buf[7];
    r->req_id = dls_ld64(buf + 8);
    r->body_len = dls_ld32(buf + 16);
    r->nseg = dls_ld32(buf + 20);
    if (r->version != DLS_WIRE_VERSION) return DLS_E_VERSION;
    if (r->nseg > DLS_MAX_SEGS) return DLS_E_NSEG;
    if (r->body_len > DLS_MAX_PAYLOAD + 4u * DLS_MAX_SEGS) return DLS_E_SIZE;
    return DLS_OK;
}

void dls_wire_put_req_hdr(uint8_t *buf, uint8_t op, uint16_t flags, uint64_t req_id, uint32_t slab,
                          uint32_t nseg, const uint8_t *token) {
    dls_st32(buf, DLS_WIRE_MAGIC);
    buf[4] = DLS_WIRE_VERSION;
    buf[5] = op;
    dls_st16(buf + 6, flags);
    dls_st64(buf + 8, req_id);
    dls_st32(buf + 16, slab);
    dls_st32(buf + 20, nseg);
    if (token) memcpy(buf + 24, token, DLS_TOKEN_LEN);
    else memset(buf + 24, 0, DLS_TOKEN_LEN);
}

void dls_wire_put_seg(uint8_t *buf, uint64_t off, uint32_t len, uint32_t crc) {
    dls_st64(buf, off);
    dls_st32(buf + 8, len);
    dls_st32(buf + 12, crc);
}

void dls_wire_put_resp_hdr(uint8_t *buf, uint8_t op, uint8_t flags, uint8_t status, uint64_t req_id,
                           uint32_t body_len, uint32_t nseg) {
    dls_st32(buf, DLS_WIRE_MAGIC);
    buf[4] = DLS_WIRE_VERSION;
    buf[5] = op;
    buf[6] = flags;
    buf[7] = status;
    dls_st64(buf + 8, req_id);
    dls_st32(buf + 16, body_len);
    dls_st32(buf + 20, nseg);
}

const char *dls_status_name(int code) {
    switch (code) {
    case DLS_OK: return "ok";
    case DLS_E_MAGIC: return "bad_magic";
    case DLS_E_VERSION: return "bad_version";
    case DLS_E_OP: return "bad_op";
    case DLS_E_FLAGS: return "bad_flags";
    case DLS_E_NSEG: return "bad_segment_count";
    case DLS_E_SEGLEN: return "bad_segment_length";
    case DLS_E_SIZE: return "message_too_large";
    case DLS_E_NOSLAB: return "no_such_slab";
    case DLS_E_TOKEN: return "bad_token";
    case DLS_E_BOUNDS: return "out_of_bounds";
    case DLS_E_CRC: return "checksum_mismatch";
    case DLS_E_INTERNAL: return "internal_error";
    case DLS_NEED_MORE: return "need_more";
    case DLS_E_IO: return "io_error";
    case DLS_E_TIMEOUT: return "timeout";
    case DLS_E_PROTO: return "protocol_error";
    case DLS_E_ARG: return "bad_argument";
    case DLS_E_CLOSED: return "closed";
    case DLS_E_UNSUPPORTED: return "unsupported";
    default: return "unknown";
    }
}

int dls_token_equal(const uint8_t *a, const uint8_t *b) {
    uint8_t d = 0;
    for (int i = 0; i < DLS_TOKEN_LEN; i++) d |= (uint8_t)(a[i] ^ b[i]);
    return d == 0;
}
