/* Provider registry and the dls_ep indirection; see provider.h. */
#include "provider.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "wire.h"

/* The RDMA verbs provider (one-sided READ/WRITE on RC queue pairs) is not
 * written yet: when it is, it lives in its own file, built only where
 * <infiniband/verbs.h> is present, and is found here behind DLS_HAVE_VERBS.
 * Until then asking for "verbs" fails with that reason (-EOPNOTSUPP). */

struct dls_ep {
    const dls_provider *p;
    void *conn;
};

static const dls_provider *lookup(const char *name) {
    if (!name || !strcmp(name, "tcp")) return &dls_tcp_provider;
#ifdef DLS_HAVE_VERBS
    if (!strcmp(name, "verbs")) return &dls_verbs_provider;
#endif
    return NULL;
}

int dls_provider_available(const char *name) { return lookup(name) != NULL; }

int dls_ep_connect(const char *provider, const char *host, int port, int timeout_ms, dls_ep **out, char *err,
                   size_t err_len) {
    *out = NULL;
    const dls_provider *p = lookup(provider);
    if (!p) {
        if (err_len)
            snprintf(err, err_len, "provider %s is not built in (the verbs provider is not written yet)", provider);
        return -EOPNOTSUPP;
    }
    void *c = NULL;
    int rc = p->connect(host, port, timeout_ms, &c, err, err_len);
    if (rc) return rc;
    dls_ep *ep = malloc(sizeof *ep);
    if (!ep) {
        p->close(c);
        if (err_len) snprintf(err, err_len, "out of memory");
        return -ENOMEM;
    }
    ep->p = p;
    ep->conn = c;
    *out = ep;
    return 0;
}

int dls_ep_register_region(dls_ep *ep, void *base, uint64_t len) { return ep->p->register_region(ep->conn, base, len); }
int dls_ep_read(dls_ep *ep, dls_batch *b) { return ep->p->read_batch(ep->conn, b); }
int dls_ep_write(dls_ep *ep, dls_batch *b) { return ep->p->write_batch(ep->conn, b); }
int dls_ep_ping(dls_ep *ep, int timeout_ms) { return ep->p->ping(ep->conn, timeout_ms); }

#define MANY_MAX 64

void dls_ep_write_many(dls_ep **eps, dls_batch **bs, int n, int *rcs) {
    if (n > MANY_MAX) {
        dls_ep_write_many(eps, bs, MANY_MAX, rcs);
        dls_ep_write_many(eps + MANY_MAX, bs + MANY_MAX, n - MANY_MAX, rcs + MANY_MAX);
        return;
    }
    int same = n > 1 && eps[0]->p->write_many != NULL;
    for (int i = 1; same && i < n; i++) same = eps[i]->p == eps[0]->p;
    if (!same) {
        for (int i = 0; i < n; i++) rcs[i] = eps[i]->p->write_batch(eps[i]->conn, bs[i]);
        return;
    }
    void *conns[MANY_MAX];
    for (int i = 0; i < n; i++) conns[i] = eps[i]->conn;
    eps[0]->p->write_many(conns, bs, n, rcs);
}

void dls_ep_close(dls_ep *ep) {
    if (!ep) return;
    ep->p->close(ep->conn);
    free(ep);
}

int dls_ep_read1(dls_ep *ep, uint32_t slab, const uint8_t *token, uint64_t off, uint32_t len, uint8_t *buf,
                 uint32_t flags, uint32_t *crc_out, int timeout_ms) {
    uint32_t crc = 0;
    dls_batch b = {.slab = slab, .token = token, .nseg = 1, .offs = &off, .lens = &len, .buf = buf,
                   .flags = flags, .crcs = &crc, .timeout_ms = timeout_ms, .bad_seg = -1};
    int rc = ep->p->read_batch(ep->conn, &b);
    if (crc_out) *crc_out = crc;
    return rc;
}
