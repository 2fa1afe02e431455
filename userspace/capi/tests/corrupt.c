/*
 * Damage: a unit whose segment file is overwritten under it is a miss (or its undamaged
 * prefix), never damaged bytes; bytes already copied are zeroed; the damage is counted; after
 * a reopen, recovery does not trust the unit.
 *
 * usage: corrupt DATA_DIR
 */
#define _POSIX_C_SOURCE 200809L

#include <dirent.h>
#include <fcntl.h>
#include <unistd.h>

#include "check.h"

#define N 768

/* Overwrites 4 KiB of every segment file at `offset` (inside the second block's record). */
static int damage(const char *dir, long offset) {
    DIR *d = opendir(dir);
    CHECK(d != NULL);
    int hit = 0;
    struct dirent *e;
    unsigned char junk[4096];
    memset(junk, 0xEE, sizeof junk);
    while ((e = readdir(d)) != NULL) {
        if (strncmp(e->d_name, "seg-", 4) != 0) continue;
        char path[4096];
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        int fd = open(path, O_WRONLY);
        CHECK(fd >= 0);
        CHECK(pwrite(fd, junk, sizeof junk, offset) == (ssize_t)sizeof junk);
        CHECK(fsync(fd) == 0);
        close(fd);
        hit++;
    }
    closedir(d);
    return hit;
}

/* Every byte is either the fill or zero: none of the unit's bytes reached the buffer. */
static void untouched_or_zeroed(const unsigned char *buf, size_t n) {
    for (size_t i = 0; i < n; i++) CHECK(buf[i] == 0x5A || buf[i] == 0);
}

int main(int argc, char **argv) {
    CHECK(argc == 2);
    kvstack_store_options o = test_store_options();
    kvstack_store *store = NULL;
    OK(kvstack_store_open(argv[1], &o, &store));
    uint32_t tokens[N];
    for (size_t i = 0; i < N; i++) tokens[i] = (uint32_t)(i * 5 + 2);
    kvstack_unit_layout layout = {.size = sizeof layout};
    OK(kvstack_store_unit_layout(store, N, &layout));
    unsigned char *payload = malloc(layout.payload_bytes), *buf = malloc(layout.payload_bytes);
    CHECK(payload != NULL && buf != NULL);
    fill(payload, layout.payload_bytes, 4);
    OK(kvstack_store_put_unit(store, "t", tokens, N, payload, layout.payload_bytes, NULL, 0, true));
    kvstack_unit unit = {.size = sizeof unit};
    OK(kvstack_store_get_unit(store, "t", tokens, N, buf, layout.payload_bytes, NULL, 0, &unit));
    CHECK(unit.tokens == N && memcmp(buf, payload, layout.payload_bytes) == 0);

    /* The segment header takes 4 KiB, then one record per block of about block_bytes. */
    long second_block = 4096 + (long)layout.block_bytes + (long)layout.block_bytes / 2;
    CHECK(damage(argv[1], second_block) >= 1);

    /* The first block reads fine, the second fails its CRC: a miss, the copied block zeroed. */
    memset(buf, 0x5A, layout.payload_bytes);
    OK(kvstack_store_get_unit(store, "t", tokens, N, buf, layout.payload_bytes, NULL, 0, &unit));
    CHECK(unit.tokens == 0 && unit.payload_bytes == 0);
    untouched_or_zeroed(buf, layout.payload_bytes);
    kvstack_tier_stats st = {.size = sizeof st};
    OK(kvstack_store_stats(store, &st));
    CHECK(st.damaged_reads >= 1);

    /* The damaged block is hidden: what is still found is the undamaged prefix, exactly. */
    kvstack_hit hit = {.size = sizeof hit};
    OK(kvstack_store_lookup(store, "t", tokens, N, &hit));
    CHECK(hit.tokens < N);
    if (hit.tokens > 0) {
        memset(buf, 0x5A, layout.payload_bytes);
        OK(kvstack_store_get_unit(store, "t", tokens, N, buf, layout.payload_bytes, NULL, 0,
                                  &unit));
        CHECK(unit.tokens == hit.tokens);
        CHECK(memcmp(buf, payload, unit.payload_bytes) == 0);
        untouched_or_zeroed(buf + unit.payload_bytes, layout.payload_bytes - unit.payload_bytes);
    }
    OK(kvstack_store_close(store));
    kvstack_store_free(store);

    /* Recovery sees the damage and does not trust the unit. */
    OK(kvstack_store_open(argv[1], &o, &store));
    OK(kvstack_store_stats(store, &st));
    CHECK(st.recovered_damage >= 1);
    OK(kvstack_store_lookup(store, "t", tokens, N, &hit));
    CHECK(hit.tokens < N);
    memset(buf, 0x5A, layout.payload_bytes);
    OK(kvstack_store_get_unit(store, "t", tokens, N, buf, layout.payload_bytes, NULL, 0, &unit));
    CHECK(unit.tokens == hit.tokens);
    CHECK(memcmp(buf, payload, unit.payload_bytes) == 0);
    untouched_or_zeroed(buf + unit.payload_bytes, layout.payload_bytes - unit.payload_bytes);
    kvstack_store_free(store);
    free(payload);
    free(buf);
    printf("damage: ok\n");
    return 0;
}
