//! Errors the gateway answers itself, in OpenAI's shape
//! (`{"error":{"message","type","param","code"}}`), so OpenAI SDKs raise the matching exception
//! (`BadRequestError` for 400, `NotFoundError` for 404, `RateLimitError` for 429, ...); on the
//! Messages API's paths in Anthropic's (`{"type":"error","error":{"type","message"}}`), which
//! Anthropic's SDKs read the same way.

use crate::request::Endpoint;
use serde::Serialize;

/// The shape of an error body: the one the API of the request's path uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ErrorStyle {
    #[default]
    OpenAi,
    Anthropic,
}

impl ErrorStyle {
    /// Anthropic's on the Messages API's paths ([`Endpoint::Messages`],
    /// [`Endpoint::CountTokens`]), OpenAI's elsewhere.
    pub fn for_path(path: &str) -> ErrorStyle {
        match Endpoint::from_path(path) {
            Endpoint::Messages | Endpoint::CountTokens => ErrorStyle::Anthropic,
            _ => ErrorStyle::OpenAi,
        }
    }

    /// On a path both APIs share (`/v1/models`): the API of the client that sent it, known by
    /// the `anthropic-version` header Anthropic's SDKs always send.
    pub fn for_shared_path(anthropic_version: bool) -> ErrorStyle {
        if anthropic_version {
            ErrorStyle::Anthropic
        } else {
            ErrorStyle::OpenAi
        }
    }
}

/// An error response the filter sends instead of forwarding the request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    /// HTTP status.
    pub status: u16,
    pub message: String,
    /// OpenAI error type, e.g. `invalid_request_error`.
    pub kind: &'static str,
    /// The request field at fault, if any.
    pub param: Option<&'static str>,
    /// Machine-readable code, e.g. `model_not_found`.
    pub code: Option<String>,
    /// A 405's `allow` header: the methods the path takes.
    pub allow: Option<&'static str>,
}

#[derive(Serialize)]
struct Envelope<'a> {
    error: Inner<'a>,
}

#[derive(Serialize)]
struct AnthropicEnvelope<'a> {
    #[serde(rename = "type")]
    kind: &'a str,
    error: AnthropicInner<'a>,
}

#[derive(Serialize)]
struct AnthropicInner<'a> {
    #[serde(rename = "type")]
    kind: &'a str,
    message: &'a str,
}

#[derive(Serialize)]
struct Inner<'a> {
    message: &'a str,
    #[serde(rename = "type")]
    kind: &'a str,
    param: Option<&'a str>,
    code: Option<&'a str>,
}

impl ApiError {
    fn new(status: u16, kind: &'static str, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            message: message.into(),
            kind,
            param: None,
            code: None,
            allow: None,
        }
    }

    fn param(mut self, p: &'static str) -> Self {
        self.param = Some(p);
        self
    }

    fn code(mut self, c: &str) -> Self {
        self.code = Some(c.to_string());
        self
    }

    /// 400: the body is not a JSON object.
    pub fn invalid_json(message: impl Into<String>) -> ApiError {
        ApiError::new(400, "invalid_request_error", message).code("invalid_json")
    }

    /// 400: a field has the wrong JSON type.
    pub fn invalid_type(param: &'static str, expected: &str) -> ApiError {
        ApiError::new(
            400,
            "invalid_request_error",
            format!("`{param}` must be a {expected}"),
        )
        .param(param)
        .code("invalid_type")
    }

    /// 400: no `model` and no default pool is configured.
    pub fn missing_model() -> ApiError {
        ApiError::new(
            400,
            "invalid_request_error",
            "you must provide a model parameter",
        )
        .param("model")
        .code("missing_required_parameter")
    }

    /// 404: the model is not served by this gateway.
    pub fn model_not_found(model: &str) -> ApiError {
        // Bound what is echoed back: the name comes from the client.
        let shown: String = model.chars().take(256).collect();
        ApiError::new(
            404,
            "invalid_request_error",
            format!("The model `{shown}` does not exist or is not served by this gateway."),
        )
        .param("model")
        .code("model_not_found")
    }

    /// 413: the body exceeds `max_body_bytes`.
    pub fn body_too_large(limit: usize) -> ApiError {
        ApiError::new(
            413,
            "invalid_request_error",
            format!("request body exceeds the gateway limit of {limit} bytes"),
        )
        .code("request_too_large")
    }

    /// 400: a `multipart/form-data` body that cannot be read ([`crate::form`]).
    pub fn invalid_form(why: &str) -> ApiError {
        ApiError::new(
            400,
            "invalid_request_error",
            format!("malformed multipart/form-data body: {why}"),
        )
        .code("invalid_form")
    }

    /// 413: a form body over `max_body_bytes` whose `model` field had not come before its file
    /// (such a body is buffered whole to find it).
    pub fn form_too_large(limit: usize) -> ApiError {
        ApiError::new(
            413,
            "invalid_request_error",
            format!(
                "multipart request body exceeds the gateway limit of {limit} bytes before its                  `model` field: send the `model` field before the file (as OpenAI's Python SDK                  does), and the upload streams to the model server whatever its size"
            ),
        )
        .code("request_too_large")
    }

    /// 415: a compressed request body (`content-encoding`), which the filter cannot read to
    /// route. Answered from the headers, before any of the body is buffered.
    pub fn unsupported_encoding(encoding: &str) -> ApiError {
        // Bound what is echoed back: the value comes from the client.
        let shown: String = encoding.chars().take(64).collect();
        ApiError::new(
            415,
            "invalid_request_error",
            format!(
                "request bodies with content-encoding `{shown}` are not supported by the \
                 gateway: send the JSON uncompressed"
            ),
        )
        .code("unsupported_content_encoding")
    }

    /// 429: a sheddable request while every pod of its pool is saturated.
    pub fn shed(pool: &str) -> ApiError {
        ApiError::new(
            429,
            "rate_limit_error",
            format!("pool `{pool}` is saturated; sheddable request rejected, retry later"),
        )
        .code("pool_saturated")
    }

    /// 503: no endpoint can take the request and fail-open is impossible.
    pub fn no_endpoints(pool: &str) -> ApiError {
        ApiError::new(
            503,
            "service_unavailable_error",
            format!("no endpoint of pool `{pool}` is available"),
        )
        .code("no_healthy_endpoints")
    }

    /// 401: the ingest token is wrong or missing.
    pub fn unauthorized() -> ApiError {
        ApiError::new(
            401,
            "authentication_error",
            "missing or invalid bearer token",
        )
        .code("invalid_token")
    }

    /// 400 for a refused snapshot, with the validator's message.
    pub fn bad_snapshot(message: impl Into<String>) -> ApiError {
        ApiError::new(400, "invalid_request_error", message).code("invalid_snapshot")
    }

    /// 400 for prefix records pushed by another gateway replica that do not decode.
    pub fn bad_prefix_records(message: impl Into<String>) -> ApiError {
        ApiError::new(400, "invalid_request_error", message).code("invalid_prefix_records")
    }

    /// 400: another replica's in-flight counts (`ingest.load_path`) do not decode, or the
    /// header naming the replica is missing or malformed.
    pub fn bad_replica_load(message: impl Into<String>) -> ApiError {
        ApiError::new(400, "invalid_request_error", message).code("invalid_replica_load")
    }

    /// 503: an ingest endpoint accepted a body but could not store it (Envoy's shared data
    /// kept changing under the compare-and-swap, or refused the write); the pusher may send it
    /// again.
    pub fn not_stored(what: &str) -> ApiError {
        ApiError::new(
            503,
            "service_unavailable_error",
            format!("could not store the {what}; retry"),
        )
        .code("not_stored")
    }

    /// 413 for a snapshot over the ingest limit.
    pub fn snapshot_too_large(message: impl Into<String>) -> ApiError {
        ApiError::ingest_too_large("snapshot_too_large", message)
    }

    /// 413 for a body over an ingest endpoint's limit, with the endpoint's code.
    pub fn ingest_too_large(code: &str, message: impl Into<String>) -> ApiError {
        ApiError::new(413, "invalid_request_error", message).code(code)
    }

    /// 405: a method the path does not take (an inference path takes POST only; an ingest
    /// path its own); `allowed` also goes out as the `allow` header.
    pub fn method_not_allowed(allowed: &'static str) -> ApiError {
        let mut e = ApiError::new(
            405,
            "invalid_request_error",
            format!("method not allowed; use {allowed}"),
        )
        .code("method_not_allowed");
        e.allow = Some(allowed);
        e
    }

    /// The JSON body in `style`.
    pub fn body(&self, style: ErrorStyle) -> String {
        match style {
            ErrorStyle::OpenAi => self.to_json(),
            ErrorStyle::Anthropic => {
                let env = AnthropicEnvelope {
                    kind: "error",
                    error: AnthropicInner {
                        kind: self.anthropic_type(),
                        message: &self.message,
                    },
                };
                serde_json::to_string(&env).unwrap_or_else(|_| {
                    r#"{"type":"error","error":{"type":"api_error","message":"internal error"}}"#
                        .to_string()
                })
            }
        }
    }

    /// Anthropic's error type for this status (its API documents one per status).
    fn anthropic_type(&self) -> &'static str {
        match self.status {
            401 => "authentication_error",
            403 => "permission_error",
            404 => "not_found_error",
            413 => "request_too_large",
            429 => "rate_limit_error",
            503 | 529 => "overloaded_error",
            500..=599 => "api_error",
            _ => "invalid_request_error",
        }
    }

    /// The JSON body in OpenAI's shape.
    pub fn to_json(&self) -> String {
        let env = Envelope {
            error: Inner {
                message: &self.message,
                kind: self.kind,
                param: self.param,
                code: self.code.as_deref(),
            },
        };
        // Serialising plain strings cannot fail; fall back to a fixed body rather than panic.
        serde_json::to_string(&env).unwrap_or_else(|_| {
            r#"{"error":{"message":"internal error","type":"server_error","param":null,"code":null}}"#
                .to_string()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_store_failure_is_a_503_naming_what_was_not_stored() {
        for what in ["snapshot", "prefix records"] {
            let e = ApiError::not_stored(what);
            assert_eq!(e.status, 503);
            let v: serde_json::Value = serde_json::from_str(&e.to_json()).unwrap();
            assert_eq!(v["error"]["type"], "service_unavailable_error");
            assert_eq!(v["error"]["code"], "not_stored");
            assert_eq!(
                v["error"]["message"],
                format!("could not store the {what}; retry")
            );
        }
    }

    #[test]
    fn shape_matches_openai() {
        let v: serde_json::Value =
            serde_json::from_str(&ApiError::model_not_found("gpt-9").to_json()).unwrap();
        assert_eq!(v["error"]["type"], "invalid_request_error");
        assert_eq!(v["error"]["code"], "model_not_found");
        assert_eq!(v["error"]["param"], "model");
        assert!(v["error"]["message"].as_str().unwrap().contains("gpt-9"));
        let v: serde_json::Value =
            serde_json::from_str(&ApiError::invalid_json("x").to_json()).unwrap();
        assert!(v["error"]["param"].is_null());
    }

    #[test]
    fn messages_paths_answer_in_anthropics_shape() {
        assert_eq!(ErrorStyle::for_path("/v1/messages"), ErrorStyle::Anthropic);
        assert_eq!(
            ErrorStyle::for_path("/v1/messages/count_tokens"),
            ErrorStyle::Anthropic
        );
        assert_eq!(
            ErrorStyle::for_path("/v1/chat/completions"),
            ErrorStyle::OpenAi
        );
        let cases = [
            (ApiError::invalid_json("x"), 400, "invalid_request_error"),
            (ApiError::model_not_found("m"), 404, "not_found_error"),
            (ApiError::body_too_large(1), 413, "request_too_large"),
            (
                ApiError::unsupported_encoding("gzip"),
                415,
                "invalid_request_error",
            ),
            (ApiError::shed("p"), 429, "rate_limit_error"),
            (ApiError::no_endpoints("p"), 503, "overloaded_error"),
            (ApiError::not_stored("snapshot"), 503, "overloaded_error"),
        ];
        for (e, status, kind) in cases {
            assert_eq!(e.status, status);
            let v: serde_json::Value =
                serde_json::from_str(&e.body(ErrorStyle::Anthropic)).unwrap();
            assert_eq!(v["type"], "error", "{v}");
            assert_eq!(v["error"]["type"], kind, "{v}");
            assert_eq!(v["error"]["message"], e.message.as_str());
            assert_eq!(v["error"].as_object().unwrap().len(), 2, "{v}");
            // OpenAI's shape is unchanged elsewhere.
            assert_eq!(e.body(ErrorStyle::OpenAi), e.to_json());
        }
    }

    #[test]
    fn unsupported_encoding_is_415_and_bounded() {
        let e = ApiError::unsupported_encoding(&"gzip".repeat(1_000));
        assert_eq!(e.status, 415);
        let v: serde_json::Value = serde_json::from_str(&e.to_json()).unwrap();
        assert_eq!(v["error"]["code"], "unsupported_content_encoding");
        assert!(v["error"]["param"].is_null());
        assert!(v["error"]["message"].as_str().unwrap().len() < 200);
    }

    #[test]
    fn echoed_model_name_is_bounded_and_escaped() {
        let long = format!("\"<script>{}", "x".repeat(10_000));
        let body = ApiError::model_not_found(&long).to_json();
        assert!(body.len() < 1_000);
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert!(v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("\"<script>"));
    }
}
