//! E2B's control plane (`/sandboxes`, `/v2/sandboxes`): create (a clone of
//! a nestbox template, or a box of an image started cold), get, list, kill,
//! set timeout, pause (the box frozen into a template), connect/resume (a
//! clone of it takes its place), fork and snapshot, with the status codes and
//! fields of E2B's OpenAPI schema as the SDK's generated client reads them.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{json, Map, Value};

use crate::envd::process::Table;
use crate::error::{E2bError, Result};
use crate::http::{Request, Response};
use crate::sandbox::{Live, Phase, Sandbox};
use crate::util::{now, random_hex, rfc3339};
use crate::{base, Server};

/// The envd version announced: the SDK enables its features by it (default
/// user, stdin, octet-stream uploads); see `docs/e2b.md`.
pub const ENVD_VERSION: &str = "0.5.7";
/// A sandbox's life when the request gives none (E2B's default).
pub const DEFAULT_TIMEOUT: u64 = 300;
/// How long a fork or snapshot waits for the commands it ends to be gone.
const KILL_WAIT: Duration = Duration::from_secs(2);
/// How long the cgroup freezer may take to freeze or thaw a box.
const FREEZER_TIMEOUT: Duration = Duration::from_secs(5);
/// The longest a create of `base` waits for the template to be made.
const BASE_WAIT: Duration = Duration::from_secs(120);

/// Answer a control-plane request.
pub fn handle(server: &Arc<Server>, req: &Request) -> Response {
    let result = authorize(server, req).and_then(|()| route(server, req));
    match result {
        Ok(r) => r,
        Err(e) => {
            let status = e.status();
            Response::json(status, &json!({"code": status, "message": e.to_string()}))
        }
    }
}

fn authorize(server: &Server, req: &Request) -> Result<()> {
    if server.keys.is_empty() {
        return Ok(());
    }
    let key = req.header("x-api-key").or_else(|| {
        req.header("authorization")
            .and_then(|a| a.strip_prefix("Bearer "))
    });
    match key {
        Some(k) if server.keys.iter().any(|ok| ok == k) => Ok(()),
        _ => Err(E2bError::Unauthorized),
    }
}

fn body(req: &Request) -> Result<Value> {
    if req.body.is_empty() {
        return Ok(json!({}));
    }
    serde_json::from_slice(&req.body)
        .map_err(|e| E2bError::Invalid(format!("request body is not JSON: {e}")))
}

fn route(server: &Arc<Server>, req: &Request) -> Result<Response> {
    let response = route_inner(server, req)?;
    // What a call on one sandbox changed (end of life, box, phase) is
    // recorded (create, fork and kill keep their records themselves).
    if let (true, Some(id)) = (req.method == "POST", sandbox_of(&req.path)) {
        if let Ok(s) = server.sandbox(id) {
            server.persist(&s);
        }
    }
    Ok(response)
}

/// The sandbox id of a `/sandboxes/ID/…` or `/v2/sandboxes/ID/…` path.
fn sandbox_of(path: &str) -> Option<&str> {
    let path = path.strip_prefix("/v2").unwrap_or(path);
    let rest = path.strip_prefix("/sandboxes/")?;
    let id = rest.split('/').next()?;
    (!id.is_empty() && rest.len() > id.len()).then_some(id)
}

fn route_inner(server: &Arc<Server>, req: &Request) -> Result<Response> {
    let path = req.path.trim_end_matches('/');
    let path = path.strip_prefix("/v2").unwrap_or(path);
    let parts: Vec<&str> = path.split('/').skip(1).collect();
    match (req.method.as_str(), parts.as_slice()) {
        ("POST", ["sandboxes"]) => {
            let s = create(server, &body(req)?)?;
            Ok(Response::json(201, &sandbox_json(&s)))
        }
        ("GET", ["sandboxes"]) => list(server, req, req.path.starts_with("/v2")),
        ("GET", ["sandboxes", id]) => Ok(Response::json(
            200,
            &detail_json(server, &*server.sandbox(id)?),
        )),
        ("DELETE", ["sandboxes", id]) => {
            kill(server, id)?;
            Ok(Response::empty(204))
        }
        ("POST", ["sandboxes", id, "timeout"]) => {
            let timeout = body(req)?
                .get("timeout")
                .and_then(Value::as_u64)
                .ok_or_else(|| E2bError::Invalid("timeout (seconds) is required".into()))?;
            let s = server.sandbox(id)?;
            s.live.lock().unwrap_or_else(|p| p.into_inner()).end_at = now() + timeout as f64;
            Ok(Response::empty(204))
        }
        ("POST", ["sandboxes", id, "refreshes"]) => {
            let duration = body(req)?
                .get("duration")
                .and_then(Value::as_u64)
                .unwrap_or(60);
            let s = server.sandbox(id)?;
            let mut live = s.live.lock().unwrap_or_else(|p| p.into_inner());
            live.end_at = live.end_at.max(now() + duration as f64);
            Ok(Response::empty(204))
        }
        ("POST", ["sandboxes", id, "pause"]) => {
            pause(server, id)?;
            Ok(Response::empty(204))
        }
        ("POST", ["sandboxes", id, "connect" | "resume"]) => {
            let timeout = body(req)?.get("timeout").and_then(Value::as_u64);
            let (s, resumed) = connect(server, id, timeout)?;
            Ok(Response::json(
                if resumed { 201 } else { 200 },
                &sandbox_json(&s),
            ))
        }
        ("POST", ["sandboxes", id, "fork"]) => {
            let b = body(req)?;
            let count = b
                .get("count")
                .and_then(Value::as_u64)
                .unwrap_or(1)
                .clamp(1, 100);
            let timeout = b.get("timeout").and_then(Value::as_u64);
            let results = fork(server, id, count as u32, timeout)?;
            Ok(Response::json(201, &Value::Array(results)))
        }
        ("POST", ["sandboxes", id, "snapshots"]) => {
            let name = body(req)?
                .get("name")
                .and_then(Value::as_str)
                .filter(|n| !n.is_empty())
                .map(String::from);
            let snapshot = snapshot(server, id, name)?;
            Ok(Response::json(201, &snapshot_json(&snapshot)))
        }
        ("GET", ["snapshots"]) => {
            let mut all = server.all_snapshots();
            all.reverse();
            let matching: Vec<crate::Snapshot> = all
                .into_iter()
                .filter(|s| req.query("sandboxID").is_none_or(|id| s.sandbox_id == id))
                .filter(|s| {
                    req.query("name")
                        .is_none_or(|n| s.names().iter().any(|m| m == n))
                })
                .collect();
            Ok(paginate(req, &matching, snapshot_json))
        }
        ("DELETE", ["templates", key]) => {
            let snapshot = server
                .take_snapshot(key)
                .ok_or_else(|| E2bError::NotFound(format!("snapshot {key:?} not found")))?;
            server.nestbox.run(
                &format!("remove snapshot {:?}", snapshot.id),
                &["rm", "-f", &snapshot.id],
            )?;
            Ok(Response::empty(204))
        }
        (_, ["sandboxes", ..]) => Err(E2bError::Unsupported(format!(
            "{} {}",
            req.method, req.path
        ))),
        _ => Err(E2bError::NotFound(format!(
            "no route {} {}",
            req.method, req.path
        ))),
    }
}

/// The `Sandbox` object of create and connect.
fn sandbox_json(s: &Sandbox) -> Value {
    json!({
        "templateID": s.template,
        "sandboxID": s.id,
        "clientID": "nestbox",
        "envdVersion": ENVD_VERSION,
        "envdAccessToken": s.token,
        "domain": null,
    })
}

/// The `SnapshotInfo` object.
fn snapshot_json(s: &crate::Snapshot) -> Value {
    json!({"snapshotID": s.id, "names": s.names()})
}

/// The page of `items` a list request asks for (`limit`, `nextToken`: the
/// offset), with `X-Next-Token` when more follow.
fn paginate<T>(req: &Request, items: &[T], to_json: impl Fn(&T) -> Value) -> Response {
    let offset: usize = req
        .query("nextToken")
        .and_then(|t| t.parse().ok())
        .unwrap_or(0);
    let limit: usize = req
        .query("limit")
        .and_then(|t| t.parse().ok())
        .unwrap_or(100)
        .max(1);
    let page: Vec<Value> = items.iter().skip(offset).take(limit).map(to_json).collect();
    let response = Response::json(200, &Value::Array(page));
    if offset + limit < items.len() {
        response.with_header("X-Next-Token", &(offset + limit).to_string())
    } else {
        response
    }
}

/// The `SandboxDetail` / `ListedSandbox` object.
fn detail_json(server: &Server, s: &Sandbox) -> Value {
    let live = s.live();
    json!({
        "templateID": s.template,
        "sandboxID": s.id,
        "clientID": "nestbox",
        "startedAt": rfc3339(s.started_at),
        "endAt": rfc3339(live.end_at),
        "envdVersion": ENVD_VERSION,
        "envdAccessToken": s.token,
        "cpuCount": server.cpu_count,
        "memoryMB": server.memory_mb,
        "diskSizeMB": 0,
        "state": live.phase.name(),
        "metadata": s.metadata,
        "domain": null,
    })
}

fn strings(v: Option<&Value>) -> Vec<(String, String)> {
    v.and_then(Value::as_object)
        .map(|m: &Map<String, Value>| {
            m.iter()
                .filter_map(|(k, v)| v.as_str().map(|v| (k.clone(), v.to_string())))
                .collect()
        })
        .unwrap_or_default()
}

/// Make a sandbox of `body.templateID`.
pub fn create(server: &Arc<Server>, body: &Value) -> Result<Arc<Sandbox>> {
    let template = body
        .get("templateID")
        .and_then(Value::as_str)
        .filter(|t| !t.is_empty())
        .ok_or_else(|| E2bError::Invalid("templateID is required".into()))?;
    let template = server.template_of(template);
    let timeout = body
        .get("timeout")
        .and_then(Value::as_u64)
        .unwrap_or(DEFAULT_TIMEOUT);
    let id = format!("e2b-{}", random_hex(8));
    if template == base::BASE && !base::is_template(server, base::BASE) {
        server.base.wait(BASE_WAIT)?;
    }
    let from_snapshot = server.all_snapshots().iter().any(|s| s.id == template);
    if base::is_template(server, &template) {
        server.nestbox.clone_box(&template, &id)?;
    } else {
        cold(server, &template, &id)?;
    }
    let sandbox = Arc::new(Sandbox {
        id: id.clone(),
        template,
        started_at: now(),
        metadata: strings(body.get("metadata")).into_iter().collect(),
        env: strings(body.get("envVars")),
        token: random_hex(16),
        auto_pause: body
            .get("autoPause")
            .and_then(Value::as_bool)
            .unwrap_or(false),
        live: Mutex::new(Live {
            box_name: id.clone(),
            phase: Phase::Running,
            end_at: now() + timeout as f64,
            generation: 0,
            previous: Vec::new(),
        }),
        procs: Default::default(),
        watchers: Default::default(),
        init: Default::default(),
    });
    if from_snapshot {
        // Its commands were frozen with it: they go on here.
        follow_commands(server, &sandbox.procs, &id, true);
    }
    server.insert(sandbox.clone());
    Ok(sandbox)
}

/// Start box `id` of image `image`, cold.
fn cold(server: &Server, image: &str, id: &str) -> Result<()> {
    let host = image == "host";
    let mut args: Vec<String> = ["run", "-d", "--name", id, "--image", image]
        .iter()
        .map(|s| s.to_string())
        .collect();
    if host {
        args.extend(base::user_box_args(server)?);
    }
    // A box of the host image runs the agent (whose binary, this server's,
    // runs on the host's libraries); another image just stays up, its
    // commands run by `nestbox exec`.
    if host {
        args.extend(base::agent_args(server));
    } else {
        args.extend(["--".into(), "sleep".into(), "infinity".into()]);
    }
    let argv: Vec<&str> = args.iter().map(String::as_str).collect();
    match server
        .nestbox
        .run(&format!("start a box of image {image:?}"), &argv)
    {
        Ok(_) => {}
        Err(E2bError::Command {
            kind: crate::error::CommandKind::NotFound,
            ..
        }) => return Err(E2bError::NoSuchTemplate(image.to_string())),
        Err(e) => return Err(e),
    }
    if host {
        let ready = base::make_home(server, id).and_then(|()| base::wait_for_agent(server, id));
        if let Err(e) = ready {
            let _ = server.nestbox.run("remove a failed box", &["rm", "-f", id]);
            return Err(e);
        }
    }
    Ok(())
}

fn list(server: &Server, req: &Request, v2: bool) -> Result<Response> {
    let states: Vec<String> = match req.query("state") {
        Some(s) => s.split(',').map(|x| x.trim().to_string()).collect(),
        None if v2 => vec!["running".into(), "paused".into()],
        None => vec!["running".into()],
    };
    let wanted: Vec<(String, String)> = req
        .query("metadata")
        .map(crate::util::parse_query)
        .unwrap_or_default();
    let mut all: Vec<Arc<Sandbox>> = server.all();
    // Newest first, as E2B lists them, unless `order=asc`.
    all.sort_by(|a, b| a.started_at.total_cmp(&b.started_at).then(a.id.cmp(&b.id)));
    if req.query("order") != Some("asc") {
        all.reverse();
    }
    let started_after = match req.query("startedAfter") {
        Some(t) => Some(crate::util::parse_rfc3339(t).ok_or_else(|| {
            E2bError::Invalid(format!("startedAfter {t:?} is not an RFC 3339 time"))
        })?),
        None => None,
    };
    let matching: Vec<Arc<Sandbox>> = all
        .into_iter()
        .filter(|s| states.iter().any(|st| st == s.live().phase.name()))
        .filter(|s| wanted.iter().all(|(k, v)| s.metadata.get(k) == Some(v)))
        .filter(|s| req.query("template").is_none_or(|t| s.template == t))
        // The times listed are cut to the millisecond: a sandbox started in
        // the millisecond of `startedAfter` is listed.
        .filter(|s| started_after.is_none_or(|t| s.started_at >= t))
        .collect();
    Ok(paginate(req, &matching, |s| detail_json(server, s)))
}

/// Remove sandbox `id` and its box.
pub fn kill(server: &Server, id: &str) -> Result<()> {
    let s = server
        .take(id)
        .ok_or_else(|| E2bError::NoSuchSandbox(id.to_string()))?;
    let live = s.live();
    if live.phase == Phase::Paused {
        // A frozen process takes no signal (the v1 freezer holds even
        // SIGKILL): thawed, then killed with its box.
        if let Err(e) = set_frozen(server, &live.box_name, false) {
            tracing::error!("e2b: thawing paused sandbox {id} to remove it: {e}");
        }
    }
    s.procs.remove_all();
    server.nestbox.run(
        &format!("remove sandbox {id:?}"),
        &["rm", "-f", &live.box_name],
    )?;
    // The boxes it was frozen into go as their last clone does, newest
    // first, each within half a second of the one above: wait for them, so
    // that what the sandbox held is gone when the answer comes (a box still
    // cloned by a fork or a snapshot's sandboxes stays).
    for old in live.previous.iter().rev() {
        let gone_or_kept = || {
            server.reg.load(old).is_err()
                || nestbox_runtime::template::clones_of(&server.reg, old)
                    .is_ok_and(|c| !c.is_empty())
        };
        let end = std::time::Instant::now() + Duration::from_secs(10);
        while !gone_or_kept() && std::time::Instant::now() < end {
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    Ok(())
}

/// Freeze the box of sandbox `s` into a template, for a fork or a snapshot;
/// the frozen box's name. Commands started through envd with pipes are
/// frozen with it and go on in every clone of it ([`Table::follow`]);
/// those on a terminal or run by `nestbox exec` are ended first
/// ([`Table::end_unfollowed`]). A paused sandbox is thawed first.
fn freeze(server: &Server, s: &Sandbox, live: &Live) -> Result<String> {
    if live.phase == Phase::Paused {
        set_frozen(server, &live.box_name, false)?;
    }
    s.procs.end_unfollowed(KILL_WAIT);
    server.nestbox.run(
        &format!("freeze sandbox {:?}", s.id),
        &["freeze", &live.box_name],
    )?;
    Ok(live.box_name.clone())
}

/// The init of running box `name`.
fn init_pid(server: &Server, name: &str) -> Result<i32> {
    let record = server.reg.load(name)?;
    match record.state.init {
        Some(init) if init.alive() => Ok(init.pid),
        _ => Err(E2bError::NotFound(format!("box {name:?} has no init"))),
    }
}

/// Take up in `procs` the commands the agent of box `name` runs: with
/// `retake_known`, a new box that is a clone of the box they ran in (they go
/// on there); without, the sandbox's own box, whose commands a server
/// before this one started. A command that cannot is logged (the sandbox
/// goes on; the stream of a command in a clone ends when the frozen box it
/// came from is removed).
pub(crate) fn follow_commands(server: &Server, procs: &Arc<Table>, name: &str, retake_known: bool) {
    let followed = init_pid(server, name).and_then(|pid| procs.follow(pid, retake_known));
    if let Err(e) = followed {
        tracing::error!("e2b: the commands of box {name} cannot be taken up: {e}");
    }
}

/// Freeze (`true`) or thaw box `name` in place, with its cgroup's freezer:
/// every process of it stops where it is (or goes on), its memory, files,
/// pipes and connections kept.
fn set_frozen(server: &Server, name: &str, frozen: bool) -> Result<()> {
    let record = server.reg.load(name)?;
    let cgroup = record.state.cgroup.as_ref().ok_or_else(|| {
        E2bError::Invalid(format!(
            "box {name:?} has no cgroup, so it cannot be paused"
        ))
    })?;
    cgroup
        .set_frozen(frozen, FREEZER_TIMEOUT)
        .map_err(|e| E2bError::Runtime(e.into()))
}

/// Pause sandbox `id`: its box frozen in place (every process, commands
/// started through envd included, stops where it is; connect thaws it).
fn pause(server: &Server, id: &str) -> Result<()> {
    let s = server.sandbox(id)?;
    let mut live = s.live.lock().unwrap_or_else(|p| p.into_inner());
    if live.phase == Phase::Paused {
        return Err(E2bError::AlreadyPaused(s.id.clone()));
    }
    set_frozen(server, &live.box_name, true)?;
    live.phase = Phase::Paused;
    Ok(())
}

/// Clone the frozen box behind `s` as its next box; its name.
fn next_box(server: &Server, s: &Sandbox, live: &mut Live) -> Result<String> {
    live.generation += 1;
    let name = format!("{}-r{}", s.id, live.generation);
    server.nestbox.clone_box(&live.box_name, &name)?;
    Ok(name)
}

fn connect(server: &Server, id: &str, timeout: Option<u64>) -> Result<(Arc<Sandbox>, bool)> {
    let s = server.sandbox(id)?;
    let mut live = s.live.lock().unwrap_or_else(|p| p.into_inner());
    let resumed = live.phase == Phase::Paused;
    if resumed {
        set_frozen(server, &live.box_name, false)?;
        live.phase = Phase::Running;
        // Its commands started by a server before this one (paused across
        // a restart of the server) are taken up.
        follow_commands(server, &s.procs, &live.box_name, false);
    }
    // A resume sets the new end of life; a connect to a running sandbox
    // only extends it, never shortens it (as E2B does).
    let end_at = now() + timeout.unwrap_or(DEFAULT_TIMEOUT) as f64;
    if resumed {
        live.end_at = end_at;
    } else if timeout.is_some() {
        live.end_at = live.end_at.max(end_at);
    }
    drop(live);
    Ok((s, resumed))
}

/// Freeze the box of running sandbox `s` and go on in a clone of it; the
/// frozen box's name, and the sandbox's end of life.
fn freeze_and_go_on(server: &Server, s: &Sandbox) -> Result<(String, f64)> {
    let mut live = s.live.lock().unwrap_or_else(|p| p.into_inner());
    // Refused before the freeze, so the sandbox goes on as it was.
    nestbox_runtime::lifecycle::nested::refuse_too_deep(&server.reg.load(&live.box_name)?)?;
    let frozen = freeze(server, s, &live)?;
    let name = next_box(server, s, &mut live)?;
    follow_commands(server, &s.procs, &name, true);
    live.box_name = name;
    live.previous.push(frozen.clone());
    if live.phase == Phase::Paused {
        // It stays paused: its new box is frozen in place as the old was.
        set_frozen(server, &live.box_name, true)?;
    }
    Ok((frozen, live.end_at))
}

fn fork(server: &Arc<Server>, id: &str, count: u32, timeout: Option<u64>) -> Result<Vec<Value>> {
    let s = server.sandbox(id)?;
    let (frozen, end_at) = freeze_and_go_on(server, &s)?;
    let mut results = Vec::new();
    for _ in 0..count {
        let new_id = format!("e2b-{}", random_hex(8));
        match server.nestbox.clone_box(&frozen, &new_id) {
            Ok(()) => {
                let forked = Arc::new(Sandbox {
                    id: new_id.clone(),
                    template: s.template.clone(),
                    started_at: now(),
                    metadata: s.metadata.clone(),
                    env: s.env.clone(),
                    token: random_hex(16),
                    auto_pause: s.auto_pause,
                    live: Mutex::new(Live {
                        box_name: new_id,
                        phase: Phase::Running,
                        end_at: timeout.map_or(end_at, |t| now() + t as f64),
                        generation: 0,
                        previous: Vec::new(),
                    }),
                    procs: Default::default(),
                    watchers: Default::default(),
                    init: Default::default(),
                });
                follow_commands(server, &forked.procs, &forked.id, true);
                server.insert(forked.clone());
                results.push(json!({"sandbox": sandbox_json(&forked)}));
            }
            Err(e) => {
                results.push(json!({"error": {"code": e.status(), "message": e.to_string()}}))
            }
        }
    }
    server
        .nestbox
        .run("remove the forked box", &["rm", "-f", &frozen])?;
    Ok(results)
}

/// Keep the sandbox's state as a template (its id the snapshot's); the
/// sandbox goes on in a clone of it.
fn snapshot(server: &Server, id: &str, name: Option<String>) -> Result<crate::Snapshot> {
    let s = server.sandbox(id)?;
    let (frozen, _) = freeze_and_go_on(server, &s)?;
    let snapshot = crate::Snapshot {
        id: frozen,
        name,
        sandbox_id: s.id.clone(),
    };
    server.keep_snapshot(snapshot.clone());
    Ok(snapshot)
}

/// Remove the sandboxes whose time is up (pause those made with
/// `autoPause`, which then stay until connected or killed); run every
/// `period`.
pub fn reaper(server: Arc<Server>, period: Duration) {
    loop {
        std::thread::sleep(period);
        let t = now();
        for s in server.all() {
            let live = s.live();
            if live.end_at > t || (s.auto_pause && live.phase == Phase::Paused) {
                continue;
            }
            if s.auto_pause {
                match pause(&server, &s.id) {
                    Ok(()) => server.persist(&s),
                    Err(e) => tracing::error!("e2b: pausing expired sandbox {}: {e}", s.id),
                }
            } else if let Err(e) = kill(&server, &s.id) {
                tracing::error!("e2b: removing expired sandbox {}: {e}", s.id);
            }
        }
    }
}
