/* TCP slab server: connections and their buffers; see tcp_server.h.
 *
 * Each worker thread owns an epoll set holding the (shared) listening socket,
 * with EPOLLEXCLUSIVE so one worker takes each new connection, an eventfd used
 * to stop it, and the connections it accepted.  A connection is touched by its
 * worker only.  This file accepts, reads into each connection's input buffer,
 * flushes its output and closes idle or stalled peers; what a request means
 * (checks, slabs, responses) is slab_service.c's business. */
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
#include <unistd.h>

#include "slab_service.h"

#define IN_INITIAL (64u << 10)
#define READ_CHUNK (1u << 20)

typedef struct conn {
    dls_stream st; /* what the request side sees: socket, buffers, protocol state */
    int want_out;  /* registered for EPOLLOUT */
    uint64_t last_rx_ns; /* when bytes last arrived (or the connection opened) */
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
    dls_slab_table slabs;
    dls_server_counters n; /* atomics */
    uint64_t idle_ns, frame_ns, sweep_ns; /* 0: that timeout is off */
    uint64_t timed_out;
};

static char LISTEN_TAG, STOP_TAG;

static void conn_close(worker *w, conn *c) {
    epoll_ctl(w->epfd, EPOLL_CTL_DEL, c->st.fd, NULL);
    close(c->st.fd);
    if (c->prev) c->prev->next = c->next;
    else w->conns = c->next;
    if (c->next) c->next->prev = c->prev;
    free(c->st.in);
    free(c->st.out);
    free(c);
    DLS_ADD(&w->s->n.open_connections, (uint64_t)-1);
}

/* Send queued output; 0 when drained, 1 when the socket is full, -1 on error. */
static int flush_out(dls_server *s, dls_stream *c) {
    while (c->outoff < c->outlen) {
        ssize_t n = send(c->fd, c->out + c->outoff, c->outlen - c->outoff, MSG_NOSIGNAL);
        if (n < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) return 1;
            return -1;
        }
        c->outoff += (size_t)n;
        DLS_ADD(&s->n.bytes_out, (uint64_t)n);
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
    epoll_ctl(w->epfd, EPOLL_CTL_MOD, c->st.fd, &ev);
    c->want_out = want_out;
}

static void conn_event(worker *w, conn *c, uint32_t events) {
    dls_server *s = w->s;
    dls_stream *st = &c->st;
    if (events & EPOLLERR) {
        conn_close(w, c);
        return;
    }
    int did_recv = 0;
    for (;;) {
        int more = dls_serve_input(&s->slabs, &s->n, st);
        int fr = flush_out(s, st);
        if (fr < 0) {
            conn_close(w, c);
            return;
        }
        if (fr == 1) {
            set_interest(w, c, 1);
            return;
        }
        if (st->closing) {
            conn_close(w, c);
            return;
        }
        set_interest(w, c, 0);
        if (more) continue; /* parse the rest before reading more */
        /* Everything read so far is served: level-triggered epoll reports the
         * next bytes, so skip the recv that would most likely say EAGAIN. */
        if (did_recv && st->inlen == 0) return;
        if (st->incap - st->inlen < 4096 && dls_reserve(&st->in, &st->incap, st->inlen + READ_CHUNK)) {
            conn_close(w, c);
            return;
        }
        ssize_t n = recv(st->fd, st->in + st->inlen, st->incap - st->inlen, 0);
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
        st->inlen += (size_t)n;
        c->last_rx_ns = dls_monotonic_ns();
        did_recv = 1;
        DLS_ADD(&s->n.bytes_in, (uint64_t)n);
    }
    /* still busy: level-triggered epoll calls us again, after other connections */
}

static void accept_all(worker *w) {
    for (;;) {
        int fd = accept4(w->s->lfd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) return; /* EAGAIN, or a transient error: nothing more now */
        if (DLS_LOAD(&w->s->n.open_connections) >= (uint64_t)w->s->max_conns) {
            close(fd); /* a flood of connections must not exhaust the donor */
            DLS_ADD(&w->s->n.refused, 1);
            continue;
        }
        int one = 1;
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        conn *c = calloc(1, sizeof *c);
        if (!c || dls_reserve(&c->st.in, &c->st.incap, IN_INITIAL)) {
            free(c);
            close(fd);
            continue;
        }
        c->st.fd = fd;
        c->last_rx_ns = dls_monotonic_ns();
        struct epoll_event ev = {.events = EPOLLIN | EPOLLRDHUP, .data.ptr = c};
        if (epoll_ctl(w->epfd, EPOLL_CTL_ADD, fd, &ev)) {
            free(c->st.in);
            free(c);
            close(fd);
            continue;
        }
        c->next = w->conns;
        if (w->conns) w->conns->prev = c;
        w->conns = c;
        DLS_ADD(&w->s->n.connections, 1);
        DLS_ADD(&w->s->n.open_connections, 1);
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
        int out_queued = c->st.outlen > c->st.outoff;
        int stale = 0;
        if (s->frame_ns && c->st.partial_since && !out_queued && now - c->st.partial_since > s->frame_ns) stale = 1;
        if (s->idle_ns && !c->st.authed && now - c->last_rx_ns > s->idle_ns) stale = 1;
        if (stale) {
            DLS_ADD(&s->timed_out, 1);
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
    s->lfd = -1;
    if (dls_slabs_init(&s->slabs)) goto fail;
    s->workers = calloc((size_t)nthreads, sizeof(worker));
    if (!s->workers) goto fail;
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
    dls_slabs_destroy(&s->slabs);
    free(s->workers);
    free(s);
}

int dls_server_add_slab(dls_server *s, uint32_t id, void *base, uint64_t size, const uint8_t *token) {
    return dls_slabs_add(&s->slabs, id, base, size, token);
}

int dls_server_remove_slab(dls_server *s, uint32_t id) { return dls_slabs_remove(&s->slabs, id); }

int dls_server_slab_stats(dls_server *s, uint32_t id, dls_slab_stats *out) {
    return dls_slabs_stats(&s->slabs, id, out);
}

void dls_server_get_counters(dls_server *s, dls_server_counters *o) {
    o->connections = DLS_LOAD(&s->n.connections);
    o->open_connections = DLS_LOAD(&s->n.open_connections);
    o->requests = DLS_LOAD(&s->n.requests);
    o->errors = DLS_LOAD(&s->n.errors);
    o->bad_frames = DLS_LOAD(&s->n.bad_frames);
    o->bytes_in = DLS_LOAD(&s->n.bytes_in);
    o->bytes_out = DLS_LOAD(&s->n.bytes_out);
    o->refused = DLS_LOAD(&s->n.refused);
}

uint64_t dls_server_timed_out(dls_server *s) { return DLS_LOAD(&s->timed_out); }
