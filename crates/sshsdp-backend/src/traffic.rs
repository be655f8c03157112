//! Host↔device bytes, charged by the function that moves them ([`Traffic`]), on whichever
//! thread it runs: the model thread's staging and the lanes' uploads alike.

use std::sync::atomic::{AtomicU64, Ordering};

/// Why bytes cross between the host and the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Purpose {
    /// The backend's own data: a gathered bucket uploaded for compute, a gradient read back to
    /// be accumulated on the host, a scalar the step needs.
    Data,
    /// Staging: device values moved only so that a host collective or the host codec can work
    /// on them (and back), or host values moved to where their buffer's placement is.
    Stage,
}

/// Host↔device bytes moved since the last [`Traffic::take`].
#[derive(Debug, Default)]
pub(crate) struct Traffic {
    uploaded: AtomicU64,
    downloaded: AtomicU64,
    staged: AtomicU64,
}

impl Traffic {
    /// `bytes` copied from the host into device memory.
    pub fn upload(&self, bytes: u64, purpose: Purpose) {
        self.uploaded.fetch_add(bytes, Ordering::Relaxed);
        self.stage(bytes, purpose);
    }

    /// `bytes` read back from device memory to the host.
    pub fn download(&self, bytes: u64, purpose: Purpose) {
        self.downloaded.fetch_add(bytes, Ordering::Relaxed);
        self.stage(bytes, purpose);
    }

    fn stage(&self, bytes: u64, purpose: Purpose) {
        if purpose == Purpose::Stage {
            self.staged.fetch_add(bytes, Ordering::Relaxed);
        }
    }

    /// (uploaded, downloaded, staged) bytes since the last call, reset to zero.
    pub fn take(&self) -> (u64, u64, u64) {
        (
            self.uploaded.swap(0, Ordering::Relaxed),
            self.downloaded.swap(0, Ordering::Relaxed),
            self.staged.swap(0, Ordering::Relaxed),
        )
    }
}
