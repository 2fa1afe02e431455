//! The boundary with C: the panic boundary every entry point runs in, and the checked
//! conversions of C arguments (pointers, lengths, strings, size-prefixed structs) into Rust
//! values. Every `unsafe` of the crate that touches caller memory is here or names the
//! caller's contract it relies on.

use std::ffi::c_char;
use std::mem::{MaybeUninit, align_of, size_of};

use crate::KVSTACK_MAX_STRING_BYTES as MAX_STRING_BYTES;
use crate::error::{Error, Result};

/// The panic boundary: every exported function runs its body through one of these.
pub(crate) mod boundary {
    use std::any::Any;
    use std::panic::{self, AssertUnwindSafe};

    use crate::error::{Error, Result, clear_last_error, kvstack_result, set_last_error};

    /// The message of a caught panic. Dropping a payload may itself panic; such a payload is
    /// leaked rather than let unwind out of the boundary.
    fn panic_message(payload: Box<dyn Any + Send>) -> String {
        let msg = if let Some(s) = payload.downcast_ref::<&str>() {
            (*s).to_owned()
        } else if let Some(s) = payload.downcast_ref::<String>() {
            s.clone()
        } else {
            "a panic with a non-string payload".to_owned()
        };
        if let Err(again) = panic::catch_unwind(AssertUnwindSafe(|| drop(payload))) {
            std::mem::forget(again);
        }
        msg
    }

    /// Runs `f`, catching a panic, and turns its outcome into a result code. A failure
    /// becomes the thread's last error; a success clears it.
    ///
    /// Unwind safety: state a panic could leave half-changed is behind a lock that a panic
    /// poisons (the engine) or a flag the panicking call sets (the store); later calls on that
    /// handle refuse with `KVSTACK_POISONED`, so no broken state is observed after the
    /// `AssertUnwindSafe`.
    pub(crate) fn call(function: &'static str, f: impl FnOnce() -> Result<()>) -> kvstack_result {
        match panic::catch_unwind(AssertUnwindSafe(f)) {
            Ok(Ok(())) => {
                clear_last_error();
                kvstack_result::KVSTACK_OK
            }
            Ok(Err(e)) => {
                set_last_error(&e);
                e.code()
            }
            Err(payload) => panicked(function, payload),
        }
    }

    /// As [`call`], but an error leaves the last error as it was: for the functions that
    /// read it or describe codes.
    pub(crate) fn keep_last_error(
        function: &'static str,
        f: impl FnOnce() -> Result<()>,
    ) -> kvstack_result {
        match panic::catch_unwind(AssertUnwindSafe(f)) {
            Ok(Ok(())) => kvstack_result::KVSTACK_OK,
            Ok(Err(e)) => e.code(),
            Err(payload) => panicked(function, payload),
        }
    }

    /// Runs `f` for a function without a result code (the `_free` functions and version
    /// getters): a panic gives `fallback` and the last error says what happened.
    pub(crate) fn value<T>(function: &'static str, fallback: T, f: impl FnOnce() -> T) -> T {
        match panic::catch_unwind(AssertUnwindSafe(f)) {
            Ok(v) => v,
            Err(payload) => {
                panicked(function, payload);
                fallback
            }
        }
    }

    fn panicked(function: &'static str, payload: Box<dyn Any + Send>) -> kvstack_result {
        let e = Error::Panic {
            function,
            message: panic_message(payload),
        };
        set_last_error(&e);
        kvstack_result::KVSTACK_PANIC
    }
}

/// Checks that `p` may be read or written as a `T`: not NULL, aligned.
fn check_ptr<T>(p: *const T, name: &'static str) -> Result<()> {
    if p.is_null() {
        return Err(Error::Null { name });
    }
    if !p.is_aligned() {
        return Err(Error::invalid(
            name,
            format!("not aligned to {} bytes", align_of::<T>()),
        ));
    }
    Ok(())
}

/// An output argument, checked before any work is done and written once at the end.
pub(crate) struct Out<T> {
    ptr: *mut T,
}

impl<T> Out<T> {
    /// Checks the output pointer `p` (not NULL, aligned).
    ///
    /// # Safety
    /// `p` is NULL or valid for a write of one `T` for the rest of the call (what the caller
    /// of the exported function promises for its out-pointers).
    pub(crate) unsafe fn new(p: *mut T, name: &'static str) -> Result<Out<T>> {
        check_ptr(p, name)?;
        Ok(Out { ptr: p })
    }

    /// As [`Out::new`], but NULL means the caller does not want this output.
    ///
    /// # Safety
    /// As [`Out::new`].
    pub(crate) unsafe fn optional(p: *mut T, name: &'static str) -> Result<Option<Out<T>>> {
        if p.is_null() {
            return Ok(None);
        }
        // SAFETY: the caller's contract is the one `Out::new` needs.
        unsafe { Out::new(p, name) }.map(Some)
    }

    /// Writes the output (the previous value, possibly uninitialised, is not read or
    /// dropped: outputs are plain C values).
    pub(crate) fn write(&self, v: T) {
        // SAFETY: `new` checked the pointer is non-NULL and aligned, and its caller promised
        // it is valid for a write of one `T` during the call.
        unsafe { self.ptr.write(v) }
    }
}

/// A caller's output byte buffer, filled front to back. Its bytes may be uninitialised, so
/// no Rust slice is ever made of it: bytes are copied in through the raw pointer.
pub(crate) struct OutBuf {
    ptr: *mut u8,
    cap: usize,
    len: usize,
}

impl OutBuf {
    /// Checks the buffer `p` of `cap` bytes: NULL only with `cap == 0`, at most
    /// `isize::MAX` bytes.
    ///
    /// # Safety
    /// `p` is NULL or valid for writes of `cap` bytes for the rest of the call, and no other
    /// argument of the call overlaps it.
    pub(crate) unsafe fn new(p: *mut u8, cap: usize, name: &'static str) -> Result<OutBuf> {
        if p.is_null() && cap > 0 {
            return Err(Error::Null { name });
        }
        if cap > isize::MAX as usize {
            return Err(Error::invalid(name, format!("length {cap} is absurd")));
        }
        Ok(OutBuf {
            ptr: p,
            cap,
            len: 0,
        })
    }

    /// Bytes the buffer holds.
    pub(crate) fn capacity(&self) -> usize {
        self.cap
    }

    /// Bytes written so far.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Appends `bytes`; an error (and nothing written) when they do not fit.
    pub(crate) fn push(&mut self, bytes: &[u8], name: &'static str) -> Result<()> {
        let end = self
            .len
            .checked_add(bytes.len())
            .filter(|&e| e <= self.cap)
            .ok_or(Error::BufferTooSmall {
                name,
                needed: (self.len as u64).saturating_add(bytes.len() as u64),
                given: self.cap as u64,
            })?;
        if !bytes.is_empty() {
            // SAFETY: `new`'s caller promised `cap` writable bytes at `ptr` that no argument
            // overlaps (so not `bytes`, which the library owns); `len..end` lies within `cap`.
            unsafe {
                std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.ptr.add(self.len), bytes.len())
            };
        }
        self.len = end;
        Ok(())
    }

    /// Zeroes what was written and forgets it: a read that did not complete leaves no bytes.
    pub(crate) fn clear(&mut self) {
        if self.len > 0 {
            // SAFETY: bytes `0..len` were written by `push` within the caller's buffer.
            unsafe { std::ptr::write_bytes(self.ptr, 0, self.len) };
        }
        self.len = 0;
    }
}

/// A caller's array of `n` values, borrowed for the call: `&[]` for `n == 0` (the pointer may
/// then be NULL), else a non-NULL, aligned pointer and at most `max` values.
///
/// # Safety
/// When `n > 0`, `p` points to `n` initialised values of `T` that nothing writes during the
/// call.
pub(crate) unsafe fn slice<'a, T>(
    p: *const T,
    n: usize,
    max: usize,
    name: &'static str,
) -> Result<&'a [T]> {
    if n == 0 {
        return Ok(&[]);
    }
    check_ptr(p, name)?;
    if n > max || n.saturating_mul(size_of::<T>()) > isize::MAX as usize {
        return Err(Error::invalid(
            name,
            format!("{n} elements is over the limit of {max}"),
        ));
    }
    // SAFETY: `p` is non-NULL and aligned (checked), the caller promised `n` initialised
    // values that nothing writes during the call, and `n * size_of::<T>()` fits an isize.
    Ok(unsafe { std::slice::from_raw_parts(p, n) })
}

/// A NUL-terminated UTF-8 string argument of at most [`MAX_STRING_BYTES`] bytes.
///
/// # Safety
/// `p` is NULL or points to a readable NUL-terminated string (or at least to
/// `MAX_STRING_BYTES + 1` readable bytes) that nothing writes during the call.
pub(crate) unsafe fn c_str<'a>(p: *const c_char, name: &'static str) -> Result<&'a str> {
    if p.is_null() {
        return Err(Error::Null { name });
    }
    let bytes = p.cast::<u8>();
    // The terminator is looked for within the limit only, so an unterminated buffer is
    // refused instead of read past.
    let mut n = 0usize;
    loop {
        if n > MAX_STRING_BYTES {
            return Err(Error::invalid(
                name,
                format!("longer than {MAX_STRING_BYTES} bytes or not NUL-terminated"),
            ));
        }
        // SAFETY: the caller promised a readable string up to its NUL; `n` has not passed the
        // NUL yet (every earlier byte was non-zero) and is within the limit checked above.
        if unsafe { *bytes.add(n) } == 0 {
            break;
        }
        n += 1;
    }
    // SAFETY: the `n` bytes before the NUL were just read through the same pointer; the
    // caller promised nothing writes them during the call.
    let raw = unsafe { std::slice::from_raw_parts(bytes, n) };
    std::str::from_utf8(raw).map_err(|source| Error::Utf8 { name, source })
}

/// As [`c_str`], but NULL is `None`.
///
/// # Safety
/// As [`c_str`].
pub(crate) unsafe fn opt_c_str<'a>(
    p: *const c_char,
    name: &'static str,
) -> Result<Option<&'a str>> {
    if p.is_null() {
        return Ok(None);
    }
    // SAFETY: the caller's contract is the one `c_str` needs.
    unsafe { c_str(p, name) }.map(Some)
}

/// Writes `text` into the caller's buffer `buf` of `len` bytes as a NUL-terminated string and
/// its full length (without the NUL) to `out_len`; cuts it at a character boundary and
/// returns [`Error::BufferTooSmall`] when it does not fit.
///
/// # Safety
/// `buf` is NULL with `len == 0` or valid for writes of `len` bytes; `out_len` is NULL or
/// valid for a write of a `usize`.
pub(crate) unsafe fn write_str(
    text: &str,
    buf: *mut c_char,
    len: usize,
    out_len: *mut usize,
    name: &'static str,
) -> Result<()> {
    // SAFETY: the caller's contract for `out_len` is the one `Out::new` needs.
    let out_len = unsafe { Out::new(out_len, "out_len") }?;
    // SAFETY: the caller's contract for `buf` is the one `OutBuf::new` needs (its one other
    // pointer, `out_len`, is a `usize` it does not share bytes with).
    let mut out = unsafe { OutBuf::new(buf.cast::<u8>(), len, name) }?;
    out_len.write(text.len());
    if out.capacity() > text.len() {
        out.push(text.as_bytes(), name)?;
        out.push(&[0], name)?;
        return Ok(());
    }
    if out.capacity() > 0 {
        let mut cut = out.capacity() - 1;
        while !text.is_char_boundary(cut) {
            cut -= 1;
        }
        out.push(&text.as_bytes()[..cut], name)?;
        out.push(&[0], name)?;
    }
    Err(Error::BufferTooSmall {
        name,
        needed: text.len() as u64 + 1,
        given: len as u64,
    })
}

/// A C struct whose first field is its `size` in bytes, set by the caller, so that it can
/// grow: a caller built against an older header passes a smaller size, and the library reads
/// or writes only the fields that size covers (fields past it take their defaults).
///
/// # Safety
/// Implementors are `#[repr(C)]` with a first field `size: usize`, and every field is valid
/// for any bit pattern (integers, floats, raw pointers; flags are `u8`, not `bool`).
pub(crate) unsafe trait SizedStruct: Copy {
    /// Name in messages.
    const NAME: &'static str;
    /// The size of the first released version (the smallest a caller may pass).
    const MIN_SIZE: usize;
}

/// The caller's `size` of the struct at `p`, checked against what this library knows.
///
/// # Safety
/// `p` is non-NULL, aligned and valid for reads of at least a `usize`.
unsafe fn caller_size<T: SizedStruct>(p: *const T) -> Result<usize> {
    // SAFETY: the caller's contract: `p` is aligned for `T` (so for its first field, a
    // `usize`) and readable for it.
    let size = unsafe { p.cast::<usize>().read() };
    if size < T::MIN_SIZE || size > size_of::<T>() {
        return Err(Error::option(
            T::NAME,
            format!(
                "size {size} is not one this library knows ({}..={}): set `size` to \
                 sizeof({})",
                T::MIN_SIZE,
                size_of::<T>(),
                T::NAME
            ),
        ));
    }
    Ok(size)
}

/// Reads a size-prefixed struct: the fields the caller's size covers, the rest from
/// `defaults`. NULL gives `defaults`.
///
/// # Safety
/// `p` is NULL or points to a readable `T` whose first `size` bytes (its first field) are
/// initialised.
pub(crate) unsafe fn read_sized<T: SizedStruct>(p: *const T, defaults: T) -> Result<T> {
    if p.is_null() {
        return Ok(defaults);
    }
    check_ptr(p, T::NAME)?;
    // SAFETY: `p` is non-NULL and aligned (checked) and readable (the caller's contract).
    let size = unsafe { caller_size(p) }?;
    let mut v = MaybeUninit::new(defaults);
    // SAFETY: `size <= size_of::<T>()` (checked); the caller promised `size` readable bytes at
    // `p`; `v` is a distinct local. `SizedStruct` guarantees any bytes make valid fields.
    unsafe { std::ptr::copy_nonoverlapping(p.cast::<u8>(), v.as_mut_ptr().cast::<u8>(), size) };
    // SAFETY: `v` was initialised from `defaults`, and overwritten bytes are valid fields.
    Ok(unsafe { v.assume_init() })
}

/// A size-prefixed output struct of the caller, checked before any work is done: the library
/// writes the fields its `size` covers (the `size` field stays as the caller set it).
pub(crate) struct OutSized<T> {
    ptr: *mut T,
    size: usize,
}

impl<T: SizedStruct> OutSized<T> {
    /// Checks `p`: not NULL, aligned, a `size` this library knows.
    ///
    /// # Safety
    /// `p` is NULL or points to a `T` whose `size` field the caller set, valid for writes of
    /// `size` bytes for the rest of the call.
    pub(crate) unsafe fn new(p: *mut T) -> Result<OutSized<T>> {
        check_ptr(p, T::NAME)?;
        // SAFETY: `p` is non-NULL and aligned (checked); the caller set its `size` field.
        let size = unsafe { caller_size(p) }?;
        Ok(OutSized { ptr: p, size })
    }

    /// Writes `v`'s fields that the caller's size covers.
    pub(crate) fn write(&self, v: &T) {
        let at = size_of::<usize>();
        // SAFETY: `new` checked `MIN_SIZE <= size <= size_of::<T>()` (and `MIN_SIZE > at`:
        // every struct has fields after `size`), so `at..size` lies within both `*v` and the
        // `size` bytes the caller promised writable at `ptr`; `v` is the library's value, not
        // the caller's memory.
        unsafe {
            std::ptr::copy_nonoverlapping(
                (v as *const T).cast::<u8>().add(at),
                self.ptr.cast::<u8>().add(at),
                self.size - at,
            )
        };
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::panic)]

    use super::*;
    use crate::error::{kvstack_last_error, kvstack_result};

    fn last() -> String {
        let mut buf = [0 as c_char; 512];
        let mut n = 0usize;
        // SAFETY: a local buffer of its length and a local length.
        let rc = unsafe { kvstack_last_error(buf.as_mut_ptr(), buf.len(), &mut n) };
        assert_eq!(rc, kvstack_result::KVSTACK_OK);
        let bytes: Vec<u8> = buf[..n].iter().map(|&c| c as u8).collect();
        String::from_utf8(bytes).unwrap()
    }

    #[test]
    fn a_panic_becomes_a_code_and_its_message_the_last_error() {
        let rc = boundary::call("kvstack_test", || panic!("boom {}", 7));
        assert_eq!(rc, kvstack_result::KVSTACK_PANIC);
        assert_eq!(last(), "panic in kvstack_test: boom 7");
        // A success clears it; an error sets it with its chain.
        assert_eq!(boundary::call("t", || Ok(())), kvstack_result::KVSTACK_OK);
        assert_eq!(last(), "");
        let rc = boundary::call("t", || Err(Error::Null { name: "x" }));
        assert_eq!(rc, kvstack_result::KVSTACK_NULL_ARGUMENT);
        assert_eq!(last(), "argument `x` is NULL");
        // Functions without a code give their fallback.
        assert_eq!(boundary::value("t", 5u32, || panic!("no")), 5);
        assert_eq!(last(), "panic in t: no");
    }

    #[test]
    fn strings_are_bounded_checked_and_cut_at_char_boundaries() {
        // SAFETY: NULL, and local NUL-terminated strings.
        unsafe {
            assert!(matches!(
                c_str(std::ptr::null(), "s"),
                Err(Error::Null { .. })
            ));
            assert_eq!(c_str(c"tenant-a".as_ptr(), "s").unwrap(), "tenant-a");
            let bad = [0xffu8 as c_char, 0];
            assert!(matches!(c_str(bad.as_ptr(), "s"), Err(Error::Utf8 { .. })));
            let long = vec![b'a' as c_char; MAX_STRING_BYTES + 8];
            assert!(matches!(
                c_str(long.as_ptr(), "s"),
                Err(Error::Invalid { .. })
            ));
        }
        let mut buf = [0x55 as c_char; 4];
        let mut n = 0usize;
        // "é" is two bytes: 3 bytes of room hold "a" and the NUL, not half of the "é".
        // SAFETY: a local buffer of its length and a local length.
        let r = unsafe { write_str("aé", buf.as_mut_ptr(), 3, &mut n, "b") };
        assert!(matches!(r, Err(Error::BufferTooSmall { needed: 4, .. })));
        assert_eq!(n, 3);
        assert_eq!(buf[..3], [b'a' as c_char, 0, 0x55]);
        // SAFETY: as above.
        unsafe { write_str("aé", buf.as_mut_ptr(), 4, &mut n, "b") }.unwrap();
        assert_eq!(buf[3], 0);
        // SAFETY: a size query with no buffer.
        let r = unsafe { write_str("abc", std::ptr::null_mut(), 0, &mut n, "b") };
        assert!(matches!(r, Err(Error::BufferTooSmall { .. })));
        assert_eq!(n, 3);
    }

    #[test]
    fn arrays_are_checked_before_use() {
        let v = [1u32, 2, 3];
        // SAFETY: NULL with lengths, and a local array with its length.
        unsafe {
            assert!(
                slice::<u32>(std::ptr::null(), 0, 10, "t")
                    .unwrap()
                    .is_empty()
            );
            assert!(matches!(
                slice::<u32>(std::ptr::null(), 1, 10, "t"),
                Err(Error::Null { .. })
            ));
            assert!(matches!(
                slice(v.as_ptr(), 3, 2, "t"),
                Err(Error::Invalid { .. })
            ));
            let odd = v.as_ptr().cast::<u8>().add(1).cast::<u32>();
            assert!(matches!(slice(odd, 1, 10, "t"), Err(Error::Invalid { .. })));
            assert_eq!(slice(v.as_ptr(), 3, 3, "t").unwrap(), &v);
        }
    }
}
