//! Why a PTX file could not be loaded or a launch failed.

/// This crate's result.
pub type Result<T> = std::result::Result<T, Error>;

/// Where in a launch something went wrong.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Site {
    /// The entry point.
    pub kernel: String,
    /// The CTA (`%ctaid`).
    pub block: [u32; 3],
    /// The thread's linear index in its CTA, if one thread is to blame.
    pub thread: Option<u32>,
    /// The PTX source line of the instruction (0: none).
    pub line: u32,
}

impl std::fmt::Display for Site {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}, block {:?}", self.kernel, self.block)?;
        if let Some(t) = self.thread {
            write!(f, ", thread {t}")?;
        }
        if self.line != 0 {
            write!(f, ", PTX line {}", self.line)?;
        }
        Ok(())
    }
}

/// An error of the interpreter: the PTX uses something it does not support, or a
/// launch did something a GPU would do wrong or undefinedly.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// The PTX text could not be read: `file:line: what`.
    #[error("{file}:{line}: {msg}")]
    Parse {
        /// The module's name.
        file: String,
        /// 1-based line.
        line: u32,
        /// What was wrong or unsupported.
        msg: String,
    },
    /// A launch was refused before it ran (unknown entry, params of the wrong size,
    /// a block or shared size outside the limits).
    #[error("launch refused: {0}")]
    Config(String),
    /// The launch did something undefined or wrong: an access outside every range, a
    /// race, a divergent collective, a read of a pending `cp.async`.
    #[error("{site}: {msg}")]
    Fault {
        /// Where.
        site: Site,
        /// What.
        msg: String,
    },
    /// A thread called one of the Rust panic functions: the location comes from the
    /// PTX's own `.global` data.
    #[error("{site}: kernel panicked at {file}:{line}:{col} ({func})")]
    Panic {
        /// Where.
        site: Site,
        /// The panic function called.
        func: String,
        /// Source file of the panic, as the PTX records it.
        file: String,
        /// Line of the panic.
        line: u32,
        /// Column of the panic.
        col: u32,
    },
    /// A thread executed `trap`.
    #[error("{site}: trap")]
    Trap {
        /// Where.
        site: Site,
    },
}

impl Error {
    pub(crate) fn parse(file: &str, line: u32, msg: impl Into<String>) -> Self {
        Error::Parse {
            file: file.to_string(),
            line,
            msg: msg.into(),
        }
    }
}
