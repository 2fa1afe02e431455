/*
 * Misuse: every bad argument gets its own code and a message naming it, nothing crashes, and
 * a failed call writes nothing it should not.
 *
 * usage: errors DATA_DIR
 */
#include <stdalign.h>

#include "check.h"

static void store_misuse(const char *dir) {
    kvstack_store_options o = test_store_options();
    kvstack_store *store = NULL, *second = (kvstack_store *)&o;
    kvstack_hit hit = {.size = sizeof hit};
    kvstack_unit unit = {.size = sizeof unit};
    uint32_t tokens[512];
    for (size_t i = 0; i < 512; i++) tokens[i] = (uint32_t)i;

    /* Opening. */
    EXPECT_RC(kvstack_store_open(NULL, &o, &store), KVSTACK_NULL_ARGUMENT);
    EXPECT_ERROR_HAS("`dir` is NULL");
    EXPECT_RC(kvstack_store_open(dir, &o, NULL), KVSTACK_NULL_ARGUMENT);
    EXPECT_RC(kvstack_store_open("", &o, &store), KVSTACK_INVALID_ARGUMENT);
    CHECK(store == NULL);
    kvstack_store_options bad = o;
    bad.size = 8;
    EXPECT_RC(kvstack_store_open(dir, &bad, &store), KVSTACK_INVALID_OPTION);
    EXPECT_ERROR_HAS("sizeof(kvstack_store_options)");
    bad = o;
    bad.page_tokens = 0;
    EXPECT_RC(kvstack_store_open(dir, &bad, &store), KVSTACK_INVALID_OPTION);
    bad = o;
    bad.segment_bytes = 1000;
    EXPECT_RC(kvstack_store_open(dir, &bad, &store), KVSTACK_INVALID_OPTION);
    EXPECT_ERROR_HAS("segment_bytes");
    bad = o;
    bad.config_path = "/nonexistent/config.json";
    EXPECT_RC(kvstack_store_open(dir, &bad, &store), KVSTACK_CONFIG);
    EXPECT_ERROR_HAS("/nonexistent/config.json");
    bad = o;
    bad.weights_id = NULL;
    bad.weights_id_len = 4;
    EXPECT_RC(kvstack_store_open(dir, &bad, &store), KVSTACK_NULL_ARGUMENT);
    CHECK(store == NULL);

    OK(kvstack_store_open(dir, &o, &store));
    /* One writer per directory, in this process too; the refused open leaves *out NULL. */
    EXPECT_RC(kvstack_store_open(dir, &o, &second), KVSTACK_STORE_IN_USE);
    CHECK(second == NULL);
    EXPECT_ERROR_HAS("in use");

    /* Handles, strings, arrays. */
    EXPECT_RC(kvstack_store_lookup(NULL, "t", tokens, 512, &hit), KVSTACK_NULL_ARGUMENT);
    EXPECT_ERROR_HAS("`store` is NULL");
    EXPECT_RC(kvstack_store_lookup(store, NULL, tokens, 512, &hit), KVSTACK_NULL_ARGUMENT);
    EXPECT_RC(kvstack_store_lookup(store, "", tokens, 512, &hit), KVSTACK_INVALID_ARGUMENT);
    EXPECT_RC(kvstack_store_lookup(store, "\xff\xfe", tokens, 512, &hit), KVSTACK_INVALID_UTF8);
    EXPECT_RC(kvstack_store_lookup(store, "t", NULL, 512, &hit), KVSTACK_NULL_ARGUMENT);
    EXPECT_RC(kvstack_store_lookup(store, "t", tokens, (size_t)KVSTACK_MAX_TOKENS + 1, &hit),
              KVSTACK_INVALID_ARGUMENT);
    EXPECT_RC(kvstack_store_lookup(store, "t", tokens, SIZE_MAX, &hit), KVSTACK_INVALID_ARGUMENT);
    alignas(4) unsigned char raw[16] = {0};
    EXPECT_RC(kvstack_store_lookup(store, "t", (const uint32_t *)(void *)(raw + 1), 2, &hit),
              KVSTACK_INVALID_ARGUMENT);
    EXPECT_ERROR_HAS("aligned");
    EXPECT_RC(kvstack_store_lookup(store, "t", tokens, 512, NULL), KVSTACK_NULL_ARGUMENT);
    kvstack_hit small = {.size = 0};
    EXPECT_RC(kvstack_store_lookup(store, "t", tokens, 512, &small), KVSTACK_INVALID_OPTION);
    EXPECT_ERROR_HAS("sizeof(kvstack_hit)");
    /* A tenant name without its NUL within the limit is refused, not read on. */
    char *long_name = malloc(KVSTACK_MAX_STRING_BYTES + 16);
    CHECK(long_name != NULL);
    memset(long_name, 'a', KVSTACK_MAX_STRING_BYTES + 15);
    long_name[KVSTACK_MAX_STRING_BYTES + 15] = 0;
    EXPECT_RC(kvstack_store_lookup(store, long_name, tokens, 512, &hit), KVSTACK_INVALID_ARGUMENT);
    free(long_name);
    /* An empty lookup is a miss, not an error. */
    OK(kvstack_store_lookup(store, "t", NULL, 0, &hit));
    CHECK(hit.tokens == 0);

    /* Puts: every shape is checked before anything is stored. */
    kvstack_unit_layout layout = {.size = sizeof layout};
    EXPECT_RC(kvstack_store_unit_layout(store, 511, &layout), KVSTACK_STORE_UNALIGNED);
    EXPECT_RC(kvstack_store_unit_layout(store, 0, &layout), KVSTACK_INVALID_ARGUMENT);
    OK(kvstack_store_unit_layout(store, 512, &layout));
    unsigned char *payload = malloc(layout.payload_bytes);
    CHECK(payload != NULL);
    fill(payload, layout.payload_bytes, 9);
    EXPECT_RC(kvstack_store_put_unit(store, "t", tokens, 512, payload, layout.payload_bytes - 1,
                                     NULL, 0, true),
              KVSTACK_STORE_PAYLOAD);
    EXPECT_ERROR_HAS("payload bytes given");
    EXPECT_RC(kvstack_store_put_unit(store, "t", tokens, 511, payload, layout.payload_bytes, NULL,
                                     0, true),
              KVSTACK_STORE_UNALIGNED);
    EXPECT_RC(kvstack_store_put_unit(store, "t", tokens, 0, payload, layout.payload_bytes, NULL, 0,
                                     true),
              KVSTACK_INVALID_ARGUMENT);
    EXPECT_RC(kvstack_store_put_unit(store, "t", tokens, 512, NULL, layout.payload_bytes, NULL, 0,
                                     true),
              KVSTACK_NULL_ARGUMENT);
    EXPECT_RC(kvstack_store_put_unit(store, "t", tokens, 512, payload, layout.payload_bytes,
                                     payload, 0, true),
              KVSTACK_INVALID_ARGUMENT);
    unsigned char garbage[64];
    memset(garbage, 7, sizeof garbage);
    EXPECT_RC(kvstack_store_put_unit(store, "t", tokens, 512, payload, layout.payload_bytes,
                                     garbage, sizeof garbage, true),
              KVSTACK_STORE_PAYLOAD);
    EXPECT_ERROR_HAS("window snapshot");
    OK(kvstack_store_lookup(store, "t", tokens, 512, &hit));
    CHECK(hit.tokens == 0);

    OK(kvstack_store_put_unit(store, "t", tokens, 512, payload, layout.payload_bytes, NULL, 0,
                              true));

    /* Short buffers: the size needed is reported and nothing is written. */
    unsigned char *got = malloc(layout.payload_bytes);
    CHECK(got != NULL);
    memset(got, 0x5A, layout.payload_bytes);
    EXPECT_RC(kvstack_store_get_unit(store, "t", tokens, 512, got, layout.payload_bytes - 1, NULL,
                                     0, &unit),
              KVSTACK_BUFFER_TOO_SMALL);
    CHECK(unit.tokens == 512 && unit.payload_bytes == layout.payload_bytes);
    EXPECT_ERROR_HAS("buffer `payload`");
    for (size_t i = 0; i < layout.payload_bytes; i++) CHECK(got[i] == 0x5A);
    EXPECT_RC(kvstack_store_get_unit(store, "t", tokens, 512, NULL, 10, NULL, 0, &unit),
              KVSTACK_NULL_ARGUMENT);
    EXPECT_RC(kvstack_store_get_unit(store, "t", tokens, 512, got, layout.payload_bytes, NULL, 0,
                                     NULL),
              KVSTACK_NULL_ARGUMENT);
    OK(kvstack_store_get_unit(store, "t", tokens, 512, got, layout.payload_bytes, NULL, 0, &unit));
    CHECK(memcmp(got, payload, layout.payload_bytes) == 0);

    /* Deletes check their arguments; one that names no stored unit says so. */
    EXPECT_RC(kvstack_store_delete(store, "t", NULL, 512), KVSTACK_NULL_ARGUMENT);
    EXPECT_RC(kvstack_store_delete(store, "t", tokens, 0), KVSTACK_INVALID_ARGUMENT);
    EXPECT_RC(kvstack_store_delete(store, "other", tokens, 512), KVSTACK_STORE_NOT_FOUND);
    EXPECT_RC(kvstack_store_delete(store, "t", tokens, 300), KVSTACK_STORE_NOT_FOUND);
    EXPECT_ERROR_HAS("no unit of these tokens");

    /* Stats need their size too. */
    kvstack_tier_stats st = {.size = sizeof st - 8};
    EXPECT_RC(kvstack_store_stats(store, &st), KVSTACK_INVALID_OPTION);
    EXPECT_RC(kvstack_store_stats(store, NULL), KVSTACK_NULL_ARGUMENT);

    /* A closed store: every call but close and free says so. */
    OK(kvstack_store_close(store));
    OK(kvstack_store_close(store));
    EXPECT_RC(kvstack_store_lookup(store, "t", tokens, 512, &hit), KVSTACK_CLOSED);
    EXPECT_ERROR_HAS("the store is closed");
    EXPECT_RC(kvstack_store_get_unit(store, "t", tokens, 512, got, layout.payload_bytes, NULL, 0,
                                     &unit),
              KVSTACK_CLOSED);
    EXPECT_RC(kvstack_store_put_unit(store, "t", tokens, 512, payload, layout.payload_bytes, NULL,
                                     0, true),
              KVSTACK_CLOSED);
    EXPECT_RC(kvstack_store_flush(store), KVSTACK_CLOSED);
    st.size = sizeof st;
    EXPECT_RC(kvstack_store_stats(store, &st), KVSTACK_CLOSED);
    kvstack_store_free(store);

    /* A read-only store reads and refuses writes. */
    kvstack_store_options ro = o;
    ro.read_only = 1;
    OK(kvstack_store_open(dir, &ro, &store));
    OK(kvstack_store_lookup(store, "t", tokens, 512, &hit));
    CHECK(hit.tokens == 512);
    EXPECT_RC(kvstack_store_put_unit(store, "t", tokens, 512, payload, layout.payload_bytes, NULL,
                                     0, true),
              KVSTACK_STORE_READ_ONLY);
    kvstack_store_free(store);

    free(payload);
    free(got);
}

static void strings_and_codes(void) {
    /* The last error: size query, a short buffer cuts it, reading does not clear it. */
    kvstack_hit hit = {.size = sizeof hit};
    EXPECT_RC(kvstack_store_lookup(NULL, "t", NULL, 0, &hit), KVSTACK_NULL_ARGUMENT);
    size_t n = 0;
    EXPECT_RC(kvstack_last_error(NULL, 0, &n), KVSTACK_BUFFER_TOO_SMALL);
    CHECK(n == strlen("argument `store` is NULL"));
    char small[9];
    memset(small, 'x', sizeof small);
    EXPECT_RC(kvstack_last_error(small, sizeof small, &n), KVSTACK_BUFFER_TOO_SMALL);
    CHECK(strcmp(small, "argument") == 0);
    EXPECT_RC(kvstack_last_error(NULL, 5, &n), KVSTACK_NULL_ARGUMENT);
    EXPECT_RC(kvstack_last_error(small, sizeof small, NULL), KVSTACK_NULL_ARGUMENT);
    CHECK(strcmp(last_error(), "argument `store` is NULL") == 0);
    /* A success clears it. */
    CHECK(strcmp(kvstack_version(), "") != 0);
    kvstack_store_options o = {.size = sizeof o};
    OK(kvstack_store_options_default(&o));
    CHECK(strcmp(last_error(), "") == 0);

    char buf[128];
    OK(kvstack_result_describe(KVSTACK_STORE_FULL, buf, sizeof buf, &n));
    CHECK(strncmp(buf, "KVSTACK_STORE_FULL: ", 20) == 0 && n == strlen(buf));
    OK(kvstack_result_describe(12345, buf, sizeof buf, &n));
    CHECK(strcmp(buf, "unknown kvstack result 12345") == 0);
    OK(kvstack_result_describe(KVSTACK_OK, buf, sizeof buf, &n));
    CHECK(strcmp(buf, "KVSTACK_OK: success") == 0);
    EXPECT_RC(kvstack_result_describe(KVSTACK_PANIC, buf, 4, &n), KVSTACK_BUFFER_TOO_SMALL);
    CHECK(strcmp(buf, "KVS") == 0 && n > 4);

    /* Freeing NULL is a no-op. */
    kvstack_store_free(NULL);
    kvstack_engine_free(NULL);
    kvstack_session_free(NULL);
}

static void engine_misuse(void) {
    kvstack_engine_options o = test_engine_options(11);
    kvstack_engine *engine = NULL;
    EXPECT_RC(kvstack_engine_new(NULL, &o, NULL), KVSTACK_NULL_ARGUMENT);
    kvstack_engine_options bad = o;
    bad.threads = 0;
    EXPECT_RC(kvstack_engine_new(NULL, &bad, &engine), KVSTACK_INVALID_OPTION);
    EXPECT_ERROR_HAS("threads");
    bad = o;
    bad.prefill = 7;
    EXPECT_RC(kvstack_engine_new(NULL, &bad, &engine), KVSTACK_INVALID_OPTION);
    bad = o;
    bad.weights_path = "/nonexistent/w.safetensors";
    EXPECT_RC(kvstack_engine_new(NULL, &bad, &engine), KVSTACK_INVALID_OPTION);
    EXPECT_RC(kvstack_engine_new("/nonexistent/config.json", &o, &engine), KVSTACK_INVALID_OPTION);
    EXPECT_RC(kvstack_engine_new("/nonexistent/config.json", &bad, &engine), KVSTACK_CONFIG);
    EXPECT_ERROR_HAS("/nonexistent/config.json");
    bad.size = 3;
    EXPECT_RC(kvstack_engine_new(NULL, &bad, &engine), KVSTACK_INVALID_OPTION);
    CHECK(engine == NULL);

    OK(kvstack_engine_new(NULL, &o, &engine));
    kvstack_session *s = NULL;
    EXPECT_RC(kvstack_session_new(NULL, "t", &s), KVSTACK_NULL_ARGUMENT);
    EXPECT_RC(kvstack_session_new(engine, "", &s), KVSTACK_INVALID_ARGUMENT);
    EXPECT_RC(kvstack_session_new(engine, "t", NULL), KVSTACK_NULL_ARGUMENT);
    OK(kvstack_session_new(engine, "t", &s));

    uint32_t prompt[40];
    for (size_t i = 0; i < 40; i++) prompt[i] = (uint32_t)(i * 13 + 1);
    kvstack_request_params p = {.size = sizeof p};
    OK(kvstack_request_params_default(&p));
    p.max_new_tokens = 3;
    EXPECT_RC(kvstack_session_submit(NULL, prompt, 40, &p), KVSTACK_NULL_ARGUMENT);
    EXPECT_RC(kvstack_session_submit(s, NULL, 40, &p), KVSTACK_NULL_ARGUMENT);
    EXPECT_RC(kvstack_session_submit(s, prompt, 0, &p), KVSTACK_INVALID_ARGUMENT);
    uint32_t outside[2] = {1, 4000000000u};
    EXPECT_RC(kvstack_session_submit(s, outside, 2, &p), KVSTACK_REQUEST_INVALID);
    EXPECT_ERROR_HAS("outside the vocabulary");
    kvstack_request_params bp = p;
    bp.max_new_tokens = 0;
    EXPECT_RC(kvstack_session_submit(s, prompt, 40, &bp), KVSTACK_REQUEST_INVALID);
    bp = p;
    bp.sampling = 9;
    EXPECT_RC(kvstack_session_submit(s, prompt, 40, &bp), KVSTACK_INVALID_OPTION);
    bp.sampling = KVSTACK_SAMPLING_TOP_P;
    bp.temperature = -1.0f;
    EXPECT_RC(kvstack_session_submit(s, prompt, 40, &bp), KVSTACK_INVALID_OPTION);
    bp.temperature = 1.0f;
    bp.top_p = 0.0f;
    EXPECT_RC(kvstack_session_submit(s, prompt, 40, &bp), KVSTACK_INVALID_OPTION);
    bp.max_new_tokens = 9000;
    bp.top_p = 1.0f;
    EXPECT_RC(kvstack_session_submit(s, prompt, 40, &bp), KVSTACK_REQUEST_INVALID);
    EXPECT_ERROR_HAS("context limit");

    OK(kvstack_session_submit(s, prompt, 40, &p));
    EXPECT_RC(kvstack_session_submit(s, prompt, 40, &p), KVSTACK_SESSION_BUSY);

    uint32_t out[8];
    size_t n = 0;
    bool done = true;
    EXPECT_RC(kvstack_session_step(s, NULL, 8, &n, &done), KVSTACK_NULL_ARGUMENT);
    EXPECT_RC(kvstack_session_step(s, out, 8, NULL, &done), KVSTACK_NULL_ARGUMENT);
    EXPECT_RC(kvstack_session_step(s, out, 8, &n, NULL), KVSTACK_NULL_ARGUMENT);
    EXPECT_RC(kvstack_session_poll(NULL, out, 8, &n, &done), KVSTACK_NULL_ARGUMENT);
    /* A poll with no room delivers nothing but says the request is not done. */
    OK(kvstack_session_poll(s, NULL, 0, &n, &done));
    CHECK(n == 0 && !done);

    /* Cancel mid-request: the session is idle again and takes a new request. */
    OK(kvstack_session_step(s, out, 8, &n, &done));
    bool cancelled = false;
    OK(kvstack_session_cancel(s, &cancelled));
    CHECK(cancelled);
    OK(kvstack_session_cancel(s, &cancelled));
    CHECK(!cancelled);
    OK(kvstack_session_cancel(s, NULL));
    OK(kvstack_session_poll(s, out, 8, &n, &done));
    CHECK(n == 0 && done);
    OK(kvstack_session_submit(s, prompt, 40, &p));
    size_t got = 0;
    done = false;
    for (int i = 0; i < 1000 && !done; i++) {
        OK(kvstack_session_step(s, out + got, 8 - got, &n, &done));
        got += n;
    }
    CHECK(done && got == 3);

    /* A session outliving its engine is closed, and still freed. */
    kvstack_session *orphan = NULL;
    OK(kvstack_session_new(engine, "u", &orphan));
    OK(kvstack_session_submit(orphan, prompt, 40, &p));
    kvstack_session_free(s);
    kvstack_engine_free(engine);
    EXPECT_RC(kvstack_session_submit(orphan, prompt, 40, &p), KVSTACK_CLOSED);
    EXPECT_RC(kvstack_session_step(orphan, out, 8, &n, &done), KVSTACK_CLOSED);
    EXPECT_ERROR_HAS("closed");
    EXPECT_RC(kvstack_session_cancel(orphan, NULL), KVSTACK_CLOSED);
    kvstack_session_free(orphan);
}

int main(int argc, char **argv) {
    CHECK(argc == 2);
    store_misuse(argv[1]);
    strings_and_codes();
    engine_misuse();
    printf("misuse: ok\n");
    return 0;
}
