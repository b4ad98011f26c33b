//! Safe wrappers over the callbacks in [`crate::abi`]. Every call is given a live filter pointer
//! (the one Envoy passed to the current hook) and returns plain values; nothing here panics.

use crate::abi::*;

/// The Envoy side of one HTTP stream, valid during the hook it was passed to.
#[derive(Clone, Copy)]
pub struct Stream(pub FilterEnvoyPtr);

impl Stream {
    /// Replaces a header (an empty value removes it).
    pub fn set_header(self, map: u32, name: &str, value: &str) {
        let v = if value.is_empty() {
            ModuleBuffer::NULL
        } else {
            ModuleBuffer::of(value.as_bytes())
        };
        // SAFETY: live filter pointer; both buffers outlive the call (Envoy copies them).
        unsafe {
            envoy_dynamic_module_callback_http_set_header(
                self.0,
                map,
                ModuleBuffer::of(name.as_bytes()),
                v,
            );
        }
    }

    pub fn remove_header(self, map: u32, name: &str) {
        self.set_header(map, name, "");
    }

    /// Appends a header value (used for headers that were stripped on arrival: cheaper than a
    /// replace).
    pub fn add_header(self, map: u32, name: &str, value: &str) {
        // SAFETY: as for `set_header`.
        unsafe {
            envoy_dynamic_module_callback_http_add_header(
                self.0,
                map,
                ModuleBuffer::of(name.as_bytes()),
                ModuleBuffer::of(value.as_bytes()),
            );
        }
    }

    /// Every request header, in one call. The slices borrow Envoy's header map: they are valid
    /// until the current hook returns or the map is changed, whichever comes first.
    pub fn request_headers<'a>(self) -> Vec<(&'a [u8], &'a [u8])> {
        self.headers(REQUEST_HEADERS)
    }

    /// One response header's first value (`None` without it), borrowed from Envoy's map as
    /// [`Stream::request_headers`]' are: one call, no vector of every header.
    pub fn response_header<'a>(self, name: &str) -> Option<&'a [u8]> {
        let mut out = EnvoyBuffer::EMPTY;
        // SAFETY: live filter pointer; the key outlives the call; `out` is written by Envoy.
        let ok = unsafe {
            envoy_dynamic_module_callback_http_get_header(
                self.0,
                RESPONSE_HEADERS,
                ModuleBuffer::of(name.as_bytes()),
                &mut out,
                0,
                std::ptr::null_mut(),
            )
        };
        // SAFETY: valid until the current hook returns or the map changes.
        (ok && !out.ptr.is_null()).then(|| unsafe { out.as_slice() })
    }

    /// Every response header, as [`Stream::request_headers`] gives the request's.
    pub fn response_headers<'a>(self) -> Vec<(&'a [u8], &'a [u8])> {
        self.headers(RESPONSE_HEADERS)
    }

    fn headers<'a>(self, map: u32) -> Vec<(&'a [u8], &'a [u8])> {
        // SAFETY: live filter pointer; the vector is sized by Envoy's own count first.
        unsafe {
            let n = envoy_dynamic_module_callback_http_get_headers_size(self.0, map);
            let mut hs = vec![
                EnvoyHeader {
                    key_ptr: std::ptr::null(),
                    key_len: 0,
                    value_ptr: std::ptr::null(),
                    value_len: 0,
                };
                n
            ];
            if n == 0
                || !envoy_dynamic_module_callback_http_get_headers(self.0, map, hs.as_mut_ptr())
            {
                return Vec::new();
            }
            hs.iter()
                .map(|h| {
                    let k = EnvoyBuffer {
                        ptr: h.key_ptr,
                        len: h.key_len,
                    };
                    let v = EnvoyBuffer {
                        ptr: h.value_ptr,
                        len: h.value_len,
                    };
                    (k.as_slice(), v.as_slice())
                })
                .collect()
        }
    }

    fn body_chunks(self, kind: u32, out: &mut Vec<EnvoyBuffer>) {
        // SAFETY: live filter pointer; the chunk vector is sized by Envoy's own count first.
        unsafe {
            let n = envoy_dynamic_module_callback_http_get_body_chunks_size(self.0, kind);
            if n == 0 {
                return;
            }
            let at = out.len();
            out.resize(at + n, EnvoyBuffer::EMPTY);
            if !envoy_dynamic_module_callback_http_get_body_chunks(
                self.0,
                kind,
                out[at..].as_mut_ptr(),
            ) {
                out.truncate(at);
            }
        }
    }

    /// Bytes of the request body held so far: what Envoy buffered plus the chunk of the current
    /// hook (unless that chunk already is the buffer).
    pub fn request_body_len(self) -> usize {
        // SAFETY: live filter pointer.
        unsafe {
            let buffered =
                envoy_dynamic_module_callback_http_get_body_size(self.0, BUFFERED_REQUEST_BODY);
            if envoy_dynamic_module_callback_http_received_buffered_request_body(self.0) {
                return buffered;
            }
            buffered
                + envoy_dynamic_module_callback_http_get_body_size(self.0, RECEIVED_REQUEST_BODY)
        }
    }

    /// Runs `f` on the whole request body (at its end): Envoy's own bytes when they are one
    /// chunk, a copy otherwise.
    pub fn with_request_body<R>(self, f: impl FnOnce(&[u8]) -> R) -> R {
        let mut chunks = Vec::with_capacity(4);
        self.body_chunks(BUFFERED_REQUEST_BODY, &mut chunks);
        // SAFETY: live filter pointer.
        if !unsafe { envoy_dynamic_module_callback_http_received_buffered_request_body(self.0) } {
            self.body_chunks(RECEIVED_REQUEST_BODY, &mut chunks);
        }
        chunks.retain(|c| c.len > 0);
        // SAFETY: the chunks are Envoy's, valid until this hook returns; `f` runs inside it and
        // nothing changes the body meanwhile.
        unsafe {
            match chunks.as_slice() {
                [] => f(&[]),
                [one] => f(one.as_slice()),
                many => {
                    let mut body = Vec::with_capacity(many.iter().map(|c| c.len).sum());
                    for c in many {
                        body.extend_from_slice(c.as_slice());
                    }
                    f(&body)
                }
            }
        }
    }

    /// Runs `f` on the first bytes (at most `max`) of the response body chunk of this hook.
    pub fn with_response_chunk<R>(self, max: usize, f: impl FnOnce(&[u8]) -> R) -> R {
        let mut chunks = Vec::with_capacity(2);
        self.body_chunks(RECEIVED_RESPONSE_BODY, &mut chunks);
        let mut head = Vec::new();
        for c in chunks.iter().filter(|c| c.len > 0) {
            // SAFETY: the chunks are Envoy's, valid until this hook returns.
            let bytes = unsafe { c.as_slice() };
            head.extend_from_slice(&bytes[..bytes.len().min(max - head.len())]);
            if head.len() == max {
                break;
            }
        }
        f(&head)
    }

    /// Replaces the whole request body with `new` (at its end: in the last body hook, or in the
    /// trailers hook, where there is no received chunk and the body is all buffered).
    pub fn replace_request_body(self, new: &[u8]) {
        // SAFETY: live filter pointer; `new` outlives the call (Envoy copies it).
        unsafe {
            let buffered =
                envoy_dynamic_module_callback_http_get_body_size(self.0, BUFFERED_REQUEST_BODY);
            envoy_dynamic_module_callback_http_drain_body(self.0, BUFFERED_REQUEST_BODY, buffered);
            let into_received =
                !envoy_dynamic_module_callback_http_received_buffered_request_body(self.0) && {
                    let received = envoy_dynamic_module_callback_http_get_body_size(
                        self.0,
                        RECEIVED_REQUEST_BODY,
                    );
                    envoy_dynamic_module_callback_http_drain_body(
                        self.0,
                        RECEIVED_REQUEST_BODY,
                        received,
                    );
                    // Refused when there is no received chunk (the trailers hook).
                    envoy_dynamic_module_callback_http_append_body(
                        self.0,
                        RECEIVED_REQUEST_BODY,
                        ModuleBuffer::of(new),
                    )
                };
            if !into_received {
                envoy_dynamic_module_callback_http_append_body(
                    self.0,
                    BUFFERED_REQUEST_BODY,
                    ModuleBuffer::of(new),
                );
            }
        }
    }

    /// Sends a local reply; the stream stops here.
    pub fn send_response(self, status: u32, headers: &[(&str, &str)], body: &[u8]) {
        let hs: Vec<ModuleHeader> = headers
            .iter()
            .map(|(k, v)| ModuleHeader {
                key_ptr: k.as_ptr(),
                key_len: k.len(),
                value_ptr: v.as_ptr(),
                value_len: v.len(),
            })
            .collect();
        let details = b"gpuroute";
        // SAFETY: live filter pointer; every buffer outlives the call (Envoy copies them).
        unsafe {
            envoy_dynamic_module_callback_http_send_response(
                self.0,
                status,
                hs.as_ptr(),
                hs.len(),
                ModuleBuffer::of(body),
                ModuleBuffer::of(details),
            );
        }
    }

    /// Resumes the request, stopped by an earlier hook (`hold`): on the stream's worker thread.
    pub fn continue_decoding(self) {
        // SAFETY: a live filter pointer, on its worker thread.
        unsafe { envoy_dynamic_module_callback_http_filter_continue_decoding(self.0) }
    }

    pub fn clear_route_cache(self) {
        // SAFETY: live filter pointer.
        unsafe { envoy_dynamic_module_callback_http_clear_route_cache(self.0) }
    }

    /// The downstream peer's address (`ip:port` or `ip`).
    pub fn source_address(self) -> Option<String> {
        self.attribute_string(ATTRIBUTE_SOURCE_ADDRESS)
    }

    /// The address of the upstream host Envoy sent the request to (`ip:port`), once it chose
    /// one.
    pub fn upstream_address(self) -> Option<String> {
        self.attribute_string(ATTRIBUTE_UPSTREAM_ADDRESS)
    }

    fn attribute_string(self, attribute: u32) -> Option<String> {
        let mut out = EnvoyBuffer::EMPTY;
        let len_ptr: *mut usize = &mut out.len;
        // SAFETY: live filter pointer; `out` outlives the call.
        let ok = unsafe {
            envoy_dynamic_module_callback_http_filter_get_attribute_string(
                self.0, attribute, &mut out, len_ptr,
            )
        };
        // SAFETY: valid until the hook returns; copied right away.
        ok.then(|| String::from_utf8_lossy(unsafe { out.as_slice() }).into_owned())
    }
}

/// Metric updates through the filter configuration, outside any stream (from
/// `on_http_filter_config_scheduled` and `on_http_filter_config_destroy`).
#[derive(Clone, Copy)]
pub struct ConfigStats(pub ConfigEnvoyPtr);

// SAFETY: kept in the module's configuration only to be used from Envoy's hooks for that same
// configuration (scheduled, destroy), during which Envoy's configuration object is live; Envoy's
// stats are safe to update from any thread.
unsafe impl Send for ConfigStats {}
unsafe impl Sync for ConfigStats {}

/// Metric labels (or label names) as Envoy takes them.
fn buffers(labels: &[&str]) -> Vec<ModuleBuffer> {
    labels
        .iter()
        .map(|l| ModuleBuffer::of(l.as_bytes()))
        .collect()
}

/// The shape of every config-level metric update callback.
type ConfigMetricFn = unsafe fn(ConfigEnvoyPtr, usize, *const ModuleBuffer, usize, u64) -> u32;

impl ConfigStats {
    fn update(self, f: ConfigMetricFn, id: Option<usize>, labels: &[&str], value: u64) {
        let Some(id) = id else { return };
        let ls = buffers(labels);
        // SAFETY: the config pointer Envoy passed to the current hook; labels outlive the call.
        unsafe {
            f(self.0, id, ls.as_ptr(), ls.len(), value);
        }
    }

    pub fn counter(self, id: Option<usize>, labels: &[&str], by: u64) {
        self.update(
            envoy_dynamic_module_callback_http_filter_config_increment_counter,
            id,
            labels,
            by,
        );
    }

    pub fn gauge(self, id: Option<usize>, value: u64) {
        self.update(
            envoy_dynamic_module_callback_http_filter_config_set_gauge,
            id,
            &[],
            value,
        );
    }

    pub fn histogram(self, id: Option<usize>, value: u64) {
        self.update(
            envoy_dynamic_module_callback_http_filter_config_record_histogram_value,
            id,
            &[],
            value,
        );
    }
}

/// Wakes `on_http_filter_config_scheduled` on Envoy's main thread; `commit` may be called from
/// any thread (Envoy posts the event to the main dispatcher).
pub struct Scheduler(*mut std::ffi::c_void);

// SAFETY: Envoy documents the config scheduler's commit as callable from any thread; the
// pointer is deleted only through `delete`, on the main thread, after the last commit.
unsafe impl Send for Scheduler {}
unsafe impl Sync for Scheduler {}

impl Scheduler {
    /// # Safety
    /// `config` must be the live config pointer of `on_http_filter_config_new`.
    pub unsafe fn new(config: ConfigEnvoyPtr) -> Option<Scheduler> {
        let p = envoy_dynamic_module_callback_http_filter_config_scheduler_new(config);
        (!p.is_null()).then_some(Scheduler(p))
    }

    pub fn commit(&self, event: u64) {
        // SAFETY: live until `delete`.
        unsafe { envoy_dynamic_module_callback_http_filter_config_scheduler_commit(self.0, event) }
    }

    pub fn delete(self) {
        // SAFETY: deleted once; no commit follows (the owner took it out of its slot).
        unsafe { envoy_dynamic_module_callback_http_filter_config_scheduler_delete(self.0) }
    }
}

/// Wakes `on_http_filter_scheduled` for one stream on its worker thread; `commit` may be called
/// from any thread (Envoy posts the event to the stream's dispatcher, and drops it if the stream
/// is gone).
pub struct StreamScheduler(*mut std::ffi::c_void);

// SAFETY: Envoy documents the scheduler's commit as callable from any thread. The owner (the
// stream's filter) deletes it once, after taking it out of every place another thread could
// commit through (`Config::held`, under its lock).
unsafe impl Send for StreamScheduler {}
unsafe impl Sync for StreamScheduler {}

impl StreamScheduler {
    /// # Safety
    /// `s` must be the live filter pointer of the current hook.
    pub unsafe fn new(s: Stream) -> Option<StreamScheduler> {
        let p = envoy_dynamic_module_callback_http_filter_scheduler_new(s.0);
        (!p.is_null()).then_some(StreamScheduler(p))
    }

    pub fn commit(&self, event: u64) {
        // SAFETY: live until `delete`.
        unsafe { envoy_dynamic_module_callback_http_filter_scheduler_commit(self.0, event) }
    }

    /// A copy of the pointer, for a queue entry; the owner deletes the scheduler only after
    /// removing that entry.
    pub fn share(&self) -> StreamScheduler {
        StreamScheduler(self.0)
    }

    /// Whether `other` is a copy of this scheduler.
    pub fn is(&self, other: &StreamScheduler) -> bool {
        self.0 == other.0
    }

    pub fn delete(self) {
        // SAFETY: deleted once, by its owner, after every copy was removed.
        unsafe { envoy_dynamic_module_callback_http_filter_scheduler_delete(self.0) }
    }
}

/// Metric definitions, only possible while the filter config is being created.
pub struct Definer(pub ConfigEnvoyPtr);

impl Definer {
    fn define(
        &self,
        f: unsafe fn(ConfigEnvoyPtr, ModuleBuffer, *const ModuleBuffer, usize, *mut usize) -> u32,
        name: &str,
        labels: &[&str],
    ) -> Option<usize> {
        let ls = buffers(labels);
        let mut id = 0usize;
        // SAFETY: the config pointer is live during `on_http_filter_config_new`; buffers outlive
        // the call.
        let rc = unsafe {
            f(
                self.0,
                ModuleBuffer::of(name.as_bytes()),
                ls.as_ptr(),
                ls.len(),
                &mut id,
            )
        };
        (rc == METRICS_SUCCESS).then_some(id)
    }

    pub fn counter(&self, name: &str, labels: &[&str]) -> Option<usize> {
        self.define(
            envoy_dynamic_module_callback_http_filter_config_define_counter,
            name,
            labels,
        )
    }

    pub fn gauge(&self, name: &str) -> Option<usize> {
        self.define(
            envoy_dynamic_module_callback_http_filter_config_define_gauge,
            name,
            &[],
        )
    }

    pub fn histogram(&self, name: &str) -> Option<usize> {
        self.define(
            envoy_dynamic_module_callback_http_filter_config_define_histogram,
            name,
            &[],
        )
    }
}

pub fn log(level: u32, msg: &str) {
    // SAFETY: the message outlives the call.
    unsafe { envoy_dynamic_module_callback_log(level, ModuleBuffer::of(msg.as_bytes())) }
}
