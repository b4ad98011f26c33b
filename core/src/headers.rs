//! The headers the filter (either build) uses to steer Envoy, in one place: a header added here
//! is stripped from client requests by both the proxy-wasm and the dynamic-module shells.

use crate::bytes::owned;
use crate::error::ApiError;
use crate::form;

/// Headers the filter sets to steer Envoy. A client must never be able to set them: with an
/// ORIGINAL_DST data plane a forged destination would make the gateway connect anywhere. Every
/// one starts with `x-` (the shells skip other headers on one compare).
pub const INTERNAL: &[&str] = &[
    DESTINATION,
    MODEL,
    BASE_MODEL,
    POOL,
    ADAPTER,
    "x-envoy-original-dst-host",
];
/// `ip:port[,ip:port...]`: the picked pod first, then fallbacks for retries.
pub const DESTINATION: &str = "x-gateway-destination-endpoint";
pub const MODEL: &str = "x-gateway-model-name";
pub const BASE_MODEL: &str = "x-gateway-base-model-name";
/// The pool; the shipped Envoy routes match on it.
pub const POOL: &str = "x-gateway-pool";
pub const ADAPTER: &str = "x-gateway-lora-adapter";
/// Request header whose value, when present, keys a weighted split instead of the conversation
/// (`splits`): every request with the same value gets the same target (a user, a tenant).
pub const SPLIT_KEY: &str = "x-gateway-split-key";
/// Response header with the decision's score breakdown (`debug_header`).
pub const DEBUG: &str = "x-gateway-debug";

/// What the filter needs from the request headers, read in one pass over them.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct RequestHead {
    /// `:path` without its query or fragment.
    pub path: String,
    pub method: String,
    pub content_length: Option<usize>,
    /// `x-gateway-priority` (below 0: sheddable).
    pub priority: Option<i64>,
    pub authorization: Option<String>,
    /// `content-encoding` other than `identity` (its value; `?` if not UTF-8): the body is
    /// compressed, and the filter cannot read it.
    pub content_encoding: Option<String>,
    /// Internal headers the client sent (to strip before anything else).
    pub forged: Vec<&'static str>,
    /// `anthropic-version` is present: Anthropic's SDKs send it on every request, so on a path
    /// both APIs share (`/v1/models`) an error answers in Anthropic's shape.
    pub anthropic: bool,
    /// `x-gpuroute-cursor`: where a relay is in this Envoy's prefix records
    /// ([`crate::exchange`]).
    pub cursor: Option<String>,
    /// `x-gpuroute-replica`: the gateway replica whose in-flight counts a `POST` to
    /// `ingest.load_path` carries ([`crate::replica_load`]).
    pub replica: Option<String>,
    /// `x-gateway-split-key` ([`SPLIT_KEY`]), when not empty.
    pub split_key: Option<String>,
    /// The boundary of a `multipart/form-data` body (`""` when it has none usable): the body
    /// is a form ([`crate::form`]), not JSON.
    pub form_boundary: Option<String>,
}

impl RequestHead {
    /// Reads `(name, value)` pairs as Envoy hands them over (names lower-case). A value that is
    /// not UTF-8 counts as absent.
    pub fn read<'a>(pairs: impl IntoIterator<Item = (&'a [u8], &'a [u8])>) -> RequestHead {
        let mut h = RequestHead::default();
        for (k, v) in pairs {
            let text = || std::str::from_utf8(v).ok();
            match k {
                b":path" => {
                    let full = text().unwrap_or_default();
                    // Bytes, not characters: `str::split` decodes each character (~14
                    // instructions a byte in V8). `?` and `#` are ASCII, so the cut is on a
                    // character boundary.
                    let end = full.bytes().position(|b| b == b'?' || b == b'#');
                    h.path = owned(end.and_then(|n| full.get(..n)).unwrap_or(full));
                }
                b":method" => h.method = owned(text().unwrap_or_default()),
                b"x-gpuroute-cursor" => h.cursor = text().map(owned),
                b"x-gpuroute-replica" => h.replica = text().map(owned),
                b"x-gateway-split-key" => {
                    h.split_key = text().map(str::trim).filter(|t| !t.is_empty()).map(owned);
                }
                b"content-length" => h.content_length = text().and_then(|t| t.trim().parse().ok()),
                b"x-gateway-priority" => h.priority = text().and_then(|t| t.trim().parse().ok()),
                b"authorization" => h.authorization = text().map(str::to_string),
                b"anthropic-version" => h.anthropic = true,
                // Only a form's type is read further (JSON's is skipped on its first byte).
                b"content-type" if v.first().is_some_and(|b| b | 0x20 == b'm') => {
                    h.form_boundary = text().and_then(form::boundary);
                }
                b"content-encoding" => {
                    let enc = text().map_or("?", str::trim);
                    if !enc.is_empty() && !enc.eq_ignore_ascii_case("identity") {
                        h.content_encoding = Some(enc.to_string());
                    }
                }
                // Every internal header starts with "x-": most headers are skipped on one compare.
                _ if k.starts_with(b"x-") => {
                    h.forged.extend(INTERNAL.iter().find(|n| n.as_bytes() == k));
                }
                _ => {}
            }
        }
        h
    }

    /// The 413 for a body found over `max_body_bytes` while it is buffered: for a form, the one
    /// that says to send `model` before the file.
    pub fn too_large(&self, max_body_bytes: usize) -> ApiError {
        match self.form_boundary {
            Some(_) => ApiError::form_too_large(max_body_bytes),
            None => ApiError::body_too_large(max_body_bytes),
        }
    }

    /// What the request line and headers alone decide for a request on an inference path,
    /// before any of its body is buffered: a method other than POST (405: it would otherwise
    /// reach the route table without a pool, whose answer says the filter is not running), a
    /// declared length over `max_body_bytes` (413; not for a form, whose upload may stream on),
    /// then a compressed body the filter cannot read (415). Both shells answer the error and
    /// count it under its code.
    pub fn admit(&self, method: &str, max_body_bytes: usize) -> Result<(), ApiError> {
        if method != "POST" {
            return Err(ApiError::method_not_allowed("POST"));
        }
        // A form's upload streams on once its `model` field is read, whatever its length
        // (`crate::form`); only what is buffered before that is bounded.
        if self.form_boundary.is_none() && self.content_length.is_some_and(|n| n > max_body_bytes) {
            return Err(ApiError::body_too_large(max_body_bytes));
        }
        match &self.content_encoding {
            Some(enc) => Err(ApiError::unsupported_encoding(enc)),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_form_is_known_by_its_content_type_and_may_declare_any_length() {
        let head = |ct: &'static [u8]| {
            let pairs: Vec<(&[u8], &[u8])> = vec![
                (b":method", b"POST"),
                (b"content-type", ct),
                (b"content-length", b"9000000"),
            ];
            RequestHead::read(pairs)
        };
        let form = head(b"multipart/form-data; boundary=abc");
        assert_eq!(form.form_boundary.as_deref(), Some("abc"));
        assert_eq!(form.admit("POST", 1000), Ok(()));
        let json = head(b"application/json");
        assert_eq!(json.form_boundary, None);
        assert_eq!(json.admit("POST", 1000).unwrap_err().status, 413);
    }

    #[test]
    fn a_blank_or_non_utf8_split_key_is_no_key() {
        for v in [&b""[..], b"   ", b"\xff\xfe"] {
            let pairs: Vec<(&[u8], &[u8])> = vec![(b"x-gateway-split-key", v)];
            assert_eq!(RequestHead::read(pairs).split_key, None, "{v:?}");
        }
    }

    #[test]
    fn the_path_ends_at_its_query_or_fragment() {
        for (full, path) in [
            ("/v1/chat/completions", "/v1/chat/completions"),
            ("/v1/chat/completions?x=1#f", "/v1/chat/completions"),
            ("/v1/models#a?b", "/v1/models"),
            ("/v1/mödels/é?x", "/v1/mödels/é"),
            ("/日本?", "/日本"),
            ("?only", ""),
            ("#", ""),
            ("", ""),
        ] {
            let pairs: Vec<(&[u8], &[u8])> = vec![(b":path", full.as_bytes())];
            assert_eq!(RequestHead::read(pairs).path, path, "{full:?}");
            assert_eq!(full.split(['?', '#']).next(), Some(path), "{full:?}");
        }
    }

    #[test]
    fn every_internal_header_starts_with_x_dash() {
        assert!(INTERNAL.iter().all(|h| h.starts_with("x-")));
    }

    #[test]
    fn reads_what_the_filter_needs_and_flags_forged_headers() {
        let pairs: Vec<(&[u8], &[u8])> = vec![
            (b":path", b"/v1/chat/completions?x=1#f"),
            (b":method", b"POST"),
            (b"content-length", b" 42 "),
            (b"x-gateway-priority", b"-1"),
            (b"authorization", b"Bearer t"),
            (b"x-gateway-destination-endpoint", b"10.0.0.1:80"),
            (b"x-gateway-pool", b"p"),
            (b"x-other", b"v"),
            (b"x-gateway-split-key", b" user-42 "),
            (b"user-agent", b"curl"),
        ];
        let h = RequestHead::read(pairs);
        assert_eq!(h.split_key.as_deref(), Some("user-42"));
        assert_eq!(h.path, "/v1/chat/completions");
        assert_eq!(h.method, "POST");
        assert_eq!(h.content_length, Some(42));
        assert_eq!(h.priority, Some(-1));
        assert_eq!(h.authorization.as_deref(), Some("Bearer t"));
        assert_eq!(h.forged, vec![DESTINATION, POOL]);
        assert!(!h.anthropic);
        let pairs: Vec<(&[u8], &[u8])> = vec![(b"anthropic-version", b"2023-06-01")];
        assert!(RequestHead::read(pairs).anthropic);
    }

    #[test]
    fn an_encoded_body_is_flagged_and_identity_is_not() {
        let enc = |v: &[u8]| {
            let pairs: Vec<(&[u8], &[u8])> = vec![(b"content-encoding", v)];
            RequestHead::read(pairs).content_encoding
        };
        assert_eq!(enc(b"gzip").as_deref(), Some("gzip"));
        assert_eq!(enc(b" br ").as_deref(), Some("br"));
        assert_eq!(enc(&[0xff]).as_deref(), Some("?"));
        assert_eq!(enc(b"identity"), None);
        assert_eq!(enc(b"Identity"), None);
        assert_eq!(enc(b""), None);
        assert_eq!(
            RequestHead::read(Vec::<(&[u8], &[u8])>::new()).content_encoding,
            None
        );
    }

    #[test]
    fn admit_refuses_other_methods_then_too_large_then_encoded_bodies() {
        let head = |len: Option<usize>, enc: Option<&str>| RequestHead {
            content_length: len,
            content_encoding: enc.map(str::to_string),
            ..RequestHead::default()
        };
        let code = |h: RequestHead| h.admit("POST", 100).err().map(|e| (e.status, e.code));
        assert_eq!(code(head(Some(100), None)), None);
        assert_eq!(code(head(None, None)), None);
        assert_eq!(
            code(head(Some(101), None)),
            Some((413, Some("request_too_large".into())))
        );
        assert_eq!(
            code(head(None, Some("gzip"))),
            Some((415, Some("unsupported_content_encoding".into())))
        );
        assert_eq!(
            code(head(Some(101), Some("gzip"))),
            Some((413, Some("request_too_large".into())))
        );
        for method in ["GET", "PUT", "OPTIONS", "post", ""] {
            let e = head(Some(101), Some("gzip"))
                .admit(method, 100)
                .unwrap_err();
            assert_eq!((e.status, e.allow), (405, Some("POST")), "{method}");
            assert_eq!(e.code.as_deref(), Some("method_not_allowed"));
        }
    }

    #[test]
    fn non_utf8_values_count_as_absent() {
        let pairs: Vec<(&[u8], &[u8])> = vec![
            (b":path", b"/v1/\xff"),
            (b"authorization", &[0xff, 0xfe]),
            (b"content-length", &[0xff]),
        ];
        let h = RequestHead::read(pairs);
        assert_eq!(h.authorization, None);
        assert_eq!(h.content_length, None);
    }
}
