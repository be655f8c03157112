//! What every rank agrees on before an optimizer step, in one all-gather over the world: the
//! global gradient norm (clipping and the non-finite check) and which parameters received a
//! gradient in the step (those that did not are not stepped, as Burn's optimizers skip a
//! parameter without a gradient).
//!
//! Each rank sends its sum of squares (f64) and one bit per parameter: "a backward on this rank
//! expected its gradient since the last update". The norm sums the entries of this rank's
//! update group in its rank order (its pieces make up every bucket once), so every rank of the
//! group gets bitwise the same norm; the bits are OR-ed over the whole world, because a
//! gradient used on one replica reaches every replica through the reduction.

use burn_backend::Backend;

use super::{Runtime, State};
use crate::error::HsdpError;
use crate::storage::F32Buf;
use crate::timeline::Track;

/// Bytes each rank sends: its sum of squares and one bit per parameter.
pub(super) fn norm_message_len<B: Backend>(rt: &Runtime<B>) -> usize {
    8 + rt.plan.params().len().div_ceil(8)
}

/// The L2 norm of the world-averaged gradient, from this rank's pieces `grads`, and per
/// parameter whether any rank received a gradient for it in this step (see the module docs).
/// The norm is NaN or infinite when any gradient element is (squares of finite f32 values
/// cannot overflow f64).
pub(super) fn global_grad_norm<B: Backend>(
    rt: &Runtime<B>,
    st: &mut State<B>,
    grads: &[(usize, F32Buf<B>)],
) -> Result<(f64, Vec<bool>), HsdpError> {
    let local = F32Buf::sum_of_squares(grads.iter().map(|(_, g)| g), &rt.ctx.traffic)
        .inspect_err(|e| rt.record_failure(st, e.to_string()))?;
    let params = rt.plan.params().len();
    let mut message = local.to_le_bytes().to_vec();
    let fresh = vec![false; params];
    message.extend(pack_bits(&std::mem::replace(&mut st.received, fresh)));
    debug_assert_eq!(message.len(), norm_message_len(rt));
    let reply = rt.ctx.worker.gather_world_bytes("gradient norm", message);
    let gathered = rt
        .ctx
        .timeline
        .span(Track::Model, "wait gradient norm", None, || reply.wait());
    let all = match gathered {
        Ok(all) => all,
        Err(e) => {
            rt.record_failure(st, e.to_string());
            return Err(e.into());
        }
    };
    let len = norm_message_len(rt);
    if all.len() != len * rt.plan.mesh().world_size() {
        let failure = format!(
            "the gradient norm's all-gather returned {} bytes, expected {len} per rank",
            all.len()
        );
        rt.record_failure(st, failure.clone());
        return Err(HsdpError::Failed(failure));
    }
    let messages: Vec<&[u8]> = all.chunks_exact(len).collect();
    let total: f64 = update_group(rt)?
        .into_iter()
        .map(|r| f64::from_le_bytes(messages[r][..8].try_into().expect("8 bytes")))
        .sum();
    let mut received = vec![false; params];
    for message in &messages {
        for (param, bit) in unpack_bits(&message[8..], params).enumerate() {
            received[param] |= bit;
        }
    }
    Ok((total.sqrt(), received))
}

/// World ranks of this rank's update group, in its rank order: the world when hierarchical,
/// the shard group under HSDP, this rank alone under DDP.
fn update_group<B: Backend>(rt: &Runtime<B>) -> Result<Vec<usize>, HsdpError> {
    let mesh = rt.plan.mesh();
    Ok(match rt.plan.config().sharding {
        sshsdp_plan::Sharding::Hierarchical => (0..mesh.world_size()).collect(),
        sshsdp_plan::Sharding::Hsdp => mesh.shard_group(rt.world_rank)?,
        sshsdp_plan::Sharding::Ddp => vec![rt.world_rank],
    })
}

/// `bits` packed eight to a byte, least significant first.
fn pack_bits(bits: &[bool]) -> Vec<u8> {
    let mut packed = vec![0u8; bits.len().div_ceil(8)];
    for (i, _) in bits.iter().enumerate().filter(|(_, &b)| b) {
        packed[i / 8] |= 1 << (i % 8);
    }
    packed
}

/// The first `n` bits of `packed` ([`pack_bits`]'s order).
fn unpack_bits(packed: &[u8], n: usize) -> impl Iterator<Item = bool> + '_ {
    (0..n).map(move |i| packed[i / 8] & (1 << (i % 8)) != 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bits_round_trip() {
        for n in [0usize, 1, 7, 8, 9, 63] {
            let bits: Vec<bool> = (0..n).map(|i| (i * 7) % 3 == 0).collect();
            let packed = pack_bits(&bits);
            assert_eq!(packed.len(), n.div_ceil(8));
            assert_eq!(unpack_bits(&packed, n).collect::<Vec<_>>(), bits);
        }
    }
}
