#ifndef DLSHARE_PEER_LIMIT_H
#define DLSHARE_PEER_LIMIT_H
/* How many connections each peer address holds, so that one address cannot take
 * every place of a server (internal to tcp_server.c; no .cdef).  IPv4-mapped IPv6
 * addresses count as their IPv4 address.  Thread-safe: one mutex, held for a hash
 * lookup at accept and at close. */
#include <pthread.h>
#include <stdint.h>
#include <sys/socket.h>

#define DLS_PEER_BUCKETS 1024

typedef struct dls_peer_key {
    uint8_t addr[16]; /* IPv4 in the first 4 bytes, the rest zero */
    uint8_t v6;
} dls_peer_key;

typedef struct dls_peer dls_peer;

typedef struct dls_peer_table {
    pthread_mutex_t mu;
    int limit; /* connections per address */
    dls_peer *buckets[DLS_PEER_BUCKETS];
} dls_peer_table;

void dls_peers_init(dls_peer_table *t, int limit);
void dls_peers_destroy(dls_peer_table *t);
/* The key of a peer address (AF_INET or AF_INET6; others map to one shared key). */
dls_peer_key dls_peer_key_of(const struct sockaddr_storage *ss);
/* Count one more connection from key: 0, or -EUSERS when the address is at its
 * limit, -ENOMEM out of memory (then nothing is counted). */
int dls_peers_admit(dls_peer_table *t, const dls_peer_key *key);
/* One connection from key closed. */
void dls_peers_leave(dls_peer_table *t, const dls_peer_key *key);
#endif
