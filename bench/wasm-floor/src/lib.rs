//! The cost floor of a proxy-wasm body-based router, for `make bench-envoy`.
//!
//! What every proxy-wasm filter that routes on the body and picks the endpoint has to do per
//! request, and nothing more: read the request headers (one host call) and drop client-sent
//! internal headers; pause the headers until the body is in; copy the body into the VM; find
//! the `model` value; add the pool, model and destination headers (the destination round robin
//! over the configured endpoints, a decision that costs nothing); continue. No JSON validation,
//! no prefix hashing, no scoring, no shared data, no per-request state, no metrics, no response
//! callbacks. Measured beside plain Envoy and the real filter, it shows how much of Envoy's
//! requests/s a proxy-wasm filter doing this job can keep at best: the part of the filter's
//! cost that no work on the filter's own code can remove.
//!
//! Plugin configuration (JSON, the filter's own shape plus one key; other keys are ignored):
//! `{"pools": [{"name": "llama", ...}], "floor_endpoints": ["127.0.0.1:9001", ...]}`.
//! Only the first pool's name and the endpoint strings are read, by a plain text search (this
//! is a benchmark reference, not a configuration parser).
//!
//! With the `trap` feature (a test build, `make wasm` puts it in `target/wasm-trap/`) the module
//! also executes `unreachable` when a request body contains `TRAP`: the VM fails, as it would on
//! a trap in any module. The filter has no panic path, so nothing in it can fail on purpose;
//! `tests/e2e/test_filter.py` uses this build to check what the shipped `failure_policy` and
//! route tables make of a worker whose VM failed, under a real Envoy.
//!
//! With the `callbacks` feature (`make wasm` puts it in `target/wasm-floor-callbacks/`) the
//! module also exports, empty, the three callbacks the filter needs beyond the floor: the
//! response headers (the debug header), the response body (a stream's first chunk ends its
//! prefill) and the context's deletion (the request leaves the in-flight table). Envoy calls
//! each one it finds exported, so this build is the floor of a filter that does the filter's
//! job with those three: `scripts/envoy_overhead.py --compare-floor` measures it.
//!
//! With the `experiments` feature (`make wasm` puts it in `target/wasm-floor-experiments/`) the
//! module also does, per request, the extra work its configuration asks for (see
//! `experiments.rs`: VM time, memory traffic, distinct code), for `scripts/envoy_profile.py
//! --compare-floor`.

#[cfg(feature = "experiments")]
mod experiments;

use std::cell::RefCell;
use std::mem::MaybeUninit;

extern "C" {
    fn proxy_get_buffer_bytes(
        buffer_type: u32,
        start: usize,
        max_size: usize,
        return_buffer_data: *mut *mut u8,
        return_buffer_size: *mut usize,
    ) -> u32;
    fn proxy_get_header_map_pairs(
        map_type: u32,
        return_map_data: *mut *mut u8,
        return_map_size: *mut usize,
    ) -> u32;
    fn proxy_add_header_map_value(
        map_type: u32,
        key_data: *const u8,
        key_size: usize,
        value_data: *const u8,
        value_size: usize,
    ) -> u32;
    fn proxy_remove_header_map_value(map_type: u32, key_data: *const u8, key_size: usize) -> u32;
}

const REQUEST_HEADERS: u32 = 0;
const REQUEST_BODY: u32 = 0;
const PLUGIN_CONFIGURATION: u32 = 7;
const CONTINUE: u32 = 0;
const PAUSE: u32 = 1;

#[derive(Default)]
struct Floor {
    pool: String,
    endpoints: Vec<String>,
    next: usize,
    #[cfg(feature = "experiments")]
    experiments: experiments::Experiments,
}

thread_local! {
    static FLOOR: RefCell<Floor> = RefCell::new(Floor::default());
}

/// Takes a buffer the host filled through `proxy_on_memory_allocate`.
///
/// # Safety
/// `data` must be null or what `proxy_on_memory_allocate(size)` returned.
unsafe fn take(data: *mut u8, size: usize) -> Vec<u8> {
    if data.is_null() {
        return Vec::new();
    }
    // SAFETY: allocated by `proxy_on_memory_allocate` as exactly `size` bytes of capacity.
    unsafe { Vec::from_raw_parts(data, size, size) }
}

fn buffer(kind: u32, size: usize) -> Vec<u8> {
    let mut data = std::ptr::null_mut();
    let mut len = 0;
    // SAFETY: host call with valid out-pointers; on success the host allocated `data`.
    unsafe {
        if proxy_get_buffer_bytes(kind, 0, size, &mut data, &mut len) != 0 {
            return Vec::new();
        }
        take(data, len)
    }
}

fn add_header(name: &str, value: &[u8]) {
    // SAFETY: pointers and lengths of live slices.
    unsafe {
        proxy_add_header_map_value(
            REQUEST_HEADERS,
            name.as_ptr(),
            name.len(),
            value.as_ptr(),
            value.len(),
        );
    }
}

/// The JSON string value after `"key"` (and a colon) in `text`, without its quotes; `None` when
/// absent or not a plain string.
fn string_after<'a>(text: &'a [u8], key: &[u8]) -> Option<&'a [u8]> {
    if key.is_empty() {
        return None;
    }
    let at = text.windows(key.len()).position(|w| w == key)? + key.len();
    quoted(text.get(at..)?)
}

/// The first plain JSON string in `text`, without its quotes (`None` if it holds an escape).
fn quoted(text: &[u8]) -> Option<&[u8]> {
    let value = text.get(text.iter().position(|&c| c == b'"')? + 1..)?;
    let close = value.iter().position(|&c| c == b'"' || c == b'\\')?;
    (value.get(close) == Some(&b'"')).then_some(value.get(..close)?)
}

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
pub extern "C" fn proxy_on_configure(_context_id: u32, size: usize) -> u32 {
    let raw = buffer(PLUGIN_CONFIGURATION, size);
    // The ingest listener's plugin shares this VM (same vm_id) with a configuration of its own;
    // only the traffic listener's, the one with endpoints, is kept (one state for the VM).
    if let Some((pool, endpoints)) = parse_config(&raw) {
        FLOOR.with(|f| {
            if let Ok(mut f) = f.try_borrow_mut() {
                f.pool = pool;
                f.endpoints = endpoints;
                #[cfg(feature = "experiments")]
                {
                    f.experiments = experiments::Experiments::from_config(&raw);
                }
            }
        });
    }
    1
}

/// The first pool's name and the `floor_endpoints` list; `None` without that list.
fn parse_config(raw: &[u8]) -> Option<(String, Vec<String>)> {
    const KEY: &[u8] = b"\"floor_endpoints\"";
    let at = raw.windows(KEY.len()).position(|w| w == KEY)? + KEY.len();
    let after = raw.get(at..)?;
    let list = after.get(after.iter().position(|&c| c == b'[')? + 1..)?;
    let list = list.get(..list.iter().position(|&c| c == b']')?)?;
    let endpoints = list
        .split(|&c| c == b',')
        .filter_map(|item| {
            let addr = quoted(item)?;
            (!addr.is_empty()).then(|| String::from_utf8_lossy(addr).into_owned())
        })
        .collect();
    let pool = string_after(raw, b"\"name\"").unwrap_or(b"default");
    Some((String::from_utf8_lossy(pool).into_owned(), endpoints))
}

#[no_mangle]
pub extern "C" fn proxy_on_request_headers(_context_id: u32, _n: usize, end: u32) -> u32 {
    let mut data = std::ptr::null_mut();
    let mut size = 0;
    // SAFETY: host call with valid out-pointers; on success the host allocated `data`.
    let raw = unsafe {
        if proxy_get_header_map_pairs(REQUEST_HEADERS, &mut data, &mut size) != 0 {
            return CONTINUE;
        }
        take(data, size)
    };
    // Client-sent internal headers go, as in the real filter (found by the same cheap test: a
    // header name starting "x-gateway-"; the pairs' layout is not decoded further).
    let forged = raw.windows(10).filter(|w| *w == b"x-gateway-").count();
    if forged > 0 {
        for name in [
            "x-gateway-destination-endpoint",
            "x-gateway-pool",
            "x-gateway-model-name",
        ] {
            // SAFETY: pointer and length of a live str.
            unsafe { proxy_remove_header_map_value(REQUEST_HEADERS, name.as_ptr(), name.len()) };
        }
    }
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
    let body = buffer(REQUEST_BODY, size);
    #[cfg(feature = "trap")]
    if body.windows(4).any(|w| w == b"TRAP") {
        #[cfg(target_arch = "wasm32")]
        core::arch::wasm32::unreachable();
        #[cfg(not(target_arch = "wasm32"))]
        std::process::abort();
    }
    let model = string_after(&body, b"\"model\"").unwrap_or_default();
    FLOOR.with(|f| {
        let Ok(mut f) = f.try_borrow_mut() else {
            return;
        };
        #[cfg(feature = "experiments")]
        {
            let seed = body.len() as u64 ^ ((f.next as u64) << 20);
            f.experiments.run(seed);
        }
        add_header("x-gateway-pool", f.pool.as_bytes());
        add_header("x-gateway-model-name", model);
        if !f.endpoints.is_empty() {
            let i = f.next % f.endpoints.len();
            f.next = f.next.wrapping_add(1);
            if let Some(dest) = f.endpoints.get(i) {
                add_header("x-gateway-destination-endpoint", dest.as_bytes());
            }
        }
    });
    CONTINUE
}

/// The response headers: Envoy calls it for every response once it is exported.
#[cfg(feature = "callbacks")]
#[no_mangle]
pub extern "C" fn proxy_on_response_headers(_context_id: u32, _n: usize, _end: u32) -> u32 {
    CONTINUE
}

/// Each chunk of the response body.
#[cfg(feature = "callbacks")]
#[no_mangle]
pub extern "C" fn proxy_on_response_body(_context_id: u32, _size: usize, _end: u32) -> u32 {
    CONTINUE
}

/// The end of a context (for a stream: after its access log).
#[cfg(feature = "callbacks")]
#[no_mangle]
pub extern "C" fn proxy_on_delete(_context_id: u32) {}

#[cfg(test)]
mod tests {
    use super::{parse_config, string_after};

    #[test]
    fn reads_the_pool_and_the_endpoints() {
        let raw = br#"{"pools":[{"name":"llama","models":["m"]}],"floor_endpoints":["127.0.0.1:1", "127.0.0.1:22"],"ingest":{}}"#;
        let (pool, endpoints) = parse_config(raw).unwrap();
        assert_eq!(pool, "llama");
        assert_eq!(endpoints, ["127.0.0.1:1", "127.0.0.1:22"]);
        assert!(parse_config(br#"{"pools":[],"ingest":{"token":"t"}}"#).is_none());
    }

    #[test]
    fn finds_the_model_string() {
        let body = br#"{"model": "llama-3-8b", "messages": []}"#;
        assert_eq!(string_after(body, b"\"model\""), Some(&b"llama-3-8b"[..]));
        assert_eq!(string_after(b"{}", b"\"model\""), None);
        // An escaped model is not read (the floor adds an empty model header then).
        assert_eq!(string_after(br#"{"model":"a\"b"}"#, b"\"model\""), None);
        assert_eq!(string_after(br#"{"model":"ab"}"#, b""), None);
    }
}
