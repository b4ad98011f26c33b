//! The admin API, for failure tests and demos: `GET /pods` (every pod's live state),
//! `GET /pods/{name}`, and `POST /pods/{name}/mode` with `{"mode": "ok"|"down"|"hang"|"error"}`.

use std::sync::Arc;

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;

use crate::pod::{Mode, Pod};

/// The pods the admin API controls.
pub type Pods = Arc<Vec<Arc<Pod>>>;

/// The admin router.
pub fn router(pods: Pods) -> Router {
    Router::new()
        .route("/pods", get(list))
        .route("/pods/{name}", get(one))
        .route("/pods/{name}/mode", post(set_mode))
        .with_state(pods)
}

fn find<'a>(pods: &'a Pods, name: &str) -> Option<&'a Arc<Pod>> {
    pods.iter().find(|p| p.cfg.name == name)
}

fn no_such_pod(name: &str) -> Response {
    (
        StatusCode::NOT_FOUND,
        Json(serde_json::json!({"error": format!("no pod named `{name}`")})),
    )
        .into_response()
}

async fn list(State(pods): State<Pods>) -> Response {
    let states: Vec<_> = pods.iter().map(|p| p.state()).collect();
    Json(serde_json::json!({ "pods": states })).into_response()
}

async fn one(State(pods): State<Pods>, Path(name): Path<String>) -> Response {
    match find(&pods, &name) {
        Some(p) => Json(p.state()).into_response(),
        None => no_such_pod(&name),
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ModeRequest {
    mode: Mode,
}

async fn set_mode(
    State(pods): State<Pods>,
    Path(name): Path<String>,
    body: axum::body::Bytes,
) -> Response {
    let Some(pod) = find(&pods, &name) else {
        return no_such_pod(&name);
    };
    let req: ModeRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => return (
            StatusCode::BAD_REQUEST,
            Json(serde_json::json!({
                "error": format!("expected {{\"mode\": \"ok\"|\"down\"|\"hang\"|\"error\"}}: {e}")
            })),
        )
            .into_response(),
    };
    pod.set_mode(req.mode);
    tracing::info!(pod = %name, mode = ?req.mode, "mode changed");
    Json(serde_json::json!({"name": name, "mode": req.mode})).into_response()
}
