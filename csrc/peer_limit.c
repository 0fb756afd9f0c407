/* Connections per peer address; see peer_limit.h. */
#include "peer_limit.h"

#include <errno.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <string.h>

struct dls_peer {
    dls_peer_key key;
    int count;
    dls_peer *next;
};

void dls_peers_init(dls_peer_table *t, int limit) {
    memset(t, 0, sizeof *t);
    pthread_mutex_init(&t->mu, NULL);
    t->limit = limit;
}

void dls_peers_destroy(dls_peer_table *t) {
    for (int i = 0; i < DLS_PEER_BUCKETS; i++) {
        dls_peer *p = t->buckets[i];
        while (p) {
            dls_peer *next = p->next;
            free(p);
            p = next;
        }
        t->buckets[i] = NULL;
    }
    pthread_mutex_destroy(&t->mu);
}

dls_peer_key dls_peer_key_of(const struct sockaddr_storage *ss) {
    dls_peer_key k;
    memset(&k, 0, sizeof k);
    if (ss->ss_family == AF_INET) {
        memcpy(k.addr, &((const struct sockaddr_in *)ss)->sin_addr, 4);
    } else if (ss->ss_family == AF_INET6) {
        const struct in6_addr *a = &((const struct sockaddr_in6 *)ss)->sin6_addr;
        if (IN6_IS_ADDR_V4MAPPED(a)) {
            memcpy(k.addr, a->s6_addr + 12, 4);
        } else {
            memcpy(k.addr, a->s6_addr, 16);
            k.v6 = 1;
        }
    }
    return k;
}

static unsigned bucket_of(const dls_peer_key *k) {
    uint32_t h = 2166136261u; /* FNV-1a */
    for (int i = 0; i < 16; i++) h = (h ^ k->addr[i]) * 16777619u;
    h = (h ^ k->v6) * 16777619u;
    return h % DLS_PEER_BUCKETS;
}

static dls_peer **find(dls_peer_table *t, const dls_peer_key *k) {
    dls_peer **pp = &t->buckets[bucket_of(k)];
    while (*pp && memcmp(&(*pp)->key, k, sizeof *k)) pp = &(*pp)->next;
    return pp;
}

int dls_peers_admit(dls_peer_table *t, const dls_peer_key *key) {
    int rc = -EUSERS;
    pthread_mutex_lock(&t->mu);
    dls_peer **pp = find(t, key);
    if (*pp) {
        if ((*pp)->count < t->limit) {
            (*pp)->count++;
            rc = 0;
        }
    } else if (t->limit > 0) {
        dls_peer *p = calloc(1, sizeof *p);
        rc = p ? 0 : -ENOMEM;
        if (p) {
            p->key = *key;
            p->count = 1;
            *pp = p;
        }
    }
    pthread_mutex_unlock(&t->mu);
    return rc;
}

void dls_peers_leave(dls_peer_table *t, const dls_peer_key *key) {
    pthread_mutex_lock(&t->mu);
    dls_peer **pp = find(t, key);
    dls_peer *p = *pp;
    if (p && --p->count <= 0) {
        *pp = p->next;
        free(p);
    }
    pthread_mutex_unlock(&t->mu);
}
