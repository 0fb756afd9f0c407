/* What installing and dropping a fetched unit costs the kernel, per 4 KiB page, for the ways a
 * userfaultfd region could do it (issue 21).  One thread, no network: each 128 KiB run (the stream
 * workload's mean fetch run) is "received" by a memcpy, installed, and later dropped.
 *
 *   copy       the engine's way: receive into a bounce buffer, UFFDIO_COPY into the region (the
 *              kernel allocates, charges and copies each page), MADV_DONTNEED to drop it
 *   memfd      a memfd-backed region: receive straight into a second mapping of the page cache
 *              (each first touch allocates and zeroes a shmem page), UFFDIO_CONTINUE to map it,
 *              FALLOC_FL_PUNCH_HOLE to drop it
 *   memfd-pop  the same, the receive run populated first with one MADV_POPULATE_WRITE
 *   move       receive into a landing run, UFFDIO_MOVE its pages into the region (no copy, no
 *              allocation), and drop by moving them back to the landing run (recycled)
 *   wp         does UFFDIO_MOVE keep a page's userfaultfd write-protect bit?  (pagemap bit 57)
 *   evict-inplace, evict-move
 *              evicting a dirty page, as the engine's evictor does for an embedding table's scattered
 *              rows: batches of 64 random pages, each installed writable (UFFDIO_COPY) and written,
 *              then either write-protected and dropped in place one by one (UFFDIO_WRITEPROTECT,
 *              MADV_DONTNEED), or moved out one by one into a staging run (UFFDIO_MOVE) that is
 *              dropped once for the batch.  A second thread spins on another CPU meanwhile, as a
 *              program's other threads do, so every TLB flush must interrupt that CPU.
 *   evict-batch
 *              the same batches, each victim's bytes copied out and all 64 dropped by one
 *              process_madvise(MADV_DONTNEED) (recent kernels: 6.18 flushes once for the whole
 *              vector; older ones refuse the advice or flush per range).  NOT a safe eviction (a
 *              write between the copy and the drop would be lost): it measures what one flush for a
 *              batch would cost.
 *   a second argument "spin" runs copy and move with the other CPU spinning too (a flush's cost
 *   per call, not per page: compare runs of other sizes by changing RUN).
 *
 * Build and run:  cc -O2 -o /tmp/page_install bench/page_install.c && for m in copy memfd memfd-pop
 * move evict-inplace evict-move evict-batch; do /tmp/page_install $m; done; /tmp/page_install wp
 * Needs Linux 6.8+ for move, wp and evict-move (UFFD_FEATURE_MOVE), 5.19+ for evict-inplace (write-protect
 * on anonymous memory), 5.13+ for the others; the evict modes need 2 CPUs. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/userfaultfd.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif
#include "../csrc/uffd_compat.h" /* UFFDIO_MOVE where the uapi headers predate Linux 6.8 */

#define REGION (64ul << 20)
#define RUN (128ul << 10)
#define PASSES 8

static uint64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000ull + (uint64_t)t.tv_nsec;
}

static void die(const char *what) {
    fprintf(stderr, "%s: %s\n", what, strerror(errno));
    exit(1);
}

static int open_uffd(uint64_t features) {
    int fd = (int)syscall(SYS_userfaultfd, O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) die("userfaultfd");
    struct uffdio_api api = {.api = UFFD_API, .features = features};
    if (ioctl(fd, UFFDIO_API, &api)) die("UFFDIO_API");
    return fd;
}

static void reg(int fd, void *a, size_t n, uint64_t mode) {
    struct uffdio_register r = {.range = {(uintptr_t)a, n}, .mode = mode};
    if (ioctl(fd, UFFDIO_REGISTER, &r)) die("UFFDIO_REGISTER");
}

static void *anon(size_t n) {
    void *a = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (a == MAP_FAILED) die("mmap");
    madvise(a, n, MADV_NOHUGEPAGE);
    return a;
}

static void move(int fd, void *dst, void *src, size_t n) {
    struct uffdio_move m = {.dst = (uintptr_t)dst, .src = (uintptr_t)src, .len = n, .mode = UFFDIO_MOVE_MODE_DONTWAKE};
    if (ioctl(fd, UFFDIO_MOVE, &m)) die("UFFDIO_MOVE");
}

static volatile int spin_stop;

static void *spinner(void *arg) { /* this process's mm stays live on another CPU */
    cpu_set_t *cpu = arg;
    pthread_setaffinity_np(pthread_self(), sizeof *cpu, cpu);
    for (volatile uint64_t x = 0; !spin_stop; x++) {
    }
    return NULL;
}

/* Pins this thread to its first CPU and starts a thread spinning on the second. */
static pthread_t start_spinner(void) {
    static cpu_set_t other;
    cpu_set_t all, mine;
    CPU_ZERO(&mine);
    CPU_ZERO(&other);
    if (sched_getaffinity(0, sizeof all, &all)) die("sched_getaffinity");
    int first = -1, second = -1;
    for (int c = 0; c < CPU_SETSIZE && second < 0; c++)
        if (CPU_ISSET(c, &all)) {
            if (first < 0) first = c;
            else second = c;
        }
    if (second < 0) {
        fprintf(stderr, "needs 2 CPUs (one spins)\n");
        exit(1);
    }
    CPU_SET(first, &mine);
    CPU_SET(second, &other);
    if (sched_setaffinity(0, sizeof mine, &mine)) die("sched_setaffinity");
    pthread_t t;
    if (pthread_create(&t, NULL, spinner, &other)) die("pthread_create");
    return t;
}

static void stop_spinner(pthread_t t) {
    spin_stop = 1;
    pthread_join(t, NULL);
}

enum evict_mode { EVICT_INPLACE, EVICT_MOVE, EVICT_BATCH };

/* evict-*; the costs per page into *install and *drop, the pages into *pages. */
static void evict(enum evict_mode how, uint64_t *install, uint64_t *drop, double *pages) {
    enum { BATCH = 64, ROUNDS = 400 };
    const size_t npages = REGION / 4096;
    int moved = how == EVICT_MOVE;
    int fd = open_uffd(UFFD_FEATURE_PAGEFAULT_FLAG_WP | (moved ? UFFD_FEATURE_MOVE : 0));
    int pidfd = how == EVICT_BATCH ? (int)syscall(SYS_pidfd_open, getpid(), 0) : -1;
    if (how == EVICT_BATCH && pidfd < 0) die("pidfd_open");
    char *r = anon(REGION), *stage = anon(BATCH * 4096), *src = aligned_alloc(4096, 4096);
    memset(src, 7, 4096);
    reg(fd, r, REGION, UFFDIO_REGISTER_MODE_MISSING | UFFDIO_REGISTER_MODE_WP);
    if (moved) reg(fd, stage, BATCH * 4096, UFFDIO_REGISTER_MODE_MISSING | UFFDIO_REGISTER_MODE_WP); /* a move's destination */
    pthread_t t = start_spinner();
    srand(1);
    uint64_t n = 0, t0;
    for (int round = 0; round < ROUNDS; round++) {
        size_t v[BATCH];
        int k = 0;
        t0 = now_ns();
        for (int i = 0; i < BATCH; i++) { /* distinct pages: a copy onto one already there fails, skipped */
            v[k] = (size_t)rand() % npages;
            struct uffdio_copy c = {.dst = (uintptr_t)(r + v[k] * 4096), .src = (uintptr_t)src, .len = 4096,
                                    .mode = UFFDIO_COPY_MODE_DONTWAKE};
            if (ioctl(fd, UFFDIO_COPY, &c) == 0) k++;
            else if (errno != EEXIST) die("UFFDIO_COPY");
        }
        *install += now_ns() - t0;
        for (int i = 0; i < k; i++) r[v[i] * 4096] = 1; /* written: dirty */
        t0 = now_ns();
        if (how == EVICT_BATCH) {
            struct iovec iov[BATCH];
            for (int i = 0; i < k; i++) {
                memcpy(stage + (size_t)i * 4096, r + v[i] * 4096, 4096);
                iov[i] = (struct iovec){r + v[i] * 4096, 4096};
            }
            if (syscall(SYS_process_madvise, pidfd, iov, (size_t)k, MADV_DONTNEED, 0) != (long)k * 4096)
                die("process_madvise(MADV_DONTNEED)");
            *drop += now_ns() - t0;
            n += (uint64_t)k;
            continue;
        }
        for (int i = 0; i < k; i++) {
            if (moved) {
                move(fd, stage + (size_t)i * 4096, r + v[i] * 4096, 4096);
            } else {
                struct uffdio_writeprotect w = {.range = {(uintptr_t)(r + v[i] * 4096), 4096},
                                                .mode = UFFDIO_WRITEPROTECT_MODE_WP};
                if (ioctl(fd, UFFDIO_WRITEPROTECT, &w)) die("UFFDIO_WRITEPROTECT");
            }
        }
        if (moved) {
            if (madvise(stage, (size_t)k * 4096, MADV_DONTNEED)) die("MADV_DONTNEED");
        } else {
            for (int i = 0; i < k; i++)
                if (madvise(r + v[i] * 4096, 4096, MADV_DONTNEED)) die("MADV_DONTNEED");
        }
        *drop += now_ns() - t0;
        n += (uint64_t)k;
    }
    stop_spinner(t);
    if (pidfd >= 0) close(pidfd);
    *pages = (double)n;
}

static uint64_t pagemap(void *a) {
    int fd = open("/proc/self/pagemap", O_RDONLY);
    uint64_t e = 0;
    if (fd < 0 || pread(fd, &e, sizeof e, (off_t)((uintptr_t)a / 4096 * sizeof e)) != sizeof e) die("pagemap");
    close(fd);
    return e;
}

int main(int argc, char **argv) {
    const char *mode = argc > 1 ? argv[1] : "copy";
    int spin = argc > 2 && !strcmp(argv[2], "spin") && (!strcmp(mode, "copy") || !strcmp(mode, "move"));
    pthread_t spin_t = spin ? start_spinner() : 0;
    char *src = aligned_alloc(4096, RUN);
    memset(src, 7, RUN);
    uint64_t t, recv_ns = 0, install_ns = 0, drop_ns = 0;
    double pages = (double)PASSES * REGION / 4096;
    if (!strcmp(mode, "wp")) {
        int fd = open_uffd(UFFD_FEATURE_MOVE);
        char *r = anon(RUN), *land = anon(RUN);
        reg(fd, r, RUN, UFFDIO_REGISTER_MODE_MISSING | UFFDIO_REGISTER_MODE_WP);
        reg(fd, land, RUN, UFFDIO_REGISTER_MODE_WP);
        memcpy(land, src, RUN);
        struct uffdio_writeprotect w = {.range = {(uintptr_t)land, RUN}, .mode = UFFDIO_WRITEPROTECT_MODE_WP};
        if (ioctl(fd, UFFDIO_WRITEPROTECT, &w)) die("UFFDIO_WRITEPROTECT");
        int before = (int)(pagemap(land) >> 57 & 1);
        move(fd, r, land, RUN);
        printf("wp: write-protect bit before the move %d, after it %d (present %d)\n", before,
               (int)(pagemap(r) >> 57 & 1), (int)(pagemap(r) >> 63 & 1));
        return 0;
    }
    if (!strcmp(mode, "copy")) {
        int fd = open_uffd(0);
        char *r = anon(REGION), *bounce = anon(RUN);
        reg(fd, r, REGION, UFFDIO_REGISTER_MODE_MISSING);
        for (int p = 0; p < PASSES; p++) {
            for (size_t o = 0; o < REGION; o += RUN) {
                t = now_ns();
                memcpy(bounce, src, RUN);
                recv_ns += now_ns() - t;
                t = now_ns();
                struct uffdio_copy c = {.dst = (uintptr_t)(r + o), .src = (uintptr_t)bounce, .len = RUN,
                                        .mode = UFFDIO_COPY_MODE_DONTWAKE};
                if (ioctl(fd, UFFDIO_COPY, &c)) die("UFFDIO_COPY");
                install_ns += now_ns() - t;
            }
            for (size_t o = 0; o < REGION; o += RUN) {
                t = now_ns();
                madvise(r + o, RUN, MADV_DONTNEED);
                drop_ns += now_ns() - t;
            }
        }
    } else if (!strcmp(mode, "memfd") || !strcmp(mode, "memfd-pop")) {
        int fd = open_uffd(UFFD_FEATURE_MINOR_SHMEM);
        int mfd = memfd_create("region", MFD_CLOEXEC);
        if (mfd < 0 || ftruncate(mfd, (off_t)REGION)) die("memfd");
        char *r = mmap(NULL, REGION, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_NORESERVE, mfd, 0);
        char *shadow = mmap(NULL, REGION, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_NORESERVE, mfd, 0);
        if (r == MAP_FAILED || shadow == MAP_FAILED) die("mmap memfd");
        reg(fd, r, REGION, UFFDIO_REGISTER_MODE_MISSING | UFFDIO_REGISTER_MODE_MINOR);
        int pop = !strcmp(mode, "memfd-pop");
        for (int p = 0; p < PASSES; p++) {
            for (size_t o = 0; o < REGION; o += RUN) {
                t = now_ns();
                if (pop && madvise(shadow + o, RUN, MADV_POPULATE_WRITE)) die("MADV_POPULATE_WRITE");
                memcpy(shadow + o, src, RUN);
                recv_ns += now_ns() - t;
                t = now_ns();
                struct uffdio_continue c = {.range = {(uintptr_t)(r + o), RUN}, .mode = UFFDIO_CONTINUE_MODE_DONTWAKE};
                if (ioctl(fd, UFFDIO_CONTINUE, &c)) die("UFFDIO_CONTINUE");
                install_ns += now_ns() - t;
            }
            for (size_t o = 0; o < REGION; o += RUN) {
                t = now_ns();
                if (fallocate(mfd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, (off_t)o, (off_t)RUN)) die("punch");
                drop_ns += now_ns() - t;
            }
        }
    } else if (!strcmp(mode, "move")) {
        int fd = open_uffd(UFFD_FEATURE_MOVE);
        char *r = anon(REGION), *land = anon(RUN);
        reg(fd, r, REGION, UFFDIO_REGISTER_MODE_MISSING);
        reg(fd, land, RUN, UFFDIO_REGISTER_MODE_WP); /* a move's destination must be registered */
        memset(land, 1, RUN);
        for (int p = 0; p < PASSES; p++) {
            for (size_t o = 0; o < REGION; o += RUN) {
                if (o) { /* the run before goes back to the landing run: its drop, and the pages recycled */
                    t = now_ns();
                    move(fd, land, r + o - RUN, RUN);
                    drop_ns += now_ns() - t;
                }
                t = now_ns();
                memcpy(land, src, RUN);
                recv_ns += now_ns() - t;
                t = now_ns();
                move(fd, r + o, land, RUN);
                install_ns += now_ns() - t;
            }
            t = now_ns();
            move(fd, land, r + REGION - RUN, RUN);
            drop_ns += now_ns() - t;
        }
    } else if (!strcmp(mode, "evict-inplace") || !strcmp(mode, "evict-move") || !strcmp(mode, "evict-batch")) {
        evict(!strcmp(mode, "evict-move") ? EVICT_MOVE : !strcmp(mode, "evict-batch") ? EVICT_BATCH : EVICT_INPLACE,
              &install_ns, &drop_ns, &pages);
    } else {
        fprintf(stderr, "usage: %s copy|memfd|memfd-pop|move|wp|evict-inplace|evict-move|evict-batch [spin]\n", argv[0]);
        return 2;
    }
    if (spin) stop_spinner(spin_t);
    printf("%-13s%s ns per 4 KiB page: receive %5.0f  install %5.0f  drop %5.0f  total %5.0f\n", mode,
           spin ? " (spin)" : "",
           recv_ns / pages, install_ns / pages, drop_ns / pages, (recv_ns + install_ns + drop_ns) / pages);
    return 0;
}
