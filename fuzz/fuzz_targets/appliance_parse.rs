//! kvstackd's parsers on arbitrary bytes. Byte 0 picks one: even, the KV-cache API's unit
//! frame (`kvstack_appliance::frame::decode`, `docs/kv-protocol.md`); odd, the config file
//! (`Config::from_toml_str`, `docs/appliance.md`). The rest is the input.
//!
//! What must hold besides "no panic": a frame that decodes describes itself (one CRC per
//! block, each block's length and CRC as its header says, as many token ids as announced),
//! fits in its input, and re-encodes to a frame that decodes to the same thing; a config that
//! parses keeps every documented bound (the limits within their ranges, the prompt limit
//! within the context, every tenant's prompt limit within the global one, names unique).
#![no_main]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use kvstack_appliance::Config;
use kvstack_appliance::frame;
use libfuzzer_sys::fuzz_target;

fn check_frame(input: &[u8]) {
    let Ok(f) = frame::decode(input) else {
        return;
    };
    let h = &f.header;
    assert_eq!(h.crc32c.len(), h.blocks.len());
    assert_eq!(f.blocks.len(), h.blocks.len());
    for (b, (&len, &crc)) in f.blocks.iter().zip(h.blocks.iter().zip(&h.crc32c)) {
        assert_eq!(b.len() as u64, len);
        assert_eq!(crc32c::crc32c(b), crc);
    }
    assert_eq!(f.token_ids.len() as u64, h.token_ids);
    assert_eq!(
        f.window.as_ref().map_or(0, |w| w.len() as u64),
        h.window_bytes
    );
    let sections: usize = f.blocks.iter().map(Vec::len).sum::<usize>()
        + 4 * f.token_ids.len()
        + f.window.as_ref().map_or(0, Vec::len);
    assert!(frame::PREFIX_BYTES + sections <= input.len());
    let again = frame::encode(
        h.tokens,
        h.page_tokens,
        h.model.clone(),
        &f.token_ids,
        &f.blocks,
        f.window.as_deref(),
    );
    assert_eq!(
        frame::decode(&again).unwrap(),
        f,
        "re-encoded frame decodes differently"
    );
}

fn check_config(text: &str) {
    let Ok(c) = Config::from_toml_str(text, "fuzz") else {
        return;
    };
    let l = &c.limits;
    assert!(l.max_header_bytes >= 8192, "hyper's minimum read buffer");
    assert!(l.max_prompt_tokens as u64 <= c.engine.context_limit);
    assert!(l.max_tokens as u64 <= c.engine.context_limit);
    assert!(l.max_connections >= 1 && c.engine.queue_depth >= 1 && c.engine.max_sessions >= 1);
    assert!(!c.tenants.is_empty(), "no tenants means one default tenant");
    for (i, t) in c.tenants.iter().enumerate() {
        assert!(t.max_prompt_tokens <= l.max_prompt_tokens, "tenant {i}");
        assert!(t.max_concurrent >= 1, "tenant {i}");
        assert!(
            c.tenants[..i].iter().all(|o| o.name != t.name),
            "tenant {i} repeats a name"
        );
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    if mode % 2 == 0 {
        check_frame(rest);
    } else if let Ok(text) = std::str::from_utf8(rest) {
        check_config(text);
    }
});
