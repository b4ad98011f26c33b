//! Byte-level helpers for the request path, written for what they compile to on wasm32 in V8:
//! there `memory.copy` (what `push_str` and `to_string` become) is a call out of the wasm code
//! into a C function with a fixed cost of ~80 instructions, and wasi-libc's `memcmp` (behind
//! `==` on strings and slices, and every string-keyed map lookup) a loop of one byte per
//! iteration behind a call. Natively they are the plain std operations or equivalent to them
//! (the tests check each against std; `make wasm-test` runs them compiled to wasm32).

/// `text.push_str(s)`. On wasm32 with SIMD, when the room is already reserved, the bytes are
/// copied in the wasm code itself, sixteen at a time (a short string in two overlapping words):
/// `push_str` compiles to `memory.copy`, which V8 runs as a call out of the wasm code into a C
/// function, a fixed cost (~80 instructions) larger than copying a role or a message's content.
/// The blocks are moved with the SIMD load and store intrinsics: a plain loop of 16-byte copies
/// LLVM turns back into `memory.copy` (measured: 1,200 more instructions per request, not fewer).
#[inline(always)]
pub fn append(text: &mut String, s: &str) {
    #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
    {
        use std::arch::wasm32::{v128, v128_load, v128_store};
        let n = s.len();
        if text.capacity() - text.len() < n {
            text.push_str(s);
            return;
        }
        // SAFETY: the room for `n` more bytes after `len` was checked above. Every read is
        // inside `s` (a 16-byte block at an offset <= n - 16, an 8- or 4-byte word at 0 and at
        // n - 8 or n - 4, or a single byte below n), every write at the same offset of the room;
        // unaligned reads and writes are allowed. Overlapping blocks write the same bytes twice.
        // The bytes written are `s`'s, so the buffer stays UTF-8 once its length is `len + n`.
        unsafe {
            let v = text.as_mut_vec();
            let len = v.len();
            let dst = v.as_mut_ptr().add(len);
            let src = s.as_ptr();
            if n >= 16 {
                let mut i = 0;
                while i + 16 < n {
                    v128_store(
                        dst.add(i).cast::<v128>(),
                        v128_load(src.add(i).cast::<v128>()),
                    );
                    i += 16;
                }
                let last = v128_load(src.add(n - 16).cast::<v128>());
                v128_store(dst.add(n - 16).cast::<v128>(), last);
            } else if n >= 8 {
                two_words::<u64>(src, dst, n);
            } else if n >= 4 {
                two_words::<u32>(src, dst, n);
            } else {
                for i in 0..n {
                    dst.add(i).write(*src.add(i));
                }
            }
            v.set_len(len + n);
        }
    }
    #[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
    text.push_str(s);
}

/// Copies `n` bytes from `src` to `dst` as two words of type `W`, at 0 and at `n - size_of W`
/// (overlapping when `n` is under two words): [`append`]'s copy of a short string.
///
/// # Safety
/// `size_of::<W>() <= n`, `src` readable and `dst` writable for `n` bytes (no alignment needed).
#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
#[inline(always)]
unsafe fn two_words<W: Copy>(src: *const u8, dst: *mut u8, n: usize) {
    let last = n - std::mem::size_of::<W>();
    // SAFETY: both words lie within the `n` bytes the caller vouches for; unaligned access.
    unsafe {
        let (a, b) = (
            src.cast::<W>().read_unaligned(),
            src.add(last).cast::<W>().read_unaligned(),
        );
        dst.cast::<W>().write_unaligned(a);
        dst.add(last).cast::<W>().write_unaligned(b);
    }
}

/// `s.to_string()` through [`append`]: for the short names a request copies (its path, its
/// pool), without a `memory.copy` on wasm32.
pub fn owned(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    append(&mut out, s);
    out
}

/// `b.starts_with(p)` for the short keys, roles and separators the scanner matches, without a
/// call to `memcmp` (`memcmp` had 3.5% of the samples of `make profile-wasm` with the
/// plain-message path before this; none after).
///
/// Eight bytes at a time (four for shorter words), the last word overlapping the one before: a
/// 15-byte separator is two word compares, not fifteen byte compares with a loop each. With `p`
/// a literal, its words are constants.
#[inline(always)]
pub fn has_prefix(b: &[u8], p: &[u8]) -> bool {
    let n = p.len();
    let Some(b) = b.get(..n) else {
        return false;
    };
    if n >= 8 {
        let mut i = 0;
        while i + 8 < n {
            if word::<8>(b, i) != word::<8>(p, i) {
                return false;
            }
            i += 8;
        }
        word::<8>(b, n - 8) == word::<8>(p, n - 8)
    } else if n >= 4 {
        word::<4>(b, 0) == word::<4>(p, 0) && word::<4>(b, n - 4) == word::<4>(p, n - 4)
    } else {
        b.iter().zip(p).all(|(x, y)| x == y)
    }
}

/// The `N` bytes of `b` at `at` as one little-endian integer, `N` 4 or 8 (0 when out of
/// bounds, which [`has_prefix`] never asks for). One unaligned load.
#[inline(always)]
pub(crate) fn word<const N: usize>(b: &[u8], at: usize) -> u64 {
    let Some(bytes) = b.get(at..at + N) else {
        return 0;
    };
    if let Ok(w) = <[u8; 8]>::try_from(bytes) {
        u64::from_le_bytes(w)
    } else if let Ok(w) = <[u8; 4]>::try_from(bytes) {
        u64::from(u32::from_le_bytes(w))
    } else {
        0
    }
}

/// `memcmp` of the first `min(a.len(), b.len())` bytes: negative, zero or positive as the first
/// byte that differs is smaller in `a`, absent, or larger. Eight bytes per step (four for
/// shorter slices), the last word overlapping the one before, where wasi-libc's `memcmp` takes one
/// byte per step: the filter exports this as its `memcmp` (`filter/src/lib.rs`), so string
/// equality and the string-keyed maps use it. Written with word loads only: nothing here can
/// compile to a call to `memcmp` itself. It keeps a word loop of its own beside
/// [`has_prefix`]'s: one helper shared by both (the first differing pair of words) counted 3,315
/// more instructions per request in the VM, and 1,044 more with this function not inlined
/// (`make profile-wasm-instr`).
pub fn compare(a: &[u8], b: &[u8]) -> i32 {
    let n = a.len().min(b.len());
    let (Some(a), Some(b)) = (a.get(..n), b.get(..n)) else {
        return 0;
    };
    // Words as read are little-endian: byte-swapped, the first byte is the most significant,
    // so integer order is the bytes' order.
    let order = |x: u64, y: u64| match x.swap_bytes().cmp(&y.swap_bytes()) {
        std::cmp::Ordering::Less => -1,
        std::cmp::Ordering::Equal => 0,
        std::cmp::Ordering::Greater => 1,
    };
    if n >= 8 {
        let mut i = 0;
        while i + 8 < n {
            let (x, y) = (word::<8>(a, i), word::<8>(b, i));
            if x != y {
                return order(x, y);
            }
            i += 8;
        }
        order(word::<8>(a, n - 8), word::<8>(b, n - 8))
    } else if n >= 4 {
        let (x, y) = (word::<4>(a, 0), word::<4>(b, 0));
        if x != y {
            return order(x, y);
        }
        order(word::<4>(a, n - 4), word::<4>(b, n - 4))
    } else {
        for (x, y) in a.iter().zip(b) {
            if x != y {
                return i32::from(*x) - i32::from(*y);
            }
        }
        0
    }
}

/// A cursor over bytes this crate encoded (shared-data values, relayed bodies); every read
/// checks the length, so a truncated or corrupt value is an error, never a panic.
pub struct ByteReader<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> ByteReader<'a> {
    pub fn new(b: &'a [u8]) -> ByteReader<'a> {
        ByteReader { b, at: 0 }
    }

    /// Bytes not read yet.
    pub fn left(&self) -> usize {
        self.b.len().saturating_sub(self.at)
    }

    pub fn take(&mut self, n: usize) -> Result<&'a [u8], &'static str> {
        let end = self.at.checked_add(n).ok_or("truncated")?;
        let s = self.b.get(self.at..end).ok_or("truncated")?;
        self.at = end;
        Ok(s)
    }

    pub fn u8(&mut self) -> Result<u8, &'static str> {
        Ok(self.take(1)?[0])
    }

    pub fn u16(&mut self) -> Result<u16, &'static str> {
        let mut a = [0u8; 2];
        a.copy_from_slice(self.take(2)?);
        Ok(u16::from_le_bytes(a))
    }

    pub fn u32(&mut self) -> Result<u32, &'static str> {
        let mut a = [0u8; 4];
        a.copy_from_slice(self.take(4)?);
        Ok(u32::from_le_bytes(a))
    }

    pub fn u64(&mut self) -> Result<u64, &'static str> {
        let mut a = [0u8; 8];
        a.copy_from_slice(self.take(8)?);
        Ok(u64::from_le_bytes(a))
    }

    pub fn f64(&mut self) -> Result<f64, &'static str> {
        Ok(f64::from_bits(self.u64()?))
    }

    /// A string written by [`put_str`]: its length (u32), then its UTF-8 bytes.
    pub fn str(&mut self) -> Result<&'a str, &'static str> {
        let n = self.u32()? as usize;
        std::str::from_utf8(self.take(n)?).map_err(|_| "not UTF-8")
    }
}

/// Writes `s` as [`ByteReader::str`] reads it.
pub fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u32).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `append` is `push_str` at every length (each of its copy paths: bytes, two 4- or 8-byte
    /// words, 16-byte blocks with an overlapping last one), with and without room reserved,
    /// after text of any length; under `make wasm-test` this runs its wasm32 SIMD copy.
    #[test]
    fn append_equals_push_str() {
        let source: String = (0..200u8).map(|i| char::from(b'a' + i % 26)).collect();
        for before in [0usize, 1, 7, 16, 33] {
            for n in 0..70 {
                for reserve in [false, true] {
                    let mut got = source[..before].to_string();
                    if reserve {
                        got.reserve(n);
                    }
                    let mut want = got.clone();
                    append(&mut got, &source[before..before + n]);
                    want.push_str(&source[before..before + n]);
                    assert_eq!(got, want, "before {before}, n {n}, reserve {reserve}");
                }
            }
        }
        // Multi-byte characters are copied as bytes.
        let mut got = String::with_capacity(64);
        append(&mut got, "é and 日本語 and 🙂, sixteen bytes and more");
        assert_eq!(got, "é and 日本語 and 🙂, sixteen bytes and more");
    }

    proptest::proptest! {
            /// The word compares agree with `starts_with` at every length (under 4, 4-7, 8, and
            /// longer words whose last word overlaps), for prefixes that match, differ in one byte
            /// anywhere, or run past the end.
            #[test]
            fn has_prefix_equals_starts_with(
                b in proptest::collection::vec(0u8..4, 0..40),
                n in 0usize..41,
                flip in proptest::option::of(proptest::prelude::any::<proptest::sample::Index>()),
            ) {
                let mut p: Vec<u8> = b.iter().copied().chain(std::iter::repeat(7)).take(n).collect();
                if let (Some(at), false) = (flip, p.is_empty()) {
                    let at = at.index(p.len());
                    p[at] ^= 1;
                }
                proptest::prop_assert_eq!(has_prefix(&b, &p), b.starts_with(&p));
            }

        /// `compare` orders as `memcmp` would (the slices' `Ord`) at every length, for slices
        /// that are equal, differ in one byte anywhere (in either direction), or differ in
        /// several.
        #[test]
        fn compare_orders_as_slices_do(
            a in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..40),
            flips in proptest::collection::vec((proptest::prelude::any::<proptest::sample::Index>(), 1u8..=255), 0..3),
        ) {
            let mut b = a.clone();
            for (at, x) in flips {
                if !b.is_empty() {
                    let at = at.index(b.len());
                    b[at] = b[at].wrapping_add(x);
                }
            }
            let want = a.cmp(&b) as i32;
            proptest::prop_assert_eq!(compare(&a, &b).signum(), want);
            proptest::prop_assert_eq!(compare(&b, &a).signum(), -want);
        }
    }

    #[test]
    fn compare_reads_only_the_common_length() {
        assert_eq!(compare(b"abcdefghij", b"abc"), 0);
        assert_eq!(compare(b"", b"x"), 0);
        assert!(compare(b"abcdefghiZ", b"abcdefghia") < 0);
        assert!(compare(b"\xff", b"\x01") > 0);
    }
}
