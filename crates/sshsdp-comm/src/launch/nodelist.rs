//! Slurm's hostlist syntax (`SLURM_JOB_NODELIST`), expanded into host names.
//!
//! * Entries are separated by commas outside brackets: `a,b,c`.
//! * A bracket group is a comma-separated list of numbers and inclusive ranges; zero padding
//!   is kept, to the width of the range's lower bound as written: `gpu[01-03,07]` →
//!   `gpu01 gpu02 gpu03 gpu07`, `n[8-10]` → `n8 n9 n10`.
//! * A name may hold several groups; the first varies slowest:
//!   `rack[1-2]-n[1-2]` → `rack1-n1 rack1-n2 rack2-n1 rack2-n2`.
//!
//! Unbalanced or nested brackets, empty entries or groups, reversed ranges and non-numbers in
//! brackets are [`CommError::InvalidArgument`] naming the list; so is an expansion longer than
//! [`MAX_HOSTS`] names, so that a hostile list cannot exhaust memory.

use crate::{CommError, CommResult};

/// The most names [`expand_nodelist`] produces before it gives up.
pub const MAX_HOSTS: usize = 1 << 20;

/// One piece of an entry: literal text, or a bracket group's numbers as written.
enum Piece<'a> {
    Text(&'a str),
    Group(Vec<String>),
}

/// Expands a Slurm hostlist (`gpu[01-04],login1`) into its host names, in order.
pub fn expand_nodelist(list: &str) -> CommResult<Vec<String>> {
    let bad =
        |why: String| CommError::InvalidArgument(format!("bad Slurm nodelist {list:?}: {why}"));
    let trimmed = list.trim();
    if trimmed.is_empty() {
        return Err(bad("it is empty".into()));
    }
    let mut hosts = Vec::new();
    // Numbers held by bracket groups, over the whole list: bounds memory before the product.
    let mut budget = MAX_HOSTS;
    for entry in split_top_level(trimmed).map_err(&bad)? {
        let pieces = parse_entry(entry, &mut budget).map_err(&bad)?;
        let count = pieces.iter().try_fold(1usize, |n, p| match p {
            Piece::Text(_) => Some(n),
            Piece::Group(g) => n.checked_mul(g.len()),
        });
        match count.and_then(|c| c.checked_add(hosts.len())) {
            Some(total) if total <= MAX_HOSTS => {}
            _ => return Err(bad(format!("it expands to more than {MAX_HOSTS} names"))),
        }
        product(&pieces, String::new(), &mut hosts);
    }
    Ok(hosts)
}

/// Splits at commas outside brackets, checking that brackets balance and do not nest.
fn split_top_level(list: &str) -> Result<Vec<&str>, String> {
    let mut entries = Vec::new();
    let mut depth = 0u32;
    let mut start = 0;
    for (i, c) in list.char_indices() {
        match c {
            '[' if depth > 0 => return Err(format!("nested '[' at byte {i}")),
            '[' => depth = 1,
            ']' if depth == 0 => return Err(format!("']' without '[' at byte {i}")),
            ']' => depth = 0,
            ',' if depth == 0 => {
                entries.push(&list[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    if depth > 0 {
        return Err("'[' without ']'".into());
    }
    entries.push(&list[start..]);
    if let Some(pos) = entries.iter().position(|e| e.trim().is_empty()) {
        return Err(format!("entry {} is empty", pos + 1));
    }
    Ok(entries.into_iter().map(str::trim).collect())
}

/// Splits one entry (balanced, not nested) into text and expanded bracket groups.
fn parse_entry<'a>(entry: &'a str, budget: &mut usize) -> Result<Vec<Piece<'a>>, String> {
    let mut pieces = Vec::new();
    let mut rest = entry;
    while let Some(open) = rest.find('[') {
        // `split_top_level` checked that every '[' has its ']' after it.
        let close = rest[open..]
            .find(']')
            .map(|c| open + c)
            .ok_or("'[' without ']'")?;
        if open > 0 {
            pieces.push(Piece::Text(&rest[..open]));
        }
        pieces.push(Piece::Group(expand_group(&rest[open + 1..close], budget)?));
        rest = &rest[close + 1..];
    }
    if !rest.is_empty() {
        pieces.push(Piece::Text(rest));
    }
    if pieces
        .iter()
        .any(|p| matches!(p, Piece::Text(t) if t.chars().any(char::is_whitespace)))
    {
        return Err(format!("host name {entry:?} holds whitespace"));
    }
    Ok(pieces)
}

/// Expands the inside of one bracket group: `01-03,07` → `01 02 03 07`.
/// `budget` is how many more numbers all groups may hold; it is decreased.
fn expand_group(group: &str, budget: &mut usize) -> Result<Vec<String>, String> {
    let mut out = Vec::new();
    for item in group.split(',') {
        let (lo_text, hi_text) = match item.split_once('-') {
            Some((lo, hi)) => (lo, hi),
            None => (item, item),
        };
        let lo = parse_number(lo_text, group)?;
        let hi = parse_number(hi_text, group)?;
        if hi < lo {
            return Err(format!("range {item:?} in [{group}] runs backwards"));
        }
        let len = usize::try_from(hi - lo)
            .ok()
            .and_then(|d| d.checked_add(1))
            .filter(|&n| n <= *budget)
            .ok_or_else(|| format!("it expands to more than {MAX_HOSTS} names"))?;
        *budget -= len;
        let width = lo_text.len();
        out.extend((0..len as u64).map(|k| format!("{:0width$}", lo + k)));
    }
    Ok(out)
}

/// A non-negative decimal number as Slurm writes it (digits only).
fn parse_number(text: &str, group: &str) -> Result<u64, String> {
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return Err(format!("{text:?} in [{group}] is not a number or range"));
    }
    text.parse()
        .map_err(|_| format!("{text:?} in [{group}] is too large"))
}

/// Appends every combination of the pieces (first group slowest) to `out`.
fn product(pieces: &[Piece<'_>], prefix: String, out: &mut Vec<String>) {
    match pieces.split_first() {
        None => out.push(prefix),
        Some((Piece::Text(t), rest)) => product(rest, prefix + t, out),
        Some((Piece::Group(g), rest)) => {
            for n in g {
                product(rest, format!("{prefix}{n}"), out);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok(list: &str) -> Vec<String> {
        expand_nodelist(list).unwrap_or_else(|e| panic!("{list}: {e}"))
    }

    fn err(list: &str) -> String {
        match expand_nodelist(list) {
            Err(CommError::InvalidArgument(m)) => m,
            other => panic!("{list}: expected InvalidArgument, got {other:?}"),
        }
    }

    #[test]
    fn plain_names_and_commas() {
        assert_eq!(ok("node1"), ["node1"]);
        assert_eq!(ok("a,b,c"), ["a", "b", "c"]);
        assert_eq!(ok(" login-1.cluster "), ["login-1.cluster"]);
    }

    #[test]
    fn ranges_keep_padding() {
        assert_eq!(ok("gpu[01-03,07]"), ["gpu01", "gpu02", "gpu03", "gpu07"]);
        assert_eq!(ok("n[8-10]"), ["n8", "n9", "n10"]);
        assert_eq!(ok("n[008-010]"), ["n008", "n009", "n010"]);
        assert_eq!(ok("gpu[01-04]")[0], "gpu01");
    }

    #[test]
    fn single_numbers_and_mixed_entries() {
        assert_eq!(ok("gpu[5]"), ["gpu5"]);
        assert_eq!(ok("gpu[05]"), ["gpu05"]);
        assert_eq!(ok("a[1-2],b,c[3]"), ["a1", "a2", "b", "c3"]);
        assert_eq!(ok("[1-2]x"), ["1x", "2x"]);
    }

    #[test]
    fn several_groups_first_slowest() {
        assert_eq!(
            ok("rack[1-2]-n[1-2]"),
            ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]
        );
        assert_eq!(
            ok("r[1,3]n[07-08].x"),
            ["r1n07.x", "r1n08.x", "r3n07.x", "r3n08.x"]
        );
    }

    #[test]
    fn malformed_lists_are_errors_naming_the_list() {
        for bad in [
            "",
            " ",
            "gpu[01-03",
            "gpu01-03]",
            "gpu[[1]]",
            "gpu[3-1]",
            "gpu[]",
            "gpu[1,,2]",
            "gpu[a-b]",
            "gpu[1-2-3]",
            "a,,b",
            "a,",
            "gpu[-3]",
            "gpu[99999999999999999999999]",
            "my node",
        ] {
            let m = err(bad);
            assert!(m.contains(&format!("{bad:?}")), "{m}");
        }
        assert!(err("gpu[3-1]").contains("backwards"));
    }

    #[test]
    fn hostile_lists_are_capped() {
        let m = err("n[0-99999999999]");
        assert!(m.contains("more than"), "{m}");
        let m = err("a[0-9999]b[0-9999]");
        assert!(m.contains("more than"), "{m}");
        let many = ["x[0-999999]"; 2].join(",");
        assert!(err(&many).contains("more than"));
        let groups = "a[0-600000]".repeat(2);
        assert!(err(&groups).contains("more than"));
    }
}
