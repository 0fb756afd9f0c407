/* A donor's slab memory; see slab_memory.h. */
#define _GNU_SOURCE
#include "slab_memory.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <unistd.h>

#define HUGE_2M (2ull << 20)

uint64_t dls_page_size(void) { return (uint64_t)sysconf(_SC_PAGESIZE); }

static uint64_t round_up(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

int dls_slab_mem_map(uint64_t size, int flags, dls_slab_mem *r, char *reason, size_t reason_len) {
    memset(r, 0, sizeof *r);
    if (reason_len) reason[0] = 0;
    if (size == 0) return -EINVAL;
    int base_flags = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE;
    if (flags & DLS_SLAB_MEM_POPULATE) base_flags |= MAP_POPULATE;
    void *p = MAP_FAILED;
    if (flags & DLS_SLAB_MEM_HUGE) {
        uint64_t hsize = round_up(size, HUGE_2M);
        /* without MAP_NORESERVE, so that a shortage of huge pages fails here and
         * not as SIGBUS on first touch */
        p = mmap(NULL, hsize, PROT_READ | PROT_WRITE, (base_flags & ~MAP_NORESERVE) | MAP_HUGETLB, -1, 0);
        if (p != MAP_FAILED) {
            r->size = hsize;
            r->flags |= DLS_SLAB_MEM_HUGE;
        } else if (reason_len) {
            snprintf(reason, reason_len, "MAP_HUGETLB refused (%s; see /proc/sys/vm/nr_hugepages); using normal pages",
                     strerror(errno));
        }
    }
    if (p == MAP_FAILED) {
        uint64_t psize = round_up(size, dls_page_size());
        p = mmap(NULL, psize, PROT_READ | PROT_WRITE, base_flags, -1, 0);
        if (p == MAP_FAILED) return -errno;
        r->size = psize;
        if ((flags & DLS_SLAB_MEM_HUGE) && madvise(p, psize, MADV_HUGEPAGE) != 0 && reason_len) {
            /* transparent huge pages as the next best thing, when the kernel has them */
            size_t n = strlen(reason);
            snprintf(reason + n, reason_len - n, "%sMADV_HUGEPAGE refused (%s)", n ? "; " : "", strerror(errno));
        }
    }
    r->base = p;
    if (flags & DLS_SLAB_MEM_POPULATE) r->flags |= DLS_SLAB_MEM_POPULATE;
    if (flags & DLS_SLAB_MEM_LOCK) {
        if (mlock(p, r->size) == 0) {
            r->flags |= DLS_SLAB_MEM_LOCK;
        } else if (reason_len) {
            size_t n = strlen(reason);
            snprintf(reason + n, reason_len - n, "%smlock refused (%s; raise RLIMIT_MEMLOCK or grant CAP_IPC_LOCK); unlocked",
                     n ? "; " : "", strerror(errno));
        }
    }
    return 0;
}

int dls_slab_mem_unmap(dls_slab_mem *r) {
    if (!r->base) return 0;
    /* munmap unlocks a locked range itself */
    int rc = munmap(r->base, r->size) == 0 ? 0 : -errno;
    if (rc == 0) {
        r->base = NULL;
        r->size = 0;
    }
    return rc;
}

int dls_random_token(uint8_t *out) {
    size_t got = 0;
    while (got < 16) {
        ssize_t n = getrandom(out + got, 16 - got, 0);
        if (n < 0) {
            if (errno == EINTR) continue;
            return -errno;
        }
        got += (size_t)n;
    }
    return 0;
}
