/*
 * Helpers of the C tests: CHECK aborts the test with the failed expression, the result code
 * and the library's last error.
 */
#ifndef KVSTACK_TEST_CHECK_H
#define KVSTACK_TEST_CHECK_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvstack.h"

static inline const char *last_error(void) {
    static _Thread_local char buf[4096];
    size_t n = 0;
    buf[0] = 0;
    kvstack_last_error(buf, sizeof buf, &n);
    return buf;
}

static inline const char *code_name(kvstack_result rc) {
    static _Thread_local char buf[256];
    size_t n = 0;
    kvstack_result_describe(rc, buf, sizeof buf, &n);
    return buf;
}

#define CHECK(cond)                                                                     \
    do {                                                                                \
        if (!(cond)) {                                                                  \
            fprintf(stderr, "%s:%d: check failed: %s (last error: %s)\n", __FILE__,     \
                    __LINE__, #cond, last_error());                                     \
            exit(1);                                                                    \
        }                                                                               \
    } while (0)

/* A call that must return `want`. */
#define EXPECT_RC(call, want)                                                           \
    do {                                                                                \
        kvstack_result rc_ = (call);                                                    \
        if (rc_ != (want)) {                                                            \
            fprintf(stderr, "%s:%d: %s gave %u (%s), want %u (last error: %s)\n",       \
                    __FILE__, __LINE__, #call, (unsigned)rc_, code_name(rc_),           \
                    (unsigned)(want), last_error());                                    \
            exit(1);                                                                    \
        }                                                                               \
    } while (0)

#define OK(call) EXPECT_RC(call, KVSTACK_OK)

/* The last error must contain `part`. */
#define EXPECT_ERROR_HAS(part)                                                          \
    do {                                                                                \
        const char *e_ = last_error();                                                  \
        if (strstr(e_, (part)) == NULL) {                                               \
            fprintf(stderr, "%s:%d: last error \"%s\" lacks \"%s\"\n", __FILE__,        \
                    __LINE__, e_, (part));                                              \
            exit(1);                                                                    \
        }                                                                               \
    } while (0)

/* Store options small enough for a test directory, with plain (unlocked) memory. */
static inline kvstack_store_options test_store_options(void) {
    kvstack_store_options o = {.size = sizeof o};
    OK(kvstack_store_options_default(&o));
    o.segment_bytes = 8u << 20;
    o.capacity_bytes = 16 * o.segment_bytes;
    o.pool_capacity_bytes = 64u << 20;
    o.lock_memory = 0;
    o.huge_pages = 0;
    return o;
}

/* Engine options of the tests: the built-in tiny model, a short context, plain memory. */
static inline kvstack_engine_options test_engine_options(unsigned long long seed) {
    kvstack_engine_options o = {.size = sizeof o};
    OK(kvstack_engine_options_default(&o));
    o.seed = seed;
    o.context_limit = 8192;
    o.max_sequences = 4;
    o.chunk = 128;
    o.lock_memory = 0;
    o.huge_pages = 0;
    return o;
}

/* Deterministic bytes. */
static inline void fill(unsigned char *p, size_t n, unsigned long long seed) {
    unsigned long long x = seed * 0x9E3779B97F4A7C15ull | 1;
    for (size_t i = 0; i < n; i++) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        p[i] = (unsigned char)(x >> 32);
    }
}

/* A window snapshot of a unit of `tokens` tokens as docs/tiers.md draws it (zero pending
 * state: the length is a multiple of the compress ratio), with rows from `seed`. */
static inline unsigned char *make_window(const kvstack_unit_layout *l, unsigned long long seed) {
    unsigned char *w = malloc(l->window_bytes);
    CHECK(w != NULL);
    memset(w, 0, l->window_bytes);
    memcpy(w, "KVWSNAP1", 8);
    unsigned long long tokens = l->tokens;
    memcpy(w + 8, &tokens, 8);
    unsigned int layers = (unsigned int)l->layers, rows = (unsigned int)l->window_rows;
    unsigned int sources = (unsigned int)l->kv_sources;
    memcpy(w + 16, &layers, 4);
    memcpy(w + 20, &rows, 4);
    memcpy(w + 24, &sources, 4);
    size_t row_bytes = l->window_bytes - 32 - 4 * l->kv_sources;
    fill(w + 32, row_bytes, seed);
    return w;
}

#endif
