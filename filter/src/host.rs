//! Panic-free host calls.
//!
//! The proxy-wasm SDK's wrappers `panic!` on any status they do not expect (and some `unwrap`
//! UTF-8 conversions of header values a client controls); a panic takes the whole VM down. The
//! filter does not use the SDK: this module declares the ABI 0.2.1 imports the filter uses, with
//! plain integer arguments and results, and turns every status into a `Result`, so a surprising
//! host answer becomes a fail-open decision instead of a crash. Memory the host returns is
//! allocated through `abi::proxy_on_memory_allocate` (a boxed slice), so it is taken back with
//! `Vec::from_raw_parts`.

use crate::abi::{BufferType, LogLevel, MapType, MetricType, Status};
use std::ptr::{null, null_mut};

#[link(wasm_import_module = "env")]
extern "C" {
    fn proxy_log(level: u32, message_data: *const u8, message_size: usize) -> u32;
    fn proxy_get_current_time_nanoseconds(return_time: *mut u64) -> u32;
    fn proxy_set_tick_period_milliseconds(period: u32) -> u32;
    fn proxy_get_buffer_bytes(
        buffer_type: u32,
        start: usize,
        max_size: usize,
        return_buffer_data: *mut *mut u8,
        return_buffer_size: *mut usize,
    ) -> u32;
    fn proxy_set_buffer_bytes(
        buffer_type: u32,
        start: usize,
        size: usize,
        buffer_data: *const u8,
        buffer_size: usize,
    ) -> u32;
    fn proxy_get_header_map_pairs(
        map_type: u32,
        return_map_data: *mut *mut u8,
        return_map_size: *mut usize,
    ) -> u32;
    fn proxy_get_header_map_value(
        map_type: u32,
        key_data: *const u8,
        key_size: usize,
        return_value_data: *mut *mut u8,
        return_value_size: *mut usize,
    ) -> u32;
    fn proxy_replace_header_map_value(
        map_type: u32,
        key_data: *const u8,
        key_size: usize,
        value_data: *const u8,
        value_size: usize,
    ) -> u32;
    fn proxy_add_header_map_value(
        map_type: u32,
        key_data: *const u8,
        key_size: usize,
        value_data: *const u8,
        value_size: usize,
    ) -> u32;
    fn proxy_remove_header_map_value(map_type: u32, key_data: *const u8, key_size: usize) -> u32;
    fn proxy_get_property(
        path_data: *const u8,
        path_size: usize,
        return_value_data: *mut *mut u8,
        return_value_size: *mut usize,
    ) -> u32;
    fn proxy_get_shared_data(
        key_data: *const u8,
        key_size: usize,
        return_value_data: *mut *mut u8,
        return_value_size: *mut usize,
        return_cas: *mut u32,
    ) -> u32;
    fn proxy_set_shared_data(
        key_data: *const u8,
        key_size: usize,
        value_data: *const u8,
        value_size: usize,
        cas: u32,
    ) -> u32;
    #[allow(clippy::too_many_arguments)]
    fn proxy_send_local_response(
        status_code: u32,
        status_code_details_data: *const u8,
        status_code_details_size: usize,
        body_data: *const u8,
        body_size: usize,
        headers_data: *const u8,
        headers_size: usize,
        grpc_status: i32,
    ) -> u32;
    fn proxy_define_metric(
        metric_type: u32,
        name_data: *const u8,
        name_size: usize,
        return_id: *mut u32,
    ) -> u32;
    fn proxy_increment_metric(metric_id: u32, offset: i64) -> u32;
    fn proxy_record_metric(metric_id: u32, value: u64) -> u32;
    fn proxy_set_effective_context(context_id: u32) -> u32;
    fn proxy_continue_stream(stream_type: u32) -> u32;
}

/// Takes ownership of a buffer the host allocated through `proxy_on_memory_allocate`.
///
/// # Safety
/// `data` must be null or a pointer the host obtained from `proxy_on_memory_allocate(size)`.
unsafe fn take(data: *mut u8, size: usize) -> Vec<u8> {
    if data.is_null() {
        Vec::new()
    } else {
        Vec::from_raw_parts(data, size, size)
    }
}

fn ok(raw: u32) -> Result<(), Status> {
    match Status::from_raw(raw) {
        Status::Ok => Ok(()),
        other => Err(other),
    }
}

pub fn log(level: LogLevel, msg: &str) {
    // SAFETY: pointer and length of a live &str.
    let _ = unsafe { proxy_log(level as u32, msg.as_ptr(), msg.len()) };
}

#[link(wasm_import_module = "wasi_snapshot_preview1")]
extern "C" {
    /// WASI's clock; Envoy answers `CLOCK_MONOTONIC` (1) from its steady clock, one for the
    /// whole process (every worker's VM and the ingest listener's read the same).
    fn clock_time_get(clock_id: u32, precision: u64, time: *mut u64) -> u32;
}

/// Envoy's wall clock, nanoseconds since the Unix epoch (0 if the host refuses).
fn wall_nanos() -> u64 {
    let mut t = 0u64;
    // SAFETY: `t` outlives the call.
    match Status::from_raw(unsafe { proxy_get_current_time_nanoseconds(&mut t) }) {
        Status::Ok => t,
        _ => 0,
    }
}

/// Envoy's monotonic clock, nanoseconds since an arbitrary start (`None` if the host refuses).
fn monotonic_nanos() -> Option<u64> {
    let mut t = 0u64;
    // SAFETY: `t` outlives the call.
    (unsafe { clock_time_get(1, 1, &mut t) } == 0 && t != 0).then_some(t)
}

/// Where the clock's zero lies: the wall clock less the monotonic one when the first VM of this
/// `vm_id` read them (kept in shared data, so every VM's clock agrees), 0 until it is known.
static CLOCK_BASE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

fn clock_base(mono: u64) -> u64 {
    use std::sync::atomic::Ordering::Relaxed;
    let base = CLOCK_BASE.load(Relaxed);
    if base != 0 {
        return base;
    }
    let stored = || match get_shared(CLOCK_BASE_KEY).0 {
        Some(v) => v
            .try_into()
            .ok()
            .map(u64::from_le_bytes)
            .filter(|b| *b != 0),
        None => None,
    };
    let base = stored().unwrap_or_else(|| {
        let mine = wall_nanos().saturating_sub(mono).max(1);
        // Two VMs starting at once may both write: each then takes what is stored.
        let _ = set_shared(CLOCK_BASE_KEY, &mine.to_le_bytes(), None);
        stored().unwrap_or(mine)
    });
    CLOCK_BASE.store(base, Relaxed);
    base
}

const CLOCK_BASE_KEY: &str = "gpuroute.clock.base";

/// The filter's clock, nanoseconds: Unix time as Envoy's wall clock read it when the first VM
/// started, then counted on Envoy's monotonic clock, so it never steps. Every age and deadline
/// (a snapshot's, a hold's, an ejection's, another replica's counts) is measured on it: on the
/// wall clock, a step back (an NTP correction, a VM resumed) made a snapshot received before it
/// look new for as long as the step, and a dead aggregator's last snapshot was routed on for
/// that long instead of failing open. The wall clock where the host has no monotonic one.
pub fn now_nanos() -> u64 {
    match monotonic_nanos() {
        Some(mono) => clock_base(mono).saturating_add(mono),
        None => wall_nanos(),
    }
}

pub fn now_ms() -> u64 {
    now_nanos() / 1_000_000
}

pub fn set_tick_period_ms(ms: u32) -> Result<(), Status> {
    // SAFETY: plain value call.
    ok(unsafe { proxy_set_tick_period_milliseconds(ms) })
}

pub fn get_buffer(kind: BufferType, start: usize, max: usize) -> Result<Vec<u8>, Status> {
    let (mut data, mut size) = (null_mut(), 0usize);
    // SAFETY: out-pointers outlive the call; the returned buffer is host-allocated via our
    // allocator and owned by us afterwards.
    unsafe {
        match Status::from_raw(proxy_get_buffer_bytes(
            kind as u32,
            start,
            max,
            &mut data,
            &mut size,
        )) {
            Status::Ok => Ok(take(data, size)),
            Status::NotFound | Status::Empty => Ok(Vec::new()),
            other => Err(other),
        }
    }
}

pub fn set_buffer(kind: BufferType, start: usize, size: usize, value: &[u8]) -> Result<(), Status> {
    // SAFETY: pointer and length of a live slice.
    ok(unsafe { proxy_set_buffer_bytes(kind as u32, start, size, value.as_ptr(), value.len()) })
}

/// All headers of a map in one host call, as the raw serialised map (see [`header_pairs`]).
pub fn get_header_map(map: MapType) -> Vec<u8> {
    let (mut data, mut size) = (null_mut(), 0usize);
    // SAFETY: as in `get_buffer`.
    unsafe {
        match Status::from_raw(proxy_get_header_map_pairs(map as u32, &mut data, &mut size)) {
            Status::Ok => take(data, size),
            _ => Vec::new(),
        }
    }
}

/// One header's value (`None` when the map has no such header), in one host call: cheaper than
/// [`get_header_map`] for one header.
pub fn get_header(map: MapType, name: &str) -> Option<Vec<u8>> {
    let (mut data, mut size) = (null_mut(), 0usize);
    // SAFETY: pointer and length of a live string; the value as in `get_buffer`.
    unsafe {
        match Status::from_raw(proxy_get_header_map_value(
            map as u32,
            name.as_ptr(),
            name.len(),
            &mut data,
            &mut size,
        )) {
            Status::Ok => Some(take(data, size)),
            _ => None,
        }
    }
}

/// Decodes a serialised header map: a u32 count, then (key length, value length) u32 pairs,
/// then each key and value followed by a NUL. Anything malformed ends the list early.
pub fn header_pairs(raw: &[u8]) -> Vec<(&[u8], &[u8])> {
    let u32_at = |at: usize| -> Option<usize> {
        let b = raw.get(at..at + 4)?;
        Some(u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize)
    };
    let Some(n) = u32_at(0) else {
        return Vec::new();
    };
    // Every pair needs 8 bytes of lengths: a count beyond that is malformed.
    let n = n.min(raw.len() / 8);
    let mut out = Vec::with_capacity(n.min(256));
    let mut data = 4usize.saturating_add(n.saturating_mul(8));
    for i in 0..n {
        let (Some(kl), Some(vl)) = (u32_at(4 + i * 8), u32_at(8 + i * 8)) else {
            break;
        };
        let Some(k) = raw.get(data..data.saturating_add(kl)) else {
            break;
        };
        let v_start = data.saturating_add(kl).saturating_add(1);
        let Some(v) = raw.get(v_start..v_start.saturating_add(vl)) else {
            break;
        };
        out.push((k, v));
        data = v_start.saturating_add(vl).saturating_add(1);
    }
    out
}

pub fn set_header(map: MapType, name: &str, value: &str) -> Result<(), Status> {
    // SAFETY: pointers and lengths of live strings.
    ok(unsafe {
        proxy_replace_header_map_value(
            map as u32,
            name.as_ptr(),
            name.len(),
            value.as_ptr(),
            value.len(),
        )
    })
}

/// Adds a header without looking for an existing one (cheaper than [`set_header`]): for the
/// filter's own headers, which were stripped from the request on arrival.
pub fn add_header(map: MapType, name: &str, value: &str) -> Result<(), Status> {
    // SAFETY: pointers and lengths of live strings.
    ok(unsafe {
        proxy_add_header_map_value(
            map as u32,
            name.as_ptr(),
            name.len(),
            value.as_ptr(),
            value.len(),
        )
    })
}

pub fn remove_header(map: MapType, name: &str) -> Result<(), Status> {
    // SAFETY: pointer and length of a live string.
    ok(unsafe { proxy_remove_header_map_value(map as u32, name.as_ptr(), name.len()) })
}

/// An Envoy attribute, e.g. `["source", "address"]`.
pub fn get_property(path: &[&str]) -> Option<Vec<u8>> {
    let mut p = Vec::new();
    for part in path {
        p.extend_from_slice(part.as_bytes());
        p.push(0);
    }
    p.pop();
    let (mut data, mut size) = (null_mut(), 0usize);
    // SAFETY: as in `get_buffer`.
    unsafe {
        match Status::from_raw(proxy_get_property(
            p.as_ptr(),
            p.len(),
            &mut data,
            &mut size,
        )) {
            Status::Ok => Some(take(data, size)),
            _ => None,
        }
    }
}

/// A shared-data value and its CAS token (`None` when the key was never written).
pub fn get_shared(key: &str) -> (Option<Vec<u8>>, Option<u32>) {
    let (mut data, mut size, mut cas) = (null_mut(), 0usize, 0u32);
    // SAFETY: as in `get_buffer`.
    unsafe {
        match Status::from_raw(proxy_get_shared_data(
            key.as_ptr(),
            key.len(),
            &mut data,
            &mut size,
            &mut cas,
        )) {
            Status::Ok => {
                let v = (!data.is_null()).then(|| take(data, size));
                (v, (cas != 0).then_some(cas))
            }
            _ => (None, None),
        }
    }
}

/// Writes a shared-data value; with `cas`, fails with `CasMismatch` if it changed meanwhile.
pub fn set_shared(key: &str, value: &[u8], cas: Option<u32>) -> Result<(), Status> {
    // SAFETY: pointers and lengths of live values.
    ok(unsafe {
        proxy_set_shared_data(
            key.as_ptr(),
            key.len(),
            value.as_ptr(),
            value.len(),
            cas.unwrap_or(0),
        )
    })
}

/// Sends a local reply and stops the request.
pub fn send_response(status: u32, headers: &[(&str, &str)], body: &[u8]) -> Result<(), Status> {
    let mut h = Vec::with_capacity(64);
    h.extend_from_slice(&(headers.len() as u32).to_le_bytes());
    for (k, v) in headers {
        h.extend_from_slice(&(k.len() as u32).to_le_bytes());
        h.extend_from_slice(&(v.len() as u32).to_le_bytes());
    }
    for (k, v) in headers {
        h.extend_from_slice(k.as_bytes());
        h.push(0);
        h.extend_from_slice(v.as_bytes());
        h.push(0);
    }
    let details = b"gpuroute";
    // SAFETY: pointers and lengths of live buffers.
    ok(unsafe {
        proxy_send_local_response(
            status,
            details.as_ptr(),
            details.len(),
            if body.is_empty() {
                null()
            } else {
                body.as_ptr()
            },
            body.len(),
            h.as_ptr(),
            h.len(),
            -1,
        )
    })
}

pub fn define_metric(kind: MetricType, name: &str) -> Option<u32> {
    let mut id = 0u32;
    // SAFETY: pointer and length of a live string; `id` outlives the call.
    match Status::from_raw(unsafe {
        proxy_define_metric(kind as u32, name.as_ptr(), name.len(), &mut id)
    }) {
        Status::Ok => Some(id),
        _ => None,
    }
}

pub fn increment_metric(id: u32, by: i64) {
    // SAFETY: plain value call.
    let _ = unsafe { proxy_increment_metric(id, by) };
}

pub fn record_metric(id: u32, value: u64) {
    // SAFETY: plain value call.
    let _ = unsafe { proxy_record_metric(id, value) };
}

/// Makes the host's calls that follow act on context `id` (a stream's headers, body, local
/// reply), until the next such call or the end of this callback.
pub fn set_effective_context(id: u32) -> Result<(), Status> {
    // SAFETY: plain integer argument.
    ok(unsafe { proxy_set_effective_context(id) })
}

/// Resumes the effective context's request, paused by an earlier callback's `Pause` (Envoy
/// continues it once the current callback returns).
pub fn continue_request() -> Result<(), Status> {
    // SAFETY: plain integer argument (0: the request stream).
    ok(unsafe { proxy_continue_stream(0) })
}
