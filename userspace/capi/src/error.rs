//! Errors: the crate's [`Error`], the stable numeric [`kvstack_result`] each one maps to, and
//! the thread-local last error that keeps the whole message chain for the C caller.

use std::cell::RefCell;
use std::ffi::c_char;

use crate::ffi::{self, boundary};

/// Result alias of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Result codes of every `kvstack_` function: 0 is success, anything else an error whose
/// message (with its whole chain of causes) is in `kvstack_last_error` on the calling
/// thread.
///
/// The numbers are stable ABI: a code keeps its number for ever, new codes take new numbers,
/// and a code that is retired stays listed (commented) so its number is never reused.
/// Ranges: 1..=99 arguments and the boundary itself, 100..=199 the store, 200..=299 the model,
/// its config and its cache, 300..=399 the engine. A caller must treat an unknown non-zero
/// value as an error of its range (`KVSTACK_STORE_OTHER`-like); `kvstack_result_describe`
/// describes any value.
///
/// Retired numbers (never reused): none yet.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum kvstack_result {
    /// Success.
    KVSTACK_OK = 0,

    /// A pointer argument that must not be NULL was NULL.
    KVSTACK_NULL_ARGUMENT = 1,
    /// An argument is out of range: a zero length where one is required, an absurd size or
    /// count, a misaligned array, a value outside its set.
    KVSTACK_INVALID_ARGUMENT = 2,
    /// An output buffer is too small; the size it needs was written to the size output.
    KVSTACK_BUFFER_TOO_SMALL = 3,
    /// A string argument is not UTF-8.
    KVSTACK_INVALID_UTF8 = 4,
    /// The operation is not available in this build of the library.
    KVSTACK_UNSUPPORTED = 5,
    /// The handle was closed (a closed store, a session whose engine was freed).
    KVSTACK_CLOSED = 6,
    /// The library panicked inside the call; it was caught at the boundary. The message is in
    /// the last error.
    KVSTACK_PANIC = 7,
    /// An earlier call panicked while it held this handle's state: the handle can only be
    /// freed.
    KVSTACK_POISONED = 8,
    /// An options struct is unusable: its `size` is not one this library knows, or a field is
    /// out of range (named in the last error).
    KVSTACK_INVALID_OPTION = 9,

    /// A file operation of the store failed (errno in the last error).
    KVSTACK_STORE_IO = 100,
    /// Another process, or another open store in this one, holds the data directory.
    KVSTACK_STORE_IN_USE = 101,
    /// The data directory could not be opened or locked.
    KVSTACK_STORE_LOCK = 102,
    /// The store was opened read-only.
    KVSTACK_STORE_READ_ONLY = 103,
    /// The store is full and nothing may be reclaimed (every unit is within its retention).
    KVSTACK_STORE_FULL = 104,
    /// The write-behind queue is full: the write was refused rather than block.
    KVSTACK_STORE_QUEUE_FULL = 105,
    /// An earlier write or sync failed: the store no longer writes (reads go on).
    KVSTACK_STORE_POISONED = 106,
    /// A unit write failed.
    KVSTACK_STORE_WRITE_FAILED = 107,
    /// A unit length is not a multiple of the model's largest compress ratio.
    KVSTACK_STORE_UNALIGNED = 108,
    /// A unit or block is larger than the store's records can hold.
    KVSTACK_STORE_TOO_LARGE = 109,
    /// Unit bytes do not match the model's geometry (size of a block, of the payload, the
    /// window snapshot).
    KVSTACK_STORE_PAYLOAD = 110,
    /// The location is not a store or cannot hold one.
    KVSTACK_STORE_LOCATION = 111,
    /// Pinned memory for the store's buffers or the window pool could not be set up.
    KVSTACK_STORE_MEMORY = 112,
    /// The store's bookkeeping is inconsistent (a bug: please report it).
    KVSTACK_STORE_INTERNAL = 113,
    /// No unit of these tokens is stored for this tenant (a delete found nothing).
    KVSTACK_STORE_NOT_FOUND = 114,
    /// A store error this version of the library has no code for.
    KVSTACK_STORE_OTHER = 199,

    /// The model config or its layer plan is unusable.
    KVSTACK_CONFIG = 200,
    /// The model: weights that do not load, a forward-pass error.
    KVSTACK_MODEL = 201,
    /// The paged KV cache: out of pages or sequences, a geometry it cannot hold.
    KVSTACK_CACHE = 202,

    /// The engine refused a request (no tokens, a token outside the vocabulary, over the
    /// context limit, an unknown session).
    KVSTACK_REQUEST_INVALID = 300,
    /// The session has a request in flight, or tokens of its last one not yet polled.
    KVSTACK_SESSION_BUSY = 301,
    /// The session's request failed inside the engine; the session is usable again.
    KVSTACK_REQUEST_FAILED = 302,
    /// An engine error this version of the library has no code for.
    KVSTACK_ENGINE_OTHER = 399,
}

impl kvstack_result {
    /// Every code, in numeric order.
    pub const ALL: [kvstack_result; 33] = [
        kvstack_result::KVSTACK_OK,
        kvstack_result::KVSTACK_NULL_ARGUMENT,
        kvstack_result::KVSTACK_INVALID_ARGUMENT,
        kvstack_result::KVSTACK_BUFFER_TOO_SMALL,
        kvstack_result::KVSTACK_INVALID_UTF8,
        kvstack_result::KVSTACK_UNSUPPORTED,
        kvstack_result::KVSTACK_CLOSED,
        kvstack_result::KVSTACK_PANIC,
        kvstack_result::KVSTACK_POISONED,
        kvstack_result::KVSTACK_INVALID_OPTION,
        kvstack_result::KVSTACK_STORE_IO,
        kvstack_result::KVSTACK_STORE_IN_USE,
        kvstack_result::KVSTACK_STORE_LOCK,
        kvstack_result::KVSTACK_STORE_READ_ONLY,
        kvstack_result::KVSTACK_STORE_FULL,
        kvstack_result::KVSTACK_STORE_QUEUE_FULL,
        kvstack_result::KVSTACK_STORE_POISONED,
        kvstack_result::KVSTACK_STORE_WRITE_FAILED,
        kvstack_result::KVSTACK_STORE_UNALIGNED,
        kvstack_result::KVSTACK_STORE_TOO_LARGE,
        kvstack_result::KVSTACK_STORE_PAYLOAD,
        kvstack_result::KVSTACK_STORE_LOCATION,
        kvstack_result::KVSTACK_STORE_MEMORY,
        kvstack_result::KVSTACK_STORE_INTERNAL,
        kvstack_result::KVSTACK_STORE_NOT_FOUND,
        kvstack_result::KVSTACK_STORE_OTHER,
        kvstack_result::KVSTACK_CONFIG,
        kvstack_result::KVSTACK_MODEL,
        kvstack_result::KVSTACK_CACHE,
        kvstack_result::KVSTACK_REQUEST_INVALID,
        kvstack_result::KVSTACK_SESSION_BUSY,
        kvstack_result::KVSTACK_REQUEST_FAILED,
        kvstack_result::KVSTACK_ENGINE_OTHER,
    ];

    /// The code with number `n`, if this library knows it.
    pub fn from_u32(n: u32) -> Option<kvstack_result> {
        Self::ALL.iter().copied().find(|c| *c as u32 == n)
    }

    /// The code's name, as in the header.
    pub fn name(self) -> &'static str {
        use kvstack_result::*;
        match self {
            KVSTACK_OK => "KVSTACK_OK",
            KVSTACK_NULL_ARGUMENT => "KVSTACK_NULL_ARGUMENT",
            KVSTACK_INVALID_ARGUMENT => "KVSTACK_INVALID_ARGUMENT",
            KVSTACK_BUFFER_TOO_SMALL => "KVSTACK_BUFFER_TOO_SMALL",
            KVSTACK_INVALID_UTF8 => "KVSTACK_INVALID_UTF8",
            KVSTACK_UNSUPPORTED => "KVSTACK_UNSUPPORTED",
            KVSTACK_CLOSED => "KVSTACK_CLOSED",
            KVSTACK_PANIC => "KVSTACK_PANIC",
            KVSTACK_POISONED => "KVSTACK_POISONED",
            KVSTACK_INVALID_OPTION => "KVSTACK_INVALID_OPTION",
            KVSTACK_STORE_IO => "KVSTACK_STORE_IO",
            KVSTACK_STORE_IN_USE => "KVSTACK_STORE_IN_USE",
            KVSTACK_STORE_LOCK => "KVSTACK_STORE_LOCK",
            KVSTACK_STORE_READ_ONLY => "KVSTACK_STORE_READ_ONLY",
            KVSTACK_STORE_FULL => "KVSTACK_STORE_FULL",
            KVSTACK_STORE_QUEUE_FULL => "KVSTACK_STORE_QUEUE_FULL",
            KVSTACK_STORE_POISONED => "KVSTACK_STORE_POISONED",
            KVSTACK_STORE_WRITE_FAILED => "KVSTACK_STORE_WRITE_FAILED",
            KVSTACK_STORE_UNALIGNED => "KVSTACK_STORE_UNALIGNED",
            KVSTACK_STORE_TOO_LARGE => "KVSTACK_STORE_TOO_LARGE",
            KVSTACK_STORE_PAYLOAD => "KVSTACK_STORE_PAYLOAD",
            KVSTACK_STORE_LOCATION => "KVSTACK_STORE_LOCATION",
            KVSTACK_STORE_MEMORY => "KVSTACK_STORE_MEMORY",
            KVSTACK_STORE_INTERNAL => "KVSTACK_STORE_INTERNAL",
            KVSTACK_STORE_NOT_FOUND => "KVSTACK_STORE_NOT_FOUND",
            KVSTACK_STORE_OTHER => "KVSTACK_STORE_OTHER",
            KVSTACK_CONFIG => "KVSTACK_CONFIG",
            KVSTACK_MODEL => "KVSTACK_MODEL",
            KVSTACK_CACHE => "KVSTACK_CACHE",
            KVSTACK_REQUEST_INVALID => "KVSTACK_REQUEST_INVALID",
            KVSTACK_SESSION_BUSY => "KVSTACK_SESSION_BUSY",
            KVSTACK_REQUEST_FAILED => "KVSTACK_REQUEST_FAILED",
            KVSTACK_ENGINE_OTHER => "KVSTACK_ENGINE_OTHER",
        }
    }

    /// One line on what the code means.
    pub fn description(self) -> &'static str {
        use kvstack_result::*;
        match self {
            KVSTACK_OK => "success",
            KVSTACK_NULL_ARGUMENT => "a required pointer argument was NULL",
            KVSTACK_INVALID_ARGUMENT => "an argument is out of range",
            KVSTACK_BUFFER_TOO_SMALL => "an output buffer is too small",
            KVSTACK_INVALID_UTF8 => "a string argument is not UTF-8",
            KVSTACK_UNSUPPORTED => "the operation is not supported by this build",
            KVSTACK_CLOSED => "the handle is closed",
            KVSTACK_PANIC => "the library panicked inside the call (caught)",
            KVSTACK_POISONED => "the handle is unusable after an earlier panic",
            KVSTACK_INVALID_OPTION => "an options struct has an unknown size or a bad field",
            KVSTACK_STORE_IO => "a file operation of the store failed",
            KVSTACK_STORE_IN_USE => "the data directory is in use by another store",
            KVSTACK_STORE_LOCK => "the data directory could not be opened or locked",
            KVSTACK_STORE_READ_ONLY => "the store is open read-only",
            KVSTACK_STORE_FULL => "the store is full and nothing may be reclaimed",
            KVSTACK_STORE_QUEUE_FULL => "the store's write-behind queue is full",
            KVSTACK_STORE_POISONED => "the store stopped writing after an I/O failure",
            KVSTACK_STORE_WRITE_FAILED => "a unit write failed",
            KVSTACK_STORE_UNALIGNED => "a unit length is not a multiple of the compress ratio",
            KVSTACK_STORE_TOO_LARGE => "a unit or block is too large for the store",
            KVSTACK_STORE_PAYLOAD => "unit bytes do not match the model's geometry",
            KVSTACK_STORE_LOCATION => "the location is not a store or cannot hold one",
            KVSTACK_STORE_MEMORY => "memory for the store could not be set up",
            KVSTACK_STORE_INTERNAL => "the store's bookkeeping is inconsistent (a bug)",
            KVSTACK_STORE_NOT_FOUND => "no such unit is stored for this tenant",
            KVSTACK_STORE_OTHER => "a store error",
            KVSTACK_CONFIG => "the model config is unusable",
            KVSTACK_MODEL => "a model error (weights, forward pass)",
            KVSTACK_CACHE => "a paged KV cache error (out of pages or sequences)",
            KVSTACK_REQUEST_INVALID => "the engine refused the request",
            KVSTACK_SESSION_BUSY => "the session has a request in flight or tokens not polled",
            KVSTACK_REQUEST_FAILED => "the request failed inside the engine",
            KVSTACK_ENGINE_OTHER => "an engine error",
        }
    }
}

/// Errors of the C ABI: bad arguments, the boundary itself, and the errors of the crates
/// below, kept whole (their chain is what the last error shows).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A required pointer argument is NULL.
    #[error("argument `{name}` is NULL")]
    Null {
        /// The argument.
        name: &'static str,
    },

    /// An argument is out of range.
    #[error("argument `{name}`: {reason}")]
    Invalid {
        /// The argument.
        name: &'static str,
        /// What is wrong.
        reason: String,
    },

    /// An options (or output) struct is unusable.
    #[error("`{name}`: {reason}")]
    BadOption {
        /// The struct or field (`kvstack_store_options.size`).
        name: &'static str,
        /// What is wrong.
        reason: String,
    },

    /// An output buffer is too small.
    #[error("buffer `{name}` holds {given} bytes, {needed} needed")]
    BufferTooSmall {
        /// The buffer argument.
        name: &'static str,
        /// Bytes needed.
        needed: u64,
        /// Bytes given.
        given: u64,
    },

    /// A string argument is not UTF-8.
    #[error("argument `{name}` is not UTF-8")]
    Utf8 {
        /// The argument.
        name: &'static str,
        /// Where the UTF-8 breaks.
        #[source]
        source: std::str::Utf8Error,
    },

    /// What the caller named does not exist.
    #[error("{what}")]
    NotFound {
        /// What was looked for.
        what: &'static str,
    },

    /// The operation is not available in this build.
    #[error("{what} is not supported by this build of libkvstack")]
    Unsupported {
        /// The operation, and why.
        what: &'static str,
    },

    /// The handle is closed.
    #[error("the {what} is closed")]
    Closed {
        /// Which handle.
        what: &'static str,
    },

    /// A panic inside the library, caught at the boundary.
    #[error("panic in {function}: {message}")]
    Panic {
        /// The entry point.
        function: &'static str,
        /// The panic's message.
        message: String,
    },

    /// A handle whose state an earlier panic left behind.
    #[error("the {what} is unusable: an earlier call panicked while using it")]
    Poisoned {
        /// Which handle.
        what: &'static str,
    },

    /// The session cannot take a request now.
    #[error("session busy: {reason}")]
    Busy {
        /// Why.
        reason: String,
    },

    /// A request failed inside the engine (the engine's message and its chain).
    #[error("request failed: {reason}")]
    RequestFailed {
        /// The engine's message.
        reason: String,
    },

    /// The model config.
    #[error(transparent)]
    Spec(#[from] kvstack_spec::Error),

    /// The SSD store, the window pool or the prefix units.
    #[error(transparent)]
    Tiers(#[from] kvstack_tiers::Error),

    /// The engine or the service (and what they drive).
    #[error(transparent)]
    Engine(#[from] kvstack_engine::Error),
}

impl Error {
    /// The stable code of this error.
    pub fn code(&self) -> kvstack_result {
        use kvstack_result::*;
        match self {
            Error::Null { .. } => KVSTACK_NULL_ARGUMENT,
            Error::Invalid { .. } => KVSTACK_INVALID_ARGUMENT,
            Error::BadOption { .. } => KVSTACK_INVALID_OPTION,
            Error::BufferTooSmall { .. } => KVSTACK_BUFFER_TOO_SMALL,
            Error::Utf8 { .. } => KVSTACK_INVALID_UTF8,
            Error::Unsupported { .. } => KVSTACK_UNSUPPORTED,
            Error::NotFound { .. } => KVSTACK_STORE_NOT_FOUND,
            Error::Closed { .. } => KVSTACK_CLOSED,
            Error::Panic { .. } => KVSTACK_PANIC,
            Error::Poisoned { .. } => KVSTACK_POISONED,
            Error::Busy { .. } => KVSTACK_SESSION_BUSY,
            Error::RequestFailed { .. } => KVSTACK_REQUEST_FAILED,
            Error::Spec(_) => KVSTACK_CONFIG,
            Error::Tiers(e) => tiers_code(e),
            Error::Engine(e) => engine_code(e),
        }
    }

    /// The message with every source after it, `: `-separated (what the last error holds).
    pub fn chain(&self) -> String {
        let mut msg = self.to_string();
        let mut src = std::error::Error::source(self);
        while let Some(s) = src {
            msg.push_str(": ");
            msg.push_str(&s.to_string());
            src = s.source();
        }
        msg
    }

    /// [`Error::Invalid`].
    pub(crate) fn invalid(name: &'static str, reason: impl Into<String>) -> Error {
        Error::Invalid {
            name,
            reason: reason.into(),
        }
    }

    /// [`Error::BadOption`].
    pub(crate) fn option(name: &'static str, reason: impl Into<String>) -> Error {
        Error::BadOption {
            name,
            reason: reason.into(),
        }
    }
}

fn tiers_code(e: &kvstack_tiers::Error) -> kvstack_result {
    use kvstack_result::*;
    use kvstack_tiers::Error as T;
    match e {
        T::Io { .. } => KVSTACK_STORE_IO,
        T::Memory(_) => KVSTACK_STORE_MEMORY,
        T::InvalidOption { .. } => KVSTACK_INVALID_OPTION,
        T::InUse { .. } => KVSTACK_STORE_IN_USE,
        T::Lock(_) => KVSTACK_STORE_LOCK,
        T::ReadOnly => KVSTACK_STORE_READ_ONLY,
        T::StoreFull { .. } => KVSTACK_STORE_FULL,
        T::QueueFull { .. } => KVSTACK_STORE_QUEUE_FULL,
        T::Poisoned { .. } => KVSTACK_STORE_POISONED,
        T::WriteFailed { .. } => KVSTACK_STORE_WRITE_FAILED,
        T::UnitTooLong { .. } | T::BlockTooLarge { .. } => KVSTACK_STORE_TOO_LARGE,
        T::Unaligned { .. } => KVSTACK_STORE_UNALIGNED,
        T::Closed => KVSTACK_CLOSED,
        T::Location { .. } => KVSTACK_STORE_LOCATION,
        T::Payload { .. } | T::UnitRange { .. } => KVSTACK_STORE_PAYLOAD,
        T::Internal { .. } => KVSTACK_STORE_INTERNAL,
        T::Cache(_) => KVSTACK_CACHE,
        T::Config(_) => KVSTACK_CONFIG,
        _ => KVSTACK_STORE_OTHER,
    }
}

fn engine_code(e: &kvstack_engine::Error) -> kvstack_result {
    use kvstack_engine::Error as E;
    use kvstack_result::*;
    match e {
        E::Request { .. } => KVSTACK_REQUEST_INVALID,
        E::InvalidOption { .. } => KVSTACK_INVALID_OPTION,
        E::Spec(_) => KVSTACK_CONFIG,
        E::Cache(_) => KVSTACK_CACHE,
        E::Tiers(t) => tiers_code(t),
        E::Model(_) => KVSTACK_MODEL,
        _ => KVSTACK_ENGINE_OTHER,
    }
}

thread_local! {
    /// The message chain of the last failed call on this thread.
    static LAST_ERROR: RefCell<Option<String>> = const { RefCell::new(None) };
}

/// Keeps `e`'s chain as this thread's last error.
pub(crate) fn set_last_error(e: &Error) {
    let msg = e.chain();
    // During thread teardown the slot may be gone: the code still tells the caller.
    let _ = LAST_ERROR.try_with(|l| {
        if let Ok(mut l) = l.try_borrow_mut() {
            *l = Some(msg);
        }
    });
}

/// Forgets this thread's last error (a call succeeded).
pub(crate) fn clear_last_error() {
    let _ = LAST_ERROR.try_with(|l| {
        if let Ok(mut l) = l.try_borrow_mut() {
            l.take();
        }
    });
}

/// This thread's last error, if the last call failed.
pub(crate) fn last_error() -> Option<String> {
    LAST_ERROR
        .try_with(|l| l.try_borrow().ok().and_then(|l| l.clone()))
        .ok()
        .flatten()
}

/// Writes a description of the result code `code` (any number, known or not) into `buf` as a
/// NUL-terminated string: its name and what it means, e.g. `KVSTACK_STORE_FULL: the store is
/// full and nothing may be reclaimed`.
///
/// `*out_len` receives the description's length in bytes, without the NUL. When `len` is not
/// larger than that, the description is cut at a character boundary to fit (NUL-terminated
/// whenever `len > 0`) and `KVSTACK_BUFFER_TOO_SMALL` is returned: `buf = NULL, len = 0`
/// asks for the length alone.
///
/// Does not change the thread's last error.
///
/// Thread safety: callable from any thread at any time.
///
/// # Safety
/// `buf` is NULL with `len == 0`, or points to `len` writable bytes; `out_len` points to a
/// writable `size_t`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvstack_result_describe(
    code: u32,
    buf: *mut c_char,
    len: usize,
    out_len: *mut usize,
) -> kvstack_result {
    boundary::keep_last_error("kvstack_result_describe", || {
        let text = match kvstack_result::from_u32(code) {
            Some(c) => format!("{}: {}", c.name(), c.description()),
            None => format!("unknown kvstack result {code}"),
        };
        // SAFETY: the caller's contract above: `buf` is NULL with `len == 0` or holds `len`
        // writable bytes, and `out_len` is writable.
        unsafe { ffi::write_str(&text, buf, len, out_len, "buf") }
    })
}

/// Writes the message of the last call on this thread that failed (the error with its whole
/// chain of causes, `: `-separated) into `buf` as a NUL-terminated UTF-8 string. A call that
/// returns `KVSTACK_OK` clears it (then the message is empty and `*out_len` is 0); the
/// functions without a result code (`kvstack_version`, `_free`) leave it unless they panic.
///
/// `*out_len` receives the message's length in bytes, without the NUL. When `len` is not
/// larger than that, the message is cut at a character boundary to fit (NUL-terminated
/// whenever `len > 0`) and `KVSTACK_BUFFER_TOO_SMALL` is returned: `buf = NULL, len = 0` asks
/// for the length alone.
///
/// Reading it does not change it (the same message can be read again, at another size).
///
/// Thread safety: callable from any thread; each thread has its own last error.
///
/// # Safety
/// `buf` is NULL with `len == 0`, or points to `len` writable bytes; `out_len` points to a
/// writable `size_t`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvstack_last_error(
    buf: *mut c_char,
    len: usize,
    out_len: *mut usize,
) -> kvstack_result {
    boundary::keep_last_error("kvstack_last_error", || {
        let text = last_error().unwrap_or_default();
        // SAFETY: the caller's contract above: `buf` is NULL with `len == 0` or holds `len`
        // writable bytes, and `out_len` is writable.
        unsafe { ffi::write_str(&text, buf, len, out_len, "buf") }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_keep_their_numbers() {
        use kvstack_result::*;
        // The numbers are ABI: this table changes only by adding rows.
        let pinned = [
            (KVSTACK_OK, 0),
            (KVSTACK_NULL_ARGUMENT, 1),
            (KVSTACK_INVALID_ARGUMENT, 2),
            (KVSTACK_BUFFER_TOO_SMALL, 3),
            (KVSTACK_INVALID_UTF8, 4),
            (KVSTACK_UNSUPPORTED, 5),
            (KVSTACK_CLOSED, 6),
            (KVSTACK_PANIC, 7),
            (KVSTACK_POISONED, 8),
            (KVSTACK_INVALID_OPTION, 9),
            (KVSTACK_STORE_IO, 100),
            (KVSTACK_STORE_IN_USE, 101),
            (KVSTACK_STORE_LOCK, 102),
            (KVSTACK_STORE_READ_ONLY, 103),
            (KVSTACK_STORE_FULL, 104),
            (KVSTACK_STORE_QUEUE_FULL, 105),
            (KVSTACK_STORE_POISONED, 106),
            (KVSTACK_STORE_WRITE_FAILED, 107),
            (KVSTACK_STORE_UNALIGNED, 108),
            (KVSTACK_STORE_TOO_LARGE, 109),
            (KVSTACK_STORE_PAYLOAD, 110),
            (KVSTACK_STORE_LOCATION, 111),
            (KVSTACK_STORE_MEMORY, 112),
            (KVSTACK_STORE_INTERNAL, 113),
            (KVSTACK_STORE_NOT_FOUND, 114),
            (KVSTACK_STORE_OTHER, 199),
            (KVSTACK_CONFIG, 200),
            (KVSTACK_MODEL, 201),
            (KVSTACK_CACHE, 202),
            (KVSTACK_REQUEST_INVALID, 300),
            (KVSTACK_SESSION_BUSY, 301),
            (KVSTACK_REQUEST_FAILED, 302),
            (KVSTACK_ENGINE_OTHER, 399),
        ];
        for (code, n) in pinned {
            assert_eq!(code as u32, n, "{}", code.name());
            assert_eq!(kvstack_result::from_u32(n), Some(code));
            assert!(code.name().starts_with("KVSTACK_"));
            assert!(!code.description().is_empty());
        }
        // Every code is pinned, and no two share a number.
        let mut all: Vec<u32> = kvstack_result::ALL.iter().map(|c| *c as u32).collect();
        assert_eq!(all.len(), pinned.len());
        all.sort_unstable();
        all.dedup();
        assert_eq!(all.len(), pinned.len());
        assert_eq!(kvstack_result::from_u32(10), None);
        assert_eq!(kvstack_result::from_u32(u32::MAX), None);
    }

    #[test]
    fn lower_errors_map_to_their_ranges_and_keep_their_chain() {
        let io = kvstack_tiers::Error::Io {
            what: "cannot open segment",
            path: "/x/seg-1.kvs".into(),
            source: std::io::Error::from_raw_os_error(5),
        };
        let e = Error::from(kvstack_engine::Error::Tiers(io));
        assert_eq!(e.code(), kvstack_result::KVSTACK_STORE_IO);
        let chain = e.chain();
        assert!(
            chain.starts_with("cannot open segment /x/seg-1.kvs: "),
            "{chain}"
        );
        assert!(chain.contains("os error 5"), "{chain}");
        let full = Error::from(kvstack_tiers::Error::StoreFull { needed: 1 });
        assert_eq!(full.code(), kvstack_result::KVSTACK_STORE_FULL);
        let req = Error::from(kvstack_engine::Error::Request {
            session: 3,
            reason: "no".into(),
        });
        assert_eq!(req.code(), kvstack_result::KVSTACK_REQUEST_INVALID);
    }
}
