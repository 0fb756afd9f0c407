/* The request side of the slab server; see slab_service.h.
 *
 * Every data request passes the same checks, in this order: the slab exists,
 * the token is the slab's, the segments lie inside it (wire.c), and, for a
 * WRITE with DLS_F_CRC, each segment matches its checksum.  A bad request gets
 * its error status, never an access outside a slab.  The slab table's lock is
 * held shared from the checks to the end of the copy, so a slab being removed
 * is never touched after dls_slabs_remove returns. */
#define _GNU_SOURCE
#include "slab_service.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>

#include "pagecrc.h"

#define DIRECT_SEND_MIN (64u << 10) /* smaller responses are cheaper to copy than to scatter */
#define DIRECT_IOV 1024             /* IOV_MAX on Linux; later segments are copied */

uint64_t dls_monotonic_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

int dls_reserve(uint8_t **buf, size_t *cap, size_t need) {
    if (*cap >= need) return 0;
    size_t nc = *cap ? *cap : 4096;
    while (nc < need) nc *= 2;
    uint8_t *nb = realloc(*buf, nc);
    if (!nb) return -ENOMEM;
    *buf = nb;
    *cap = nc;
    return 0;
}

/* --- the slab table ------------------------------------------------------------------- */

int dls_slabs_init(dls_slab_table *t) {
    t->slabs = calloc(DLS_MAX_SLAB_ID, sizeof(dls_slab *));
    if (!t->slabs) return -ENOMEM;
    pthread_rwlockattr_t attr;
    int rc = pthread_rwlockattr_init(&attr);
    if (!rc) {
        rc = pthread_rwlockattr_setkind_np(&attr, PTHREAD_RWLOCK_PREFER_WRITER_NONRECURSIVE_NP);
        if (!rc) rc = pthread_rwlock_init(&t->lock, &attr);
        pthread_rwlockattr_destroy(&attr);
    }
    if (rc) {
        free(t->slabs);
        t->slabs = NULL;
        return -rc;
    }
    return 0;
}

void dls_slabs_destroy(dls_slab_table *t) {
    if (!t->slabs) return;
    for (int i = 0; i < DLS_MAX_SLAB_ID; i++) free(t->slabs[i]);
    pthread_rwlock_destroy(&t->lock);
    free(t->slabs);
    t->slabs = NULL;
}

int dls_slabs_add(dls_slab_table *t, uint32_t id, void *base, uint64_t size, const uint8_t *token) {
    if (id >= DLS_MAX_SLAB_ID || !base || !size) return -EINVAL;
    dls_slab *sl = calloc(1, sizeof *sl);
    if (!sl) return -ENOMEM;
    sl->base = base;
    sl->size = size;
    memcpy(sl->token, token, DLS_TOKEN_LEN);
    pthread_rwlock_wrlock(&t->lock);
    dls_slab *old = t->slabs[id];
    if (!old) t->slabs[id] = sl;
    pthread_rwlock_unlock(&t->lock);
    if (old) {
        free(sl);
        return -EEXIST;
    }
    return 0;
}

int dls_slabs_remove(dls_slab_table *t, uint32_t id) {
    if (id >= DLS_MAX_SLAB_ID) return -ENOENT;
    pthread_rwlock_wrlock(&t->lock); /* waits for every request that holds it shared */
    dls_slab *sl = t->slabs[id];
    t->slabs[id] = NULL;
    pthread_rwlock_unlock(&t->lock);
    if (!sl) return -ENOENT;
    free(sl);
    return 0;
}

int dls_slabs_stats(dls_slab_table *t, uint32_t id, dls_slab_stats *out) {
    memset(out, 0, sizeof *out);
    if (id >= DLS_MAX_SLAB_ID) return -ENOENT;
    pthread_rwlock_rdlock(&t->lock);
    dls_slab *sl = t->slabs[id];
    if (sl) {
        out->size = sl->size;
        out->last_access_ns = DLS_LOAD(&sl->last_access_ns);
        out->reads = DLS_LOAD(&sl->reads);
        out->writes = DLS_LOAD(&sl->writes);
        out->bytes_read = DLS_LOAD(&sl->bytes_read);
        out->bytes_written = DLS_LOAD(&sl->bytes_written);
    }
    pthread_rwlock_unlock(&t->lock);
    return sl ? 0 : -ENOENT;
}

/* --- checks ---------------------------------------------------------------------------- */

/* Append a bodiless response. */
static int respond_status(dls_stream *c, uint8_t op, uint8_t flags, uint8_t status, uint64_t req_id) {
    if (dls_reserve(&c->out, &c->outcap, c->outlen + DLS_RESP_HDR_LEN)) return -ENOMEM;
    dls_wire_put_resp_hdr(c->out + c->outlen, op, flags, status, req_id, 0, 0);
    c->outlen += DLS_RESP_HDR_LEN;
    return 0;
}

/* The slab, token and bounds check every data request passes, in this order.
 * The caller holds t->lock for reading; *out is the slab (NULL when absent).
 * A valid token marks the connection authenticated (idle timeout exempt). */
static int check_access(dls_slab_table *t, dls_stream *c, const dls_req_view *v, dls_slab **out) {
    dls_slab *sl = v->slab < DLS_MAX_SLAB_ID ? t->slabs[v->slab] : NULL;
    *out = sl;
    if (!sl) return DLS_E_NOSLAB;
    if (!dls_token_equal(sl->token, v->token)) return DLS_E_TOKEN;
    c->authed = 1;
    return dls_wire_check_bounds(v, sl->size);
}

/* Each segment of a WRITE against the checksum it carries. */
static int check_write_crcs(const dls_req_view *v) {
    const uint8_t *p = v->payload;
    for (uint32_t i = 0; i < v->nseg; i++) {
        uint64_t off;
        uint32_t len, crc;
        dls_wire_seg(v, i, &off, &len, &crc);
        if (dls_crc32c_pages(0, p, len) != crc) return DLS_E_CRC;
        p += len;
    }
    return DLS_OK;
}

/* The checks of a WRITE whose header and descriptors are in but whose payload
 * is not, made before any room is reserved for that payload: the flags, then
 * what serve() checks first (slab, token, bounds).  The same status serve()
 * would give, except a checksum mismatch, which needs the payload. */
static int precheck_write(dls_slab_table *t, dls_stream *c, const dls_req_view *v) {
    if (v->flags & ~DLS_F_KNOWN) return DLS_E_FLAGS;
    dls_slab *sl;
    pthread_rwlock_rdlock(&t->lock);
    int status = check_access(t, c, v, &sl);
    pthread_rwlock_unlock(&t->lock);
    return status;
}

/* --- the operations (the caller holds t->lock shared; sl passed its checks) --------------- */

static void serve_write(dls_slab *sl, const dls_req_view *v) {
    const uint8_t *p = v->payload;
    for (uint32_t i = 0; i < v->nseg; i++) {
        uint64_t off;
        uint32_t len, crc;
        dls_wire_seg(v, i, &off, &len, &crc);
        memcpy(sl->base + off, p, len);
        p += len;
    }
    DLS_ADD(&sl->writes, 1);
    DLS_ADD(&sl->bytes_written, v->payload_len);
    __atomic_store_n(&sl->last_access_ns, dls_monotonic_ns(), __ATOMIC_RELAXED);
}

/* A READ response with nothing queued before it: hand the slab's bytes to the
 * socket straight from the slab (while the shared lock keeps the slab mapped),
 * and queue a copy of only what the socket does not take now. */
static int serve_read_direct(dls_server_counters *ctr, dls_stream *c, const dls_slab *sl, const dls_req_view *v,
                             uint8_t flags, size_t crc_bytes, size_t body, size_t total) {
    uint8_t head[DLS_RESP_HDR_LEN + 4 * DLS_MAX_SEGS];
    dls_wire_put_resp_hdr(head, v->op, flags, DLS_OK, v->req_id, (uint32_t)body, v->nseg);
    struct iovec iov[DIRECT_IOV];
    int k = 0;
    iov[k++] = (struct iovec){head, DLS_RESP_HDR_LEN + crc_bytes};
    for (uint32_t i = 0; i < v->nseg; i++) {
        uint64_t off;
        uint32_t len, crc;
        dls_wire_seg(v, i, &off, &len, &crc);
        if (crc_bytes) dls_st32(head + DLS_RESP_HDR_LEN + 4u * i, dls_crc32c_pages(0, sl->base + off, len));
        if (k < DIRECT_IOV) iov[k++] = (struct iovec){sl->base + off, len};
    }
    struct msghdr m = {.msg_iov = iov, .msg_iovlen = (size_t)k};
    size_t sent = 0;
    ssize_t n = sendmsg(c->fd, &m, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (n > 0) {
        sent = (size_t)n;
        DLS_ADD(&ctr->bytes_out, (uint64_t)n);
    }
    if (sent >= total) return 0;
    /* queue the rest: the unsent part of the header, then of the segments */
    if (dls_reserve(&c->out, &c->outcap, c->outlen + (total - sent))) return -ENOMEM;
    size_t skip = sent, hl = DLS_RESP_HDR_LEN + crc_bytes;
    if (skip < hl) {
        memcpy(c->out + c->outlen, head + skip, hl - skip);
        c->outlen += hl - skip;
        skip = 0;
    } else {
        skip -= hl;
    }
    for (uint32_t i = 0; i < v->nseg; i++) {
        uint64_t off;
        uint32_t len, crc;
        dls_wire_seg(v, i, &off, &len, &crc);
        if (skip >= len) {
            skip -= len;
            continue;
        }
        memcpy(c->out + c->outlen, sl->base + off + skip, len - skip);
        c->outlen += len - skip;
        skip = 0;
    }
    return 0;
}

/* A READ response copied whole into the output queue. */
static int serve_read_queued(dls_stream *c, const dls_slab *sl, const dls_req_view *v, uint8_t flags,
                             size_t crc_bytes, size_t body, size_t total) {
    if (dls_reserve(&c->out, &c->outcap, c->outlen + total)) return -ENOMEM;
    uint8_t *h = c->out + c->outlen;
    dls_wire_put_resp_hdr(h, v->op, flags, DLS_OK, v->req_id, (uint32_t)body, v->nseg);
    uint8_t *crcs = h + DLS_RESP_HDR_LEN;
    uint8_t *d = crcs + crc_bytes;
    for (uint32_t i = 0; i < v->nseg; i++) {
        uint64_t off;
        uint32_t len, crc;
        dls_wire_seg(v, i, &off, &len, &crc);
        memcpy(d, sl->base + off, len);
        if (crc_bytes) dls_st32(crcs + 4u * i, dls_crc32c_pages(0, d, len));
        d += len;
    }
    c->outlen += total;
    return 0;
}

static int serve_read(dls_server_counters *ctr, dls_stream *c, dls_slab *sl, const dls_req_view *v,
                      uint8_t flags) {
    size_t crc_bytes = (v->flags & DLS_F_CRC) ? 4u * v->nseg : 0;
    size_t body = crc_bytes + v->payload_len;
    size_t total = DLS_RESP_HDR_LEN + body;
    /* Counted before the answer can leave (a direct send may hand it to the client at once): whoever
     * has the answer finds the read in the slab's statistics, as for a write. */
    DLS_ADD(&sl->reads, 1);
    DLS_ADD(&sl->bytes_read, v->payload_len);
    __atomic_store_n(&sl->last_access_ns, dls_monotonic_ns(), __ATOMIC_RELAXED);
    return c->outlen == c->outoff && total >= DIRECT_SEND_MIN
               ? serve_read_direct(ctr, c, sl, v, flags, crc_bytes, body, total)
               : serve_read_queued(c, sl, v, flags, crc_bytes, body, total);
}

/* Serve one well-formed request; appends its response.  -1 on out of memory. */
static int serve(dls_slab_table *t, dls_server_counters *ctr, dls_stream *c, const dls_req_view *v) {
    uint8_t flags = (uint8_t)(v->flags & DLS_F_CRC);
    if (v->op == DLS_OP_PING) return respond_status(c, v->op, flags, DLS_OK, v->req_id);
    pthread_rwlock_rdlock(&t->lock);
    dls_slab *sl;
    int status = check_access(t, c, v, &sl);
    if (status == DLS_OK && v->op == DLS_OP_WRITE && (v->flags & DLS_F_CRC)) status = check_write_crcs(v);
    if (status != DLS_OK) {
        pthread_rwlock_unlock(&t->lock);
        DLS_ADD(&ctr->errors, 1);
        return respond_status(c, v->op, flags, (uint8_t)status, v->req_id);
    }
    int rc;
    if (v->op == DLS_OP_WRITE) {
        serve_write(sl, v);
        pthread_rwlock_unlock(&t->lock);
        rc = respond_status(c, v->op, flags, DLS_OK, v->req_id);
    } else {
        rc = serve_read(ctr, c, sl, v, flags);
        pthread_rwlock_unlock(&t->lock);
    }
    return rc;
}

/* --- dispatch --------------------------------------------------------------------------- */

int dls_serve_input(dls_slab_table *t, dls_server_counters *ctr, dls_stream *c) {
    size_t off = 0;
    int more = 0, done = 0; /* done: some frame was completed */
    if (c->discard) { /* the payload of a refused WRITE: drop it unbuffered */
        size_t d = c->discard < c->inlen ? (size_t)c->discard : c->inlen;
        off = d;
        c->discard -= d;
        done = c->discard == 0;
    }
    while (!c->closing && !c->discard && off < c->inlen && c->outlen - c->outoff < DLS_OUT_HIGH_WATER) {
        dls_req_view v;
        int rc = dls_wire_parse_req(c->in + off, c->inlen - off, &v);
        if (rc == DLS_NEED_MORE) {
            if (v.segs && v.op == DLS_OP_WRITE && !c->prechecked) {
                /* Header and descriptors are in, the payload is not: refuse now
                 * rather than buffer up to DLS_MAX_REQ_FRAME for a stranger. */
                int st = precheck_write(t, c, &v);
                if (st != DLS_OK) {
                    DLS_ADD(&ctr->requests, 1);
                    DLS_ADD(&ctr->errors, 1);
                    if (st == DLS_E_FLAGS) DLS_ADD(&ctr->bad_frames, 1);
                    uint8_t fl = st == DLS_E_FLAGS ? 0 : (uint8_t)(v.flags & DLS_F_CRC);
                    if (respond_status(c, v.op, fl, (uint8_t)st, v.req_id)) c->closing = 1;
                    c->discard = v.frame_len - (c->inlen - off);
                    off = c->inlen;
                    break;
                }
                c->prechecked = 1;
            }
            if (dls_reserve(&c->in, &c->incap, (size_t)v.frame_len)) c->closing = 1;
            break;
        }
        c->prechecked = 0;
        done = 1;
        DLS_ADD(&ctr->requests, 1);
        if (rc != DLS_OK) {
            DLS_ADD(&ctr->bad_frames, 1);
            DLS_ADD(&ctr->errors, 1);
            if (respond_status(c, v.op, 0, (uint8_t)rc, v.req_id)) c->closing = 1;
            if (v.resync && v.frame_len) {
                off += v.frame_len;
                continue;
            }
            c->closing = 1; /* the stream cannot be resynchronised */
            off = c->inlen;
            break;
        }
        if (serve(t, ctr, c, &v)) {
            c->closing = 1;
            break;
        }
        off += v.frame_len;
    }
    if (!c->closing && off < c->inlen && c->outlen - c->outoff >= DLS_OUT_HIGH_WATER) more = 1;
    if (off) {
        memmove(c->in, c->in + off, c->inlen - off);
        c->inlen -= off;
    }
    /* the frame timeout runs from when the frame now pending began */
    if (!c->inlen && !c->discard) c->partial_since = 0;
    else if (done || !c->partial_since) c->partial_since = dls_monotonic_ns();
    return more;
}
