//! A small HTTP/1.1 server on `std`: one thread per connection, keep-alive,
//! request bodies by `Content-Length` or chunked, responses either whole or
//! streamed as chunks that are written (and so reach the client) as soon as
//! they are produced — what the Connect protocol's server streams need.
//!
//! Why not a crate: the E2B SDK needs exactly this much (no TLS, no HTTP/2:
//! its `http://` transports speak HTTP/1.1), each chunk of a stream must be
//! on the wire when it is written, and a blocking thread per connection fits
//! handlers that wait on processes. See `docs/e2b.md`.

use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::time::Duration;

/// The longest request head (request line and headers).
const MAX_HEAD: usize = 64 << 10;
/// The largest request body accepted (uploads are held in memory).
pub const MAX_BODY: usize = 1 << 30;
/// How long an idle keep-alive connection is kept open.
const IDLE: Duration = Duration::from_secs(300);

/// One request, its body read whole.
#[derive(Debug, Default)]
pub struct Request {
    /// `GET`, `POST`…
    pub method: String,
    /// The path, percent-decoded, without the query.
    pub path: String,
    /// The query's pairs, percent-decoded.
    pub query: Vec<(String, String)>,
    /// Headers, names in lower case.
    pub headers: Vec<(String, String)>,
    /// The body.
    pub body: Vec<u8>,
}

impl Request {
    /// The first header named `name` (lower case).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    /// The first query parameter named `name`.
    pub fn query(&self, name: &str) -> Option<&str> {
        self.query
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

/// Writes the chunks of a streamed response.
#[derive(Debug)]
pub struct ChunkWriter<'a> {
    stream: &'a mut TcpStream,
    /// Chunks kept to go out with the next write (the last ones of the body
    /// go with its end: one write, one segment for the client to wake on).
    pending: Vec<u8>,
}

impl ChunkWriter<'_> {
    /// Send `data` as one chunk, now.
    pub fn chunk(&mut self, data: &[u8]) -> io::Result<()> {
        self.keep(data);
        let out = std::mem::take(&mut self.pending);
        self.stream.write_all(&out)?;
        self.stream.flush()
    }

    /// Send `data` as one chunk with the end of the body: the producer
    /// writes nothing after it but other last chunks.
    pub fn last_chunk(&mut self, data: &[u8]) {
        self.keep(data);
    }

    fn keep(&mut self, data: &[u8]) {
        if data.is_empty() {
            return;
        }
        self.pending
            .extend_from_slice(format!("{:x}\r\n", data.len()).as_bytes());
        self.pending.extend_from_slice(data);
        self.pending.extend_from_slice(b"\r\n");
    }
}

/// Produces a streamed body.
pub type Producer = Box<dyn FnOnce(&mut ChunkWriter<'_>) -> io::Result<()> + Send>;

/// A response body.
pub enum Body {
    /// Sent whole, with its length.
    Bytes(Vec<u8>),
    /// Sent chunk by chunk as the producer writes.
    Stream(Producer),
}

impl std::fmt::Debug for Body {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Body::Bytes(b) => write!(f, "Bytes({} bytes)", b.len()),
            Body::Stream(_) => write!(f, "Stream"),
        }
    }
}

/// A response.
#[derive(Debug)]
pub struct Response {
    /// Status code.
    pub status: u16,
    /// Headers besides the framing ones.
    pub headers: Vec<(String, String)>,
    /// Body.
    pub body: Body,
}

impl Response {
    /// A JSON response.
    pub fn json(status: u16, value: &serde_json::Value) -> Self {
        Response::bytes(status, "application/json", value.to_string().into_bytes())
    }

    /// A response of `content_type` with `body`.
    pub fn bytes(status: u16, content_type: &str, body: Vec<u8>) -> Self {
        Response {
            status,
            headers: vec![("Content-Type".into(), content_type.into())],
            body: Body::Bytes(body),
        }
    }

    /// No content.
    pub fn empty(status: u16) -> Self {
        Response {
            status,
            headers: Vec::new(),
            body: Body::Bytes(Vec::new()),
        }
    }

    /// A streamed response of `content_type`.
    pub fn stream(status: u16, content_type: &str, producer: Producer) -> Self {
        Response {
            status,
            headers: vec![("Content-Type".into(), content_type.into())],
            body: Body::Stream(producer),
        }
    }

    /// Add a header.
    pub fn with_header(mut self, name: &str, value: &str) -> Self {
        self.headers.push((name.into(), value.into()));
        self
    }
}

/// What answers requests.
pub type Handler = Arc<dyn Fn(Request) -> Response + Send + Sync>;

/// Accept connections on `listener` for ever, each served by its own thread.
pub fn serve(listener: TcpListener, handler: Handler) {
    for conn in listener.incoming() {
        let Ok(stream) = conn else { continue };
        let handler = handler.clone();
        let spawned = std::thread::Builder::new()
            .name("e2b-http".into())
            .spawn(move || connection(stream, &handler));
        if let Err(e) = spawned {
            tracing::error!("e2b: cannot start a connection thread: {e}");
        }
    }
}

/// Why a request could not be read.
#[derive(Debug)]
enum ReadError {
    /// The connection ended (cleanly, between requests, or not).
    Closed,
    /// The request broke the protocol: answer this status and close.
    Bad(u16, &'static str),
}

impl From<io::Error> for ReadError {
    fn from(_: io::Error) -> Self {
        ReadError::Closed
    }
}

fn connection(mut stream: TcpStream, handler: &Handler) {
    let _ = stream.set_nodelay(true);
    let _ = stream.set_read_timeout(Some(IDLE));
    let Ok(read_half) = stream.try_clone() else {
        return;
    };
    let mut reader = BufReader::new(read_half);
    loop {
        let request = match read_request(&mut reader, &mut stream) {
            Ok(r) => r,
            Err(ReadError::Closed) => return,
            Err(ReadError::Bad(status, why)) => {
                let _ = write_response(
                    &mut stream,
                    Response::bytes(status, "text/plain", why.as_bytes().to_vec()),
                    false,
                );
                return;
            }
        };
        let keep_alive = !request
            .header("connection")
            .is_some_and(|c| c.eq_ignore_ascii_case("close"));
        let response = handler(request);
        if write_response(&mut stream, response, keep_alive).is_err() || !keep_alive {
            return;
        }
    }
}

fn read_line(reader: &mut impl BufRead, budget: &mut usize) -> Result<String, ReadError> {
    let mut line = Vec::new();
    let n = reader
        .by_ref()
        .take(*budget as u64 + 1)
        .read_until(b'\n', &mut line)?;
    if n == 0 {
        return Err(ReadError::Closed);
    }
    if n > *budget {
        return Err(ReadError::Bad(431, "request head too large"));
    }
    *budget -= n;
    while line.last().is_some_and(|b| *b == b'\n' || *b == b'\r') {
        line.pop();
    }
    String::from_utf8(line).map_err(|_| ReadError::Bad(400, "request head is not UTF-8"))
}

fn read_request(
    reader: &mut BufReader<TcpStream>,
    writer: &mut TcpStream,
) -> Result<Request, ReadError> {
    let mut budget = MAX_HEAD;
    let mut first = read_line(reader, &mut budget)?;
    // Tolerate empty lines between requests.
    while first.is_empty() {
        first = read_line(reader, &mut budget)?;
    }
    let mut parts = first.split(' ');
    let (Some(method), Some(target), Some(version)) = (parts.next(), parts.next(), parts.next())
    else {
        return Err(ReadError::Bad(400, "malformed request line"));
    };
    if !version.starts_with("HTTP/1.") {
        return Err(ReadError::Bad(505, "only HTTP/1.x is served"));
    }
    let mut request = Request {
        method: method.to_string(),
        ..Request::default()
    };
    let (path, query) = target.split_once('?').unwrap_or((target, ""));
    request.path = crate::util::percent_decode(path);
    request.query = crate::util::parse_query(query);
    loop {
        let line = read_line(reader, &mut budget)?;
        if line.is_empty() {
            break;
        }
        let Some((name, value)) = line.split_once(':') else {
            return Err(ReadError::Bad(400, "malformed header"));
        };
        request
            .headers
            .push((name.trim().to_ascii_lowercase(), value.trim().to_string()));
    }
    if request
        .header("expect")
        .is_some_and(|e| e.eq_ignore_ascii_case("100-continue"))
    {
        writer.write_all(b"HTTP/1.1 100 Continue\r\n\r\n")?;
    }
    let chunked = request
        .header("transfer-encoding")
        .is_some_and(|t| t.to_ascii_lowercase().contains("chunked"));
    if chunked {
        request.body = read_chunked(reader)?;
    } else if let Some(len) = request.header("content-length") {
        let len: usize = len
            .parse()
            .map_err(|_| ReadError::Bad(400, "bad Content-Length"))?;
        if len > MAX_BODY {
            return Err(ReadError::Bad(413, "request body too large"));
        }
        let mut body = vec![0; len];
        reader.read_exact(&mut body)?;
        request.body = body;
    }
    Ok(request)
}

fn read_chunked(reader: &mut BufReader<TcpStream>) -> Result<Vec<u8>, ReadError> {
    let mut body = Vec::new();
    loop {
        let mut budget = MAX_HEAD;
        let line = read_line(reader, &mut budget)?;
        let size = line.split(';').next().unwrap_or("").trim();
        let size =
            usize::from_str_radix(size, 16).map_err(|_| ReadError::Bad(400, "bad chunk size"))?;
        if size == 0 {
            // Trailers, up to the empty line.
            while !read_line(reader, &mut budget)?.is_empty() {}
            return Ok(body);
        }
        if body.len() + size > MAX_BODY {
            return Err(ReadError::Bad(413, "request body too large"));
        }
        let start = body.len();
        body.resize(start + size, 0);
        reader.read_exact(&mut body[start..])?;
        let mut crlf = [0u8; 2];
        reader.read_exact(&mut crlf)?;
    }
}

fn reason(status: u16) -> &'static str {
    match status {
        100 => "Continue",
        200 => "OK",
        201 => "Created",
        204 => "No Content",
        400 => "Bad Request",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "Not Found",
        405 => "Method Not Allowed",
        409 => "Conflict",
        413 => "Payload Too Large",
        415 => "Unsupported Media Type",
        429 => "Too Many Requests",
        431 => "Request Header Fields Too Large",
        500 => "Internal Server Error",
        501 => "Not Implemented",
        502 => "Bad Gateway",
        503 => "Service Unavailable",
        504 => "Gateway Timeout",
        505 => "HTTP Version Not Supported",
        507 => "Insufficient Storage",
        _ => "Status",
    }
}

/// Make the close of `stream` send a reset (`SO_LINGER` of 0) instead of
/// an orderly end.
fn reset_on_close(stream: &TcpStream) {
    let linger = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    let _ = nix::sys::socket::setsockopt(stream, nix::sys::socket::sockopt::Linger, &linger);
}

fn write_response(stream: &mut TcpStream, response: Response, keep_alive: bool) -> io::Result<()> {
    let mut head = format!(
        "HTTP/1.1 {} {}\r\n",
        response.status,
        reason(response.status)
    );
    for (k, v) in &response.headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    if !keep_alive {
        head.push_str("Connection: close\r\n");
    }
    match response.body {
        Body::Bytes(body) => {
            head.push_str(&format!("Content-Length: {}\r\n\r\n", body.len()));
            let mut out = head.into_bytes();
            out.extend_from_slice(&body);
            stream.write_all(&out)?;
            stream.flush()
        }
        Body::Stream(producer) => {
            head.push_str("Transfer-Encoding: chunked\r\n\r\n");
            stream.write_all(head.as_bytes())?;
            stream.flush()?;
            let mut writer = ChunkWriter {
                stream,
                pending: Vec::new(),
            };
            if let Err(e) = producer(&mut writer) {
                // A stream cut by its producer (the sandbox went) is reset,
                // not ended: the client sees the connection dropped
                // mid-stream, as when E2B's VM is gone.
                reset_on_close(writer.stream);
                return Err(e);
            }
            // The last chunks and the end of the body, in one write.
            let mut out = std::mem::take(&mut writer.pending);
            out.extend_from_slice(b"0\r\n\r\n");
            writer.stream.write_all(&out)?;
            writer.stream.flush()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{BufRead, BufReader, Read, Write};

    /// A server on a free loopback port answering with `handler`.
    fn server(handler: Handler) -> std::net::SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        std::thread::spawn(move || serve(listener, handler));
        addr
    }

    fn read_head(r: &mut BufReader<TcpStream>) -> Vec<String> {
        let mut lines = Vec::new();
        loop {
            let mut l = String::new();
            r.read_line(&mut l).unwrap();
            let l = l.trim_end().to_string();
            if l.is_empty() {
                return lines;
            }
            lines.push(l);
        }
    }

    #[test]
    fn bodies_by_length_and_chunks_on_one_kept_connection() {
        let addr = server(Arc::new(|req: Request| {
            let text = format!(
                "{} {} {:?} {}",
                req.method,
                req.path,
                req.query("p"),
                String::from_utf8_lossy(&req.body)
            );
            Response::bytes(200, "text/plain", text.into_bytes())
        }));
        let mut s = TcpStream::connect(addr).unwrap();
        s.write_all(b"POST /a%20b?p=x%2Fy HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello")
            .unwrap();
        s.write_all(
            b"POST /c HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2;x=1\r\nde\r\n0\r\n\r\n",
        )
        .unwrap();
        let mut r = BufReader::new(s.try_clone().unwrap());
        for want in ["POST /a b Some(\"x/y\") hello", "POST /c None abcde"] {
            let head = read_head(&mut r);
            assert_eq!(head[0], "HTTP/1.1 200 OK");
            let len: usize = head
                .iter()
                .find_map(|h| h.strip_prefix("Content-Length: "))
                .unwrap()
                .parse()
                .unwrap();
            let mut body = vec![0; len];
            r.read_exact(&mut body).unwrap();
            assert_eq!(String::from_utf8(body).unwrap(), want);
        }
    }

    #[test]
    fn streamed_chunks_arrive_before_the_stream_ends() {
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let rx = std::sync::Mutex::new(Some(rx));
        let addr = server(Arc::new(move |_req: Request| {
            let rx = rx.lock().unwrap().take().unwrap();
            Response::stream(
                200,
                "application/octet-stream",
                Box::new(move |w| {
                    w.chunk(b"first")?;
                    // The second chunk waits until the client has the first.
                    rx.recv().unwrap();
                    w.chunk(b"second")
                }),
            )
        }));
        let mut s = TcpStream::connect(addr).unwrap();
        s.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
        let mut r = BufReader::new(s.try_clone().unwrap());
        let head = read_head(&mut r);
        assert!(
            head.contains(&"Transfer-Encoding: chunked".to_string()),
            "{head:?}"
        );
        let mut size = String::new();
        r.read_line(&mut size).unwrap();
        assert_eq!(size.trim(), "5");
        let mut data = [0u8; 7];
        r.read_exact(&mut data).unwrap();
        assert_eq!(&data, b"first\r\n");
        tx.send(()).unwrap();
        // The second chunk, then the end of the body (the connection stays).
        let mut rest = [0u8; 16];
        r.read_exact(&mut rest).unwrap();
        assert_eq!(&rest, b"6\r\nsecond\r\n0\r\n\r\n");
    }

    #[test]
    fn a_malformed_request_is_answered_400_and_closed() {
        let addr = server(Arc::new(|_req: Request| Response::empty(204)));
        let mut s = TcpStream::connect(addr).unwrap();
        s.write_all(b"NONSENSE\r\n\r\n").unwrap();
        let mut all = String::new();
        s.read_to_string(&mut all).unwrap();
        assert!(all.starts_with("HTTP/1.1 400 "), "{all}");
        assert!(all.ends_with("malformed request line"), "{all}");
    }
}
