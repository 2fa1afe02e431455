/*
 * The C side of the ABI benchmark (tests/bench.rs runs it): in a store the Rust side filled,
 * times lookup + get of the whole unit of `N` tokens into one buffer, and the rate of an empty
 * lookup and of a missing one. Prints `name value` lines.
 *
 * usage: abi DATA_DIR N_TOKENS ITERATIONS
 */
#define _POSIX_C_SOURCE 200809L

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvstack.h"

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static void check(kvstack_result rc, const char *what) {
    if (rc == KVSTACK_OK) return;
    char msg[4096];
    size_t n;
    kvstack_last_error(msg, sizeof msg, &n);
    fprintf(stderr, "%s: %u: %s\n", what, (unsigned)rc, msg);
    exit(1);
}

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    if (argc != 4) return 2;
    size_t n = strtoull(argv[2], NULL, 10);
    int iters = atoi(argv[3]);
    kvstack_store_options o = {.size = sizeof o};
    check(kvstack_store_options_default(&o), "options");
    o.capacity_bytes = 1ull << 30;
    o.pool_capacity_bytes = 64u << 20;
    o.lock_memory = 0;
    o.read_only = 1;
    kvstack_store *store = NULL;
    check(kvstack_store_open(argv[1], &o, &store), "open");
    uint32_t *tokens = malloc(n * sizeof *tokens);
    for (size_t i = 0; i < n; i++) tokens[i] = ((uint32_t)i * 2654435761u) % 129280;
    kvstack_hit hit = {.size = sizeof hit};
    check(kvstack_store_lookup(store, "bench", tokens, n, &hit), "lookup");
    if (hit.tokens != n) {
        fprintf(stderr, "unit not found (%llu of %zu tokens)\n", (unsigned long long)hit.tokens, n);
        return 1;
    }
    unsigned char *buf = malloc(hit.payload_bytes);
    memset(buf, 0, hit.payload_bytes);
    double *t = malloc(sizeof(double) * (size_t)iters);
    kvstack_unit unit = {.size = sizeof unit};
    for (int i = -1; i < iters; i++) { /* one warm-up */
        double t0 = now();
        check(kvstack_store_lookup(store, "bench", tokens, n, &hit), "lookup");
        check(kvstack_store_get_unit(store, "bench", tokens, n, buf, hit.payload_bytes, NULL, 0,
                                     &unit),
              "get");
        double dt = now() - t0;
        if (unit.tokens != n) return 1;
        if (i >= 0) t[i] = dt;
    }
    qsort(t, (size_t)iters, sizeof *t, cmp);
    printf("lookup_get_median_ms %.3f\n", t[iters / 2] * 1e3);
    printf("lookup_get_min_ms %.3f\n", t[0] * 1e3);
    printf("payload_bytes %llu\n", (unsigned long long)hit.payload_bytes);

    /* Calls per second of an empty lookup (no tokens) and of a miss (one block, no unit). */
    for (int kind = 0; kind < 2; kind++) {
        size_t k = kind == 0 ? 0 : 256;
        long calls = 0;
        double t0 = now(), dt = 0;
        while (dt < 1.0) {
            for (int j = 0; j < 1000; j++) {
                check(kvstack_store_lookup(store, kind == 0 ? "bench" : "nobody", tokens, k, &hit),
                      "lookup");
            }
            calls += 1000;
            dt = now() - t0;
        }
        printf("%s_lookups_per_s %.0f\n", kind == 0 ? "empty" : "miss", (double)calls / dt);
    }
    kvstack_store_free(store);
    free(tokens);
    free(buf);
    free(t);
    return 0;
}
