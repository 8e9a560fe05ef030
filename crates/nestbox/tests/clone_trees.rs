//! Cloning boxes with more than one process, seen from outside: a shell
//! whose background child (a Python server it started with `&`) serves. Every clone has the template's
//! processes with the same pids, parents, session and groups, continues from
//! the frozen state and then diverges; the template is untouched.

mod common;

use std::time::Duration;

use common::*;

/// GET / from the box's port 8080 (from a process exec'd into the box): the
/// answer's fields.
fn get(root: &TestRoot, name: &str) -> Vec<i64> {
    let code = "import urllib.request; \
                print(urllib.request.urlopen('http://127.0.0.1:8080/', timeout=10).read().decode().strip())";
    let out = root.run(&["exec", name, "--", "python3", "-c", code]).ok();
    out.stdout
        .split_whitespace()
        .map(|f| {
            f.parse()
                .unwrap_or_else(|_| panic!("answer of {name}: {out}"))
        })
        .collect()
}

/// `(pid, ppid, sid, pgid)` of every process of box `name` but its init and
/// the reader itself, as the box's own /proc shows them.
fn tree(root: &TestRoot, name: &str) -> Vec<(i64, i64, i64, i64)> {
    let code = "import os\n\
                me = os.getpid()\n\
                for p in sorted(int(d) for d in os.listdir('/proc') if d.isdigit()):\n\
                \x20   if p in (1, me): continue\n\
                \x20   try: f = open(f'/proc/{p}/stat').read().rsplit(')', 1)[1].split()\n\
                \x20   except OSError: continue\n\
                \x20   if int(f[1]) == me or int(f[1]) == 0: continue\n\
                \x20   print(p, f[1], f[3], f[2])";
    let out = root.run(&["exec", name, "--", "python3", "-c", code]).ok();
    out.stdout
        .lines()
        .map(|l| {
            let v: Vec<i64> = l.split_whitespace().map(|x| x.parse().unwrap()).collect();
            (v[0], v[1], v[2], v[3])
        })
        .collect()
}

/// A shell whose background child serves HTTP and which waits for it.
const SHELL: &str = "python3 -c \"
import http.server
count = 0
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        global count
        count += 1
        body = ('%d\\n' % count).encode()
        self.send_response(200)
        self.send_header('Content-Length', str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
print('ready', flush=True)
http.server.HTTPServer(('127.0.0.1', 8080), H).serve_forever()
\" & wait $!; echo \"child ended: $?\"";

#[test]
fn shell_with_a_background_child_clones_and_still_waits_for_it() {
    let Some(root) = TestRoot::new("shell_with_a_background_child_clones_and_still_waits_for_it")
    else {
        return;
    };
    root.detached_sh("tpl", &[], SHELL);
    wait_for(
        "the shell's child to serve",
        Duration::from_secs(20),
        || root.ok(&["logs", "tpl"]).contains("ready"),
    );
    assert_eq!(get(&root, "tpl")[0], 1);
    assert_eq!(get(&root, "tpl")[0], 2);
    let template_tree = tree(&root, "tpl");
    assert_eq!(template_tree, vec![(2, 1, 2, 2), (3, 2, 2, 2)]);
    root.ok(&["freeze", "tpl"]);
    for i in 0..20 {
        let name = format!("c{i}");
        root.ok(&["clone", "tpl", "-d", "--name", &name]);
        assert_eq!(tree(&root, &name), template_tree, "processes of {name}");
        assert_eq!(get(&root, &name)[0], 3, "{name} continues the count");
        assert_eq!(get(&root, &name)[0], 4, "{name} counts on");
    }
    // The clone's shell is the child's parent: it sees its child end.
    root.ok(&["exec", "c0", "--", "sh", "-c", "kill -TERM 3"]);
    wait_for(
        "the clone's shell to end after its child",
        Duration::from_secs(10),
        || root.ok(&["logs", "c0"]).contains("child ended: 143"),
    );
    root.ok(&["clone", "tpl", "-d", "--name", "late"]);
    assert_eq!(
        get(&root, "late")[0],
        3,
        "the template's count is untouched"
    );
    let mut args = vec![
        "rm".to_string(),
        "-f".to_string(),
        "late".to_string(),
        "tpl".to_string(),
    ];
    args.extend((0..20).map(|i| format!("c{i}")));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    root.ok(&args);
}
