//! Registration's first collective: every rank learns whether every rank could plan and
//! whether all planned the same model (parameters and buffers); where they did not, every
//! rank's error names the first parameter or buffer path that differs and the two shapes (or
//! the config, when the models agree).

use std::hash::{Hash, Hasher};

use sshsdp_plan::Plan;

use crate::error::HsdpError;
use crate::lanes::comm::MeshComm;
use crate::model::buffers::BufferSpec;

/// A rank's parameters or buffers: each one's path and shape, in module order.
type ParamList = Vec<(String, Vec<usize>)>;

/// Bytes of one rank's verdict: a failure flag, the plan's fingerprint and a digest of the
/// buffers.
const VERDICT: usize = 41;

/// One all-gather of a failure flag, the plan's fingerprint and a digest of the module's
/// buffers. A local error is returned as is on its rank and names the failed rank on the
/// others. Where they differ, a second exchange (of every rank's parameter and buffer lists)
/// explains how, on every rank.
pub(crate) fn agree_on_plan(
    comm: &dyn MeshComm,
    local: Result<Plan, HsdpError>,
    buffers: &[BufferSpec],
) -> Result<Plan, HsdpError> {
    let mut ours = [0u8; VERDICT];
    match &local {
        Ok(plan) => {
            ours[1..33].copy_from_slice(&plan.fingerprint().0);
            ours[33..].copy_from_slice(&digest(buffers).to_le_bytes());
        }
        Err(_) => ours[0] = 1,
    }
    let mut all = vec![0u8; VERDICT * comm.world_size()];
    comm.all_gather_bytes(&ours, &mut all)?;
    let plan = local?;
    if let Some(r) = all.chunks(VERDICT).position(|x| x[0] != 0) {
        return Err(HsdpError::Failed(format!("rank {r} failed in shard")));
    }
    let Some(other) = all.chunks(VERDICT).position(|x| x != ours) else {
        return Ok(plan);
    };
    // Every rank sees a mismatch (the gather is the same everywhere), so all make this call.
    let mine = plan
        .params()
        .iter()
        .map(|p| (p.spec.path.clone(), p.spec.shape.clone()))
        .collect();
    let params = exchange_lists(comm, &mine)?;
    let buffers = buffers
        .iter()
        .map(|b| (b.path.clone(), b.shape.clone()))
        .collect();
    let buffers = exchange_lists(comm, &buffers)?;
    let rank = comm.world_rank();
    let detail = describe(rank, &params[rank], other, &params[other], "parameter")
        .or_else(|| describe(rank, &buffers[rank], other, &buffers[other], "buffer"))
        .unwrap_or_else(|| {
            format!(
                "the parameters and buffers agree with rank {other}'s, so the configs differ \
                 (mesh, bucket size, runtime format, sharding, alignment or role rule) or \
                 which parameters are frozen"
            )
        });
    Err(HsdpError::PlanMismatch {
        ours: plan.fingerprint().to_string(),
        detail,
    })
}

/// A digest of the buffers' paths and shapes, the same on every rank of one build (the
/// standard library's SipHash with its fixed default keys).
fn digest(buffers: &[BufferSpec]) -> u64 {
    let mut hasher = std::hash::DefaultHasher::new();
    buffers.hash(&mut hasher);
    hasher.finish()
}

/// Every rank's `(path, shape)` list, in rank order: the lengths first, then the lists padded
/// to the longest (all-gathers move equal lengths).
fn exchange_lists(comm: &dyn MeshComm, mine: &ParamList) -> Result<Vec<ParamList>, HsdpError> {
    let bytes = serde_json::to_vec(mine).expect("paths and shapes serialize");
    let world = comm.world_size();
    let mut lengths = vec![0u8; 8 * world];
    comm.all_gather_bytes(&(bytes.len() as u64).to_le_bytes(), &mut lengths)?;
    let lengths: Vec<usize> = lengths
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")) as usize)
        .collect();
    let longest = lengths.iter().copied().max().unwrap_or(0);
    let mut padded = bytes;
    padded.resize(longest, 0);
    let mut all = vec![0u8; longest * world];
    comm.all_gather_bytes(&padded, &mut all)?;
    lengths
        .iter()
        .enumerate()
        .map(|(r, &len)| {
            serde_json::from_slice(&all[r * longest..r * longest + len]).map_err(|e| {
                HsdpError::Failed(format!("rank {r}'s parameter list is unreadable: {e}"))
            })
        })
        .collect()
}

/// How this rank's parameters or buffers (`what`; `me`, rank `rank`) differ from rank
/// `other`'s (`theirs`): the first of this rank's (module order) that rank `other` lacks or
/// shapes differently, else the first of theirs this rank lacks; `None` where they agree.
fn describe(
    rank: usize,
    me: &[(String, Vec<usize>)],
    other: usize,
    theirs: &[(String, Vec<usize>)],
    what: &str,
) -> Option<String> {
    let find = |list: &[(String, Vec<usize>)], path: &str| {
        list.iter().find(|(p, _)| p == path).map(|(_, s)| s.clone())
    };
    for (path, shape) in me {
        match find(theirs, path) {
            None => {
                return Some(format!(
                    "rank {other} is missing {what} `{path}` {shape:?} that rank {rank} has"
                ))
            }
            Some(their) if &their != shape => {
                return Some(format!(
                    "{what} `{path}` has shape {shape:?} on rank {rank} but {their:?} on rank \
                     {other}"
                ))
            }
            Some(_) => {}
        }
    }
    theirs
        .iter()
        .find(|(p, _)| find(me, p).is_none())
        .map(|(path, shape)| {
            format!("rank {rank} is missing {what} `{path}` {shape:?} that rank {other} has")
        })
}

#[cfg(test)]
mod tests {
    use super::describe;

    fn list(items: &[(&str, &[usize])]) -> Vec<(String, Vec<usize>)> {
        items
            .iter()
            .map(|(p, s)| (p.to_string(), s.to_vec()))
            .collect()
    }

    #[test]
    fn the_first_difference_is_named() {
        let a = list(&[("a.weight", &[4, 8]), ("b.weight", &[8, 8])]);
        let b = list(&[("a.weight", &[4, 8]), ("b.weight", &[8, 9])]);
        let d = describe(1, &b, 0, &a, "parameter").unwrap();
        assert!(
            d.contains("`b.weight`") && d.contains("[8, 9]") && d.contains("[8, 8]"),
            "{d}"
        );
        let c = list(&[("a.weight", &[4, 8])]);
        let d = describe(1, &c, 0, &a, "parameter").unwrap();
        assert!(
            d.contains("rank 1 is missing parameter `b.weight` [8, 8]"),
            "{d}"
        );
        let d = describe(0, &a, 1, &c, "buffer").unwrap();
        assert!(d.contains("rank 1 is missing buffer `b.weight`"), "{d}");
        assert_eq!(describe(0, &a, 1, &a, "parameter"), None);
    }
}
