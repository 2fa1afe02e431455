/*
 * Embedding kvstack in an inference engine, in one page:
 *   1. open the KV store of a model in a data directory,
 *   2. store the KV of a prefix your engine computed, look a longer prompt up, and read the
 *      stored prefix's bytes back (size query first),
 *   3. generate tokens with kvstack's own engine (the built-in tiny V4.1 model).
 *
 * Build: cc -std=c11 embed.c $(pkg-config --cflags --libs kvstack) -o embed
 * Run:   ./embed /tmp/kvstack-embed
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvstack.h"

/* Prints the failed call's code and the library's message (with its chain), and exits. */
static void check(kvstack_result rc, const char *what) {
    if (rc == KVSTACK_OK) return;
    char code[256], msg[4096];
    size_t n;
    kvstack_result_describe(rc, code, sizeof code, &n);
    kvstack_last_error(msg, sizeof msg, &n);
    fprintf(stderr, "%s: %s: %s\n", what, code, msg);
    exit(1);
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s DATA_DIR\n", argv[0]);
        return 2;
    }
    printf("libkvstack %s (ABI %u)\n", kvstack_version(), kvstack_abi_version());

    /* 1. The store of the built-in DeepSeek-V4.1-Flash config (config_path NULL). Every
     * struct starts with its size, so that it can grow without breaking this program. */
    kvstack_store_options so = {.size = sizeof so};
    check(kvstack_store_options_default(&so), "store options");
    so.pool_capacity_bytes = 64u << 20; /* DRAM window pool; 0 = 10% of RAM */
    kvstack_store *store = NULL;
    check(kvstack_store_open(argv[1], &so, &store), "open store");

    /* 2. KV of a 512-token prefix, in the stored formats (docs/formats.md): here a stand-in
     * for what your engine computed. */
    uint32_t prompt[600];
    for (uint32_t i = 0; i < 600; i++) prompt[i] = (i * 131 + 7) % 1024;
    kvstack_unit_layout layout = {.size = sizeof layout};
    check(kvstack_store_unit_layout(store, 512, &layout), "layout");
    unsigned char *kv = malloc(layout.payload_bytes);
    if (kv == NULL) return 1;
    for (uint64_t i = 0; i < layout.payload_bytes; i++) kv[i] = (unsigned char)(i * 7);
    check(kvstack_store_put_unit(store, "tenant-1", prompt, 512, kv, layout.payload_bytes, NULL, 0,
                                 true /* durable */),
          "put");

    /* A new request shares 512 of its 600 tokens: look it up, then read the prefix. */
    kvstack_hit hit = {.size = sizeof hit};
    check(kvstack_store_lookup(store, "tenant-1", prompt, 600, &hit), "lookup");
    printf("prefix found: %llu tokens (SSD %llu, DRAM window %llu), %llu bytes\n",
           (unsigned long long)hit.tokens, (unsigned long long)hit.ssd_tokens,
           (unsigned long long)hit.dram_window_tokens, (unsigned long long)hit.payload_bytes);
    kvstack_unit unit = {.size = sizeof unit};
    kvstack_result rc = kvstack_store_get_unit(store, "tenant-1", prompt, 600, NULL, 0, NULL, 0,
                                               &unit);
    if (rc != KVSTACK_BUFFER_TOO_SMALL) check(rc, "size query");
    unsigned char *got = malloc(unit.payload_bytes);
    if (got == NULL) return 1;
    check(kvstack_store_get_unit(store, "tenant-1", prompt, 600, got, unit.payload_bytes, NULL, 0,
                                 &unit),
          "get");
    printf("read %llu bytes of %llu tokens: %s\n", (unsigned long long)unit.payload_bytes,
           (unsigned long long)unit.tokens,
           memcmp(got, kv, unit.payload_bytes) == 0 ? "as stored" : "DIFFERENT");
    free(got);
    free(kv);
    check(kvstack_store_close(store), "close store");
    kvstack_store_free(store);

    /* 3. Generate with the engine: the built-in tiny model (config_path NULL). */
    kvstack_engine_options eo = {.size = sizeof eo};
    check(kvstack_engine_options_default(&eo), "engine options");
    eo.context_limit = 8192;
    kvstack_engine *engine = NULL;
    check(kvstack_engine_new(NULL, &eo, &engine), "engine");
    kvstack_session *session = NULL;
    check(kvstack_session_new(engine, "tenant-1", &session), "session");
    kvstack_request_params p = {.size = sizeof p};
    check(kvstack_request_params_default(&p), "params");
    p.max_new_tokens = 8;
    check(kvstack_session_submit(session, prompt, 600, &p), "submit");
    printf("generated:");
    bool done = false;
    while (!done) {
        uint32_t out[8];
        size_t n = 0;
        check(kvstack_session_step(session, out, 8, &n, &done), "step");
        for (size_t i = 0; i < n; i++) printf(" %u", out[i]);
    }
    printf("\n");
    kvstack_session_free(session);
    kvstack_engine_free(engine);
    return 0;
}
