//! The proxy-wasm ABI 0.2.1 surface of the filter: the host's constants and the callbacks the
//! filter exports, dispatched to `Root` and `Http` contexts.
//!
//! Why not the proxy-wasm SDK's dispatcher: the SDK exports every callback of the ABI
//! (`proxy_on_done`, `proxy_on_log`, response trailers, network-filter and gRPC callbacks,
//! ...) whatever the filter implements, and the host calls each exported one it has an event
//! for. It also takes the host's booleans and enums as Rust `bool`s and enums (undefined
//! behaviour for a value out of range) and panics on statuses it does not expect. This module exports only what the
//! filter uses and takes every argument as a plain integer. The module is ~100 KB smaller. The
//! saving in Envoy's time per request is within the noise of `scripts/envoy_overhead.py`
//! (under ~2 us: a host call costs 0.3-1 us, measured by adding ten of each to a request).
//!
//! | export | why |
//! |---|---|
//! | `proxy_on_context_create`, `proxy_on_delete` | per-request state (its end is also where the request leaves the in-flight table); a plugin instance's end gives its worker id back |
//! | `proxy_on_vm_start`, `proxy_on_configure`, `proxy_on_tick` | root context: configuration, snapshot refresh, worker sync |
//! | `proxy_on_request_headers`, `proxy_on_request_body` | the routing decision |
//! | `proxy_on_request_trailers` | the decision for a request that ends with trailers (HTTP/2); called only for those |
//! | `proxy_on_response_headers` | the debug header (`debug_header`) |
//! | `proxy_on_response_body` | a streamed response's first chunk ends the pod's prefill of it |
//! | `proxy_on_memory_allocate` | buffers the host returns |
//!
//! Not exported, so never called: `proxy_on_done` (the host then treats a context as done),
//! `proxy_on_log` (the end of a request is handled in `proxy_on_delete`, which the host calls
//! right after it), response trailers, metadata, network filter and gRPC callbacks.
//!
//! Every argument the host passes is taken as a plain integer (a boolean as `u32`, never a Rust
//! `bool` or enum, which would be undefined behaviour for an unexpected value), and nothing here
//! can panic: a context id the filter does not know, or a context already in use, gets the
//! host's default (`Continue`).

use crate::{Http, Pass, Release, Root, Worker};
use gpuroute_core::idmap::IdMap;
use std::cell::RefCell;
use std::mem::MaybeUninit;
use std::rc::Rc;
use std::sync::Arc;

/// `proxy_log` levels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum LogLevel {
    Warn = 3,
    Error = 4,
    Critical = 5,
}

/// The host's status codes (`WasmResult`); the ones the filter tells apart, the rest by value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    Ok,
    NotFound,
    Empty,
    CasMismatch,
    Other(u32),
}

impl Status {
    pub fn from_raw(raw: u32) -> Status {
        match raw {
            0 => Status::Ok,
            1 => Status::NotFound,
            7 => Status::Empty,
            8 => Status::CasMismatch,
            other => Status::Other(other),
        }
    }
}

/// Buffers (`proxy_get_buffer_bytes`).
#[derive(Debug, Clone, Copy)]
#[repr(u32)]
pub enum BufferType {
    HttpRequestBody = 0,
    HttpResponseBody = 1,
    PluginConfiguration = 7,
}

/// Header maps (`proxy_get_header_map_pairs` and friends).
#[derive(Debug, Clone, Copy)]
#[repr(u32)]
pub enum MapType {
    HttpRequestHeaders = 0,
    HttpResponseHeaders = 2,
}

/// Envoy stat kinds (`proxy_define_metric`).
#[derive(Debug, Clone, Copy)]
#[repr(u32)]
pub enum MetricType {
    Counter = 0,
    Gauge = 1,
    Histogram = 2,
}

/// What a stream callback tells the host.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum Action {
    Continue = 0,
    Pause = 1,
}

/// Live contexts by the host's context id (small integers: `IdMap` spreads them, no SipHash).
/// A stream's context is boxed: the map moves a pointer, not the context (~300 bytes), in and
/// out, where a copy that size is a `memory.copy`, a call out of V8's code (one a request).
#[derive(Default)]
struct Contexts {
    roots: IdMap<u32, Root>,
    streams: IdMap<u32, Box<Http>>,
}

thread_local! {
    // A wasm VM is single-threaded; the host never runs two callbacks of one VM at once.
    static CONTEXTS: RefCell<Contexts> = RefCell::new(Contexts::default());
}

/// Runs `f` on a stream context; `None` if it is unknown or (never expected) already borrowed.
fn with_stream<R>(id: u32, f: impl FnOnce(&mut Http) -> R) -> Option<R> {
    CONTEXTS.with(|c| {
        let mut c = c.try_borrow_mut().ok()?;
        c.streams.get_mut(&id).map(|s| f(s))
    })
}

fn with_root<R>(id: u32, f: impl FnOnce(&mut Root) -> R) -> Option<R> {
    CONTEXTS.with(|c| {
        let mut c = c.try_borrow_mut().ok()?;
        c.roots.get_mut(&id).map(f)
    })
}

fn action(a: Option<Action>) -> u32 {
    a.unwrap_or(Action::Continue) as u32
}

#[cfg(target_os = "wasi")]
extern "C" {
    fn __wasm_call_ctors();
}

/// Module start: static constructors, and a panic hook that logs (a panic should be impossible
/// here; if one happens, the message reaches Envoy's log before the VM fails).
#[no_mangle]
pub extern "C" fn _initialize() {
    #[cfg(target_os = "wasi")]
    // SAFETY: the wasi reactor's constructor entry point, called once before anything else.
    unsafe {
        __wasm_call_ctors();
    }
    std::panic::set_hook(Box::new(|info| {
        crate::host::log(LogLevel::Critical, &format!("gpuroute: panic: {info}"));
    }));
}

/// The ABI version marker the host looks for.
#[no_mangle]
pub extern "C" fn proxy_abi_version_0_2_1() {}

/// Memory for buffers the host hands to the filter; taken back by `host::take` with
/// `Vec::from_raw_parts(ptr, size, size)`, so it must be exactly `size` bytes of capacity.
#[no_mangle]
pub extern "C" fn proxy_on_memory_allocate(size: usize) -> *mut u8 {
    let mut v: Vec<MaybeUninit<u8>> = Vec::with_capacity(size);
    // SAFETY: the bytes are handed to the host to fill; nobody reads them before that.
    unsafe { v.set_len(size) };
    Box::into_raw(v.into_boxed_slice()) as *mut u8
}

#[no_mangle]
pub extern "C" fn proxy_on_context_create(context_id: u32, root_context_id: u32) {
    CONTEXTS.with(|c| {
        let Ok(mut c) = c.try_borrow_mut() else {
            return;
        };
        if root_context_id == 0 {
            c.roots.insert(context_id, Root::new(context_id));
        } else if let Some(stream) = c
            .roots
            .get(&root_context_id)
            .map(|r| r.create_http(context_id))
        {
            c.streams.insert(context_id, Box::new(stream));
        }
    });
}

#[no_mangle]
pub extern "C" fn proxy_on_vm_start(_context_id: u32, _vm_configuration_size: usize) -> u32 {
    1
}

#[no_mangle]
pub extern "C" fn proxy_on_configure(context_id: u32, plugin_configuration_size: usize) -> u32 {
    u32::from(with_root(context_id, |r| r.on_configure(plugin_configuration_size)).unwrap_or(false))
}

#[no_mangle]
pub extern "C" fn proxy_on_tick(context_id: u32) {
    if let Some(Some(worker)) = with_root(context_id, Root::on_tick) {
        release_held(&worker, context_id, Pass::Tick);
    }
}

/// Decides again for the requests `worker` holds (`hold`), in their order, and continues those
/// that now have a pod (or answers them), each through its own context; then makes `current`
/// the effective context again. A pool found still saturated is not asked again in the pass
/// (but for a request queued behind its held on arrival, decided once). `pass`: why
/// (`Http::release`). Returns whether `current`, held, now has a pod: its callback, running,
/// continues it (not `continue_request` from within it).
fn release_held(worker: &Rc<RefCell<Worker>>, current: u32, pass: Pass) -> bool {
    let queue = match worker.try_borrow() {
        Ok(w) if !w.held.is_empty() => w.held.iter().map(|q| q.id).collect::<Vec<_>>(),
        _ => return false,
    };
    let mut blocked: Vec<Arc<str>> = Vec::new();
    let mut goes = false;
    for id in queue {
        if crate::host::set_effective_context(id).is_err() {
            continue;
        }
        match with_stream(id, |h| h.release(&blocked, pass)) {
            Some(Release::Continue) if id == current => goes = true,
            Some(Release::Continue) => {
                let _ = crate::host::continue_request();
            }
            Some(Release::Held(pool)) => blocked.push(pool),
            Some(Release::Waiting | Release::Answered | Release::Nothing) | None => {}
        }
    }
    let _ = crate::host::set_effective_context(current);
    goes
}

/// What a callback that may have routed its request tells the host: a request queued behind
/// held requests of its pool (`Http::queued_behind`) waits only for the pass that decides again
/// for them and it, in their order, here: it goes now if the room left after them suits it.
fn routed(context_id: u32, a: Option<Action>) -> u32 {
    if a == Some(Action::Pause) {
        if let Some(Some(worker)) = with_stream(context_id, Http::queued_behind) {
            if release_held(&worker, context_id, Pass::Queued) {
                return Action::Continue as u32;
            }
        }
    }
    action(a)
}

#[no_mangle]
pub extern "C" fn proxy_on_request_headers(
    context_id: u32,
    _num_headers: usize,
    end_of_stream: u32,
) -> u32 {
    routed(
        context_id,
        with_stream(context_id, |h| h.on_request_headers(end_of_stream != 0)),
    )
}

#[no_mangle]
pub extern "C" fn proxy_on_request_body(
    context_id: u32,
    body_size: usize,
    end_of_stream: u32,
) -> u32 {
    routed(
        context_id,
        with_stream(context_id, |h| {
            h.on_request_body(body_size, end_of_stream != 0)
        }),
    )
}

#[no_mangle]
pub extern "C" fn proxy_on_request_trailers(context_id: u32, _num_trailers: usize) -> u32 {
    routed(
        context_id,
        with_stream(context_id, Http::on_request_trailers),
    )
}

#[no_mangle]
pub extern "C" fn proxy_on_response_headers(
    context_id: u32,
    _num_headers: usize,
    _end_of_stream: u32,
) -> u32 {
    action(with_stream(context_id, Http::on_response_headers))
}

#[no_mangle]
pub extern "C" fn proxy_on_response_body(
    context_id: u32,
    body_size: usize,
    end_of_stream: u32,
) -> u32 {
    action(with_stream(context_id, |h| {
        h.on_response_body(body_size, end_of_stream != 0)
    }))
}

/// The host's last call for a context. For a stream, after its access log: the request is over.
#[no_mangle]
pub extern "C" fn proxy_on_delete(context_id: u32) {
    let (root, stream) = CONTEXTS.with(|c| {
        let Ok(mut c) = c.try_borrow_mut() else {
            return (None, None);
        };
        match c.roots.remove(&context_id) {
            Some(r) => (Some(r), None),
            None => (None, c.streams.remove(&context_id)),
        }
    });
    // Outside the borrow: ending a request, or a plugin instance, writes shared data.
    if let Some(mut s) = stream {
        // A request that ends leaves room on its pod for one its worker holds.
        if let (Some(pod), Some(worker)) = (s.on_end(), s.worker.clone()) {
            release_held(&worker, context_id, Pass::Ended(pod));
        }
    }
    if let Some(mut r) = root {
        r.on_delete();
    }
}
