#!/usr/bin/env python3
"""Embedding kvstack from Python with ctypes: the same steps as examples/c/embed.c.

Open the KV store of a model, store the KV of a 512-token prefix, look a longer prompt up and
read the prefix's bytes back, then generate tokens with kvstack's engine (built-in tiny model).

usage: embed.py LIBKVSTACK_SO DATA_DIR
"""

import ctypes as C
import sys

OK, BUFFER_TOO_SMALL = 0, 3


class StoreOptions(C.Structure):
    _fields_ = [
        ("size", C.c_size_t),
        ("config_path", C.c_char_p),
        ("weights_id", C.POINTER(C.c_uint8)),
        ("weights_id_len", C.c_size_t),
        ("capacity_bytes", C.c_uint64),
        ("segment_bytes", C.c_uint64),
        ("retention_ms", C.c_uint64),
        ("pool_capacity_bytes", C.c_uint64),
        ("pool_ttl_ms", C.c_uint64),
        ("page_tokens", C.c_uint32),
        ("read_only", C.c_uint8),
        ("lock_memory", C.c_uint8),
        ("huge_pages", C.c_uint8),
    ]


class Hit(C.Structure):
    _fields_ = [(n, C.c_size_t if n == "size" else C.c_uint64) for n in (
        "size", "tokens", "ssd_tokens", "dram_window_tokens", "blocks", "payload_bytes",
        "window_bytes")]


class Unit(C.Structure):
    _fields_ = [(n, C.c_size_t if n == "size" else C.c_uint64) for n in (
        "size", "tokens", "blocks", "payload_bytes", "window_bytes")]


class UnitLayout(C.Structure):
    _fields_ = [(n, C.c_size_t if n == "size" else C.c_uint64) for n in (
        "size", "tokens", "page_tokens", "align", "blocks", "block_bytes", "payload_bytes",
        "window_bytes", "layers", "window_rows", "kv_sources")]


class EngineOptions(C.Structure):
    _fields_ = [
        ("size", C.c_size_t),
        ("weights_path", C.c_char_p),
        ("data_dir", C.c_char_p),
        ("seed", C.c_uint64),
        ("context_limit", C.c_uint64),
        ("store_capacity_bytes", C.c_uint64),
        ("store_segment_bytes", C.c_uint64),
        ("pool_capacity_bytes", C.c_uint64),
        ("threads", C.c_uint32),
        ("chunk", C.c_uint32),
        ("max_decode_batch", C.c_uint32),
        ("max_sequences", C.c_uint32),
        ("prefill", C.c_uint32),
        ("keep_live", C.c_uint8),
        ("lock_memory", C.c_uint8),
        ("huge_pages", C.c_uint8),
    ]


class RequestParams(C.Structure):
    _fields_ = [
        ("size", C.c_size_t),
        ("seed", C.c_uint64),
        ("max_new_tokens", C.c_uint32),
        ("sampling", C.c_uint32),
        ("temperature", C.c_float),
        ("top_p", C.c_float),
    ]


def sized(cls):
    """A struct with its `size` set, as every kvstack struct needs."""
    s = cls()
    s.size = C.sizeof(cls)
    return s


class KvstackError(Exception):
    pass


def load(path):
    lib = C.CDLL(path)
    lib.kvstack_version.restype = C.c_char_p
    lib.kvstack_abi_version.restype = C.c_uint32
    P = C.c_void_p
    for name, args in {
        "kvstack_result_describe": [C.c_uint32, C.c_char_p, C.c_size_t, C.POINTER(C.c_size_t)],
        "kvstack_last_error": [C.c_char_p, C.c_size_t, C.POINTER(C.c_size_t)],
        "kvstack_store_options_default": [C.POINTER(StoreOptions)],
        "kvstack_store_open": [C.c_char_p, C.POINTER(StoreOptions), C.POINTER(P)],
        "kvstack_store_unit_layout": [P, C.c_size_t, C.POINTER(UnitLayout)],
        "kvstack_store_put_unit": [P, C.c_char_p, C.POINTER(C.c_uint32), C.c_size_t, C.c_char_p,
                                   C.c_size_t, C.c_char_p, C.c_size_t, C.c_bool],
        "kvstack_store_lookup": [P, C.c_char_p, C.POINTER(C.c_uint32), C.c_size_t,
                                 C.POINTER(Hit)],
        "kvstack_store_get_unit": [P, C.c_char_p, C.POINTER(C.c_uint32), C.c_size_t, C.c_void_p,
                                   C.c_size_t, C.c_void_p, C.c_size_t, C.POINTER(Unit)],
        "kvstack_store_close": [P],
        "kvstack_engine_options_default": [C.POINTER(EngineOptions)],
        "kvstack_engine_new": [C.c_char_p, C.POINTER(EngineOptions), C.POINTER(P)],
        "kvstack_session_new": [P, C.c_char_p, C.POINTER(P)],
        "kvstack_request_params_default": [C.POINTER(RequestParams)],
        "kvstack_session_submit": [P, C.POINTER(C.c_uint32), C.c_size_t,
                                   C.POINTER(RequestParams)],
        "kvstack_session_step": [P, C.POINTER(C.c_uint32), C.c_size_t, C.POINTER(C.c_size_t),
                                 C.POINTER(C.c_bool)],
    }.items():
        f = getattr(lib, name)
        f.argtypes = args
        f.restype = C.c_uint32
    for name in ("kvstack_store_free", "kvstack_session_free", "kvstack_engine_free"):
        f = getattr(lib, name)
        f.argtypes = [P]
        f.restype = None
    return lib


def check(lib, rc, what, allow=()):
    """Raises with the code's name and the library's message (its whole chain)."""
    if rc == OK or rc in allow:
        return rc
    n = C.c_size_t()
    code = C.create_string_buffer(256)
    msg = C.create_string_buffer(4096)
    lib.kvstack_result_describe(rc, code, len(code), C.byref(n))
    lib.kvstack_last_error(msg, len(msg), C.byref(n))
    raise KvstackError(f"{what}: {code.value.decode()}: {msg.value.decode()}")


def main():
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    lib = load(sys.argv[1])
    data_dir = sys.argv[2].encode()
    print(f"libkvstack {lib.kvstack_version().decode()} (ABI {lib.kvstack_abi_version()})")

    # 1. The store of the built-in DeepSeek-V4.1-Flash config.
    so = sized(StoreOptions)
    check(lib, lib.kvstack_store_options_default(C.byref(so)), "store options")
    so.pool_capacity_bytes = 64 << 20
    store = C.c_void_p()
    check(lib, lib.kvstack_store_open(data_dir, C.byref(so), C.byref(store)), "open store")

    # 2. KV of a 512-token prefix (a stand-in for what an engine computed), then a lookup of
    #    a 600-token prompt sharing it and a read of the prefix (size query first).
    prompt = (C.c_uint32 * 600)(*[(i * 131 + 7) % 1024 for i in range(600)])
    layout = sized(UnitLayout)
    check(lib, lib.kvstack_store_unit_layout(store, 512, C.byref(layout)), "layout")
    kv = bytes((i * 7) & 0xFF for i in range(layout.payload_bytes))
    check(lib, lib.kvstack_store_put_unit(store, b"tenant-1", prompt, 512, kv, len(kv), None, 0,
                                          True), "put")
    hit = sized(Hit)
    check(lib, lib.kvstack_store_lookup(store, b"tenant-1", prompt, 600, C.byref(hit)), "lookup")
    print(f"prefix found: {hit.tokens} tokens (SSD {hit.ssd_tokens}, DRAM window "
          f"{hit.dram_window_tokens}), {hit.payload_bytes} bytes")
    unit = sized(Unit)
    check(lib, lib.kvstack_store_get_unit(store, b"tenant-1", prompt, 600, None, 0, None, 0,
                                          C.byref(unit)), "size query", allow=(BUFFER_TOO_SMALL,))
    buf = C.create_string_buffer(unit.payload_bytes)
    check(lib, lib.kvstack_store_get_unit(store, b"tenant-1", prompt, 600, buf, len(buf), None,
                                          0, C.byref(unit)), "get")
    same = buf.raw[:unit.payload_bytes] == kv[:unit.payload_bytes]
    print(f"read {unit.payload_bytes} bytes of {unit.tokens} tokens: "
          f"{'as stored' if same else 'DIFFERENT'}")
    if not same:
        return 1
    check(lib, lib.kvstack_store_close(store), "close store")
    lib.kvstack_store_free(store)

    # 3. Generate with the engine (built-in tiny model).
    eo = sized(EngineOptions)
    check(lib, lib.kvstack_engine_options_default(C.byref(eo)), "engine options")
    eo.context_limit = 8192
    engine = C.c_void_p()
    check(lib, lib.kvstack_engine_new(None, C.byref(eo), C.byref(engine)), "engine")
    session = C.c_void_p()
    check(lib, lib.kvstack_session_new(engine, b"tenant-1", C.byref(session)), "session")
    p = sized(RequestParams)
    check(lib, lib.kvstack_request_params_default(C.byref(p)), "params")
    p.max_new_tokens = 8
    check(lib, lib.kvstack_session_submit(session, prompt, 600, C.byref(p)), "submit")
    tokens, done = [], C.c_bool(False)
    out, n = (C.c_uint32 * 8)(), C.c_size_t()
    while not done.value:
        check(lib, lib.kvstack_session_step(session, out, 8, C.byref(n), C.byref(done)), "step")
        tokens.extend(out[: n.value])
    print("generated:", " ".join(map(str, tokens)))
    lib.kvstack_session_free(session)
    lib.kvstack_engine_free(engine)
    return 0


if __name__ == "__main__":
    sys.exit(main())
