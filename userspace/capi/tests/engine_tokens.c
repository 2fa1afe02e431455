/*
 * The engine through the C ABI: three turns of one session (greedy, greedy, top-p), driven
 * by kvstack_session_step with a small output buffer, printed one line per turn for the
 * Rust side to compare with kvstack_engine::Service on the same seed. With a data directory
 * the session releases its KV between turns and the next turn restores it from the tiers.
 *
 * With CONFIG and WEIGHTS the model is that checkpoint instead of the built-in one.
 *
 * usage: engine_tokens SEED DATA_DIR|- [CONFIG WEIGHTS]
 */
#include "check.h"

static void turn(kvstack_session *s, const uint32_t *in, size_t n, const kvstack_request_params *p,
                 const char *name) {
    OK(kvstack_session_submit(s, in, n, p));
    uint32_t out[256];
    size_t got = 0, k = 0;
    bool done = false;
    for (int steps = 0; !done; steps++) {
        CHECK(steps < 100000);
        /* At most 3 tokens a call: the rest waits in the session for the next one. */
        size_t room = sizeof out / sizeof out[0] - got;
        OK(kvstack_session_step(s, out + got, room < 3 ? room : 3, &k, &done));
        got += k;
    }
    CHECK(got == p->max_new_tokens);
    printf("%s:", name);
    for (size_t i = 0; i < got; i++) printf(" %u", out[i]);
    printf("\n");
}

int main(int argc, char **argv) {
    CHECK(argc == 3 || argc == 5);
    kvstack_engine_options o = test_engine_options(strtoull(argv[1], NULL, 10));
    const char *config = NULL;
    if (argc == 5) {
        config = argv[3];
        o.weights_path = argv[4];
    }
    if (strcmp(argv[2], "-") != 0) {
        o.data_dir = argv[2];
        o.keep_live = 0;
        o.store_segment_bytes = 8u << 20;
        o.store_capacity_bytes = 16 * o.store_segment_bytes;
        o.pool_capacity_bytes = 64u << 20;
    }
    kvstack_engine *engine = NULL;
    OK(kvstack_engine_new(config, &o, &engine));
    kvstack_session *s = NULL;
    OK(kvstack_session_new(engine, "tenant", &s));

    uint32_t prompt[300], more[50];
    for (uint32_t i = 0; i < 300; i++) prompt[i] = (i * 131 + 7) % 1024;
    for (uint32_t i = 0; i < 50; i++) more[i] = (i * 17 + 400) % 1024;
    kvstack_request_params p = {.size = sizeof p};
    OK(kvstack_request_params_default(&p));
    p.max_new_tokens = 8;
    turn(s, prompt, 300, &p, "turn1");
    p.max_new_tokens = 5;
    turn(s, more, 50, &p, "turn2");
    p.max_new_tokens = 6;
    p.sampling = KVSTACK_SAMPLING_TOP_P;
    p.temperature = 0.8f;
    p.top_p = 0.9f;
    p.seed = 77;
    turn(s, prompt, 20, &p, "turn3");

    OK(kvstack_engine_flush(engine));
    kvstack_session_free(s);
    kvstack_engine_free(engine);
    return 0;
}
