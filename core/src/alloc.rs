//! Size-class free lists in front of another allocator: the proxy-wasm filter's global allocator
//! in the VM (`filter/src/lib.rs`).
//!
//! A request in the filter allocates and frees about a dozen blocks (the header pairs and body
//! the host hands over, the prompt text, the anchors, the load view, the in-flight record, the
//! destination, ...). Behind `malloc` and `free` on wasm32-wasip1 is wasi-libc's dlmalloc, about
//! 250 instructions per allocation and free in V8 (`make profile-wasm-instr`, 2026-12-02: dlmalloc,
//! dlfree, malloc and free together 2,883 instructions of the filter's 50,512 per request). Here a
//! freed block goes on the list of its size class (powers of two from 16 bytes to 64 KiB) and the
//! next allocation of that class takes it back: a few loads and stores. Larger or over-aligned
//! blocks, and a class's first blocks, come from the allocator behind.
//!
//! A class keeps at most [`RETAIN_BYTES`] on its list; a free beyond that goes back to the
//! allocator behind, so memory a burst of one size used returns to where every size can reuse it
//! (a wasm VM's memory never shrinks, so a retained block costs no more than one dlmalloc keeps).
//! Blocks are their class's size, up to twice what was asked: the price of the fast path.
//!
//! Not thread-safe: the lists are plain cells. Only a wasm32 build without the `atomics` feature
//! (a proxy-wasm VM: one thread, no way to start another) may use it as the global allocator;
//! [`SizeClasses`] is `Sync` there only.

use std::alloc::{GlobalAlloc, Layout};
use std::cell::UnsafeCell;
use std::ptr::{self, null_mut};

/// log2 of the smallest class (16 bytes: room for the list's next pointer, and the alignment
/// every class block has).
const MIN_SHIFT: u32 = 4;
/// log2 of the largest class (64 KiB); anything larger goes to the allocator behind.
const MAX_SHIFT: u32 = 16;
const CLASSES: usize = (MAX_SHIFT - MIN_SHIFT + 1) as usize;
/// Alignment of every class block; a layout asking for more goes to the allocator behind.
const ALIGN: usize = 1 << MIN_SHIFT;
/// Bytes of free blocks one class keeps at most (13 classes: at most 3.25 MiB kept in all).
pub const RETAIN_BYTES: usize = 256 << 10;

/// The free lists: per class the first free block (each free block holds the next one's address
/// in its first bytes) and the bytes kept.
struct Lists {
    heads: [*mut u8; CLASSES],
    kept: [usize; CLASSES],
}

/// See the module docs. `A` is the allocator behind (`std::alloc::System` in the filter).
pub struct SizeClasses<A: GlobalAlloc> {
    behind: A,
    lists: UnsafeCell<Lists>,
}

// SAFETY: a wasm32 module without the `atomics` target feature runs on one thread and cannot
// start another, so the lists are never reached from two threads.
#[cfg(all(target_arch = "wasm32", not(target_feature = "atomics")))]
unsafe impl<A: GlobalAlloc + Sync> Sync for SizeClasses<A> {}

impl<A: GlobalAlloc> SizeClasses<A> {
    pub const fn new(behind: A) -> Self {
        SizeClasses {
            behind,
            lists: UnsafeCell::new(Lists {
                heads: [null_mut(); CLASSES],
                kept: [0; CLASSES],
            }),
        }
    }

    /// Bytes of free blocks kept in class `class` (0 for no such class).
    #[cfg(test)]
    fn kept(&self, class: usize) -> usize {
        // SAFETY: one thread (see the type's docs); a copy out, no reference kept.
        let lists = unsafe { &*self.lists.get() };
        lists.kept.get(class).copied().unwrap_or(0)
    }
}

impl<A: GlobalAlloc> Drop for SizeClasses<A> {
    /// Gives the kept blocks back (an instance in a test; the global one is never dropped).
    fn drop(&mut self) {
        let lists = self.lists.get_mut();
        for (c, head) in lists.heads.iter_mut().enumerate() {
            while !head.is_null() {
                let p = *head;
                // SAFETY: a free block of class `c`, allocated behind with `block(c)`; its first
                // bytes hold the next one's address.
                unsafe {
                    *head = p.cast::<*mut u8>().read();
                    self.behind.dealloc(p, block(c));
                }
            }
        }
    }
}

impl<A: GlobalAlloc> SizeClasses<A> {
    /// The allocator behind, out of line: `alloc`'s fast path inlines at every allocation site,
    /// this call does not.
    #[cold]
    #[inline(never)]
    unsafe fn alloc_behind(&self, layout: Layout) -> *mut u8 {
        self.behind.alloc(layout)
    }
}

/// The class of `layout` (0 for up to 16 bytes, 1 for 17-32, ...), `None` for a block larger
/// than the largest class or aligned more than [`ALIGN`].
pub fn class_of(layout: Layout) -> Option<usize> {
    if layout.align() > ALIGN || layout.size() > 1 << MAX_SHIFT {
        return None;
    }
    // Bits of size - 1: the log2 of the smallest power of two >= size (0 for sizes 0 and 1).
    let bits = usize::BITS - layout.size().saturating_sub(1).leading_zeros();
    Some((bits.max(MIN_SHIFT) - MIN_SHIFT) as usize)
}

/// The layout every block of `class` is allocated with from the allocator behind.
fn block(class: usize) -> Layout {
    // SAFETY: a power of two of at most 64 KiB, aligned to 16 (a power of two no larger).
    unsafe { Layout::from_size_align_unchecked(1 << (class as u32 + MIN_SHIFT), ALIGN) }
}

unsafe impl<A: GlobalAlloc> GlobalAlloc for SizeClasses<A> {
    #[inline]
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let Some(c) = class_of(layout) else {
            return self.alloc_behind(layout);
        };
        // SAFETY: one thread (see the type's docs), and no other reference to the lists lives
        // across this call (the allocator behind never calls back into this one).
        let lists = &mut *self.lists.get();
        let (Some(head), Some(kept)) = (lists.heads.get_mut(c), lists.kept.get_mut(c)) else {
            return self.alloc_behind(layout);
        };
        let free = *head;
        if free.is_null() {
            return self.alloc_behind(block(c));
        }
        // SAFETY: a block on the list is free, at least 16 bytes and 16-aligned, and holds the
        // next free block's address in its first bytes (written by `dealloc`).
        *head = free.cast::<*mut u8>().read();
        *kept -= block(c).size();
        free
    }

    /// Out of line: inlined at every free as well (far more sites than allocations), the
    /// filter's `.wasm` grew by a further ~67 KB for ~430 fewer instructions per request.
    #[inline(never)]
    unsafe fn dealloc(&self, p: *mut u8, layout: Layout) {
        let Some(c) = class_of(layout) else {
            return self.behind.dealloc(p, layout);
        };
        // SAFETY: as in `alloc`.
        let lists = &mut *self.lists.get();
        let size = block(c).size();
        match (lists.heads.get_mut(c), lists.kept.get_mut(c)) {
            (Some(head), Some(kept)) if *kept + size <= RETAIN_BYTES => {
                // SAFETY: `p` is a block of class `c` the caller gives up (GlobalAlloc's
                // contract: allocated here with a layout of the same class), so at least 16
                // bytes and 16-aligned: its first bytes take the list's link.
                p.cast::<*mut u8>().write(*head);
                *head = p;
                *kept += size;
            }
            _ => self.behind.dealloc(p, block(c)),
        }
    }

    unsafe fn realloc(&self, p: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: GlobalAlloc's contract for `realloc`: `new_size` with `layout`'s alignment is
        // a valid layout.
        let new = Layout::from_size_align_unchecked(new_size, layout.align());
        match (class_of(layout), class_of(new)) {
            // The block already has room: its class's size.
            (Some(a), Some(b)) if a == b => p,
            (None, None) => self.behind.realloc(p, layout, new_size),
            _ => {
                let q = self.alloc(new);
                if !q.is_null() {
                    // SAFETY: both blocks hold at least the smaller size, and are distinct.
                    ptr::copy_nonoverlapping(p, q, layout.size().min(new_size));
                    self.dealloc(p, layout);
                }
                q
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::alloc::System;

    fn layout(size: usize, align: usize) -> Layout {
        Layout::from_size_align(size, align).unwrap()
    }

    #[test]
    fn classes_are_the_next_power_of_two_from_16_bytes_to_64_kib() {
        let cases = [
            (0, Some(0)),
            (1, Some(0)),
            (16, Some(0)),
            (17, Some(1)),
            (32, Some(1)),
            (33, Some(2)),
            (4097, Some(9)),
            (65536, Some(12)),
            (65537, None),
        ];
        for (size, want) in cases {
            assert_eq!(class_of(layout(size, 1)), want, "size {size}");
        }
        assert_eq!(class_of(layout(8, 16)), Some(0));
        assert_eq!(class_of(layout(8, 32)), None, "over-aligned");
    }

    #[test]
    fn a_freed_block_is_handed_out_again_for_its_class() {
        let a = SizeClasses::new(System);
        unsafe {
            let p = a.alloc(layout(100, 8));
            a.dealloc(p, layout(100, 8));
            assert_eq!(a.kept(3), 128);
            // Another size of the same class (65-128 bytes) takes the same block.
            let q = a.alloc(layout(70, 1));
            assert_eq!(q, p);
            assert_eq!(a.kept(3), 0);
            // Another class does not.
            let r = a.alloc(layout(200, 8));
            assert_ne!(r, p);
            a.dealloc(q, layout(70, 1));
            a.dealloc(r, layout(200, 8));
        }
    }

    #[test]
    fn a_class_keeps_at_most_retain_bytes() {
        let a = SizeClasses::new(System);
        let l = layout(60_000, 1);
        let per = 1 << 16;
        let n = RETAIN_BYTES / per + 3;
        unsafe {
            let blocks: Vec<*mut u8> = (0..n).map(|_| a.alloc(l)).collect();
            for p in blocks {
                a.dealloc(p, l);
            }
        }
        assert_eq!(a.kept(12), RETAIN_BYTES);
    }

    #[test]
    fn realloc_within_a_class_keeps_the_block_and_across_classes_keeps_the_bytes() {
        let a = SizeClasses::new(System);
        unsafe {
            let p = a.alloc(layout(20, 1));
            p.copy_from_nonoverlapping(b"0123456789abcdefghij".as_ptr(), 20);
            assert_eq!(a.realloc(p, layout(20, 1), 32), p);
            let q = a.realloc(p, layout(32, 1), 100_000);
            assert_ne!(q, p);
            assert_eq!(std::slice::from_raw_parts(q, 20), b"0123456789abcdefghij");
            // The old block went on its list.
            assert_eq!(a.kept(1), 32);
            let r = a.realloc(q, layout(100_000, 1), 10);
            assert_eq!(std::slice::from_raw_parts(r, 10), b"0123456789");
            a.dealloc(r, layout(10, 1));
        }
    }

    proptest::proptest! {
        /// Any sequence of allocations, frees and reallocations: live blocks never overlap, are
        /// aligned as asked, and keep what was written to them; the lists keep no more than
        /// their limit.
        #[test]
        fn live_blocks_stay_apart_and_keep_their_bytes(ops in proptest::collection::vec(
            (0u8..4, 0usize..3000, proptest::prelude::any::<proptest::sample::Index>()), 1..200)
        ) {
            let a = SizeClasses::new(System);
            // (pointer, layout, the byte every position was filled with)
            let mut live: Vec<(*mut u8, Layout, u8)> = Vec::new();
            for (n, (op, size, pick)) in ops.into_iter().enumerate() {
                let fill = n as u8;
                // Sizes over the largest class now and then, alignments 1 to 64.
                let size = if size % 97 == 0 { size * 40 } else { size } + 1;
                let align = 1 << (size % 7);
                unsafe {
                    match op {
                        0 | 1 => {
                            let l = layout(size, align);
                            let p = a.alloc(l);
                            proptest::prop_assert!(!p.is_null());
                            proptest::prop_assert_eq!(p as usize % align, 0);
                            p.write_bytes(fill, size);
                            live.push((p, l, fill));
                        }
                        2 if !live.is_empty() => {
                            let (p, l, _) = live.swap_remove(pick.index(live.len()));
                            a.dealloc(p, l);
                        }
                        3 if !live.is_empty() => {
                            let i = pick.index(live.len());
                            let (p, l, old) = live[i];
                            let q = a.realloc(p, l, size);
                            let kept = l.size().min(size);
                            proptest::prop_assert!(std::slice::from_raw_parts(q, kept).iter().all(|&b| b == old));
                            q.write_bytes(fill, size);
                            live[i] = (q, layout(size, l.align()), fill);
                        }
                        _ => {}
                    }
                    let mut spans: Vec<(usize, usize)> = live.iter().map(|(p, l, _)| (*p as usize, l.size())).collect();
                    spans.sort_unstable();
                    for w in spans.windows(2) {
                        proptest::prop_assert!(w[0].0 + w[0].1 <= w[1].0, "overlap");
                    }
                    for (p, l, f) in &live {
                        proptest::prop_assert!(std::slice::from_raw_parts(*p, l.size()).iter().all(|b| b == f));
                    }
                }
            }
            for c in 0..CLASSES {
                proptest::prop_assert!(a.kept(c) <= RETAIN_BYTES);
            }
            for (p, l, _) in live {
                unsafe { a.dealloc(p, l) };
            }
        }
    }
}
