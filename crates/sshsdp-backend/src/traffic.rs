//! Host↔device bytes and host reads, charged by the function that moves them ([`Traffic`]), on
//! whichever thread it runs: the model thread's staging and the lanes' uploads alike.

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

/// Host↔device bytes moved since the last [`Traffic::take`], and the reads that moved the
/// downloaded ones.
#[derive(Debug, Default)]
pub(crate) struct Traffic {
    uploaded: AtomicU64,
    downloaded: AtomicU64,
    staged: AtomicU64,
    reads: AtomicU64,
    syncs: AtomicU64,
}

/// What [`Traffic::take`] returns.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Moved {
    /// Bytes copied host → device.
    pub uploaded: u64,
    /// Bytes copied device → host.
    pub downloaded: u64,
    /// Of both, bytes moved only for staging.
    pub staged: u64,
    /// Device → host reads (each one a host wait for the device, unless issued ahead).
    pub reads: u64,
    /// Host waits for a device queue to drain (a device collective's ordering).
    pub syncs: u64,
}

impl Traffic {
    /// `bytes` copied from the host into device memory.
    pub fn upload(&self, bytes: u64, purpose: Purpose) {
        self.uploaded.fetch_add(bytes, Ordering::Relaxed);
        self.stage(bytes, purpose);
    }

    /// `bytes` read back from device memory to the host, in one read.
    pub fn download(&self, bytes: u64, purpose: Purpose) {
        self.downloaded.fetch_add(bytes, Ordering::Relaxed);
        self.reads.fetch_add(1, Ordering::Relaxed);
        self.stage(bytes, purpose);
    }

    /// A host wait for a device queue to drain (device collectives: CubeCL backends only).
    #[cfg_attr(not(any(feature = "wgpu", feature = "cuda")), allow(dead_code))]
    pub fn sync(&self) {
        self.syncs.fetch_add(1, Ordering::Relaxed);
    }

    fn stage(&self, bytes: u64, purpose: Purpose) {
        if purpose == Purpose::Stage {
            self.staged.fetch_add(bytes, Ordering::Relaxed);
        }
    }

    /// What moved since the last call, reset to zero.
    pub fn take(&self) -> Moved {
        Moved {
            uploaded: self.uploaded.swap(0, Ordering::Relaxed),
            downloaded: self.downloaded.swap(0, Ordering::Relaxed),
            staged: self.staged.swap(0, Ordering::Relaxed),
            reads: self.reads.swap(0, Ordering::Relaxed),
            syncs: self.syncs.swap(0, Ordering::Relaxed),
        }
    }
}
