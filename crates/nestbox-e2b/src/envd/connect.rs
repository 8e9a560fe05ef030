//! The Connect protocol with the JSON codec, as the SDK speaks it: a unary
//! call is a POST of `application/json` answered by one JSON object (errors:
//! an HTTP status and `{"code","message"}`); a server stream is a POST of
//! `application/connect+json` whose body and answer are envelopes (one flag
//! byte, a 4-byte big-endian length, the JSON), the last answer envelope
//! flagged end-of-stream with `{}` or `{"error":{…}}`.

use serde_json::{json, Value};

use crate::error::E2bError;
use crate::http::{ChunkWriter, Request, Response};

/// Flag of the end-of-stream envelope.
const END_STREAM: u8 = 0x02;

/// Whether the request is a streaming call.
pub fn is_stream(req: &Request) -> bool {
    req.header("content-type")
        .is_some_and(|c| c.starts_with("application/connect+"))
}

/// The request message: the body of a unary call, the first envelope of a
/// streaming one.
pub fn message(req: &Request) -> Result<Value, E2bError> {
    let body: &[u8] = if is_stream(req) {
        if req.body.len() < 5 {
            return Err(E2bError::Invalid(
                "streaming request without an envelope".into(),
            ));
        }
        if req.body[0] & 0x01 != 0 {
            return Err(E2bError::Invalid(
                "compressed messages are not supported".into(),
            ));
        }
        let len = u32::from_be_bytes([req.body[1], req.body[2], req.body[3], req.body[4]]) as usize;
        req.body
            .get(5..5 + len)
            .ok_or_else(|| E2bError::Invalid("truncated envelope".into()))?
    } else {
        &req.body
    };
    if body.is_empty() {
        return Ok(json!({}));
    }
    serde_json::from_slice(body)
        .map_err(|e| E2bError::Invalid(format!("request message is not JSON: {e}")))
}

/// The JSON of an error.
pub fn error_json(e: &E2bError) -> Value {
    json!({"code": e.code().name(), "message": e.to_string()})
}

/// A unary answer.
pub fn unary(result: Result<Value, E2bError>) -> Response {
    match result {
        Ok(v) => Response::json(200, &v),
        Err(e) => Response::json(e.status(), &error_json(&e)),
    }
}

/// One envelope.
pub fn envelope(flags: u8, message: &Value) -> Vec<u8> {
    let data = message.to_string().into_bytes();
    let mut out = Vec::with_capacity(5 + data.len());
    out.push(flags);
    out.extend_from_slice(&(data.len() as u32).to_be_bytes());
    out.extend_from_slice(&data);
    out
}

/// Write one message of a stream.
pub fn send(w: &mut ChunkWriter<'_>, message: &Value) -> std::io::Result<()> {
    w.chunk(&envelope(0, message))
}

/// Send the last message of a stream with its end (one write).
pub fn send_last(w: &mut ChunkWriter<'_>, message: &Value) {
    w.last_chunk(&envelope(0, message));
}

/// End a stream, with its error if it failed (sent with the end of the body).
pub fn end(w: &mut ChunkWriter<'_>, error: Option<&E2bError>) -> std::io::Result<()> {
    let last = match error {
        None => json!({}),
        Some(e) => json!({"error": error_json(e)}),
    };
    w.last_chunk(&envelope(END_STREAM, &last));
    Ok(())
}

/// A stream that fails before its first message: a 200 with only the
/// end-of-stream envelope carrying the error.
pub fn stream_error(e: E2bError) -> Response {
    Response::stream(
        200,
        "application/connect+json",
        Box::new(move |w| end(w, Some(&e))),
    )
}
