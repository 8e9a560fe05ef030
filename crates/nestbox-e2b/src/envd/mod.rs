//! The in-sandbox API ("envd") the SDK reaches at `E2B_SANDBOX_URL`, served
//! on the same port as the control plane and routed to a sandbox by the
//! `E2b-Sandbox-Id` header: `/health`, `/files`, and the Connect services
//! `process.Process` and `filesystem.Filesystem`.

pub mod agent;
pub mod agentd;
pub mod connect;
pub mod fs;
pub mod process;

use std::sync::Arc;

use serde_json::json;
use sha2::Digest;

use crate::error::E2bError;
use crate::http::{Request, Response};
use crate::Server;

/// Answer a `/files` request without the `E2b-Sandbox-Id` header, signed
/// (the SDK's `download_url` / `upload_url`): its sandbox is the one whose
/// access token makes the signature, `v1_` and the unpadded base64 of
/// SHA-256 of `PATH:OPERATION:USER:TOKEN[:EXPIRATION]`, as envd checks it.
pub fn signed_files(server: &Arc<Server>, req: &Request) -> Response {
    let found = (|| {
        let signature = req.query("signature").unwrap_or_default();
        let operation = if req.method == "GET" { "read" } else { "write" };
        let expiration = req.query("signature_expiration");
        let sandbox = server
            .all()
            .into_iter()
            .find(|s| {
                let mut raw = format!(
                    "{}:{operation}:{}:{}",
                    req.query("path").unwrap_or_default(),
                    req.query("username").unwrap_or_default(),
                    s.token
                );
                if let Some(e) = expiration {
                    raw = format!("{raw}:{e}");
                }
                let digest = sha2::Sha256::digest(raw.as_bytes());
                let encoded = crate::util::base64_encode(&digest);
                signature == format!("v1_{}", encoded.trim_end_matches('='))
            })
            .ok_or(E2bError::BadSignature)?;
        if let Some(e) = expiration {
            let at: f64 = e.parse().map_err(|_| E2bError::BadSignature)?;
            if at < crate::util::now() {
                return Err(E2bError::SignatureExpired);
            }
        }
        Ok(sandbox)
    })();
    match found {
        Ok(sandbox) => fs::files(server, &sandbox, req),
        Err(e) => Response::json(
            e.status(),
            &json!({"code": e.status(), "message": e.to_string()}),
        ),
    }
}

/// Answer an envd request for sandbox `id`.
pub fn handle(server: &Arc<Server>, id: &str, req: &Request) -> Response {
    let rpc = |e: E2bError| {
        if connect::is_stream(req) {
            connect::stream_error(e)
        } else {
            connect::unary(Err(e))
        }
    };
    let sandbox = match server.sandbox(id) {
        Ok(s) => s,
        Err(e) => {
            // As E2B's proxy answers for a sandbox it does not know: the SDK
            // reads "was not found" in a 502 as the sandbox not running.
            let body = json!({"code": 502, "message": e.to_string()});
            return Response::json(502, &body);
        }
    };
    if req.header("x-access-token") != Some(sandbox.token.as_str()) {
        let e = E2bError::BadAccessToken(id.to_string());
        return if req.path.starts_with("/process.") || req.path.starts_with("/filesystem.") {
            rpc(e)
        } else {
            Response::json(401, &json!({"code": 401, "message": e.to_string()}))
        };
    }
    if let Some(method) = req.path.strip_prefix("/process.Process/") {
        return process::handle(server, id, method, req);
    }
    if let Some(method) = req.path.strip_prefix("/filesystem.Filesystem/") {
        return fs::handle(server, &sandbox, method, req);
    }
    match req.path.as_str() {
        "/health" => match sandbox.root_pid(&server.reg) {
            Ok(_) => Response::empty(204),
            Err(e) => Response::json(502, &json!({"code": 502, "message": e.to_string()})),
        },
        "/files" => fs::files(server, &sandbox, req),
        "/init" => Response::empty(204),
        other => Response::json(
            404,
            &json!({"code": 404, "message": format!("no envd route {other:?}")}),
        ),
    }
}
