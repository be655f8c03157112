//! Registration's first collective: every rank learns whether every rank could plan and
//! whether all planned the same model; where they did not, every rank's error names the first
//! parameter path that differs and the two shapes (or the config, when the models agree).

use sshsdp_plan::Plan;

use crate::comm::MeshComm;
use crate::HsdpError;

/// A rank's parameters: each one's path and shape, in plan order.
type ParamList = Vec<(String, Vec<usize>)>;

/// Bytes of one rank's verdict: a failure flag and the plan's fingerprint.
const VERDICT: usize = 33;

/// One all-gather of a failure flag and the plan's fingerprint. A local error is returned as
/// is on its rank and names the failed rank on the others. Where fingerprints differ, a second
/// exchange (of every rank's parameter list) explains how, on every rank.
pub(crate) fn agree_on_plan(
    comm: &dyn MeshComm,
    local: Result<Plan, HsdpError>,
) -> Result<Plan, HsdpError> {
    let mut ours = [0u8; VERDICT];
    match &local {
        Ok(plan) => ours[1..].copy_from_slice(&plan.fingerprint().0),
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
    let specs = exchange_specs(comm, &plan)?;
    Err(HsdpError::PlanMismatch {
        ours: plan.fingerprint().to_string(),
        detail: describe(
            comm.world_rank(),
            &specs[comm.world_rank()],
            other,
            &specs[other],
        ),
    })
}

/// Every rank's `(path, shape)` list, in rank order: the lengths first, then the lists padded
/// to the longest (all-gathers move equal lengths).
fn exchange_specs(comm: &dyn MeshComm, plan: &Plan) -> Result<Vec<ParamList>, HsdpError> {
    let mine: ParamList = plan
        .params()
        .iter()
        .map(|p| (p.spec.path.clone(), p.spec.shape.clone()))
        .collect();
    let bytes = serde_json::to_vec(&mine).expect("paths and shapes serialize");
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

/// How this rank's parameters (`me`, rank `rank`) differ from rank `other`'s (`theirs`): the
/// first of this rank's parameters (plan order) that rank `other` lacks or shapes differently,
/// else the first of theirs this rank lacks, else the configs.
fn describe(
    rank: usize,
    me: &[(String, Vec<usize>)],
    other: usize,
    theirs: &[(String, Vec<usize>)],
) -> String {
    let find = |list: &[(String, Vec<usize>)], path: &str| {
        list.iter().find(|(p, _)| p == path).map(|(_, s)| s.clone())
    };
    for (path, shape) in me {
        match find(theirs, path) {
            None => {
                return format!(
                    "rank {other} is missing parameter `{path}` {shape:?} that rank {rank} has"
                )
            }
            Some(their) if &their != shape => {
                return format!(
                    "parameter `{path}` has shape {shape:?} on rank {rank} but {their:?} on rank \
                     {other}"
                )
            }
            Some(_) => {}
        }
    }
    if let Some((path, shape)) = theirs.iter().find(|(p, _)| find(me, p).is_none()) {
        return format!(
            "rank {rank} is missing parameter `{path}` {shape:?} that rank {other} has"
        );
    }
    format!(
        "the parameters agree with rank {other}'s, so the configs differ (mesh, bucket size, \
         runtime format, sharding, alignment or role rule)"
    )
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
        let d = describe(1, &b, 0, &a);
        assert!(
            d.contains("`b.weight`") && d.contains("[8, 9]") && d.contains("[8, 8]"),
            "{d}"
        );
        let c = list(&[("a.weight", &[4, 8])]);
        let d = describe(1, &c, 0, &a);
        assert!(
            d.contains("rank 1 is missing parameter `b.weight` [8, 8]"),
            "{d}"
        );
        let d = describe(0, &a, 1, &c);
        assert!(d.contains("rank 1 is missing parameter `b.weight`"), "{d}");
        assert!(describe(0, &a, 1, &a).contains("configs differ"));
    }
}
