/*
 * The C compiler's view of the header's structs: size and every field's offset, printed as
 * `struct.field offset` lines for the Rust side to compare with its own layout.
 */
#include <stddef.h>

#include "check.h"

#define SIZE(s) printf("%s %zu\n", #s, sizeof(s))
#define FIELD(s, f) printf("%s.%s %zu\n", #s, #f, offsetof(s, f))

int main(void) {
    SIZE(kvstack_store_options);
    FIELD(kvstack_store_options, config_path);
    FIELD(kvstack_store_options, weights_id_len);
    FIELD(kvstack_store_options, pool_ttl_ms);
    FIELD(kvstack_store_options, page_tokens);
    FIELD(kvstack_store_options, huge_pages);
    SIZE(kvstack_hit);
    FIELD(kvstack_hit, window_bytes);
    SIZE(kvstack_unit);
    FIELD(kvstack_unit, window_bytes);
    SIZE(kvstack_unit_layout);
    FIELD(kvstack_unit_layout, kv_sources);
    SIZE(kvstack_tier_stats);
    FIELD(kvstack_tier_stats, pool_evicted);
    FIELD(kvstack_tier_stats, poisoned);
    SIZE(kvstack_engine_options);
    FIELD(kvstack_engine_options, data_dir);
    FIELD(kvstack_engine_options, pool_capacity_bytes);
    FIELD(kvstack_engine_options, prefill);
    FIELD(kvstack_engine_options, huge_pages);
    SIZE(kvstack_request_params);
    FIELD(kvstack_request_params, max_new_tokens);
    FIELD(kvstack_request_params, top_p);
    SIZE(kvstack_result);
    return 0;
}
