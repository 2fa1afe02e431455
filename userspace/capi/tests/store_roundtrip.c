/*
 * Store round trip: a unit put with its window snapshot is found by a lookup (per tier),
 * read back byte for byte after a size query, served as a shorter prefix, invisible to
 * another tenant, and still there (without its DRAM window) after a close and a reopen.
 *
 * Units are keyed by the model: reopened with another weights id or another config
 * (CONFIG_JSON, when given), the store finds none of them.
 *
 * usage: store_roundtrip DATA_DIR [CONFIG_JSON]
 */
#include "check.h"

#define N 1000

int main(int argc, char **argv) {
    CHECK(argc == 2 || argc == 3);
    const char *dir = argv[1];
    CHECK(kvstack_abi_version() == KVSTACK_ABI_VERSION);
    CHECK(strlen(kvstack_version()) > 0);

    kvstack_store_options o = test_store_options();
    kvstack_store *store = NULL;
    OK(kvstack_store_open(dir, &o, &store));
    CHECK(store != NULL);

    uint32_t tokens[N + 200];
    for (size_t i = 0; i < N + 200; i++) tokens[i] = (uint32_t)(i * 7 + 3);

    kvstack_unit_layout layout = {.size = sizeof layout};
    OK(kvstack_store_unit_layout(store, N, &layout));
    CHECK(layout.tokens == N && layout.page_tokens == 256 && layout.align == 2);
    CHECK(layout.blocks == 4);
    CHECK(layout.payload_bytes > 3 * layout.block_bytes);
    CHECK(layout.payload_bytes < 4 * layout.block_bytes);
    unsigned char *payload = malloc(layout.payload_bytes);
    CHECK(payload != NULL);
    fill(payload, layout.payload_bytes, 1);
    unsigned char *window = make_window(&layout, 2);

    OK(kvstack_store_put_unit(store, "tenant-a", tokens, N, payload, layout.payload_bytes,
                              window, layout.window_bytes, true));

    /* The longest stored prefix of a longer request is the unit, served by both tiers. */
    kvstack_hit hit = {.size = sizeof hit};
    OK(kvstack_store_lookup(store, "tenant-a", tokens, N + 200, &hit));
    CHECK(hit.tokens == N && hit.ssd_tokens == N);
    CHECK(hit.dram_window_tokens == layout.window_rows);
    CHECK(hit.blocks == 4);
    CHECK(hit.payload_bytes == layout.payload_bytes);
    CHECK(hit.window_bytes >= layout.window_bytes);

    /* Size query, then the read: the same bytes. */
    kvstack_unit unit = {.size = sizeof unit};
    EXPECT_RC(kvstack_store_get_unit(store, "tenant-a", tokens, N + 200, NULL, 0, NULL, 0, &unit),
              KVSTACK_BUFFER_TOO_SMALL);
    CHECK(unit.tokens == N && unit.payload_bytes == layout.payload_bytes);
    unsigned char *got = malloc(unit.payload_bytes);
    unsigned char *got_window = malloc(hit.window_bytes);
    CHECK(got != NULL && got_window != NULL);
    OK(kvstack_store_get_unit(store, "tenant-a", tokens, N + 200, got, unit.payload_bytes,
                              got_window, hit.window_bytes, &unit));
    CHECK(unit.tokens == N && unit.blocks == 4);
    CHECK(unit.payload_bytes == layout.payload_bytes);
    CHECK(memcmp(got, payload, layout.payload_bytes) == 0);
    CHECK(unit.window_bytes == layout.window_bytes);
    CHECK(memcmp(got_window, window, layout.window_bytes) == 0);

    /* Without a window buffer, the payload alone. */
    memset(got, 0, layout.payload_bytes);
    OK(kvstack_store_get_unit(store, "tenant-a", tokens, N, got, layout.payload_bytes, NULL, 0,
                              &unit));
    CHECK(unit.tokens == N && unit.window_bytes == 0);
    CHECK(memcmp(got, payload, layout.payload_bytes) == 0);

    /* A request sharing 600 tokens gets the two whole blocks it shares. */
    OK(kvstack_store_lookup(store, "tenant-a", tokens, 600, &hit));
    CHECK(hit.tokens == 512 && hit.blocks == 2 && hit.dram_window_tokens == 0);
    CHECK(hit.payload_bytes == 2 * layout.block_bytes);
    memset(got, 0, layout.payload_bytes);
    OK(kvstack_store_get_unit(store, "tenant-a", tokens, 600, got, layout.payload_bytes, NULL, 0,
                              &unit));
    CHECK(unit.tokens == 512 && unit.payload_bytes == 2 * layout.block_bytes);
    CHECK(memcmp(got, payload, unit.payload_bytes) == 0);

    /* Another tenant sees nothing, and its read writes nothing. */
    OK(kvstack_store_lookup(store, "tenant-b", tokens, N, &hit));
    CHECK(hit.tokens == 0 && hit.payload_bytes == 0);
    memset(got, 0xA5, layout.payload_bytes);
    OK(kvstack_store_get_unit(store, "tenant-b", tokens, N, got, layout.payload_bytes, NULL, 0,
                              &unit));
    CHECK(unit.tokens == 0 && unit.payload_bytes == 0);
    for (size_t i = 0; i < layout.payload_bytes; i++) CHECK(got[i] == 0xA5);

    kvstack_tier_stats st = {.size = sizeof st};
    OK(kvstack_store_stats(store, &st));
    CHECK(st.units >= 1 && st.units_written >= 1 && st.blocks == 4);
    CHECK(st.lookups >= 4 && st.hits >= 3);
    CHECK(st.pool_entries == 1 && st.pool_hits >= 1);
    CHECK(st.poisoned == 0);

    /* Durable: after a close and a reopen the unit is there; the DRAM pool is not. */
    OK(kvstack_store_close(store));
    kvstack_store_free(store);
    store = NULL;
    OK(kvstack_store_open(dir, &o, &store));
    OK(kvstack_store_stats(store, &st));
    CHECK(st.recovered_units >= 1);
    OK(kvstack_store_lookup(store, "tenant-a", tokens, N, &hit));
    CHECK(hit.tokens == N && hit.dram_window_tokens == 0 && hit.window_bytes == 0);
    memset(got, 0, layout.payload_bytes);
    memset(got_window, 0, hit.window_bytes > 0 ? hit.window_bytes : 1);
    OK(kvstack_store_get_unit(store, "tenant-a", tokens, N, got, layout.payload_bytes, got_window,
                              layout.window_bytes, &unit));
    CHECK(unit.tokens == N && unit.window_bytes == 0);
    CHECK(memcmp(got, payload, layout.payload_bytes) == 0);

    /* Not durable: the put returns at once; a flush makes it visible. */
    uint32_t other[512];
    for (size_t i = 0; i < 512; i++) other[i] = (uint32_t)(i * 11 + 5);
    OK(kvstack_store_unit_layout(store, 512, &layout));
    fill(payload, layout.payload_bytes, 3);
    OK(kvstack_store_put_unit(store, "tenant-b", other, 512, payload, layout.payload_bytes, NULL,
                              0, false));
    OK(kvstack_store_flush(store));
    OK(kvstack_store_lookup(store, "tenant-b", other, 512, &hit));
    CHECK(hit.tokens == 512 && hit.dram_window_tokens == 0);

    OK(kvstack_store_close(store));
    kvstack_store_free(store);

    /* Another model's store in the same directory sees none of these units. */
    kvstack_store_options model = o;
    static const uint8_t weights[] = "other weights";
    model.weights_id = weights;
    model.weights_id_len = sizeof weights - 1;
    OK(kvstack_store_open(dir, &model, &store));
    OK(kvstack_store_lookup(store, "tenant-a", tokens, N, &hit));
    CHECK(hit.tokens == 0);
    kvstack_store_free(store);
    if (argc == 3) {
        model = o;
        model.config_path = argv[2];
        OK(kvstack_store_open(dir, &model, &store));
        OK(kvstack_store_lookup(store, "tenant-a", tokens, N, &hit));
        CHECK(hit.tokens == 0);
        kvstack_store_free(store);
    }
    /* And the original model still finds them. */
    OK(kvstack_store_open(dir, &o, &store));
    OK(kvstack_store_lookup(store, "tenant-a", tokens, N, &hit));
    CHECK(hit.tokens == N);

    /* A delete is durable when it returns: gone from both tiers, before and after a reopen;
       another tenant's unit of the same tokens stays. */
    EXPECT_RC(kvstack_store_delete(store, "tenant-c", other, 512), KVSTACK_STORE_NOT_FOUND);
    OK(kvstack_store_delete(store, "tenant-b", other, 512));
    OK(kvstack_store_lookup(store, "tenant-b", other, 512, &hit));
    CHECK(hit.tokens == 0 && hit.dram_window_tokens == 0);
    EXPECT_RC(kvstack_store_delete(store, "tenant-b", other, 512), KVSTACK_STORE_NOT_FOUND);
    EXPECT_ERROR_HAS("no unit of these tokens");
    OK(kvstack_store_lookup(store, "tenant-a", tokens, N, &hit));
    CHECK(hit.tokens == N);
    kvstack_store_free(store);
    OK(kvstack_store_open(dir, &o, &store));
    OK(kvstack_store_lookup(store, "tenant-b", other, 512, &hit));
    CHECK(hit.tokens == 0);
    OK(kvstack_store_lookup(store, "tenant-a", tokens, N, &hit));
    CHECK(hit.tokens == N);
    kvstack_store_free(store);
    free(payload);
    free(window);
    free(got);
    free(got_window);
    printf("store round trip: ok\n");
    return 0;
}
