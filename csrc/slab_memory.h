#ifndef DLSHARE_SLAB_MEMORY_H
#define DLSHARE_SLAB_MEMORY_H
/* A donor's slab memory: page-aligned anonymous mappings, with huge pages
 * and mlock when asked (falling back, with the reason, when the system says
 * no), returned to the OS with munmap. */
#include <stddef.h>
#include <stdint.h>

#define DLS_SLAB_MEM_HUGE 1
#define DLS_SLAB_MEM_LOCK 2
#define DLS_SLAB_MEM_POPULATE 4

typedef struct dls_slab_mem {
    void *base;
    uint64_t size;     /* mapped length, rounded up to the page size used */
    int flags;         /* the flags that took effect */
} dls_slab_mem;

/* Map at least `size` bytes.  Returns 0, or -errno when even a
 * plain mapping fails.  A refused huge-page mapping or mlock is not an error:
 * it is left out of r->flags and explained in `reason` (empty otherwise). */
int dls_slab_mem_map(uint64_t size, int flags, dls_slab_mem *r, char *reason, size_t reason_len);
/* munmap (which unlocks it if it was locked); returns 0 or -errno. */
int dls_slab_mem_unmap(dls_slab_mem *r);
uint64_t dls_page_size(void);
/* 16 bytes from the kernel CSPRNG (getrandom); 0 or -errno. */
int dls_random_token(uint8_t *out);
#endif
