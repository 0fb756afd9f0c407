/* The region engine's queues: the ring buffer they are made of, and the two hand-offs between
 * the fault side (pager_fault.c) and the eviction side (pager_evict.c).  Both sides call these;
 * neither calls the other.  See pager_queue.h. */
#define _GNU_SOURCE
#include "pager_queue.h"

#include <errno.h>
#include <stdlib.h>

/* --- queues (the caller holds the lock that guards them) ------------------------------------- */

int pg_queue_init(pg_queue *q, uint64_t cap) {
    q->items = calloc(cap ? cap : 1, sizeof *q->items);
    q->cap = cap ? cap : 1;
    q->head = q->len = 0;
    return q->items ? 0 : -ENOMEM;
}

void pg_queue_free(pg_queue *q) {
    free(q->items);
    q->items = NULL;
}

int pg_queue_push(pg_queue *q, uint32_t v) {
    if (q->len == q->cap) { /* grow rather than drop: a dropped fault would hang its thread */
        uint64_t cap = q->cap * 2;
        uint32_t *items = malloc(cap * sizeof *items);
        if (!items) return -ENOMEM;
        for (uint64_t i = 0; i < q->len; i++) items[i] = q->items[(q->head + i) % q->cap];
        free(q->items);
        q->items = items;
        q->cap = cap;
        q->head = 0;
    }
    q->items[(q->head + q->len) % q->cap] = v;
    q->len++;
    return 0;
}

int pg_queue_pop(pg_queue *q, uint32_t *v) {
    if (!q->len) return -EAGAIN;
    *v = q->items[q->head];
    q->head = (q->head + 1) % q->cap;
    q->len--;
    return 0;
}

int pg_queue_peek(const pg_queue *q, uint32_t *v) {
    if (!q->len) return -EAGAIN;
    *v = q->items[q->head];
    return 0;
}

/* --- the hand-offs ------------------------------------------------------------------------------ */

void pg_queue_demand(dls_pager *p, uint64_t u) {
    pthread_mutex_lock(&p->q_mu);
    int rc = pg_queue_push(&p->demand, (uint32_t)u);
    if (!rc) pthread_cond_signal(&p->q_cv);
    pthread_mutex_unlock(&p->q_mu);
    if (!rc) return;
    /* Out of memory: give the unit back (ABSENT) and wake whoever waits on it; its thread faults
     * again and a fault thread fetches the unit itself, with no queue on the way. */
    pg_fail(p, DLS_CALL_QUEUE, rc, u, 1);
    pg_lock(p, u);
    p->state[u] = U_ABSENT;
    p->flags[u] &= (uint8_t)~(UF_QUEUED | UF_CLAIMED | UF_WAIT | UF_WRITE);
    pg_unlock(p, u);
    pg_wake_units(p, u, 1);
}

/* Under ring_mu: push u (UF_INRING set) on the ring; out of memory, it leaves the ring's care (it
 * stays resident until a later install or write-back adds it again) and that is reported. */
void pg_ring_push_locked(dls_pager *p, uint64_t u) {
    int rc = pg_queue_push(&p->ring, (uint32_t)u);
    if (!rc) return;
    pg_lock(p, u);
    p->flags[u] &= (uint8_t)~(UF_INRING | UF_STREAM);
    pg_unlock(p, u);
    pg_fail(p, DLS_CALL_QUEUE, rc, u, 1);
}

void pg_ring_add(dls_pager *p, uint64_t u) {
    pg_lock(p, u);
    int add = !(p->flags[u] & UF_INRING);
    int stream = (p->flags[u] & UF_STREAM) && p->young_max;
    p->flags[u] |= UF_INRING;
    pg_unlock(p, u);
    if (!add) return;
    pthread_mutex_lock(&p->ring_mu);
    if (!stream) pg_ring_push_locked(p, u);
    else if (pg_queue_push(&p->young, (uint32_t)u)) pg_ring_push_locked(p, u); /* the ordinary way, then */
    pthread_mutex_unlock(&p->ring_mu);
}
