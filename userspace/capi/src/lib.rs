//! libkvstack: the C ABI of kvstack, for inference engines written in C, C++ or Python that
//! embed its KV store and its engine in-process. `include/kvstack.h` is generated from this
//! crate by cbindgen; `docs/capi.md` gives the rules (ownership, errors, threads, ABI
//! stability, linking).
//!
//! - [`store`]: `kvstack_store`, the SSD tier and DRAM window pool of one model
//!   (`kvstack_tiers::Tiers`): lookups of a tenant's longest stored prefix, unit bytes read
//!   into and written from the caller's buffers.
//! - [`engine`]: `kvstack_engine` and `kvstack_session`, the serving engine
//!   (`kvstack_engine::Service`, the API every face of kvstack drives) and its sessions.
//! - [`error`]: the stable `kvstack_result` codes, `kvstack_result_describe` and the
//!   thread-local last error with the whole chain of causes.
//! - [`ffi`]: the panic boundary every exported function runs in, and the checks of C
//!   arguments (NULL, alignment, lengths, strings, size-prefixed structs).
//!
//! Conventions: every function returns a `kvstack_result` (0 is success) and gives its
//! outputs through pointers; handles are opaque, made and freed by the library (freeing NULL
//! is a no-op); structs that may grow start with their `size`; no panic crosses the
//! boundary (a caught one is `KVSTACK_PANIC`). Only `kvstack_`-prefixed symbols are exported.

// The exported types carry their C names (`kvstack_store`, `kvstack_result`).
#![allow(non_camel_case_types)]

// Unwinding is what lets every entry point catch a panic instead of aborting the host
// process; a build with `panic = "abort"` would lose that.
#[cfg(panic = "abort")]
compile_error!("libkvstack must be built with panic = \"unwind\": its boundary catches panics");

pub mod engine;
pub mod error;
pub mod ffi;
pub mod store;

use std::ffi::{CStr, c_char};

pub use error::{Error, Result, kvstack_result};

/// The ABI version of this header. It changes only when a change breaks callers built
/// against an earlier header (a function, struct field or code removed or changed in
/// meaning); additions keep it. Compare with `kvstack_abi_version()` at run time.
pub const KVSTACK_ABI_VERSION: u32 = 1;

/// Most tokens one call takes (a lookup's, a unit's, a request's, a poll's capacity).
pub const KVSTACK_MAX_TOKENS: usize = 1 << 22;

/// Most bytes of a string argument (tenant names, paths), NUL excluded. A string that is not
/// terminated within this is refused rather than read on.
pub const KVSTACK_MAX_STRING_BYTES: usize = 4096;

/// The library's version, `MAJOR.MINOR.PATCH`.
const VERSION: &CStr = {
    // A compile-time copy of the crate version with its NUL.
    const BYTES: &[u8] = concat!(env!("CARGO_PKG_VERSION"), "\0").as_bytes();
    match CStr::from_bytes_with_nul(BYTES) {
        Ok(s) => s,
        Err(_) => c"unknown",
    }
};

/// The library's version as a static NUL-terminated string (`"0.1.0"`); never freed.
///
/// Thread safety: callable from any thread at any time.
#[unsafe(no_mangle)]
pub extern "C" fn kvstack_version() -> *const c_char {
    ffi::boundary::value("kvstack_version", VERSION.as_ptr(), || VERSION.as_ptr())
}

/// The ABI version of the loaded library (`KVSTACK_ABI_VERSION` of the header it was built
/// with). A caller compiled against a header of another ABI version must not use it.
///
/// Thread safety: callable from any thread at any time.
#[unsafe(no_mangle)]
pub extern "C" fn kvstack_abi_version() -> u32 {
    ffi::boundary::value("kvstack_abi_version", KVSTACK_ABI_VERSION, || {
        KVSTACK_ABI_VERSION
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn version_is_the_crate_version() {
        // SAFETY: the library's static NUL-terminated string.
        let v = unsafe { CStr::from_ptr(kvstack_version()) };
        assert_eq!(v.to_str().ok(), Some(env!("CARGO_PKG_VERSION")));
        assert_eq!(kvstack_abi_version(), KVSTACK_ABI_VERSION);
    }
}
