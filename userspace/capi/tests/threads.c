/*
 * Threads: two threads drive their own sessions of one engine at once (each step batches
 * both), and get the tokens each prompt gets alone; four threads read one unit from a shared
 * store at once and get its bytes.
 *
 * usage: threads DATA_DIR
 */
#include <pthread.h>

#include "check.h"

#define NEW 6

struct job {
    kvstack_engine *engine;
    const char *tenant;
    uint32_t prompt[200];
    size_t n;
    uint32_t out[NEW];
};

static void run_session(kvstack_engine *engine, const char *tenant, const uint32_t *prompt,
                        size_t n, uint32_t *out) {
    kvstack_session *s = NULL;
    OK(kvstack_session_new(engine, tenant, &s));
    kvstack_request_params p = {.size = sizeof p};
    OK(kvstack_request_params_default(&p));
    p.max_new_tokens = NEW;
    OK(kvstack_session_submit(s, prompt, n, &p));
    size_t got = 0, k = 0;
    bool done = false;
    for (int i = 0; !done; i++) {
        CHECK(i < 100000);
        OK(kvstack_session_step(s, out + got, NEW - got, &k, &done));
        got += k;
    }
    CHECK(got == NEW);
    kvstack_session_free(s);
}

static void *session_thread(void *arg) {
    struct job *j = arg;
    run_session(j->engine, j->tenant, j->prompt, j->n, j->out);
    return NULL;
}

struct reader {
    kvstack_store *store;
    const uint32_t *tokens;
    size_t n;
    const unsigned char *want;
    size_t bytes;
};

static void *read_thread(void *arg) {
    struct reader *r = arg;
    unsigned char *buf = malloc(r->bytes);
    CHECK(buf != NULL);
    for (int i = 0; i < 5; i++) {
        kvstack_unit unit = {.size = sizeof unit};
        kvstack_hit hit = {.size = sizeof hit};
        OK(kvstack_store_lookup(r->store, "shared", r->tokens, r->n, &hit));
        CHECK(hit.tokens == r->n);
        memset(buf, 0, r->bytes);
        OK(kvstack_store_get_unit(r->store, "shared", r->tokens, r->n, buf, r->bytes, NULL, 0,
                                  &unit));
        CHECK(unit.tokens == r->n && unit.payload_bytes == r->bytes);
        CHECK(memcmp(buf, r->want, r->bytes) == 0);
    }
    free(buf);
    return NULL;
}

int main(int argc, char **argv) {
    CHECK(argc == 2);
    kvstack_engine_options o = test_engine_options(5);
    kvstack_engine *engine = NULL;
    OK(kvstack_engine_new(NULL, &o, &engine));

    struct job jobs[2] = {{.engine = engine, .tenant = "a", .n = 200},
                          {.engine = engine, .tenant = "b", .n = 150}};
    for (size_t k = 0; k < 2; k++)
        for (size_t i = 0; i < jobs[k].n; i++) jobs[k].prompt[i] = (uint32_t)((i * 37 + 11 * k) % 1024);
    pthread_t t[2];
    for (int k = 0; k < 2; k++) CHECK(pthread_create(&t[k], NULL, session_thread, &jobs[k]) == 0);
    for (int k = 0; k < 2; k++) CHECK(pthread_join(t[k], NULL) == 0);
    /* Each prompt alone, on this thread: the same tokens. */
    for (int k = 0; k < 2; k++) {
        uint32_t alone[NEW];
        run_session(engine, jobs[k].tenant, jobs[k].prompt, jobs[k].n, alone);
        CHECK(memcmp(alone, jobs[k].out, sizeof alone) == 0);
    }
    kvstack_engine_free(engine);

    kvstack_store_options so = test_store_options();
    kvstack_store *store = NULL;
    OK(kvstack_store_open(argv[1], &so, &store));
    uint32_t tokens[768];
    for (size_t i = 0; i < 768; i++) tokens[i] = (uint32_t)(i * 3 + 1);
    kvstack_unit_layout layout = {.size = sizeof layout};
    OK(kvstack_store_unit_layout(store, 768, &layout));
    unsigned char *payload = malloc(layout.payload_bytes);
    CHECK(payload != NULL);
    fill(payload, layout.payload_bytes, 21);
    OK(kvstack_store_put_unit(store, "shared", tokens, 768, payload, layout.payload_bytes, NULL, 0,
                              true));
    struct reader r = {store, tokens, 768, payload, layout.payload_bytes};
    pthread_t rt[4];
    for (int k = 0; k < 4; k++) CHECK(pthread_create(&rt[k], NULL, read_thread, &r) == 0);
    for (int k = 0; k < 4; k++) CHECK(pthread_join(rt[k], NULL) == 0);
    OK(kvstack_store_close(store));
    kvstack_store_free(store);
    free(payload);
    printf("threads: ok\n");
    return 0;
}
