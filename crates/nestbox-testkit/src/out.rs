//! What a finished command printed and how it exited, with the assertions
//! every suite makes on it (shared by the CLI's and the OCI runtime's tests).

/// What a finished command printed and how it exited.
#[derive(Debug, Clone)]
pub struct Out {
    /// Standard output.
    pub stdout: String,
    /// Standard error.
    pub stderr: String,
    /// Exit code (128+N when killed by signal N, as a shell reports it).
    pub code: i32,
    /// The command line, for messages.
    pub what: String,
}

impl Out {
    /// Assert exit code 0 and return self.
    #[track_caller]
    pub fn ok(self) -> Self {
        assert_eq!(self.code, 0, "expected success\n{self}");
        self
    }

    /// Assert the exit code and return self.
    #[track_caller]
    pub fn code(self, code: i32) -> Self {
        assert_eq!(self.code, code, "unexpected exit code\n{self}");
        self
    }

    /// Assert a failure with exactly one line on stderr, containing `needle`.
    #[track_caller]
    pub fn fails_with(self, needle: &str) -> Self {
        assert_ne!(self.code, 0, "expected a failure\n{self}");
        assert!(
            self.stderr.contains(needle),
            "stderr lacks {needle:?}\n{self}"
        );
        assert_eq!(
            self.stderr.trim().lines().count(),
            1,
            "expected one line on stderr\n{self}"
        );
        self
    }

    /// Lines of stdout.
    pub fn lines(&self) -> Vec<&str> {
        self.stdout.lines().collect()
    }
}

impl std::fmt::Display for Out {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "command: {}\nexit code: {}\nstdout: {:?}\nstderr: {:?}",
            self.what, self.code, self.stdout, self.stderr
        )
    }
}
