/* TCP slab server; see tcp_server.h.
 *
 * Each worker thread owns an epoll set holding the (shared) listening socket,
 * with EPOLLEXCLUSIVE so one worker takes each new connection, an eventfd used
 * to stop it, and the connections it accepted.  A connection is touched by its
 * worker only.  Slabs sit in a table guarded by a writer-preferring rwlock:
 * requests hold it shared while they copy, removal holds it exclusive. */
#define _GNU_SOURCE
#include "tcp_server.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include "crc32c.h"
#include "pagecrc.h"
#include "wire.h"

#define IN_INITIAL (64u << 10)
#define OUT_HIGH_WATER (8u << 20) /* stop parsing while this much output is queued */
#define READ_CHUNK (1u << 20)
#define DIRECT_SEND_MIN (64u << 10) /* smaller responses are cheaper to copy than to scatter */
#define DIRECT_IOV 1024             /* IOV_MAX on Linux; later segments are copied */

typedef struct slab {
    uint8_t *base;
    uint64_t size;
    uint8_t token[DLS_TOKEN_LEN];
    uint64_t last_access_ns, reads, writes, bytes_read, bytes_written; /* atomics */
} slab;

typedef struct conn {
    int fd;
    uint8_t *in;
    size_t inlen, incap;
    uint8_t *out;
    size_t outlen, outoff, outcap;
    int closing;   /* close once the output is flushed */
    int want_out;  /* registered for EPOLLOUT */
    int authed;    /* some request on it carried a valid token */
    int prechecked; /* the incomplete WRITE at in[0] passed its early checks */
    uint64_t discard;       /* payload bytes of a refused WRITE still to drop unread */
    uint64_t last_rx_ns;    /* when bytes last arrived (or the connection opened) */
    uint64_t partial_since; /* when the incomplete frame now pending began; 0: none */
    struct conn *prev, *next;
} conn;

typedef struct worker {
    dls_server *s;
    int epfd, stopfd;
    pthread_t th;
    int started;
    conn *conns;
    uint64_t next_sweep_ns;
} worker;

struct dls_server {
    int lfd, port, nthreads, max_conns;
    worker *workers;
    pthread_rwlock_t lock;
    slab **slabs;
    uint64_t connections, open_connections, requests, errors, bad_frames, bytes_in, bytes_out, refused;
    uint64_t idle_ns, frame_ns, sweep_ns; /* 0: that timeout is off */
    uint64_t timed_out;
};

static char LISTEN_TAG, STOP_TAG;

uint64_t dls_monotonic_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

#define ADD(p, v) __atomic_add_fetch((p), (v), __ATOMIC_RELAXED)
#define LOAD(p) __atomic_load_n((p), __ATOMIC_RELAXED)

static int reserve(uint8_t **buf, size_t *cap, size_t need) {
    if (*cap >= need) return 0;
    size_t nc = *cap ? *cap : 4096;
    while (nc < need) nc *= 2;
    uint8_t *nb = realloc(*buf, nc);
    if (!nb) return -1;
    *buf = nb;
    *cap = nc;
    return 0;
}

static void conn_close(worker *w, conn *c) {
    epoll_ctl(w->epfd, EPOLL_CTL_DEL, c->fd, NULL);
    close(c->fd);
    if (c->prev) c->prev->next = c->next;
    else w->conns = c->next;
    if (c->next) c->next->prev = c->prev;
    free(c->in);
    free(c->out);
    free(c);
    ADD(&w->s->open_connections, (uint64_t)-1);
}

/* Append a bodiless response. */
static int respond_status(conn *c, uint8_t op, uint8_t flags, uint8_t status, uint64_t req_id) {
    if (reserve(&c->out, &c->outcap, c->outlen + DLS_RESP_HDR_LEN)) return -1;
    dls_wire_put_resp_hdr(c->out + c->outlen, op, flags, status, req_id, 0, 0);
    c->outlen += DLS_RESP_HDR_LEN;
    return 0;
}

/* The slab, token and bounds check every data request passes, in this order.
 * The caller holds s->lock for reading; *out is the slab (NULL when absent).
 * A valid token marks the connection authenticated (idle timeout exempt). */
static int check_access(dls_server *s, conn *c, const dls_req_view *v, slab **out) {
    slab *sl = v->slab < DLS_MAX_SLAB_ID ? s->slabs[v->slab] : NULL;
    *out = sl;
    if (!sl) return DLS_E_NOSLAB;
    if (!dls_token_equal(sl->token, v->token)) return DLS_E_TOKEN;
    c->authed = 1;
    return dls_wire_check_bounds(v, sl->size);
}

/* Serve one well-formed request; appends its response.  -1 on out of memory. */
static int serve(dls_server *s, conn *c, const dls_req_view *v) {
    uint8_t flags = (uint8_t)(v->flags & DLS_F_CRC);
    if (v->op == DLS_OP_PING) return respond_status(c, v->op, flags, DLS_OK, v->req_id);
    pthread_rwlock_rdlock(&s->lock);
    slab *sl;
    int status = check_access(s, c, v, &sl);
    if (status == DLS_OK && v->op == DLS_OP_WRITE && (v->flags & DLS_F_CRC)) {
        const uint8_t *p = v->payload;
        for (uint32_t i = 0; i < v->nseg; i++) {
            uint64_t off;
            uint32_t len, crc;
            dls_wire_seg(v, i, &off, &len, &crc);
            if (dls_crc32c_pages(0, p, len) != crc) {
                status = DLS_E_CRC;
                break;
            }
            p += len;
        }
    }
    if (status != DLS_OK) {
        pthread_rwlock_unlock(&s->lock);
        ADD(&s->errors, 1);
        return respond_status(c, v->op, flags, (uint8_t)status, v->req_id);
    }
    if (v->op == DLS_OP_WRITE) {
        const uint8_t *p = v->payload;
        for (uint32_t i = 0; i < v->nseg; i++) {
            uint64_t off;
            uint32_t len, crc;
            dls_wire_seg(v, i, &off, &len, &crc);
            memcpy(sl->base + off, p, len);
            p += len;
        }
        ADD(&sl->writes, 1);
        ADD(&sl->bytes_written, v->payload_len);
        __atomic_store_n(&sl->last_access_ns, dls_monotonic_ns(), __ATOMIC_RELAXED);
        pthread_rwlock_unlock(&s->lock);
        return respond_status(c, v->op, flags, DLS_OK, v->req_id);
    }
    /* READ */
    size_t crc_bytes = (v->flags & DLS_F_CRC) ? 4u * v->nseg : 0;
    size_t body = crc_bytes + v->payload_len;
    size_t total = DLS_RESP_HDR_LEN + body;
    size_t sent = 0;
    if (c->outlen == c->outoff && total >= DIRECT_SEND_MIN) {
        /* Nothing queued before this response: hand the slab's bytes to the
         * socket straight from the slab (while the shared lock keeps the slab
         * mapped), and copy only what the socket does not take now. */
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
        ssize_t n = sendmsg(c->fd, &m, MSG_DONTWAIT | MSG_NOSIGNAL);
        if (n > 0) {
            sent = (size_t)n;
            ADD(&s->bytes_out, (uint64_t)n);
        }
        if (sent < total) {
            /* queue the rest: the unsent part of the header, then of the segments */
            if (reserve(&c->out, &c->outcap, c->outlen + (total - sent))) {
                pthread_rwlock_unlock(&s->lock);
                return -1;
            }
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
        }
    } else {
        if (reserve(&c->out, &c->outcap, c->outlen + total)) {
            pthread_rwlock_unlock(&s->lock);
            return -1;
        }
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
    }
    ADD(&sl->reads, 1);
    ADD(&sl->bytes_read, v->payload_len);
    __atomic_store_n(&sl->last_access_ns, dls_monotonic_ns(), __ATOMIC_RELAXED);
    pthread_rwlock_unlock(&s->lock);
    return 0;
}

/* The checks of a WRITE whose header and descriptors are in but whose payload
 * is not, made before any room is reserved for that payload: the flags, then
 * what serve() checks first (slab, token, bounds).  The same status serve()
 * would give, except a checksum mismatch, which needs the payload. */
static int precheck_write(dls_server *s, conn *c, const dls_req_view *v) {
    if (v->flags & ~DLS_F_KNOWN) return DLS_E_FLAGS;
    slab *sl;
    pthread_rwlock_rdlock(&s->lock);
    int status = check_access(s, c, v, &sl);
    pthread_rwlock_unlock(&s->lock);
    return status;
}

/* Parse and serve the complete frames buffered on c.  Returns 1 when it
 * stopped at the output high-water mark with input left to parse. */
static int process_input(dls_server *s, conn *c) {
    size_t off = 0;
    int more = 0, done = 0; /* done: some frame was completed */
    if (c->discard) { /* the payload of a refused WRITE: drop it unbuffered */
        size_t d = c->discard < c->inlen ? (size_t)c->discard : c->inlen;
        off = d;
        c->discard -= d;
        done = c->discard == 0;
    }
    while (!c->closing && !c->discard && off < c->inlen && c->outlen - c->outoff < OUT_HIGH_WATER) {
        dls_req_view v;
        int rc = dls_wire_parse_req(c->in + off, c->inlen - off, &v);
        if (rc == DLS_NEED_MORE) {
            if (v.segs && v.op == DLS_OP_WRITE && !c->prechecked) {
                /* Header and descriptors are in, the payload is not: refuse now
                 * rather than buffer up to DLS_MAX_REQ_FRAME for a stranger. */
                int st = precheck_write(s, c, &v);
                if (st != DLS_OK) {
                    ADD(&s->requests, 1);
                    ADD(&s->errors, 1);
                    if (st == DLS_E_FLAGS) ADD(&s->bad_frames, 1);
                    uint8_t fl = st == DLS_E_FLAGS ? 0 : (uint8_t)(v.flags & DLS_F_CRC);
                    if (respond_status(c, v.op, fl, (uint8_t)st, v.req_id)) c->closing = 1;
                    c->discard = v.frame_len - (c->inlen - off);
                    off = c->inlen;
                    break;
                }
                c->prechecked = 1;
            }
            if (reserve(&c->in, &c->incap, (size_t)v.frame_len)) c->closing = 1;
            break;
        }
        c->prechecked = 0;
        done = 1;
        ADD(&s->requests, 1);
        if (rc != DLS_OK) {
            ADD(&s->bad_frames, 1);
            ADD(&s->errors, 1);
            if (respond_status(c, v.op, 0, (uint8_t)rc, v.req_id)) c->closing = 1;
            if (v.resync && v.frame_len) {
                off += v.frame_len;
                continue;
            }
            c->closing = 1; /* the stream cannot be resynchronised */
            off = c->inlen;
            break;
        }
        if (serve(s, c, &v)) {
            c->closing = 1;
            break;
        }
        off += v.frame_len;
    }
    if (!c->closing && off < c->inlen && c->outlen - c->outoff >= OUT_HIGH_WATER) more = 1;
    if (off) {
        memmove(c->in, c->in + off, c->inlen - off);
        c->inlen -= off;
    }
    /* the frame timeout runs from when the frame now pending began */
    if (!c->inlen && !c->discard) c->partial_since = 0;
    else if (done || !c->partial_since) c->partial_since = dls_monotonic_ns();
    return more;
}

/* Send queued output; 0 when drained, 1 when the socket is full, -1 on error. */
static int flush_out(dls_server *s, conn *c) {
    while (c->outoff < c->outlen) {
        ssize_t n = send(c->fd, c->out + c->outoff, c->outlen - c->outoff, MSG_NOSIGNAL);
        if (n < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) return 1;
            return -1;
        }
        c->outoff += (size_t)n;
        ADD(&s->bytes_out, (uint64_t)n);
    }
    c->outoff = c->outlen = 0;
    if (c->outcap > (32u << 20)) { /* give back a buffer grown by one huge batch */
        free(c->out);
        c->out = NULL;
        c->outcap = 0;
    }
    return 0;
}

static void set_interest(worker *w, conn *c, int want_out) {
    if (c->want_out == want_out) return;
    struct epoll_event ev = {.events = want_out ? EPOLLOUT : (EPOLLIN | EPOLLRDHUP), .data.ptr = c};
    epoll_ctl(w->epfd, EPOLL_CTL_MOD, c->fd, &ev);
    c->want_out = want_out;
}

static void conn_event(worker *w, conn *c, uint32_t events) {
    dls_server *s = w->s;
    if (events & EPOLLERR) {
        conn_close(w, c);
        return;
    }
    int did_recv = 0;
    for (;;) {
        int more = process_input(s, c);
        int fr = flush_out(s, c);
        if (fr < 0) {
            conn_close(w, c);
            return;
        }
        if (fr == 1) {
            set_interest(w, c, 1);
            return;
        }
        if (c->closing) {
            conn_close(w, c);
            return;
        }
        set_interest(w, c, 0);
        if (more) continue; /* parse the rest before reading more */
        /* Everything read so far is served: level-triggered epoll reports the
         * next bytes, so skip the recv that would most likely say EAGAIN. */
        if (did_recv && c->inlen == 0) return;
        if (c->incap - c->inlen < 4096 && reserve(&c->in, &c->incap, c->inlen + READ_CHUNK)) {
            conn_close(w, c);
            return;
        }
        ssize_t n = recv(c->fd, c->in + c->inlen, c->incap - c->inlen, 0);
        if (n == 0) {
            conn_close(w, c);
            return;
        }
        if (n < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) return;
            conn_close(w, c);
            return;
        }
        c->inlen += (size_t)n;
        c->last_rx_ns = dls_monotonic_ns();
        did_recv = 1;
        ADD(&s->bytes_in, (uint64_t)n);
    }
    /* still busy: level-triggered epoll calls us again, after other connections */
}

static void accept_all(worker *w) {
    for (;;) {
        int fd = accept4(w->s->lfd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) return; /* EAGAIN, or a transient error: nothing more now */
        if (LOAD(&w->s->open_connections) >= (uint64_t)w->s->max_conns) {
            close(fd); /* a flood of connections must not exhaust the donor */
            ADD(&w->s->refused, 1);
            continue;
        }
        int one = 1;
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        conn *c = calloc(1, sizeof *c);
        if (!c || reserve(&c->in, &c->incap, IN_INITIAL)) {
            free(c);
            close(fd);
            continue;
        }
        c->fd = fd;
        c->last_rx_ns = dls_monotonic_ns();
        struct epoll_event ev = {.events = EPOLLIN | EPOLLRDHUP, .data.ptr = c};
        if (epoll_ctl(w->epfd, EPOLL_CTL_ADD, fd, &ev)) {
            free(c->in);
            free(c);
            close(fd);
            continue;
        }
        c->next = w->conns;
        if (w->conns) w->conns->prev = c;
        w->conns = c;
        ADD(&w->s->connections, 1);
        ADD(&w->s->open_connections, 1);
    }
}

/* Close this worker's connections that hold a place without using it:
 * - an incomplete frame (or the payload of a refused WRITE) pending for more
 *   than frame_ns, unless the server is the one waiting (output queued);
 * - no bytes for idle_ns on a connection that never carried a valid token.
 *   Connections that did are kept however long they idle, since consumers keep
 *   them open between bursts and treat a dropped one as a failed donor. */
static void sweep(worker *w, uint64_t now) {
    dls_server *s = w->s;
    conn *c = w->conns;
    while (c) {
        conn *next = c->next;
        int out_queued = c->outlen > c->outoff;
        int stale = 0;
        if (s->frame_ns && c->partial_since && !out_queued && now - c->partial_since > s->frame_ns) stale = 1;
        if (s->idle_ns && !c->authed && now - c->last_rx_ns > s->idle_ns) stale = 1;
        if (stale) {
            ADD(&s->timed_out, 1);
            conn_close(w, c);
        }
        c = next;
    }
}

static void *worker_main(void *arg) {
    worker *w = arg;
    dls_server *s = w->s;
    struct epoll_event evs[64];
    if (s->sweep_ns) w->next_sweep_ns = dls_monotonic_ns() + s->sweep_ns;
    for (;;) {
        int timeout = -1;
        if (s->sweep_ns) {
            uint64_t now = dls_monotonic_ns();
            if (now >= w->next_sweep_ns) {
                sweep(w, now);
                w->next_sweep_ns = now + s->sweep_ns;
            }
            timeout = (int)((w->next_sweep_ns - now + 999999) / 1000000);
        }
        int n = epoll_wait(w->epfd, evs, 64, timeout);
        if (n < 0) {
            if (errno == EINTR) continue;
            break;
        }
        for (int i = 0; i < n; i++) {
            void *p = evs[i].data.ptr;
            if (p == &STOP_TAG) goto out;
            if (p == &LISTEN_TAG) accept_all(w);
            else conn_event(w, (conn *)p, evs[i].events);
        }
    }
out:
    while (w->conns) conn_close(w, w->conns);
    return NULL;
}

static void set_err(char *err, size_t len, const char *what, int e) {
    if (len) snprintf(err, len, "%s: %s", what, strerror(e));
}

dls_server *dls_server_start(const char *host, int port, int nthreads, int max_conns, char *err, size_t err_len) {
    return dls_server_start_ex(host, port, nthreads, max_conns, DLS_IDLE_TIMEOUT_MS, DLS_FRAME_TIMEOUT_MS, err,
                               err_len);
}

dls_server *dls_server_start_ex(const char *host, int port, int nthreads, int max_conns, int64_t idle_timeout_ms,
                                int64_t frame_timeout_ms, char *err, size_t err_len) {
    if (nthreads < 1) nthreads = 1;
    if (nthreads > 64) nthreads = 64;
    dls_server *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    s->slabs = calloc(DLS_MAX_SLAB_ID, sizeof(slab *));
    s->workers = calloc((size_t)nthreads, sizeof(worker));
    s->lfd = -1;
    s->max_conns = max_conns > 0 ? max_conns : DLS_MAX_CONNECTIONS;
    s->idle_ns = idle_timeout_ms > 0 ? (uint64_t)idle_timeout_ms * 1000000ull : 0;
    s->frame_ns = frame_timeout_ms > 0 ? (uint64_t)frame_timeout_ms * 1000000ull : 0;
    if (s->idle_ns || s->frame_ns) {
        /* sweep often enough to close a connection within ~1/4 of its timeout */
        uint64_t t = s->idle_ns && s->frame_ns ? (s->idle_ns < s->frame_ns ? s->idle_ns : s->frame_ns)
                                               : (s->idle_ns ? s->idle_ns : s->frame_ns);
        t /= 4;
        if (t < 5000000ull) t = 5000000ull;
        if (t > 1000000000ull) t = 1000000000ull;
        s->sweep_ns = t;
    }
    if (!s->slabs || !s->workers) goto fail;
    pthread_rwlockattr_t attr;
    pthread_rwlockattr_init(&attr);
    pthread_rwlockattr_setkind_np(&attr, PTHREAD_RWLOCK_PREFER_WRITER_NONRECURSIVE_NP);
    pthread_rwlock_init(&s->lock, &attr);
    pthread_rwlockattr_destroy(&attr);

    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM, .ai_flags = AI_PASSIVE | AI_NUMERICSERV};
    char portstr[16];
    snprintf(portstr, sizeof portstr, "%d", port);
    struct addrinfo *ai = NULL;
    int gai = getaddrinfo(host && *host ? host : NULL, portstr, &hints, &ai);
    if (gai) {
        if (err_len) snprintf(err, err_len, "cannot resolve %s: %s", host, gai_strerror(gai));
        goto fail;
    }
    s->lfd = socket(ai->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    int one = 1;
    if (s->lfd >= 0) setsockopt(s->lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (s->lfd < 0 || bind(s->lfd, ai->ai_addr, ai->ai_addrlen) || listen(s->lfd, 512)) {
        set_err(err, err_len, "cannot listen", errno);
        freeaddrinfo(ai);
        goto fail;
    }
    freeaddrinfo(ai);
    struct sockaddr_storage ss;
    socklen_t sl = sizeof ss;
    getsockname(s->lfd, (struct sockaddr *)&ss, &sl);
    s->port = ntohs(ss.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&ss)->sin6_port
                                            : ((struct sockaddr_in *)&ss)->sin_port);
    s->nthreads = nthreads;
    for (int i = 0; i < nthreads; i++) {
        worker *w = &s->workers[i];
        w->s = s;
        w->epfd = epoll_create1(EPOLL_CLOEXEC);
        w->stopfd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
        if (w->epfd < 0 || w->stopfd < 0) {
            set_err(err, err_len, "epoll/eventfd", errno);
            goto fail;
        }
        struct epoll_event ev = {.events = EPOLLIN | EPOLLEXCLUSIVE, .data.ptr = &LISTEN_TAG};
        struct epoll_event sev = {.events = EPOLLIN, .data.ptr = &STOP_TAG};
        if (epoll_ctl(w->epfd, EPOLL_CTL_ADD, s->lfd, &ev) || epoll_ctl(w->epfd, EPOLL_CTL_ADD, w->stopfd, &sev)) {
            set_err(err, err_len, "epoll_ctl", errno);
            goto fail;
        }
        if (pthread_create(&w->th, NULL, worker_main, w)) {
            set_err(err, err_len, "pthread_create", errno);
            goto fail;
        }
        w->started = 1;
    }
    return s;
fail:
    dls_server_stop(s);
    return NULL;
}

int dls_server_port(const dls_server *s) { return s->port; }

void dls_server_stop(dls_server *s) {
    if (!s) return;
    if (s->workers) {
        for (int i = 0; i < s->nthreads; i++) {
            worker *w = &s->workers[i];
            if (w->started) {
                uint64_t one = 1;
                ssize_t r = write(w->stopfd, &one, sizeof one);
                (void)r;
                pthread_join(w->th, NULL);
            }
            if (w->epfd > 0) close(w->epfd);
            if (w->stopfd > 0) close(w->stopfd);
        }
    }
    if (s->lfd >= 0) close(s->lfd);
    if (s->slabs) {
        for (int i = 0; i < DLS_MAX_SLAB_ID; i++) free(s->slabs[i]);
        pthread_rwlock_destroy(&s->lock);
    }
    free(s->slabs);
    free(s->workers);
    free(s);
}

int dls_server_add_slab(dls_server *s, uint32_t id, void *base, uint64_t size, const uint8_t *token) {
    if (id >= DLS_MAX_SLAB_ID || !base || !size) return DLS_E_NOSLAB;
    slab *sl = calloc(1, sizeof *sl);
    if (!sl) return DLS_E_INTERNAL;
    sl->base = base;
    sl->size = size;
    memcpy(sl->token, token, DLS_TOKEN_LEN);
    pthread_rwlock_wrlock(&s->lock);
    slab *old = s->slabs[id];
    if (!old) s->slabs[id] = sl;
    pthread_rwlock_unlock(&s->lock);
    if (old) {
        free(sl);
        return DLS_E_INTERNAL; /* id in use */
    }
    return DLS_OK;
}

int dls_server_remove_slab(dls_server *s, uint32_t id) {
    if (id >= DLS_MAX_SLAB_ID) return DLS_E_NOSLAB;
    pthread_rwlock_wrlock(&s->lock);
    slab *sl = s->slabs[id];
    s->slabs[id] = NULL;
    pthread_rwlock_unlock(&s->lock);
    if (!sl) return DLS_E_NOSLAB;
    free(sl);
    return DLS_OK;
}

int dls_server_slab_stats(dls_server *s, uint32_t id, dls_slab_stats *out) {
    memset(out, 0, sizeof *out);
    if (id >= DLS_MAX_SLAB_ID) return DLS_E_NOSLAB;
    pthread_rwlock_rdlock(&s->lock);
    slab *sl = s->slabs[id];
    if (sl) {
        out->size = sl->size;
        out->last_access_ns = LOAD(&sl->last_access_ns);
        out->reads = LOAD(&sl->reads);
        out->writes = LOAD(&sl->writes);
        out->bytes_read = LOAD(&sl->bytes_read);
        out->bytes_written = LOAD(&sl->bytes_written);
    }
    pthread_rwlock_unlock(&s->lock);
    return sl ? DLS_OK : DLS_E_NOSLAB;
}

void dls_server_get_counters(dls_server *s, dls_server_counters *o) {
    o->connections = LOAD(&s->connections);
    o->open_connections = LOAD(&s->open_connections);
    o->requests = LOAD(&s->requests);
    o->errors = LOAD(&s->errors);
    o->bad_frames = LOAD(&s->bad_frames);
    o->bytes_in = LOAD(&s->bytes_in);
    o->bytes_out = LOAD(&s->bytes_out);
    o->refused = LOAD(&s->refused);
}

uint64_t dls_server_timed_out(dls_server *s) { return LOAD(&s->timed_out); }
