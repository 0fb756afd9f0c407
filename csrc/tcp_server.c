/* TCP slab server: connections and their buffers; see tcp_server.h.
 *
 * Each worker thread owns an epoll set holding the (shared) listening socket,
 * with EPOLLEXCLUSIVE so one worker takes each new connection, an eventfd used
 * to stop it, and the connections it accepted.  A connection is touched by its
 * worker only.  This file accepts, reads into each connection's input buffer,
 * flushes its output and closes idle or stalled peers; what a request means
 * (checks, slabs, responses) is slab_service.c's business.
 *
 * Ceilings (the README's Security section): connections are capped globally
 * (max_conns, never above RLIMIT_NOFILE minus DLS_FD_RESERVE) and per peer
 * address (peer_limit.c); threads are the workers, whatever the load; a
 * connection that has not proved a token is closed idle_ns after it opened,
 * whatever it sends; buffers grown by a large batch are given back once the
 * connection idles.  Out of descriptors (EMFILE/ENFILE), a worker refuses the
 * pending connection with its spare descriptor, or stops listening for
 * DLS_ACCEPT_PAUSE_NS: it never spins on a readable listener it cannot drain. */
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
#include <sys/resource.h>
#include <sys/socket.h>
#include <fcntl.h>
#include <unistd.h>

#include "peer_limit.h"
#include "slab_service.h"

#define IN_INITIAL (64u << 10)
#define READ_CHUNK (1u << 20)
#define SHRINK_ABOVE (4u << 20)          /* buffers larger than this are given back when idle */
#define DLS_ACCEPT_PAUSE_NS 100000000ull /* a worker out of descriptors stops accepting this long */
#define IDLE_SWEEP_NS 1000000000ull      /* sweep period when both timeouts are off */

typedef struct conn {
    dls_stream st; /* what the request side sees: socket, buffers, protocol state */
    int want_out;  /* registered for EPOLLOUT */
    uint64_t opened_ns;  /* when it was accepted: the idle window of a tokenless peer runs from here */
    uint64_t last_rx_ns; /* when bytes last arrived (or the connection opened) */
    uint64_t sent;       /* bytes flushed from its output queue, ever */
    uint64_t sent_mark, stall_since; /* sweep's view: output queued and `sent` unchanged since */
    dls_peer_key peer;
    struct conn *prev, *next;
} conn;

typedef struct worker {
    dls_server *s;
    int epfd, stopfd;
    int spare_fd;   /* held to refuse a connection when the process is out of descriptors */
    int listening;  /* the listening socket is in epfd */
    uint64_t resume_ns; /* when not listening: when to listen again */
    pthread_t th;
    int started;
    conn *conns;
    uint64_t next_sweep_ns;
} worker;

struct dls_server {
    int lfd, port, nthreads, max_conns;
    worker *workers;
    dls_slab_table slabs;
    dls_peer_table peers;
    int peers_ready;
    dls_server_counters n; /* atomics */
    uint64_t idle_ns, frame_ns, sweep_ns; /* 0: that timeout is off */
    uint64_t timed_out;
};

static char LISTEN_TAG, STOP_TAG;

/* The counts and the peer's place are given back before the close, so that a
 * peer which sees its connection closed sees them (and may connect again at
 * once, even at its address's limit). */
static void conn_close(worker *w, conn *c) {
    DLS_ADD(&w->s->n.open_connections, (uint64_t)-1);
    dls_peers_leave(&w->s->peers, &c->peer);
    close(c->st.fd); /* which takes it out of the epoll set: nothing else holds the descriptor */
    if (c->prev) c->prev->next = c->next;
    else w->conns = c->next;
    if (c->next) c->next->prev = c->prev;
    free(c->st.in);
    free(c->st.out);
    free(c);
}

/* Send queued output; 0 when drained, 1 when the socket is full, -errno on error. */
static int flush_out(dls_server *s, conn *cn) {
    dls_stream *c = &cn->st;
    while (c->outoff < c->outlen) {
        ssize_t n = send(c->fd, c->out + c->outoff, c->outlen - c->outoff, MSG_NOSIGNAL);
        if (n < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) return 1;
            return -errno;
        }
        c->outoff += (size_t)n;
        cn->sent += (uint64_t)n;
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

/* 0, or -errno when epoll refused (the caller closes the connection: it would never be served again). */
static int set_interest(worker *w, conn *c, int want_out) {
    if (c->want_out == want_out) return 0;
    struct epoll_event ev = {.events = want_out ? EPOLLOUT : (EPOLLIN | EPOLLRDHUP), .data.ptr = c};
    if (epoll_ctl(w->epfd, EPOLL_CTL_MOD, c->st.fd, &ev)) return -errno;
    c->want_out = want_out;
    return 0;
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
        int fr = flush_out(s, c);
        if (fr < 0) {
            conn_close(w, c);
            return;
        }
        if (fr == 1) {
            if (set_interest(w, c, 1)) conn_close(w, c);
            return;
        }
        if (st->closing || set_interest(w, c, 0)) {
            conn_close(w, c);
            return;
        }
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

static void pause_listener(worker *w) {
    /* A failed removal (only ENOENT: not in the set) changes nothing below: the listener counts as
     * paused, and resume_listener's EPOLL_CTL_ADD takes EEXIST as success. */
    if (w->listening && epoll_ctl(w->epfd, EPOLL_CTL_DEL, w->s->lfd, NULL) && errno != ENOENT)
        DLS_ADD(&w->s->n.errors, 1);
    w->listening = 0;
    w->resume_ns = dls_monotonic_ns() + DLS_ACCEPT_PAUSE_NS;
}

static void resume_listener(worker *w) {
    struct epoll_event ev = {.events = EPOLLIN | EPOLLEXCLUSIVE, .data.ptr = &LISTEN_TAG};
    if (epoll_ctl(w->epfd, EPOLL_CTL_ADD, w->s->lfd, &ev) == 0 || errno == EEXIST) {
        w->listening = 1;
        w->resume_ns = 0;
    } else {
        w->resume_ns = dls_monotonic_ns() + DLS_ACCEPT_PAUSE_NS;
    }
}

/* accept failed with EMFILE/ENFILE (or no kernel memory): the listener stays
 * readable, so returning to epoll would spin.  Give up the spare descriptor to
 * accept and close one pending connection (a refusal the peer sees at once), or,
 * without a spare, stop listening for a while.  1: one was refused, try again. */
static int out_of_descriptors(worker *w) {
    dls_server *s = w->s;
    DLS_ADD(&s->n.fd_exhausted, 1);
    if (w->spare_fd >= 0) {
        close(w->spare_fd);
        int fd = accept4(s->lfd, NULL, NULL, SOCK_CLOEXEC);
        int none_pending = fd < 0 && (errno == EAGAIN || errno == EWOULDBLOCK); /* another worker took it */
        if (fd >= 0) {
            close(fd);
            DLS_ADD(&s->n.refused, 1);
        }
        w->spare_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
        if (w->spare_fd >= 0 && fd >= 0) return 1;
        if (w->spare_fd >= 0 && none_pending) return 0;
    }
    pause_listener(w);
    return 0;
}

static void accept_all(worker *w) {
    dls_server *s = w->s;
    for (;;) {
        struct sockaddr_storage ss;
        socklen_t sl = sizeof ss;
        int fd = accept4(s->lfd, (struct sockaddr *)&ss, &sl, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK) return;
            if (errno == EINTR || errno == ECONNABORTED || errno == EPROTO) continue;
            if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
                if (out_of_descriptors(w)) continue;
                return;
            }
            pause_listener(w); /* an error that may persist: do not spin on it */
            return;
        }
        if (DLS_LOAD(&s->n.open_connections) >= (uint64_t)s->max_conns) {
            DLS_ADD(&s->n.refused, 1); /* counted before the close: whoever sees the close sees it */
            close(fd); /* a flood of connections must not exhaust the donor */
            continue;
        }
        dls_peer_key key = dls_peer_key_of(&ss);
        if (dls_peers_admit(&s->peers, &key)) { /* at the address's limit (or out of memory) */
            DLS_ADD(&s->n.refused, 1);
            DLS_ADD(&s->n.refused_per_peer, 1);
            close(fd); /* nor may one address take every place */
            continue;
        }
        int one = 1;
        if (setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one)) { /* the socket is unusable */
            close(fd);
            dls_peers_leave(&s->peers, &key);
            continue;
        }
        conn *c = calloc(1, sizeof *c);
        if (!c || dls_reserve(&c->st.in, &c->st.incap, IN_INITIAL)) {
            free(c);
            close(fd);
            dls_peers_leave(&s->peers, &key);
            continue;
        }
        c->st.fd = fd;
        c->peer = key;
        c->opened_ns = c->last_rx_ns = dls_monotonic_ns();
        struct epoll_event ev = {.events = EPOLLIN | EPOLLRDHUP, .data.ptr = c};
        if (epoll_ctl(w->epfd, EPOLL_CTL_ADD, fd, &ev)) {
            free(c->st.in);
            free(c);
            close(fd);
            dls_peers_leave(&s->peers, &key);
            continue;
        }
        c->next = w->conns;
        if (w->conns) w->conns->prev = c;
        w->conns = c;
        DLS_ADD(&s->n.connections, 1);
        DLS_ADD(&s->n.open_connections, 1);
    }
}

/* Give back the buffers a large batch grew, on a connection that has idled
 * since (a consumer keeps its connection between bursts).  0, or -1 out of memory. */
static int shrink_idle(dls_server *s, conn *c, uint64_t now) {
    dls_stream *st = &c->st;
    if (st->inlen || st->discard || now - c->last_rx_ns < s->sweep_ns) return 0;
    if (st->incap > SHRINK_ABOVE) {
        free(st->in);
        st->in = NULL;
        st->incap = 0;
        if (dls_reserve(&st->in, &st->incap, IN_INITIAL)) return -ENOMEM;
    }
    if (st->outlen == st->outoff && st->outcap > SHRINK_ABOVE) {
        free(st->out);
        st->out = NULL;
        st->outcap = st->outlen = st->outoff = 0;
    }
    return 0;
}

/* Close this worker's connections that hold a place without using it:
 * - an incomplete frame (or the payload of a refused WRITE) pending for more
 *   than frame_ns, unless the server is the one waiting (output queued);
 * - output queued that the peer has not taken any of for more than frame_ns
 *   (a peer that stops reading pins its responses), token or not;
 * - a connection that has not carried a valid token idle_ns after it opened,
 *   whatever it sent (PINGs need no token).  Connections that did are kept
 *   however long they idle, since consumers keep them open between bursts and
 *   treat a dropped one as a failed donor. */
static void sweep(worker *w, uint64_t now) {
    dls_server *s = w->s;
    conn *c = w->conns;
    while (c) {
        conn *next = c->next;
        int out_queued = c->st.outlen > c->st.outoff;
        int stale = 0;
        if (s->frame_ns && c->st.partial_since && !out_queued && now - c->st.partial_since > s->frame_ns) stale = 1;
        if (!out_queued) {
            c->stall_since = 0;
        } else if (!c->stall_since || c->sent != c->sent_mark) {
            c->stall_since = now;
            c->sent_mark = c->sent;
        } else if (s->frame_ns && now - c->stall_since > s->frame_ns) {
            stale = 1;
        }
        if (s->idle_ns && !c->st.authed && now - c->opened_ns > s->idle_ns) stale = 1;
        if (stale) {
            DLS_ADD(&s->timed_out, 1);
            conn_close(w, c);
        } else if (shrink_idle(s, c, now)) {
            conn_close(w, c);
        }
        c = next;
    }
}

static void *worker_main(void *arg) {
    worker *w = arg;
    dls_server *s = w->s;
    struct epoll_event evs[64];
    w->next_sweep_ns = dls_monotonic_ns() + s->sweep_ns;
    for (;;) {
        uint64_t now = dls_monotonic_ns();
        if (now >= w->next_sweep_ns) {
            sweep(w, now);
            w->next_sweep_ns = now + s->sweep_ns;
        }
        if (!w->listening && now >= w->resume_ns) resume_listener(w);
        uint64_t wake = w->next_sweep_ns;
        if (!w->listening && w->resume_ns < wake) wake = w->resume_ns;
        int timeout = wake > now ? (int)((wake - now + 999999) / 1000000) : 0;
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

/* The reason in err; returns -e. */
static int set_err(char *err, size_t len, const char *what, int e) {
    if (len) snprintf(err, len, "%s: %s", what, strerror(e));
    return -e;
}

int dls_server_start(const char *host, int port, int nthreads, int max_conns, dls_server **out, char *err,
                     size_t err_len) {
    return dls_server_start_ex(host, port, nthreads, max_conns, 0, DLS_IDLE_TIMEOUT_MS, DLS_FRAME_TIMEOUT_MS, out,
                               err, err_len);
}

int dls_server_start_ex(const char *host, int port, int nthreads, int max_conns, int max_per_peer,
                        int64_t idle_timeout_ms, int64_t frame_timeout_ms, dls_server **out, char *err,
                        size_t err_len) {
    *out = NULL;
    if (nthreads < 1) nthreads = 1;
    if (nthreads > 64) nthreads = 64;
    dls_server *s = calloc(1, sizeof *s);
    if (!s) return set_err(err, err_len, "the server's state", ENOMEM);
    s->lfd = -1;
    int rc = dls_slabs_init(&s->slabs);
    if (rc) {
        rc = set_err(err, err_len, "the slab table", -rc);
        goto fail;
    }
    s->workers = calloc((size_t)nthreads, sizeof(worker));
    if (!s->workers) {
        rc = set_err(err, err_len, "the worker table", ENOMEM);
        goto fail;
    }
    s->max_conns = max_conns > 0 ? max_conns : DLS_MAX_CONNECTIONS;
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY) {
        /* one descriptor per connection, and the rest of the process needs some too */
        rlim_t room = rl.rlim_cur > DLS_FD_RESERVE + 1 ? rl.rlim_cur - DLS_FD_RESERVE : 1;
        if ((rlim_t)s->max_conns > room) s->max_conns = (int)room;
    }
    dls_peers_init(&s->peers, max_per_peer > 0 ? max_per_peer : DLS_MAX_PER_PEER);
    s->peers_ready = 1;
    s->idle_ns = idle_timeout_ms > 0 ? (uint64_t)idle_timeout_ms * 1000000ull : 0;
    s->frame_ns = frame_timeout_ms > 0 ? (uint64_t)frame_timeout_ms * 1000000ull : 0;
    s->sweep_ns = IDLE_SWEEP_NS; /* timeouts off: only idle buffers are given back */
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
        rc = gai == EAI_SYSTEM ? -errno : -EINVAL;
        goto fail;
    }
    s->lfd = socket(ai->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    int one = 1;
    if (s->lfd < 0 || setsockopt(s->lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) ||
        bind(s->lfd, ai->ai_addr, ai->ai_addrlen) || listen(s->lfd, 512)) {
        rc = set_err(err, err_len, "cannot listen", errno);
        freeaddrinfo(ai);
        goto fail;
    }
    freeaddrinfo(ai);
    struct sockaddr_storage ss;
    socklen_t sl = sizeof ss;
    if (getsockname(s->lfd, (struct sockaddr *)&ss, &sl)) {
        rc = set_err(err, err_len, "getsockname", errno);
        goto fail;
    }
    s->port = ntohs(ss.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&ss)->sin6_port
                                            : ((struct sockaddr_in *)&ss)->sin_port);
    s->nthreads = nthreads;
    for (int i = 0; i < nthreads; i++) {
        worker *w = &s->workers[i];
        w->s = s;
        w->epfd = epoll_create1(EPOLL_CLOEXEC);
        w->stopfd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
        w->spare_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
        w->listening = 1;
        if (w->epfd < 0 || w->stopfd < 0 || w->spare_fd < 0) {
            rc = set_err(err, err_len, "epoll/eventfd", errno);
            goto fail;
        }
        struct epoll_event ev = {.events = EPOLLIN | EPOLLEXCLUSIVE, .data.ptr = &LISTEN_TAG};
        struct epoll_event sev = {.events = EPOLLIN, .data.ptr = &STOP_TAG};
        if (epoll_ctl(w->epfd, EPOLL_CTL_ADD, s->lfd, &ev) || epoll_ctl(w->epfd, EPOLL_CTL_ADD, w->stopfd, &sev)) {
            rc = set_err(err, err_len, "epoll_ctl", errno);
            goto fail;
        }
        int e = pthread_create(&w->th, NULL, worker_main, w);
        if (e) { /* (pthread_create returns its error: errno is not set) */
            rc = set_err(err, err_len, "pthread_create", e);
            goto fail;
        }
        w->started = 1;
    }
    *out = s;
    return 0;
fail:
    dls_server_stop(s);
    return rc;
}

int dls_server_port(const dls_server *s) { return s->port; }

void dls_server_stop(dls_server *s) {
    if (!s) return;
    if (s->workers) {
        for (int i = 0; i < s->nthreads; i++) {
            worker *w = &s->workers[i];
            if (w->started) {
                uint64_t one = 1;
                /* An eventfd write of 1 fails only on a counter at its maximum, which nothing here adds up
                 * to; joining without the wake would wait for ever, so a failure is a bug to see at once. */
                if (write(w->stopfd, &one, sizeof one) != (ssize_t)sizeof one) abort();
                pthread_join(w->th, NULL);
            }
            if (w->epfd > 0) close(w->epfd);
            if (w->stopfd > 0) close(w->stopfd);
            if (w->spare_fd > 0) close(w->spare_fd);
        }
    }
    if (s->lfd >= 0) close(s->lfd);
    dls_slabs_destroy(&s->slabs);
    if (s->peers_ready) dls_peers_destroy(&s->peers);
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
    o->refused_per_peer = DLS_LOAD(&s->n.refused_per_peer);
    o->fd_exhausted = DLS_LOAD(&s->n.fd_exhausted);
}

int dls_server_max_connections(const dls_server *s) { return s->max_conns; }

uint64_t dls_server_timed_out(dls_server *s) { return DLS_LOAD(&s->timed_out); }
