//! The part of Envoy 1.40's dynamic-module ABI this module uses, declared by hand.
//!
//! Envoy's ABI header is large and version-pinned; only the callbacks below are called, with
//! the argument lists of the 1.40 binary (checked against its exported symbols and, where two
//! published header revisions differ, against its machine code: `get_body_size` takes two
//! arguments and returns the size, `get_body_chunks` fills a caller-sized vector,
//! `get_worker_index` returns a `u32`). The end-to-end suite runs against the real binary, so a
//! drift in any of these shows up as a failing test, not in production.
//!
//! Buffers are passed by value as `{ptr, len}` pairs (two integer registers on x86-64 and
//! aarch64, the same as two separate arguments).
//!
//! The callbacks are not linked: `resolve` looks each one up in the running Envoy
//! (`dlsym(RTLD_DEFAULT)`) when the module loads, and `envoy_dynamic_module_on_program_init`
//! refuses to load (Envoy then reports the module failed to initialise) if one is missing, so an
//! Envoy without a callback this module needs is a clear error at startup, not a crash at the
//! first request. It also lets the crate's unit tests link without Envoy.

use std::ffi::c_void;
use std::sync::OnceLock;

/// Bytes owned by the module, lent to Envoy for the duration of a call.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ModuleBuffer {
    pub ptr: *const u8,
    pub len: usize,
}

impl ModuleBuffer {
    pub fn of(b: &[u8]) -> ModuleBuffer {
        ModuleBuffer {
            ptr: b.as_ptr(),
            len: b.len(),
        }
    }
    pub const NULL: ModuleBuffer = ModuleBuffer {
        ptr: std::ptr::null(),
        len: 0,
    };
}

/// Bytes owned by Envoy, valid until the current event hook returns.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct EnvoyBuffer {
    pub ptr: *const u8,
    pub len: usize,
}

impl EnvoyBuffer {
    pub const EMPTY: EnvoyBuffer = EnvoyBuffer {
        ptr: std::ptr::null(),
        len: 0,
    };

    /// # Safety
    /// `ptr` must be valid for `len` bytes for the returned lifetime (Envoy guarantees this until
    /// the current hook returns).
    pub unsafe fn as_slice<'a>(self) -> &'a [u8] {
        if self.ptr.is_null() || self.len == 0 {
            &[]
        } else {
            std::slice::from_raw_parts(self.ptr, self.len)
        }
    }
}

/// A response header handed to `send_response`.
#[repr(C)]
pub struct ModuleHeader {
    pub key_ptr: *const u8,
    pub key_len: usize,
    pub value_ptr: *const u8,
    pub value_len: usize,
}

/// A header as Envoy lends it (valid until the current hook returns).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct EnvoyHeader {
    pub key_ptr: *const u8,
    pub key_len: usize,
    pub value_ptr: *const u8,
    pub value_len: usize,
}

pub type FilterEnvoyPtr = *mut c_void;
pub type ConfigEnvoyPtr = *mut c_void;

// Header map selector.
pub const REQUEST_HEADERS: u32 = 0;
pub const RESPONSE_HEADERS: u32 = 2;
// Body selector.
pub const RECEIVED_REQUEST_BODY: u32 = 0;
pub const BUFFERED_REQUEST_BODY: u32 = 1;
pub const RECEIVED_RESPONSE_BODY: u32 = 2;
// Hook results.
pub const HEADERS_CONTINUE: u32 = 0;
pub const HEADERS_STOP_ITERATION: u32 = 1;
pub const BODY_CONTINUE: u32 = 0;
pub const BODY_STOP_AND_BUFFER: u32 = 1;
pub const BODY_STOP_NO_BUFFER: u32 = 3;
pub const TRAILERS_CONTINUE: u32 = 0;
pub const TRAILERS_STOP_ITERATION: u32 = 1;
// Metrics results (the second is this module's own, for "Envoy not there").
pub const METRICS_SUCCESS: u32 = 0;
pub const METRICS_UNAVAILABLE: u32 = u32::MAX;
// Log levels.
pub const LOG_WARN: u32 = 3;
pub const LOG_ERROR: u32 = 4;
pub const LOG_CRITICAL: u32 = 5;
/// `source.address` in the attribute enum.
pub const ATTRIBUTE_SOURCE_ADDRESS: u32 = 24;
/// `upstream.address` in the attribute enum (after `source.port`, the `destination` pair and the
/// fourteen `connection` attributes).
pub const ATTRIBUTE_UPSTREAM_ADDRESS: u32 = 41;

/// glibc's `RTLD_DEFAULT`: search the global scope (the Envoy executable exports the callbacks).
const RTLD_DEFAULT: *mut c_void = std::ptr::null_mut();

extern "C" {
    fn dlsym(handle: *mut c_void, symbol: *const std::ffi::c_char) -> *mut c_void;
}

macro_rules! callbacks {
    ($( fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)? = $default:expr; )*) => {
        /// Every callback this module calls, resolved from the running Envoy.
        #[allow(non_snake_case)]
        struct Api {
            $( $name: unsafe extern "C" fn($($ty),*) $(-> $ret)?, )*
        }

        impl Api {
            fn resolve() -> Result<Api, &'static str> {
                Ok(Api {
                    $( $name: {
                        let symbol = concat!(stringify!($name), "\0");
                        // SAFETY: a NUL-terminated name; dlsym has no other precondition.
                        let p = unsafe { dlsym(RTLD_DEFAULT, symbol.as_ptr().cast()) };
                        if p.is_null() {
                            return Err(stringify!($name));
                        }
                        // SAFETY: Envoy 1.40 defines the symbol with this signature (module docs).
                        unsafe {
                            std::mem::transmute::<*mut c_void, unsafe extern "C" fn($($ty),*) $(-> $ret)?>(p)
                        }
                    }, )*
                })
            }
        }

        $(
            /// Envoy's callback of the same name (a no-op answering
            #[doc = concat!("`", stringify!($default), "`")]
            /// before the module is initialised).
            ///
            /// # Safety
            /// As for the Envoy callback: live pointers, buffers valid for the call.
            #[allow(clippy::too_many_arguments)]
            pub unsafe fn $name($($arg: $ty),*) $(-> $ret)? {
                match API.get() {
                    Some(api) => (api.$name)($($arg),*),
                    None => $default,
                }
            }
        )*
    };
}

static API: OnceLock<Api> = OnceLock::new();

/// Resolves every callback (once; on Envoy's main thread, from `on_program_init`). The error
/// names the first callback this Envoy does not have.
pub fn init() -> Result<(), &'static str> {
    if API.get().is_none() {
        let _ = API.set(Api::resolve()?);
    }
    Ok(())
}

callbacks! {
    fn envoy_dynamic_module_callback_log(level: u32, message: ModuleBuffer) = ();
    fn envoy_dynamic_module_callback_http_get_headers_size(
        filter: FilterEnvoyPtr,
        header_type: u32,
    ) -> usize = 0;
    fn envoy_dynamic_module_callback_http_get_headers(
        filter: FilterEnvoyPtr,
        header_type: u32,
        result: *mut EnvoyHeader,
    ) -> bool = false;
    fn envoy_dynamic_module_callback_http_get_header(
        filter: FilterEnvoyPtr,
        header_type: u32,
        key: ModuleBuffer,
        result: *mut EnvoyBuffer,
        index: usize,
        optional_size: *mut usize,
    ) -> bool = false;
    fn envoy_dynamic_module_callback_http_set_header(
        filter: FilterEnvoyPtr,
        header_type: u32,
        key: ModuleBuffer,
        value: ModuleBuffer,
    ) -> bool = false;
    fn envoy_dynamic_module_callback_http_add_header(
        filter: FilterEnvoyPtr,
        header_type: u32,
        key: ModuleBuffer,
        value: ModuleBuffer,
    ) -> bool = false;
    fn envoy_dynamic_module_callback_http_get_body_size(
        filter: FilterEnvoyPtr,
        body_type: u32,
    ) -> usize = 0;
    fn envoy_dynamic_module_callback_http_get_body_chunks_size(
        filter: FilterEnvoyPtr,
        body_type: u32,
    ) -> usize = 0;
    fn envoy_dynamic_module_callback_http_get_body_chunks(
        filter: FilterEnvoyPtr,
        body_type: u32,
        result: *mut EnvoyBuffer,
    ) -> bool = false;
    fn envoy_dynamic_module_callback_http_drain_body(
        filter: FilterEnvoyPtr,
        body_type: u32,
        bytes: usize,
    ) -> bool = false;
    fn envoy_dynamic_module_callback_http_append_body(
        filter: FilterEnvoyPtr,
        body_type: u32,
        data: ModuleBuffer,
    ) -> bool = false;
    fn envoy_dynamic_module_callback_http_received_buffered_request_body(
        filter: FilterEnvoyPtr,
    ) -> bool = false;
    fn envoy_dynamic_module_callback_http_send_response(
        filter: FilterEnvoyPtr,
        status: u32,
        headers: *const ModuleHeader,
        headers_len: usize,
        body: ModuleBuffer,
        details: ModuleBuffer,
    ) = ();
    fn envoy_dynamic_module_callback_http_clear_route_cache(filter: FilterEnvoyPtr) = ();
    // Older revisions return the length through a fourth argument; pointing it at `result.len`
    // makes the call correct under either.
    fn envoy_dynamic_module_callback_http_filter_get_attribute_string(
        filter: FilterEnvoyPtr,
        attribute: u32,
        result: *mut EnvoyBuffer,
        result_len: *mut usize,
    ) -> bool = false;
    fn envoy_dynamic_module_callback_http_filter_config_define_counter(
        config: ConfigEnvoyPtr,
        name: ModuleBuffer,
        label_names: *const ModuleBuffer,
        label_names_len: usize,
        id: *mut usize,
    ) -> u32 = METRICS_UNAVAILABLE;
    fn envoy_dynamic_module_callback_http_filter_config_define_gauge(
        config: ConfigEnvoyPtr,
        name: ModuleBuffer,
        label_names: *const ModuleBuffer,
        label_names_len: usize,
        id: *mut usize,
    ) -> u32 = METRICS_UNAVAILABLE;
    fn envoy_dynamic_module_callback_http_filter_config_define_histogram(
        config: ConfigEnvoyPtr,
        name: ModuleBuffer,
        label_names: *const ModuleBuffer,
        label_names_len: usize,
        id: *mut usize,
    ) -> u32 = METRICS_UNAVAILABLE;
    fn envoy_dynamic_module_callback_http_filter_config_scheduler_new(
        config: ConfigEnvoyPtr,
    ) -> *mut c_void = std::ptr::null_mut();
    fn envoy_dynamic_module_callback_http_filter_config_scheduler_commit(
        scheduler: *mut c_void,
        event_id: u64,
    ) = ();
    fn envoy_dynamic_module_callback_http_filter_config_scheduler_delete(
        scheduler: *mut c_void,
    ) = ();
    fn envoy_dynamic_module_callback_http_filter_scheduler_new(
        filter: FilterEnvoyPtr,
    ) -> *mut c_void = std::ptr::null_mut();
    fn envoy_dynamic_module_callback_http_filter_scheduler_commit(
        scheduler: *mut c_void,
        event_id: u64,
    ) = ();
    fn envoy_dynamic_module_callback_http_filter_scheduler_delete(
        scheduler: *mut c_void,
    ) = ();
    fn envoy_dynamic_module_callback_http_filter_continue_decoding(filter: FilterEnvoyPtr) = ();
    fn envoy_dynamic_module_callback_http_filter_config_increment_counter(
        config: ConfigEnvoyPtr,
        id: usize,
        label_values: *const ModuleBuffer,
        label_values_len: usize,
        value: u64,
    ) -> u32 = METRICS_UNAVAILABLE;
    fn envoy_dynamic_module_callback_http_filter_config_set_gauge(
        config: ConfigEnvoyPtr,
        id: usize,
        label_values: *const ModuleBuffer,
        label_values_len: usize,
        value: u64,
    ) -> u32 = METRICS_UNAVAILABLE;
    fn envoy_dynamic_module_callback_http_filter_config_record_histogram_value(
        config: ConfigEnvoyPtr,
        id: usize,
        label_values: *const ModuleBuffer,
        label_values_len: usize,
        value: u64,
    ) -> u32 = METRICS_UNAVAILABLE;
}
