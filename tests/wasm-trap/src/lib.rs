//! A test fixture, not part of the product: a proxy-wasm module that stands in for the filter
//! in a VM that fails.
//!
//! The gpuroute filter has no panic path (a trap would take its VM down), so nothing in it can
//! be made to fail on purpose. This module does what the end-to-end test needs and no more: it
//! pauses each request until the body is in, sets `x-gateway-pool` to `llama` (so the shipped
//! route table sends the request to that pool's cluster, as after the filter's decision), and
//! executes `unreachable` (a trap: the VM fails) when the body contains `TRAP`. With it,
//! `tests/e2e/test_filter.py` checks what the shipped `failure_policy` makes of a failed VM
//! under a real Envoy.

use std::mem::MaybeUninit;

extern "C" {
    fn proxy_get_buffer_bytes(
        buffer_type: u32,
        start: usize,
        max_size: usize,
        return_buffer_data: *mut *mut u8,
        return_buffer_size: *mut usize,
    ) -> u32;
    fn proxy_add_header_map_value(
        map_type: u32,
        key_data: *const u8,
        key_size: usize,
        value_data: *const u8,
        value_size: usize,
    ) -> u32;
}

const REQUEST_HEADERS: u32 = 0;
const REQUEST_BODY: u32 = 0;
const CONTINUE: u32 = 0;
const PAUSE: u32 = 1;
const POOL: &str = "llama";

#[no_mangle]
pub extern "C" fn proxy_abi_version_0_2_1() {}

#[no_mangle]
pub extern "C" fn proxy_on_memory_allocate(size: usize) -> *mut u8 {
    let mut v: Vec<MaybeUninit<u8>> = Vec::with_capacity(size);
    // SAFETY: handed to the host to fill before anyone reads it.
    unsafe { v.set_len(size) };
    Box::into_raw(v.into_boxed_slice()) as *mut u8
}

#[no_mangle]
pub extern "C" fn proxy_on_context_create(_context_id: u32, _root_context_id: u32) {}

#[no_mangle]
pub extern "C" fn proxy_on_vm_start(_context_id: u32, _size: usize) -> u32 {
    1
}

#[no_mangle]
pub extern "C" fn proxy_on_configure(_context_id: u32, _size: usize) -> u32 {
    1
}

#[no_mangle]
pub extern "C" fn proxy_on_request_headers(_context_id: u32, _n: usize, end: u32) -> u32 {
    if end != 0 {
        CONTINUE
    } else {
        PAUSE
    }
}

#[no_mangle]
pub extern "C" fn proxy_on_request_body(_context_id: u32, size: usize, end: u32) -> u32 {
    if end == 0 {
        return PAUSE;
    }
    let mut data = std::ptr::null_mut();
    let mut len = 0;
    // SAFETY: host call with valid out-pointers; on success the host allocated `data` through
    // `proxy_on_memory_allocate`, as a boxed slice of exactly `len` bytes.
    let body = unsafe {
        if proxy_get_buffer_bytes(REQUEST_BODY, 0, size, &mut data, &mut len) != 0 || data.is_null()
        {
            Vec::new()
        } else {
            Vec::from_raw_parts(data, len, len)
        }
    };
    if body.windows(4).any(|w| w == b"TRAP") {
        // The VM fails here, as it would on a trap in any module.
        #[cfg(target_arch = "wasm32")]
        core::arch::wasm32::unreachable();
        #[cfg(not(target_arch = "wasm32"))]
        std::process::abort();
    }
    let name = "x-gateway-pool";
    // SAFETY: pointers and lengths of live strs.
    unsafe {
        proxy_add_header_map_value(
            REQUEST_HEADERS,
            name.as_ptr(),
            name.len(),
            POOL.as_ptr(),
            POOL.len(),
        );
    }
    CONTINUE
}

#[no_mangle]
pub extern "C" fn proxy_on_done(_context_id: u32) -> u32 {
    1
}

#[no_mangle]
pub extern "C" fn proxy_on_delete(_context_id: u32) {}
