/* The `tcp` provider: a pipelined client of tcp_server.c.
 *
 * A batch is cut into requests of at most DLS_MAX_SEGS segments and
 * DLS_MAX_PAYLOAD bytes; up to WINDOW of them are in flight at once.  Sending
 * and receiving interleave under one poll loop so that neither side can block
 * the other.  Large READ data is received straight into the caller's buffer;
 * small responses go through a scratch buffer to save system calls.  The call
 * blocks in C, so cffi has released the GIL while it waits. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include "crc32c.h"
#include "pagecrc.h"
#include "provider.h"
#include "wire.h"

#define WINDOW 8
#define SCRATCH (256u << 10)
#define DIRECT_MIN (64u << 10)
#define REQ_TARGET (1u << 20)

typedef struct pend {
    uint64_t req_id;
    uint8_t op;
    uint32_t first_seg, nseg;
    uint8_t *dst;
    uint64_t data_len;
    uint32_t bi; /* which of the run's batches it belongs to */
} pend;

typedef struct tcp_conn {
    int fd;
    int broken;
    uint64_t next_id;
    pthread_mutex_t mu;
    uint8_t *req;     /* header + descriptors of the request being sent */
    uint8_t *scratch; /* received bytes not consumed yet */
    size_t sb_off, sb_len;
    int rcv_timeout_ms; /* SO_RCVTIMEO as set */
} tcp_conn;

/* Per-call state of the batches in progress on one connection: bq[0..nb) go out in that order,
 * pipelined (a batch's first request may follow the last one's before its answer is back). */
typedef struct run {
    tcp_conn *c;
    dls_batch **bq;
    int *st;             /* st[i]: the first error of bq[i] */
    uint32_t nb, cur;    /* cur: the batch whose segments are being put in requests */
    dls_batch *b;        /* bq[cur] */
    uint8_t op;
    uint32_t next_seg;   /* first segment of b not yet put in a request */
    uint8_t *next_buf;   /* where that segment's bytes live in b->buf */
    /* the request being sent */
    int sending;
    size_t req_len, req_sent;
    const uint8_t *pay;
    size_t pay_len, pay_sent;
    /* in-flight requests, FIFO */
    pend ring[WINDOW];
    int head, count;
    /* the response being received */
    int stage; /* 0 header, 1 crcs, 2 data */
    uint8_t rhdr[DLS_RESP_HDR_LEN];
    size_t rgot;
    dls_resp_view resp;
    uint8_t crcbuf[4 * DLS_MAX_SEGS];
    size_t cgot, cneed;
    uint64_t dgot;
} run;

static uint64_t mono_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static void run_init(run *r, tcp_conn *c, dls_batch **bq, int *st, uint32_t nb, uint8_t op) {
    r->c = c;
    r->bq = bq;
    r->st = st;
    r->nb = nb;
    r->op = op;
    r->b = bq[0];
    r->next_buf = bq[0]->buf;
    for (uint32_t i = 0; i < nb; i++) st[i] = DLS_OK;
}

/* 1 while a batch has segments to put in requests; moves on past batches done or failed (after an
 * error a batch issues nothing new: what it has in flight drains). */
static int has_more(run *r) {
    while (r->cur < r->nb && (r->st[r->cur] != DLS_OK || r->next_seg >= r->b->nseg)) {
        if (++r->cur == r->nb) break;
        r->b = r->bq[r->cur];
        r->next_seg = 0;
        r->next_buf = r->b->buf;
    }
    return r->cur < r->nb;
}

static int tcp_connect(const char *host, int port, int timeout_ms, void **out, char *err, size_t err_len) {
    *out = NULL;
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM, .ai_flags = AI_NUMERICSERV};
    char ps[16];
    snprintf(ps, sizeof ps, "%d", port);
    struct addrinfo *ai = NULL;
    int g = getaddrinfo(host, ps, &hints, &ai);
    if (g) {
        int e = g == EAI_SYSTEM ? errno : (g == EAI_MEMORY ? ENOMEM : EINVAL);
        if (err_len) snprintf(err, err_len, "cannot resolve %s: %s", host, gai_strerror(g));
        return -e;
    }
    int fd = socket(ai->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) {
        int e = errno;
        if (err_len) snprintf(err, err_len, "socket: %s", strerror(e));
        freeaddrinfo(ai);
        return -e;
    }
    int rc = connect(fd, ai->ai_addr, ai->ai_addrlen);
    freeaddrinfo(ai);
    if (rc && errno == EINPROGRESS) {
        struct pollfd p = {.fd = fd, .events = POLLOUT};
        int pr = poll(&p, 1, timeout_ms);
        int soerr = 0;
        socklen_t sl = sizeof soerr;
        if (pr == 1) {
            if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &soerr, &sl)) soerr = errno;
        } else {
            soerr = pr == 0 ? ETIMEDOUT : errno;
        }
        rc = soerr ? -1 : 0;
        errno = soerr;
    }
    if (rc) {
        int e = errno;
        if (err_len) snprintf(err, err_len, "cannot connect to %s:%d: %s", host, port, strerror(e));
        close(fd);
        return -e;
    }
    int one = 1;
    /* Blocking from here on: the pipelined path passes MSG_DONTWAIT and polls,
     * while a lone small request sleeps in recv itself (one system call fewer
     * on the latency path), bounded by SO_RCVTIMEO. */
    struct timeval tv = {.tv_sec = timeout_ms / 1000, .tv_usec = (timeout_ms % 1000) * 1000};
    int fl = fcntl(fd, F_GETFL);
    const char *what = NULL;
    if (setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one)) what = "TCP_NODELAY";
    else if (fl < 0 || fcntl(fd, F_SETFL, fl & ~O_NONBLOCK)) what = "making the socket blocking";
    else if (setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv)) what = "SO_RCVTIMEO";
    if (what) {
        int e = errno;
        if (err_len) snprintf(err, err_len, "connection to %s:%d: %s: %s", host, port, what, strerror(e));
        close(fd);
        return -e;
    }
    tcp_conn *c = calloc(1, sizeof *c);
    if (c) {
        c->req = malloc(DLS_REQ_HDR_LEN + DLS_SEG_LEN * DLS_MAX_SEGS);
        c->scratch = malloc(SCRATCH);
    }
    if (!c || !c->req || !c->scratch) {
        if (c) {
            free(c->req);
            free(c->scratch);
        }
        free(c);
        close(fd);
        if (err_len) snprintf(err, err_len, "out of memory");
        return -ENOMEM;
    }
    c->fd = fd;
    c->next_id = 1;
    c->rcv_timeout_ms = timeout_ms;
    pthread_mutex_init(&c->mu, NULL);
    *out = c;
    return 0;
}

static int tcp_register_region(void *conn, void *base, uint64_t len) {
    (void)conn, (void)base, (void)len;
    return DLS_OK; /* TCP needs no registration */
}

/* Put the next request of the batch on the wire queue. */
static void build_request(run *r) {
    dls_batch *b = r->b;
    uint32_t first = r->next_seg, n = 0;
    uint64_t bytes = 0;
    /* Requests of about REQ_TARGET bytes keep several in flight even for a batch
     * of a few MiB, so the donor sends one while the next is on its way. */
    while (first + n < b->nseg && n < DLS_MAX_SEGS && bytes + b->lens[first + n] <= DLS_MAX_PAYLOAD &&
           (n == 0 || bytes + b->lens[first + n] <= REQ_TARGET)) {
        bytes += b->lens[first + n];
        n++;
    }
    tcp_conn *c = r->c;
    uint64_t id = c->next_id++;
    uint8_t *q = c->req;
    uint16_t flags = (uint16_t)(b->flags & DLS_F_CRC);
    dls_wire_put_req_hdr(q, r->op, flags, id, b->slab, n, b->token);
    const uint8_t *p = r->next_buf;
    for (uint32_t i = 0; i < n; i++) {
        uint32_t len = b->lens[first + i];
        uint32_t crc = 0;
        if (r->op == DLS_OP_WRITE && (b->flags & (DLS_F_CRC | DLS_F_LOCAL_CRC))) {
            crc = dls_crc32c_pages(0, p, len);
            b->crcs[first + i] = crc;
        }
        dls_wire_put_seg(q + DLS_REQ_HDR_LEN + (size_t)i * DLS_SEG_LEN, b->offs[first + i], len, crc);
        p += len;
    }
    pend *pd = &r->ring[(r->head + r->count) % WINDOW];
    pd->req_id = id;
    pd->op = r->op;
    pd->first_seg = first;
    pd->nseg = n;
    pd->dst = r->next_buf;
    pd->data_len = bytes;
    pd->bi = r->cur;
    r->count++;
    r->sending = 1;
    r->req_len = DLS_REQ_HDR_LEN + (size_t)n * DLS_SEG_LEN;
    r->req_sent = 0;
    r->pay = r->op == DLS_OP_WRITE ? r->next_buf : NULL;
    r->pay_len = r->op == DLS_OP_WRITE ? bytes : 0;
    r->pay_sent = 0;
    r->next_seg = first + n;
    r->next_buf += bytes;
}

/* Send what the socket takes; <0 on a dead connection. */
static int pump_send(run *r) {
    while (r->sending) {
        struct iovec iov[2];
        int k = 0;
        if (r->req_sent < r->req_len) iov[k++] = (struct iovec){r->c->req + r->req_sent, r->req_len - r->req_sent};
        if (r->pay_sent < r->pay_len) iov[k++] = (struct iovec){(void *)(r->pay + r->pay_sent), r->pay_len - r->pay_sent};
        if (k == 0) {
            r->sending = 0;
            break;
        }
        struct msghdr m = {.msg_iov = iov, .msg_iovlen = (size_t)k};
        ssize_t n = sendmsg(r->c->fd, &m, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
            return DLS_E_IO;
        }
        size_t left = (size_t)n;
        size_t h = r->req_len - r->req_sent;
        if (left >= h) {
            r->req_sent = r->req_len;
            left -= h;
            r->pay_sent += left;
        } else {
            r->req_sent += left;
        }
    }
    return 0;
}

static void finish_response(run *r) {
    pend *pd = &r->ring[r->head];
    dls_batch *b = r->bq[pd->bi];
    int *st = &r->st[pd->bi];
    if (r->resp.status != DLS_OK) {
        if (*st == DLS_OK) *st = r->resp.status;
    } else if (pd->op == DLS_OP_READ && (b->flags & DLS_F_LOCAL_CRC) && !(b->flags & DLS_F_CRC)) {
        const uint8_t *d = pd->dst;
        for (uint32_t i = 0; i < pd->nseg; i++) {
            uint32_t len = b->lens[pd->first_seg + i];
            b->crcs[pd->first_seg + i] = dls_crc32c_pages(0, d, len);
            d += len;
        }
    } else if (pd->op == DLS_OP_READ && (b->flags & DLS_F_CRC)) {
        const uint8_t *d = pd->dst;
        for (uint32_t i = 0; i < pd->nseg; i++) {
            uint32_t len = b->lens[pd->first_seg + i];
            uint32_t want = dls_ld32(r->crcbuf + 4u * i);
            b->crcs[pd->first_seg + i] = want;
            if (dls_crc32c_pages(0, d, len) != want && *st == DLS_OK) {
                *st = DLS_E_CRC;
                b->bad_seg = (int32_t)(pd->first_seg + i);
            }
            d += len;
        }
    }
    r->head = (r->head + 1) % WINDOW;
    r->count--;
    r->stage = 0;
    r->rgot = r->cgot = 0;
    r->dgot = 0;
}

/* Consume received bytes at p[0:n]; returns bytes used, or <0 on a protocol error. */
static long consume(run *r, const uint8_t *p, size_t n) {
    size_t used = 0;
    while (used < n && r->count > 0) {
        pend *pd = &r->ring[r->head];
        if (r->stage == 0) {
            size_t k = DLS_RESP_HDR_LEN - r->rgot;
            if (k > n - used) k = n - used;
            memcpy(r->rhdr + r->rgot, p + used, k);
            r->rgot += k;
            used += k;
            if (r->rgot < DLS_RESP_HDR_LEN) break;
            if (dls_wire_parse_resp(r->rhdr, DLS_RESP_HDR_LEN, &r->resp) != DLS_OK) return DLS_E_PROTO;
            if (r->resp.req_id != pd->req_id || r->resp.op != pd->op) return DLS_E_PROTO;
            if (r->resp.status != DLS_OK || pd->op == DLS_OP_WRITE) {
                if (r->resp.body_len != 0) return DLS_E_PROTO;
                finish_response(r);
                continue;
            }
            r->cneed = (r->bq[pd->bi]->flags & DLS_F_CRC) ? 4u * pd->nseg : 0;
            if (r->resp.body_len != r->cneed + pd->data_len || r->resp.nseg != pd->nseg) return DLS_E_PROTO;
            r->stage = r->cneed ? 1 : 2;
            if (r->stage == 2 && pd->data_len == 0) finish_response(r);
        } else if (r->stage == 1) {
            size_t k = r->cneed - r->cgot;
            if (k > n - used) k = n - used;
            memcpy(r->crcbuf + r->cgot, p + used, k);
            r->cgot += k;
            used += k;
            if (r->cgot == r->cneed) r->stage = 2;
        } else {
            uint64_t k = pd->data_len - r->dgot;
            if (k > n - used) k = n - used;
            memcpy(pd->dst + r->dgot, p + used, k);
            r->dgot += k;
            used += k;
            if (r->dgot == pd->data_len) finish_response(r);
        }
    }
    return (long)used;
}

/* Receive what is available; <0 on a dead connection or protocol error. */
static int pump_recv(run *r) {
    tcp_conn *c = r->c;
    for (;;) {
        if (r->count == 0) return 0;
        pend *pd = &r->ring[r->head];
        if (c->sb_len == c->sb_off && r->stage == 2 && pd->data_len - r->dgot >= DIRECT_MIN) {
            ssize_t n = recv(c->fd, pd->dst + r->dgot, pd->data_len - r->dgot, MSG_DONTWAIT);
            if (n == 0) return DLS_E_IO;
            if (n < 0) {
                if (errno == EINTR) continue;
                return (errno == EAGAIN || errno == EWOULDBLOCK) ? 0 : DLS_E_IO;
            }
            r->dgot += (uint64_t)n;
            if (r->dgot == pd->data_len) finish_response(r);
            continue;
        }
        if (c->sb_off == c->sb_len) c->sb_off = c->sb_len = 0;
        if (c->sb_len == c->sb_off || c->sb_len < SCRATCH) {
            if (c->sb_off && c->sb_len == SCRATCH) {
                memmove(c->scratch, c->scratch + c->sb_off, c->sb_len - c->sb_off);
                c->sb_len -= c->sb_off;
                c->sb_off = 0;
            }
            if (c->sb_len < SCRATCH) {
                ssize_t n = recv(c->fd, c->scratch + c->sb_len, SCRATCH - c->sb_len, MSG_DONTWAIT);
                if (n == 0) return DLS_E_IO;
                if (n < 0) {
                    if (errno == EINTR) continue;
                    if (errno != EAGAIN && errno != EWOULDBLOCK) return DLS_E_IO;
                    if (c->sb_len == c->sb_off) return 0;
                } else {
                    c->sb_len += (size_t)n;
                }
            }
        }
        long used = consume(r, c->scratch + c->sb_off, c->sb_len - c->sb_off);
        if (used < 0) return (int)used;
        c->sb_off += (size_t)used;
        if (used == 0) return 0;
    }
}

static int batch_ok(dls_batch *b) {
    if (!b->token || (b->nseg && (!b->offs || !b->lens || !b->buf))) return 0;
    if ((b->flags & (DLS_F_CRC | DLS_F_LOCAL_CRC)) && !b->crcs) return 0;
    if (b->flags & ~(DLS_F_CRC | DLS_F_LOCAL_CRC)) return 0;
    for (uint32_t i = 0; i < b->nseg; i++)
        if (b->lens[i] == 0 || b->lens[i] > DLS_MAX_SEG_BYTES) return 0;
    return 1;
}

static int run_batch(tcp_conn *c, dls_batch *b, uint8_t op) {
    if (!batch_ok(b)) return DLS_E_ARG;
    b->bad_seg = -1;
    pthread_mutex_lock(&c->mu);
    if (c->broken) {
        pthread_mutex_unlock(&c->mu);
        return DLS_E_CLOSED;
    }
    run *r = calloc(1, sizeof *r);
    if (!r) {
        pthread_mutex_unlock(&c->mu);
        return DLS_E_INTERNAL;
    }
    int status;
    run_init(r, c, &b, &status, 1, op);
    int timeout = b->timeout_ms > 0 ? b->timeout_ms : 10000;
    int rc = 0;
    for (;;) {
        /* after an error, issue nothing new: drain what is in flight */
        int built = 0;
        if (!r->sending && r->count < WINDOW && has_more(r)) {
            build_request(r);
            built = 1;
        }
        if ((rc = pump_send(r)) < 0) break;
        /* A request just went out whole and nothing is buffered: its response
         * cannot be here yet, so wait in poll rather than try a recv first. */
        int skip_recv = built && !r->sending && r->count == 1 && c->sb_len == c->sb_off &&
                        !has_more(r);
        if (skip_recv && b->timeout_ms == c->rcv_timeout_ms) {
            /* sleep in recv for the response (SO_RCVTIMEO bounds the wait), after polling for it for
             * spin_us: a round trip on a fast link is shorter than the wake-up of a sleeping thread */
            c->sb_off = c->sb_len = 0;
            ssize_t n = -1;
            if (b->spin_us) {
                uint64_t until = mono_ns() + (uint64_t)b->spin_us * 1000u;
                do {
                    n = recv(c->fd, c->scratch, SCRATCH, MSG_DONTWAIT);
                    if (n >= 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) break;
                    cpu_relax();
                } while (mono_ns() < until);
            }
            if (n < 0 && (!b->spin_us || errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
                do {
                    n = recv(c->fd, c->scratch, SCRATCH, 0);
                } while (n < 0 && errno == EINTR);
            }
            if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK)) {
                rc = DLS_E_IO;
                break;
            }
            if (n < 0) {
                rc = DLS_E_TIMEOUT;
                break;
            }
            c->sb_len = (size_t)n;
            skip_recv = 0;
        }
        if (!skip_recv && (rc = pump_recv(r)) < 0) break;
        int more = r->count < WINDOW && has_more(r);
        if (!r->sending && r->count == 0 && !more) break;
        if (more && !r->sending) continue;
        struct pollfd p = {.fd = c->fd, .events = (short)((r->count ? POLLIN : 0) | (r->sending ? POLLOUT : 0))};
        int pr = poll(&p, 1, timeout);
        if (pr == 0) {
            rc = DLS_E_TIMEOUT;
            break;
        }
        if (pr < 0 && errno != EINTR) {
            rc = DLS_E_IO;
            break;
        }
    }
    if (rc < 0) {
        c->broken = 1; /* the stream is out of step: never reuse it */
        shutdown(c->fd, SHUT_RDWR);
    } else {
        rc = status;
    }
    free(r);
    pthread_mutex_unlock(&c->mu);
    return rc;
}

static int cmp_conn(const void *a, const void *b) {
    uintptr_t x = (uintptr_t)((tcp_conn *const *)a)[0], y = (uintptr_t)((tcp_conn *const *)b)[0];
    return x < y ? -1 : x > y;
}

#define MANY_MAX 64

/* Write batches bs[i] on conns[i], all at once: one run per distinct connection carries that
 * connection's batches in order, pipelined, and one poll waits on every run, so the donors receive
 * and answer in parallel and a connection's batches cost about one round trip between them, not
 * one each.  A connection that breaks fails all its batches (some may have landed: the caller
 * treats the copy as lost). */
static void tcp_write_many(void **conns, dls_batch **bs, int n, int *rcs) {
    if (n > MANY_MAX) { /* the caller's arrays are its own business; ours are fixed */
        tcp_write_many(conns, bs, MANY_MAX, rcs);
        tcp_write_many(conns + MANY_MAX, bs + MANY_MAX, n - MANY_MAX, rcs + MANY_MAX);
        return;
    }
    tcp_conn *uc[MANY_MAX];      /* the distinct connections, in address order (the lock order) */
    dls_batch *qb[MANY_MAX];     /* the good batches, grouped by connection, each group in call order */
    int qi[MANY_MAX], st[MANY_MAX], first[MANY_MAX + 1];
    run *rs[MANY_MAX];
    int nu = 0, nq = 0, timeout = 0;
    for (int i = 0; i < n; i++) uc[i] = conns[i];
    qsort(uc, (size_t)n, sizeof uc[0], cmp_conn);
    for (int i = 0; i < n; i++)
        if (i == 0 || uc[i] != uc[nu - 1]) uc[nu++] = uc[i];
    for (int k = 0; k < nu; k++) pthread_mutex_lock(&uc[k]->mu); /* in address order: no deadlock with another caller */
    for (int k = 0; k < nu; k++) {
        first[k] = nq;
        for (int i = 0; i < n; i++) {
            if (conns[i] != uc[k]) continue;
            dls_batch *b = bs[i];
            b->bad_seg = -1;
            if (!batch_ok(b)) {
                rcs[i] = DLS_E_ARG;
                continue;
            }
            if (uc[k]->broken) {
                rcs[i] = DLS_E_CLOSED;
                continue;
            }
            qb[nq] = b;
            qi[nq++] = i;
            int t = b->timeout_ms > 0 ? b->timeout_ms : 10000;
            if (t > timeout) timeout = t;
        }
    }
    first[nu] = nq;
    int active[MANY_MAX], crc[MANY_MAX]; /* crc: the connection's own error (<0), or no memory */
    for (int k = 0; k < nu; k++) {
        rs[k] = NULL;
        crc[k] = 0;
        active[k] = first[k + 1] > first[k];
        if (!active[k]) continue;
        if (!(rs[k] = calloc(1, sizeof *rs[k]))) {
            crc[k] = DLS_E_INTERNAL;
            active[k] = 0;
            continue;
        }
        run_init(rs[k], uc[k], qb + first[k], st + first[k], (uint32_t)(first[k + 1] - first[k]), DLS_OP_WRITE);
    }
    for (;;) {
        struct pollfd pf[MANY_MAX];
        int who[MANY_MAX], np = 0, busy = 0, again = 0;
        for (int k = 0; k < nu; k++) {
            if (!active[k]) continue;
            run *r = rs[k];
            if (!r->sending && r->count < WINDOW && has_more(r)) build_request(r);
            int rc = pump_send(r);
            if (rc == 0) rc = pump_recv(r);
            if (rc < 0) {
                crc[k] = rc;
                active[k] = 0;
                continue;
            }
            int more = r->count < WINDOW && has_more(r);
            if (!r->sending && r->count == 0 && !more) {
                active[k] = 0;
                continue;
            }
            busy++;
            if (more && !r->sending) {
                again = 1;
                continue;
            }
            pf[np] = (struct pollfd){.fd = r->c->fd, .events = (short)((r->count ? POLLIN : 0) | (r->sending ? POLLOUT : 0))};
            who[np++] = k;
        }
        if (!busy) break;
        if (again) continue;
        int pr = poll(pf, (nfds_t)np, timeout);
        if (pr == 0 || (pr < 0 && errno != EINTR)) {
            for (int x = 0; x < np; x++) {
                crc[who[x]] = pr == 0 ? DLS_E_TIMEOUT : DLS_E_IO;
                active[who[x]] = 0;
            }
        }
    }
    for (int k = 0; k < nu; k++) {
        for (int q = first[k]; q < first[k + 1]; q++) rcs[qi[q]] = crc[k] ? crc[k] : st[q];
        if (crc[k] < 0) {
            uc[k]->broken = 1; /* the stream is out of step: never reuse it */
            shutdown(uc[k]->fd, SHUT_RDWR);
        }
        free(rs[k]);
    }
    for (int k = nu - 1; k >= 0; k--) pthread_mutex_unlock(&uc[k]->mu);
}

static int tcp_read(void *conn, dls_batch *b) { return run_batch(conn, b, DLS_OP_READ); }
static int tcp_write(void *conn, dls_batch *b) { return run_batch(conn, b, DLS_OP_WRITE); }

static int tcp_ping(void *conn, int timeout_ms) {
    tcp_conn *c = conn;
    pthread_mutex_lock(&c->mu);
    int rc = DLS_E_CLOSED;
    if (!c->broken) {
        uint8_t h[DLS_REQ_HDR_LEN], resp[DLS_RESP_HDR_LEN];
        uint64_t id = c->next_id++;
        dls_wire_put_req_hdr(h, DLS_OP_PING, 0, id, 0, 0, NULL);
        rc = send(c->fd, h, sizeof h, MSG_NOSIGNAL) == (ssize_t)sizeof h ? 0 : DLS_E_IO;
        size_t got = 0;
        while (rc == 0 && got < sizeof resp) {
            struct pollfd p = {.fd = c->fd, .events = POLLIN};
            int pr = poll(&p, 1, timeout_ms > 0 ? timeout_ms : 10000);
            if (pr == 0) rc = DLS_E_TIMEOUT;
            else if (pr > 0) {
                ssize_t n = recv(c->fd, resp + got, sizeof resp - got, MSG_DONTWAIT);
                if (n > 0) got += (size_t)n;
                else if (n == 0 || (errno != EAGAIN && errno != EINTR)) rc = DLS_E_IO;
            }
        }
        dls_resp_view v;
        if (rc == 0 && (dls_wire_parse_resp(resp, sizeof resp, &v) != DLS_OK || v.req_id != id)) rc = DLS_E_PROTO;
        if (rc == 0) rc = v.status;
        if (rc < 0) {
            c->broken = 1;
            shutdown(c->fd, SHUT_RDWR);
        }
    }
    pthread_mutex_unlock(&c->mu);
    return rc;
}

static void tcp_close(void *conn) {
    tcp_conn *c = conn;
    if (!c) return;
    close(c->fd);
    pthread_mutex_destroy(&c->mu);
    free(c->req);
    free(c->scratch);
    free(c);
}

const dls_provider dls_tcp_provider = {
    .name = "tcp",
    .connect = tcp_connect,
    .register_region = tcp_register_region,
    .read_batch = tcp_read,
    .write_batch = tcp_write,
    .ping = tcp_ping,
    .close = tcp_close,
    .write_many = tcp_write_many,
};
