//! Fault injection for failure tests: named points in the runtime where a test makes one rank
//! fail, through the [`fail`](https://docs.rs/fail) crate's fail points.
//!
//! With the `failpoints` feature, [`inject`] at point `P` fails when the fail point `P` is
//! configured with `return(R)` — by `fail::cfg(P, "return(R)")` in a test, or by the
//! `FAILPOINTS="P=return(R)"` environment variable in a process that set up a
//! `fail::FailScenario` — and `R` is this rank's world rank (or `*` for every rank): it
//! returns an error, or panics with `return(R:panic)`. Without the feature it compiles to
//! nothing. The points the library defines are listed in [`POINTS`].

/// Every fault-injection point of the library, in the order a training run meets them.
pub const POINTS: [&str; 6] = [
    "sshsdp::shard",
    "sshsdp::gather",
    "sshsdp::reduce",
    "sshsdp::update",
    "sshsdp::save",
    "sshsdp::load",
];

/// Fails at `point` if a test configured it for `rank` (see the module documentation);
/// `Ok(())` otherwise, and always without the `failpoints` feature.
#[inline]
pub fn inject(point: &'static str, rank: usize) -> Result<(), String> {
    #[cfg(feature = "failpoints")]
    if let Some(arg) = fail::eval(point, |arg: Option<String>| arg.unwrap_or_default()) {
        let (who, how) = arg.split_once(':').unwrap_or((arg.as_str(), "error"));
        if who == "*" || who.parse::<usize>() == Ok(rank) {
            let msg = format!("injected fault at {point} on rank {rank}");
            if how == "panic" {
                panic!("{msg}");
            }
            return Err(msg);
        }
    }
    let _ = (point, rank);
    Ok(())
}
