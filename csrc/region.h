#ifndef DLSHARE_REGION_H
#define DLSHARE_REGION_H
/* Memory regions for slabs: page-aligned anonymous mappings, with huge pages
 * and mlock when asked (falling back, with the reason, when the system says
 * no), returned to the OS with munmap. */
#include <stddef.h>
#include <stdint.h>

#define DLS_REGION_HUGE 1
#define DLS_REGION_LOCK 2
#define DLS_REGION_POPULATE 4

typedef struct dls_region {
    void *base;
    uint64_t size;     /* mapped length, rounded up to the page size used */
    int flags;         /* the flags that took effect */
} dls_region;

/* Map a region of at least `size` bytes.  Returns 0, or -errno when even a
 * plain mapping fails.  A refused huge-page mapping or mlock is not an error:
 * it is left out of r->flags and explained in `reason` (empty otherwise). */
int dls_region_map(uint64_t size, int flags, dls_region *r, char *reason, size_t reason_len);
/* munmap (which unlocks it if it was locked); returns 0 or -errno. */
int dls_region_unmap(dls_region *r);
uint64_t dls_page_size(void);
/* 16 bytes from the kernel CSPRNG (getrandom); 0 or -errno. */
int dls_random_token(uint8_t *out);
#endif
