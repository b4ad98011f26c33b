//! What the load harnesses share: reading their flags' numbers, and a process's CPU time from
//! `/proc`. Included by path (`#[path = "common/harness.rs"] mod harness;`).

use anyhow::{Context, Result};

/// CPU time (user + system) of process `pid` (`"self"` for this one), from `/proc/<pid>/stat`,
/// in seconds.
pub fn cpu_seconds(pid: &str) -> Result<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // Fields after the command name, which is in parentheses and may contain spaces.
    let rest = stat.rsplit_once(')').map(|(_, r)| r).context("bad stat")?;
    let f: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the whole line, 12 and 13 after the name.
    let utime: f64 = f.get(11).context("no utime")?.parse()?;
    let stime: f64 = f.get(12).context("no stime")?.parse()?;
    // SAFETY: sysconf has no preconditions.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    Ok((utime + stime) / ticks)
}

/// The number after the flag `name`, taken from `args`.
pub fn number(args: &mut impl Iterator<Item = String>, name: &str) -> Result<u64> {
    args.next()
        .with_context(|| format!("{name} needs a value"))?
        .parse()
        .with_context(|| format!("{name} needs a number"))
}
