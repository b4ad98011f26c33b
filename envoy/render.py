#!/usr/bin/env python3
"""Render an Envoy bootstrap for a gpuroute stack.

One description (JSON) drives every shape the project runs: `make run`, the end-to-end tests,
and each configuration of the benchmark. Envoy reads the output as YAML (JSON is YAML).

Description fields:
  mode            filter | filter_original_dst | round_robin | least_request
  listen          "127.0.0.1:8080"  the OpenAI-compatible listener
  admin           "127.0.0.1:9901"
  ingest          "127.0.0.1:9002"  loopback listener for snapshot pushes (filter modes)
  wasm            path of gpuroute_filter.wasm
  runtime         "wasm" (default) or "dynamic": the same filter as an Envoy dynamic module
                  (libgpuroute.so, found through ENVOY_DYNAMIC_MODULES_SEARCH_PATH)
  filter_config   the plugin configuration (pools, ingest token, scoring, ...)
  pools           [{"name": "llama-8b", "endpoints": ["127.0.0.1:18001", ...]}]; a pool whose pods
                  serve HTTPS adds "tls": {"ca_file", and optionally "sni", "san" (names the
                  pods' certificates must carry; unset: any the CA signed), "cert_file" and
                  "key_file" (a client certificate, for pods that ask for one)}
  route_timeout_s 0 = none (streams can be long)
  access_log      optional: a file (e.g. /dev/stdout) for one JSON line per request on the
                  OpenAI listener, with the filter's routing decision (ACCESS_LOG_FORMAT)
  metrics         optional: "ip:port" of a listener that serves only the admin's
                  /stats/prometheus (for Prometheus, while the admin port, which can stop
                  Envoy, stays on loopback); every other path gets a 404

Baselines (round_robin, least_request) still run the filter for body-based routing when there
is more than one pool (with pick_endpoints false, so the pod is Envoy's choice); with one pool
they run plain Envoy, exactly what a user without the filter has.

Usage: render.py DESCRIPTION.json > envoy.yaml
"""

import copy
import json
import sys
from pathlib import Path

BODY_HEADROOM = 1024 * 1024
DEFAULT_MAX_BODY = 4 * 1024 * 1024


# The access log line (`access_log`): what Envoy logs of every request anyway, plus the headers
# the filter added to it, so each line says which pool and which pods the filter chose and
# which pod served. JSON null where a value is absent: no `destination` with a `pool` is a
# fail-open (Envoy's load balancer picked), no `pool` a request the filter answered itself or
# let through (an error, /v1/models, another path).
ACCESS_LOG_FORMAT = {
    "start_time": "%START_TIME%",
    "method": "%REQ(:METHOD)%",
    "path": "%REQ(:PATH)%",
    "status": "%RESPONSE_CODE%",
    "flags": "%RESPONSE_FLAGS%",
    "details": "%RESPONSE_CODE_DETAILS%",
    "model": "%REQ(X-GATEWAY-MODEL-NAME)%",
    "base_model": "%REQ(X-GATEWAY-BASE-MODEL-NAME)%",
    "pool": "%REQ(X-GATEWAY-POOL)%",
    "destination": "%REQ(X-GATEWAY-DESTINATION-ENDPOINT)%",
    "upstream_host": "%UPSTREAM_HOST%",
    "attempts": "%UPSTREAM_REQUEST_ATTEMPT_COUNT%",
    "bytes_received": "%BYTES_RECEIVED%",
    "bytes_sent": "%BYTES_SENT%",
    "duration_ms": "%DURATION%",
    "upstream_first_byte_ms": "%RESPONSE_DURATION%",
    "request_id": "%REQ(X-REQUEST-ID)%",
}


# Labels for the filter's stats in Prometheus. Its stat names carry the pool, the endpoint, the
# outcome or the reason as segments (`wasmcustom.gpuroute.pool.llama-8b.requests.picked`);
# Envoy's tag extraction takes each out of the name into a label, so /stats/prometheus has one
# family per kind of count
# (`envoy_gpuroute_pool_requests{gpuroute_pool="llama-8b",gpuroute_outcome="picked"}`) that a
# dashboard can sum and filter, as deploy/monitoring's rules and dashboard do. In each regex the
# first group is the part taken out of the name, the second the label's value. The first takes
# out the build's prefix (`wasmcustom.`, `dynamicmodulescustom.`) into `gpuroute_runtime`, so
# both builds give the same families. Label names start with `gpuroute_`: Prometheus's
# Kubernetes discovery adds `pod`, `endpoint` and `namespace` of its own, which a scraped label
# of that name would be renamed away from. The dynamic module labels its pick counter itself,
# with the same names (Envoy extracts no tags from a labelled counter, so that family keeps the
# module's prefix). `/stats` keeps the full names.
STAT_NAME = r"^(?:wasmcustom|dynamicmodulescustom)\.gpuroute\."
SEGMENT = r"[\w-]+"
STATS_TAGS = [
    {"tag_name": "gpuroute_runtime", "regex": r"^((wasm|dynamicmodules)custom\.)gpuroute\."},
    {"tag_name": "gpuroute_pool", "regex": STAT_NAME + rf"(?:pool|failover|overflow)(\.({SEGMENT}))\.(?:requests\.|pod\.|ttft_ms$|ejections$|unanswered$|to\.)"},
    # `hold`'s counters (`gpuroute.hold.<pool>.<event>`), held gauge (`gpuroute.held.<pool>`) and
    # wait histogram (`gpuroute.hold_ms.<pool>`): the pool taken out leaves the names they had
    # before they had one (`envoy_gpuroute_hold_held`, `envoy_gpuroute_held`,
    # `envoy_gpuroute_hold_ms_bucket`), so a query that sums them reads as it did. One tag name
    # with three patterns: Envoy logs "Skipping duplicate tag for" (a warning, without the name,
    # at the 1st, 2nd, 4th, ... time) when a stat that took its pool from one meets the others;
    # expected.
    {"tag_name": "gpuroute_pool", "regex": STAT_NAME + rf"hold(\.({SEGMENT}))\.(?:held|affinity|released|expired|answered|cancelled|full)$"},
    {"tag_name": "gpuroute_pool", "regex": STAT_NAME + rf"(?:held|hold_ms)(\.({SEGMENT}))$"},
    {"tag_name": "gpuroute_outcome", "regex": STAT_NAME + rf"pool\.{SEGMENT}\.requests(\.({SEGMENT}))$"},
    {"tag_name": "gpuroute_endpoint", "regex": STAT_NAME + rf"pool\.{SEGMENT}(\.pod\.(.+))\.picks$"},
    {"tag_name": "gpuroute_reason", "regex": STAT_NAME + rf"(?:fail_open|{SEGMENT}\.rejected)(\.({SEGMENT}))$"},
    {"tag_name": "gpuroute_code", "regex": STAT_NAME + rf"rejected(\.({SEGMENT}))$"},
    {"tag_name": "gpuroute_split", "regex": STAT_NAME + rf"split(\.({SEGMENT}))\.(?:to\.{SEGMENT}|rerouted)$"},
    {"tag_name": "gpuroute_target", "regex": STAT_NAME + rf"(?:split|failover|overflow)\.{SEGMENT}\.to(\.({SEGMENT}))$"},
]

# Bucket bounds of the filter's histograms in /stats/prometheus, where Prometheus'
# histogram_quantile interpolates within a bucket. Envoy's defaults (..., 100, 250, 500, 1000,
# 2500, 5000, ...) are too coarse for them: a TTFT of 1.25 s read as a p99 of 2.5 s, a hold of
# 126 ms as 247 ms (an audit). Each bound here is at most ~1.3x the one before in the range
# that matters (TTFT 50 ms-10 s, hold 10 ms-10 s, decision 5 us-1 ms), so the interpolated
# quantile is off by at most that step. Envoy's own /stats summary is unaffected.
HISTOGRAM_BUCKETS = [
    {"match": {"suffix": ".ttft_ms"}, "buckets": [
        10, 25, 50, 65, 80, 100, 130, 160, 200, 250, 320, 400, 500, 650, 800, 1000, 1300, 1600, 2000,
        2500, 3200, 4000, 5000, 6500, 8000, 10000, 15000, 20000, 30000, 60000]},
    # `gpuroute.hold_ms.<pool>`, and `gpuroute.hold_ms` of builds before it was per pool.
    {"match": {"contains": ".gpuroute.hold_ms"}, "buckets": [
        1, 5, 10, 13, 16, 20, 25, 32, 40, 50, 65, 80, 100, 130, 160, 200, 250, 320, 400, 500, 650, 800,
        1000, 1300, 1600, 2000, 2500, 3200, 4000, 5000, 6500, 8000, 10000, 20000, 60000]},
    {"match": {"suffix": ".decision_us"}, "buckets": [
        1, 2, 3, 5, 6.5, 8, 10, 13, 16, 20, 25, 32, 40, 50, 65, 80, 100, 130, 160, 200, 250, 320, 400, 500,
        650, 800, 1000, 2000, 5000, 10000]},
]


FILE_ACCESS_LOG = "envoy.access_loggers.file"
FILE_ACCESS_LOG_TYPE = "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog"


def access_log(path):
    return [
        {
            "name": FILE_ACCESS_LOG,
            "typed_config": {
                "@type": FILE_ACCESS_LOG_TYPE,
                "path": path,
                "log_format": {"json_format": ACCESS_LOG_FORMAT},
            },
        }
    ]


def addr(s):
    host, _, port = s.rpartition(":")
    return {"socket_address": {"address": host.strip("[]"), "port_value": int(port)}}


def wasm_filter(wasm_path, config):
    return {
        "name": "envoy.filters.http.wasm",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm",
            "config": {
                "name": "gpuroute",
                "root_id": "gpuroute",
                # Same vm_id on both listeners: they share the VM and its shared data.
                "vm_config": {
                    "vm_id": "gpuroute",
                    "runtime": "envoy.wasm.runtime.v8",
                    "code": {"local": {"filename": wasm_path}},
                },
                "configuration": {
                    "@type": "type.googleapis.com/google.protobuf.StringValue",
                    "value": json.dumps(config, separators=(",", ":")),
                },
                # Without this, pausing in on_http_request_headers becomes StopAll and the
                # request hangs (verified on Envoy 1.40).
                "allow_on_headers_stop_iteration": True,
                # If the VM fails (a trap), Envoy answers the worker's requests with 503 while it
                # backs off (1 s at first), then starts a new VM: the filter comes back. With
                # FAIL_OPEN the worker would serve without the filter for good, and every
                # inference request there would get the route table's 503 (no x-gateway-pool).
                # A VM that fails to start is not reloaded: the same 503 (no_filter_503).
                "failure_policy": "FAIL_RELOAD",
            },
        },
    }


# The filter's default inference paths (core/src/config.rs, `inference_paths`).
# The filter's default inference paths: the file the filter compiles in (core/src/config.rs).
INFERENCE_PATHS = [
    line.strip()
    for line in (Path(__file__).resolve().parent.parent / "core" / "src" / "inference_paths.txt").read_text().splitlines()
    if line.strip() and not line.strip().startswith("#")
]


def openai_error(status, message, error_type, code):
    """A direct response in OpenAI's error shape."""
    body = {"error": {"message": message, "type": error_type, "param": None, "code": code}}
    return {
        "status": status,
        "body": {"inline_string": json.dumps(body, separators=(",", ":"))},
    }


def anthropic_error(status, message, error_type):
    """A direct response in Anthropic's error shape (the Messages API's paths)."""
    body = {"type": "error", "error": {"type": error_type, "message": message}}
    return {
        "status": status,
        "body": {"inline_string": json.dumps(body, separators=(",", ":"))},
    }


def is_messages_path(path):
    """The Messages API's paths, whose errors take Anthropic's shape (the filter's rule:
    `Endpoint::from_path` in core/src/request.rs)."""
    return path.endswith("/messages") or path.endswith("/messages/count_tokens")


def no_filter_503(path):
    """What an inference request gets from the route table when the filter did not set a pool:
    only when the filter is not running on the worker (its VM failed to start), since on an
    inference path it sets the pool or answers itself. A 503, which OpenAI's and Anthropic's
    SDKs retry, instead of the catch-all's 404 that would tell the client to use an inference
    path; in the shape of the path's API."""
    message = "the routing filter is not running on this gateway worker; retry the request"
    if is_messages_path(path):
        return anthropic_error(503, message, "overloaded_error")
    return openai_error(503, message, "service_unavailable_error", "routing_unavailable")


# The Messages API's paths as a regex over `:path`, query included (the filter's rule, which
# reads the path without its query: `is_messages_path`).
MESSAGES_PATH_REGEX = r"^[^?#]*/messages(/count_tokens)?([?#].*)?$"

# Envoy's own failures before any response byte, by response flag: no healthy upstream, a
# failed connect, a tripped circuit breaker, retries exhausted, a connection or stream reset
# before the response, a route whose cluster is gone; and the upstream timeout (504).
UNAVAILABLE_FLAGS = ["UH", "UF", "UO", "URX", "UC", "UR", "NC", "LR"]
TIMEOUT_FLAGS = ["UT"]
# Envoy's own refusals of a request it could not read or does not take (a protocol error of
# the HTTP codec, an HTTP/1.0 request, a path it cannot normalise), by their response code
# details: they carry no response flag, and their statuses (400 above all) are the filter's too,
# whose answers are in the API's shape already and must stay as they are. A CEL filter (Envoy's
# `envoy.access_loggers.extension_filters.cel`, in Envoy's and Istio's builds) reads them.
REFUSED_DETAILS_CEL = ("response.code_details.startsWith('http1.') || response.code_details.startsWith('http2.')"
                       " || response.code_details in ['low_version', 'path_normalization_failed', 'upgrade_failed']")


def body_too_large_message(max_body):
    """The filter's 413 message (`ApiError::body_too_large` in core/src/error.rs)."""
    return f"request body exceeds the gateway limit of {max_body} bytes"


def form_too_large_message(max_body):
    """The filter's 413 message for a multipart form (`ApiError::form_too_large`)."""
    return (f"multipart request body exceeds the gateway limit of {max_body} bytes before its `model` field: "
            "send the `model` field before the file (as OpenAI's Python SDK does), and the upload streams to "
            "the model server whatever its size")


DEFAULT_INGEST_PATH = "/gpuroute/v1/snapshot"  # core/src/config.rs, `default_ingest_path`
DEFAULT_PREFIX_PATH = "/gpuroute/v1/prefix"  # core/src/config.rs, `default_prefix_path`
DEFAULT_LOAD_PATH = "/gpuroute/v1/load"  # core/src/config.rs, `default_load_path`


def ingest_paths(ingest):
    """The paths of the filter's ingest endpoints for its `ingest` configuration (a dict, or
    None): the snapshot path and, unless turned off (""), the prefix-record exchange's and the
    in-flight exchange's."""
    ingest = ingest or {}
    paths = [ingest.get("path", DEFAULT_INGEST_PATH), ingest.get("prefix_path", DEFAULT_PREFIX_PATH),
             ingest.get("load_path", DEFAULT_LOAD_PATH)]
    return [p for p in paths if p]


def local_reply_config(max_body, ingest=None):
    """Envoy's own error answers in the API's shape, so an SDK reads them like the filter's.

    - 413: Envoy answers an oversize body itself when one read from the socket takes its buffer
      past `per_connection_buffer_limit_bytes` before the filter has seen the body pass
      `max_body_bytes` (the filter is handed the body buffered so far, not the read that
      overflows it). The body is the filter's own 413, so it does not matter which answered;
      for a multipart form (an audio upload) the filter's form 413, which says to send `model`
      before the file.
    - 503 and 504 that Envoy generates (response flags above): no pod of the pool could take
      the request (all dead, connects refused, retries exhausted) or the pod timed out. The
      message keeps Envoy's reason.
    - 507, which Envoy's router answers when a request's first attempt failed and its body
      outgrew the retry buffer (`per_connection_buffer_limit_bytes`) before the retry (an audio
      upload streaming on to a pod that refused it): answered as the 503 above, which SDKs
      retry, with Envoy's reason ("exceeded request buffer limit while retrying upstream"). It
      carries no response flag.
    - Envoy's refusals of a request it cannot read or does not take (`REFUSED_DETAILS_CEL`:
      an HTTP/1 or HTTP/2 protocol error such as a body both chunked and with a length, 400;
      headers too large, 431; an unknown transfer coding, 501; HTTP/1.0, 426; a path it cannot
      normalise, 400; a refused upgrade, 403): the same status, the body in the API's shape
      (`malformed_request`) with Envoy's reason and its details.

    A mapper's filter reads the request's `:path` for the API (Anthropic's shape on the
    Messages API's paths). The filter's own answers carry no response flag and, for 413, the
    same body: no mapper changes them. The 413 mappers leave the ingest endpoints alone (the
    snapshot path and the prefix-record exchange's, `ingest_paths(ingest)`, served on the
    traffic listener where the aggregator talks to them there, as under Istio and Envoy
    Gateway): the filter's 413 there is `snapshot_too_large`, `prefix_records_too_large` or
    `replica_load_too_large`.
    """
    messages = {"header_filter": {"header": {"name": ":path", "string_match": {"safe_regex": {"regex": MESSAGES_PATH_REGEX}}}}}

    def status(code):
        return {"status_code_filter": {"comparison": {"op": "EQ", "value": {"default_value": code, "runtime_key": "gpuroute.local_reply.status"}}}}

    def flags(names):
        return {"response_flag_filter": {"flags": names}}

    def both(a, b):
        return {"and_filter": {"filters": [a, b]}}

    not_ingest = [{"header_filter": {"header": {"name": ":path", "string_match": {"prefix": p}, "invert_match": True}}}
                  for p in ingest_paths(ingest)]

    def fixed(body):
        return {
            "body": {"inline_string": json.dumps(body, separators=(",", ":"))},
            "body_format_override": {"text_format_source": {"inline_string": "%LOCAL_REPLY_BODY%"}, "content_type": "application/json"},
        }

    def formatted(body):
        return {"body_format_override": {"json_format": body, "content_type": "application/json"}}

    too_large = body_too_large_message(max_body)
    form = {"header_filter": {"header": {"name": "content-type", "string_match": {"prefix": "multipart/form-data", "ignore_case": True}}}}
    reason = "%LOCAL_REPLY_BODY%"
    unavailable = f"no pod of the pool could take the request: {reason}"
    timeout = f"the pod did not answer in time: {reason}"
    malformed = f"Envoy refused the HTTP request: {reason} (%RESPONSE_CODE_DETAILS%)"
    refused = {"extension_filter": {"name": "envoy.access_loggers.extension_filters.cel", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.access_loggers.filters.cel.v3.ExpressionFilter",
        "expression": REFUSED_DETAILS_CEL}}}
    return {
        "mappers": [
            dict({"filter": both(status(413), messages)}, **fixed({"type": "error", "error": {"type": "request_too_large", "message": too_large}})),
            dict({"filter": both(status(413), form)}, **fixed({"error": {"message": form_too_large_message(max_body), "type": "invalid_request_error", "param": None, "code": "request_too_large"}})),
            dict({"filter": {"and_filter": {"filters": [status(413), *not_ingest]}}}, **fixed({"error": {"message": too_large, "type": "invalid_request_error", "param": None, "code": "request_too_large"}})),
            dict({"filter": both(flags(TIMEOUT_FLAGS), messages)}, **formatted({"type": "error", "error": {"type": "api_error", "message": timeout}})),
            dict({"filter": flags(TIMEOUT_FLAGS)}, **formatted({"error": {"message": timeout, "type": "timeout_error", "param": None, "code": "upstream_timeout"}})),
            dict({"filter": both(status(507), messages), "status_code": 503},
                 **formatted({"type": "error", "error": {"type": "overloaded_error", "message": unavailable}})),
            dict({"filter": status(507), "status_code": 503},
                 **formatted({"error": {"message": unavailable, "type": "service_unavailable_error", "param": None, "code": "upstream_unavailable"}})),
            dict({"filter": both(flags(UNAVAILABLE_FLAGS), messages)}, **formatted({"type": "error", "error": {"type": "overloaded_error", "message": unavailable}})),
            dict({"filter": flags(UNAVAILABLE_FLAGS)}, **formatted({"error": {"message": unavailable, "type": "service_unavailable_error", "param": None, "code": "upstream_unavailable"}})),
            dict({"filter": both(refused, messages)}, **formatted({"type": "error", "error": {"type": "invalid_request_error", "message": malformed}})),
            dict({"filter": refused}, **formatted({"error": {"message": malformed, "type": "invalid_request_error", "param": None, "code": "malformed_request"}})),
        ]
    }


def openai_404(models_path="/v1/models"):
    """`models_path`: the filter's (`""`: not served, so not named)."""
    hint = f" or {models_path}" if models_path else ""
    return openai_error(404, f"no route: use an OpenAI inference path{hint}", "invalid_request_error", "not_found")


JSON_CONTENT_TYPE = [{"header": {"key": "content-type", "value": "application/json"}, "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}]


def catch_all_404(models_path="/v1/models"):
    """The route of every path no other route takes: the 404 in OpenAI's shape, labelled JSON."""
    return {"match": {"prefix": "/"}, "direct_response": openai_404(models_path), "response_headers_to_add": JSON_CONTENT_TYPE}


def upstream_tls(tls):
    """The transport socket of a pool whose pods serve HTTPS (`pool["tls"]`, above)."""
    validation = {"trusted_ca": {"filename": tls["ca_file"]}}
    if tls.get("san"):
        validation["match_typed_subject_alt_names"] = [
            {"san_type": "DNS", "matcher": {"exact": name}} for name in tls["san"]
        ]
    common = {"validation_context": validation}
    if tls.get("cert_file"):
        common["tls_certificates"] = [
            {"certificate_chain": {"filename": tls["cert_file"]}, "private_key": {"filename": tls["key_file"]}}
        ]
    ctx = {
        "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
        "common_tls_context": common,
    }
    if tls.get("sni"):
        ctx["sni"] = tls["sni"]
    return {"name": "envoy.transport_sockets.tls", "typed_config": ctx}


def cluster(pool, mode, connect_timeout="1s"):
    c = {
        "name": "pool_" + pool["name"],
        "connect_timeout": connect_timeout,
        "type": "STATIC",
        "per_connection_buffer_limit_bytes": 1024 * 1024,
        # Model servers stream for minutes; many concurrent streams per pod are normal.
        "circuit_breakers": {
            "thresholds": [
                {"max_connections": 100000, "max_pending_requests": 100000, "max_requests": 100000}
            ]
        },
        "load_assignment": {
            "cluster_name": "pool_" + pool["name"],
            "endpoints": [
                {"lb_endpoints": [{"endpoint": {"address": addr(e)}} for e in pool["endpoints"]]}
            ],
        },
    }
    if pool.get("tls"):
        c["transport_socket"] = upstream_tls(pool["tls"])
    least_request = {
        "typed_extension_config": {
            "name": "envoy.load_balancing_policies.least_request",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.least_request.v3.LeastRequest"
            },
        }
    }
    round_robin = {
        "typed_extension_config": {
            "name": "envoy.load_balancing_policies.round_robin",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.round_robin.v3.RoundRobin"
            },
        }
    }
    if mode == "filter":
        c["load_balancing_policy"] = {
            "policies": [
                {
                    "typed_extension_config": {
                        "name": "envoy.load_balancing_policies.override_host",
                        "typed_config": {
                            "@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost",
                            "override_host_sources": [{"header": "x-gateway-destination-endpoint"}],
                            # Fail-open: no header, or a host that is not a member -> least_request.
                            "fallback_policy": {"policies": [least_request]},
                        },
                    }
                }
            ]
        }
    elif mode == "filter_original_dst":
        c["type"] = "ORIGINAL_DST"
        c["lb_policy"] = "CLUSTER_PROVIDED"
        c["original_dst_lb_config"] = {
            "use_http_header": True,
            "http_header_name": "x-gateway-destination-endpoint",
        }
        del c["load_assignment"]
    elif mode == "least_request":
        c["load_balancing_policy"] = {"policies": [least_request]}
    elif mode == "round_robin":
        c["load_balancing_policy"] = {"policies": [round_robin]}
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    return c


def dynamic_module_filter(config):
    return {
        "name": "envoy.filters.http.dynamic_modules",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.dynamic_modules.v3.DynamicModuleFilter",
            # lib<name>.so from ENVOY_DYNAMIC_MODULES_SEARCH_PATH; loaded once per process, so
            # both listeners share its snapshot. Kept loaded: the module holds process state.
            "dynamic_module_config": {"name": "gpuroute", "do_not_close": True},
            "filter_name": "gpuroute",
            "filter_config": {
                "@type": "type.googleapis.com/google.protobuf.StringValue",
                "value": json.dumps(config, separators=(",", ":")),
            },
        },
    }


def gpuroute_filter(desc, config):
    if desc.get("runtime", "wasm") == "dynamic":
        return dynamic_module_filter(config)
    return wasm_filter(desc["wasm"], config)


def render(desc):
    mode = desc["mode"]
    pools = desc["pools"]
    fcfg = copy.deepcopy(desc.get("filter_config") or {})
    filter_on = mode.startswith("filter") or len(pools) > 1
    if not mode.startswith("filter"):
        fcfg["pick_endpoints"] = False
        fcfg.pop("ingest", None)
    if mode == "filter_original_dst":
        fcfg["data_plane"] = "original_dst"
    # With a dedicated loopback ingest listener, the public listener does not accept snapshots.
    ingest_part = fcfg.get("ingest")
    if desc.get("ingest"):
        fcfg.pop("ingest", None)
    max_body = fcfg.get("max_body_bytes", DEFAULT_MAX_BODY)
    timeout = f"{desc.get('route_timeout_s', 0)}s"

    retry = {
        # Only before any response byte: a failed connect or a refused stream moves to the next
        # endpoint of x-gateway-destination-endpoint (or the fallback policy's pick).
        "retry_on": "connect-failure,refused-stream,reset-before-request",
        "num_retries": 2,
    }
    routes = []
    if filter_on:
        for p in pools:
            routes.append(
                {
                    "match": {
                        "prefix": "/",
                        "headers": [{"name": "x-gateway-pool", "string_match": {"exact": p["name"]}}],
                    },
                    "route": {"cluster": "pool_" + p["name"], "timeout": timeout, "retry_policy": retry},
                }
            )
        for path in fcfg.get("inference_paths", INFERENCE_PATHS):
            routes.append(
                {
                    "match": {"path": path},
                    "direct_response": no_filter_503(path),
                    "response_headers_to_add": JSON_CONTENT_TYPE,
                }
            )
        routes.append(catch_all_404(fcfg.get("models_path", "/v1/models")))
    else:
        routes.append(
            {"match": {"prefix": "/"}, "route": {"cluster": "pool_" + pools[0]["name"], "timeout": timeout, "retry_policy": retry}}
        )

    http_filters = []
    if filter_on:
        http_filters.append(gpuroute_filter(desc, fcfg))
    http_filters.append(
        {
            "name": "envoy.filters.http.router",
            "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"},
        }
    )

    def hcm(stat_prefix, route_list, filters, local_replies=None, log=None):
        c = {
            "name": "envoy.filters.network.http_connection_manager",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
                "stat_prefix": stat_prefix,
                "stream_idle_timeout": "300s",
                "route_config": {"virtual_hosts": [{"name": "all", "domains": ["*"], "routes": route_list}]},
                "http_filters": filters,
            },
        }
        if local_replies:
            c["typed_config"]["local_reply_config"] = local_replies
        if log:
            c["typed_config"]["access_log"] = access_log(log)
        return c

    listeners = [
        {
            "name": "openai",
            "address": addr(desc["listen"]),
            # The filter buffers bodies up to max_body_bytes; Envoy's own limit sits above it so
            # the filter, not Envoy, answers an oversize body (with an OpenAI-style 413).
            "per_connection_buffer_limit_bytes": max_body + BODY_HEADROOM,
            "filter_chains": [
                {
                    "filters": [
                        hcm(
                            "openai",
                            routes,
                            http_filters,
                            local_reply_config(max_body, ingest_part) if filter_on else None,
                            desc.get("access_log"),
                        )
                    ]
                }
            ],
        }
    ]
    if mode.startswith("filter") and desc.get("ingest"):
        ingest_cfg = {"pools": [], "ingest": ingest_part or {}}
        listeners.append(
            {
                "name": "gpuroute_ingest",
                "address": addr(desc["ingest"]),
                "per_connection_buffer_limit_bytes": 16 * 1024 * 1024,
                "filter_chains": [
                    {
                        "filters": [
                            hcm(
                                "gpuroute_ingest",
                                [catch_all_404()],
                                [gpuroute_filter(desc, ingest_cfg), http_filters[-1]],
                            )
                        ]
                    }
                ],
            }
        )
    clusters = [cluster(p, mode) for p in pools]
    admin = desc.get("admin", "127.0.0.1:9901")
    if desc.get("metrics"):
        listeners.append(metrics_listener(desc["metrics"], hcm))
        clusters.append(admin_cluster(admin))
    return {
        "admin": {"address": addr(admin)},
        "stats_config": {"stats_tags": STATS_TAGS, "histogram_bucket_settings": HISTOGRAM_BUCKETS},
        "static_resources": {"listeners": listeners, "clusters": clusters},
    }


# The metrics listener's way to the admin interface (`metrics`).
ADMIN_CLUSTER = "envoy_admin"


def metrics_listener(address, hcm):
    """A listener that passes GET /stats/prometheus (any query) to the admin interface and
    answers everything else with a 404: Prometheus reads the stats from the pod's address, and
    nothing else of the admin (which can stop Envoy or dump its configuration) is reachable."""
    routes = [
        {"match": {"path": "/stats/prometheus", "headers": [{"name": ":method", "string_match": {"exact": "GET"}}]},
         "route": {"cluster": ADMIN_CLUSTER, "timeout": "10s"}},
        {"match": {"prefix": "/"}, "direct_response": {"status": 404}},
    ]
    router = {
        "name": "envoy.filters.http.router",
        "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"},
    }
    return {
        "name": "gpuroute_metrics",
        "address": addr(address),
        "filter_chains": [{"filters": [hcm("gpuroute_metrics", routes, [router])]}],
    }


def admin_cluster(admin):
    return {
        "name": ADMIN_CLUSTER,
        "connect_timeout": "1s",
        "type": "STATIC",
        "load_assignment": {"cluster_name": ADMIN_CLUSTER,
                            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": addr(admin)}}]}]},
    }


def main():
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    with open(sys.argv[1]) as f:
        desc = json.load(f)
    json.dump(render(desc), sys.stdout, indent=1)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
