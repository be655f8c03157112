//! Module paths: the names of the modules a visitor or mapper has entered, joined by dots
//! (`blocks.0.attn.query.weight`), the key every rank plans, checkpoints and exports by.

/// Walks module paths as a visitor or mapper enters and leaves modules.
#[derive(Default)]
pub(crate) struct PathTracker {
    stack: Vec<String>,
}

impl PathTracker {
    /// Entering the module or field `name`.
    pub(crate) fn enter(&mut self, name: &str) {
        self.stack.push(name.to_string());
    }

    /// Leaving the module entered last.
    pub(crate) fn exit(&mut self) {
        self.stack.pop();
    }

    /// The current path.
    pub(crate) fn path(&self) -> String {
        self.stack.join(".")
    }
}
