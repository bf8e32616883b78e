//! Facts about the machine and this process, read from `/proc` (Linux).

use std::{fs, time::Duration};

/// `2 cores (nproc), AMD EPYC, 23.4 GiB`: what the figures were measured on.
pub fn machine() -> String {
    let cores = std::thread::available_parallelism().map_or(0, std::num::NonZero::get);
    let model = fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("model name"))
                .map(|v| v.trim_start_matches([' ', '\t', ':']).trim().to_owned())
        })
        .unwrap_or_else(|| "unknown CPU".to_owned());
    let mem = meminfo_kib("MemTotal").map_or_else(
        || "unknown memory".to_owned(),
        |k| {
            #[allow(clippy::cast_precision_loss)]
            let gib = k as f64 / 1024.0 / 1024.0;
            format!("{gib:.1} GiB")
        },
    );
    format!("{cores} cores (nproc), {model}, {mem}")
}

fn meminfo_kib(key: &str) -> Option<u64> {
    status_field(&fs::read_to_string("/proc/meminfo").ok()?, key)
}

fn status_field(text: &str, key: &str) -> Option<u64> {
    text.lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(':'))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
}

/// The 1, 5 and 15 minute load averages (`0.52 1.10 1.40`): other work on the machine.
pub fn loadavg() -> String {
    fs::read_to_string("/proc/loadavg")
        .ok()
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|| "unknown".to_owned())
}

/// Jiffies the whole machine spent busy and in all, from the first line of `/proc/stat`.
pub fn machine_cpu() -> Option<(u64, u64)> {
    let stat = fs::read_to_string("/proc/stat").ok()?;
    let line = stat.lines().next()?.strip_prefix("cpu ")?;
    let v: Vec<u64> = line
        .split_whitespace()
        .filter_map(|f| f.parse().ok())
        .collect();
    // user nice system idle iowait irq softirq steal (guest time is already in user).
    let total: u64 = v.iter().take(8).sum();
    let idle = v.get(3)? + v.get(4).unwrap_or(&0);
    Some((total - idle, total))
}

/// The share of all cores that was busy between two [`machine_cpu`] readings, in percent.
pub fn busy_percent(before: (u64, u64), after: (u64, u64)) -> Option<f64> {
    let total = after.1.checked_sub(before.1).filter(|t| *t > 0)?;
    let busy = after.0.checked_sub(before.0)?;
    Some(busy as f64 * 100.0 / total as f64)
}

/// Resident memory of this process (`VmRSS`), in KiB.
pub fn rss_kib() -> Option<u64> {
    status_field(&fs::read_to_string("/proc/self/status").ok()?, "VmRSS")
}

/// Peak resident memory of this process (`VmHWM`), in KiB.
pub fn peak_rss_kib() -> Option<u64> {
    status_field(&fs::read_to_string("/proc/self/status").ok()?, "VmHWM")
}

/// CPU time this process has used (user + system), from `/proc/self/stat`.
pub fn cpu_time() -> Option<Duration> {
    process_cpu_time("self")
}

/// CPU time process `pid` (`"self"` or a number) has used, user + system, from
/// `/proc/<pid>/stat`. Clock ticks are taken as 100 per second, the value on every Linux
/// x86-64 and arm64 kernel.
pub fn process_cpu_time(pid: &str) -> Option<Duration> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name (which may contain spaces) start at the last ')'.
    let rest = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of stat, 12 and 13 counted from the state field.
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    Some(Duration::from_millis((utime + stime) * 10))
}

/// The processes whose command line (`/proc/<pid>/cmdline`, arguments joined by spaces)
/// satisfies `matches`, with the CPU time each has used so far.
pub fn processes_cpu(matches: impl Fn(&str) -> bool) -> std::collections::BTreeMap<u32, Duration> {
    let Ok(entries) = fs::read_dir("/proc") else {
        return Default::default();
    };
    entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|raw| {
                let line = String::from_utf8_lossy(&raw).replace('\0', " ");
                matches(line.trim_end())
            })
        })
        .filter_map(|pid| Some((pid, process_cpu_time(&pid.to_string())?)))
        .collect()
}

/// CPU used between two [`processes_cpu`] readings: the processes of the later one, less
/// what each had used at the earlier (a process that started between them counts whole; one
/// that ended is lost).
pub fn cpu_between(
    before: &std::collections::BTreeMap<u32, Duration>,
    after: &std::collections::BTreeMap<u32, Duration>,
) -> Duration {
    after
        .iter()
        .map(|(pid, t)| t.saturating_sub(before.get(pid).copied().unwrap_or_default()))
        .sum()
}

/// Raises this process's open-file limit to at least `want` (both soft and hard when running
/// with the privilege to raise the hard limit, else the soft limit up to the hard one) and
/// returns the soft limit now in force. Every SSE client and every scan holds a socket.
pub fn raise_fd_limit(want: u64) -> u64 {
    use rlimit::Resource;
    let Ok((soft, hard)) = Resource::NOFILE.get() else {
        return 0;
    };
    if soft >= want {
        return soft;
    }
    if Resource::NOFILE.set(want, hard.max(want)).is_err() {
        let _ = Resource::NOFILE.set(hard, hard);
    }
    Resource::NOFILE.get().map_or(soft, |(s, _)| s)
}

/// Which stores the environment selects for the suite (`embedded` unless the production
/// variables are set).
pub fn stores() -> String {
    let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
    let mut out = Vec::new();
    match ecoscan_redis::Settings::from_env() {
        Ok(Some(s)) if s.cluster => out.push("Redis Cluster"),
        Ok(Some(_)) => out.push("Redis"),
        _ => {}
    }
    let db = var("DATABASE_URL")
        .or_else(|| var("INGEST_DATABASE_URL"))
        .or_else(|| var("ANALYTICS_DATABASE_URL"));
    if db.is_some_and(|u| u.starts_with("postgres")) {
        out.push("PostgreSQL");
    }
    if var("S3_ENDPOINT").is_some() && var("S3_BUCKET").is_some() {
        out.push("S3");
    }
    if out.is_empty() {
        "embedded (SQLite, local files, in-memory event log and queue)".to_owned()
    } else {
        format!("production: {} (the rest embedded)", out.join(" + "))
    }
}

/// What Redis has spent, summed over every master of the Redis `REDIS_URL` names
/// (`REDIS_CLUSTER=true`: found with `CLUSTER NODES`).
#[derive(Debug, Default, Clone)]
pub struct RedisSpent {
    /// Calls and microseconds per command (`INFO commandstats`). A script's time includes the
    /// commands it calls, which are counted again under their own names.
    pub commands: std::collections::BTreeMap<String, (u64, u64)>,
    /// CPU seconds of the servers' main threads (`INFO cpu`): everything Redis did, each
    /// thing once.
    pub cpu_secs: f64,
}

/// [`RedisSpent`] so far; `None` without `REDIS_URL` or when Redis does not answer.
pub async fn redis_spent() -> Option<RedisSpent> {
    // The services' own reading of `REDIS_URL` and `REDIS_CLUSTER`: the same servers, the
    // same truth table.
    let settings = ecoscan_redis::Settings::from_env().ok().flatten()?;
    let first = settings.urls.first()?.clone();
    let mut nodes = vec![first.clone()];
    if settings.cluster {
        let mut conn = redis_connect(&first).await?;
        nodes = redis_text(&mut conn, "CLUSTER", "NODES")
            .await?
            .lines()
            .filter(|l| l.split(' ').nth(2).is_some_and(|f| f.contains("master")))
            .filter_map(|l| l.split(' ').nth(1)?.split('@').next().map(str::to_owned))
            .map(|addr| format!("redis://{addr}"))
            .collect();
    }
    let mut total = RedisSpent::default();
    for node in nodes {
        let node = redis_node_spent(&mut redis_connect(&node).await?).await?;
        for (cmd, (calls, usec)) in node.commands {
            let e = total.commands.entry(cmd).or_insert((0, 0));
            e.0 += calls;
            e.1 += usec;
        }
        total.cpu_secs += node.cpu_secs;
    }
    Some(total)
}

/// [`RedisSpent`] so far of the one Redis server `conn` talks to; `None` when it does not answer.
pub async fn redis_node_spent(conn: &mut redis::aio::MultiplexedConnection) -> Option<RedisSpent> {
    let info = redis_text(conn, "INFO", "commandstats").await?;
    let commands = parse_commandstats(&info)
        .into_iter()
        .map(|(cmd, calls, usec)| (cmd, (calls, usec)))
        .collect();
    let cpu = redis_text(conn, "INFO", "cpu").await?;
    let cpu_secs = ["used_cpu_sys_main_thread", "used_cpu_user_main_thread"]
        .iter()
        .filter_map(|k| {
            cpu.lines().find_map(|l| {
                l.strip_prefix(k)?
                    .strip_prefix(':')?
                    .trim()
                    .parse::<f64>()
                    .ok()
            })
        })
        .sum::<f64>();
    Some(RedisSpent { commands, cpu_secs })
}

/// A connection to the Redis at `url`; `None` when it does not answer.
async fn redis_connect(url: &str) -> Option<redis::aio::MultiplexedConnection> {
    redis::Client::open(url)
        .ok()?
        .get_multiplexed_async_connection()
        .await
        .ok()
}

/// What `command arg` (`INFO cpu`) answers on `conn`, as text; `None` when it does not answer.
async fn redis_text(
    conn: &mut redis::aio::MultiplexedConnection,
    command: &str,
    arg: &str,
) -> Option<String> {
    redis::cmd(command).arg(arg).query_async(conn).await.ok()
}

/// `cmdstat_xadd:calls=3,usec=12,…` lines as (command, calls, usec).
fn parse_commandstats(info: &str) -> Vec<(String, u64, u64)> {
    info.lines()
        .filter_map(|l| {
            let (name, rest) = l.strip_prefix("cmdstat_")?.split_once(':')?;
            let field = |k: &str| {
                rest.split(',')
                    .find_map(|f| f.strip_prefix(k)?.strip_prefix('='))?
                    .parse::<u64>()
                    .ok()
            };
            Some((name.to_owned(), field("calls")?, field("usec")?))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commandstats_lines_parse() {
        let info = "# Commandstats\r\ncmdstat_evalsha:calls=10,usec=250,usec_per_call=25.00,rejected_calls=0,failed_calls=0\r\ncmdstat_xlen:calls=2,usec=3,usec_per_call=1.5\r\n";
        assert_eq!(
            parse_commandstats(info),
            vec![("evalsha".to_owned(), 10, 250), ("xlen".to_owned(), 2, 3)]
        );
    }

    #[test]
    fn status_fields_are_read_in_kib() {
        let text = "Name:\tx\nVmHWM:\t  2048 kB\nVmRSS:\t  1024 kB\n";
        assert_eq!(status_field(text, "VmRSS"), Some(1024));
        assert_eq!(status_field(text, "VmHWM"), Some(2048));
        assert_eq!(status_field(text, "VmSwap"), None);
    }

    #[test]
    fn this_process_has_a_resident_size_and_cpu_time() {
        assert!(rss_kib().is_some_and(|k| k > 0));
        assert!(cpu_time().is_some());
        let me = std::process::id();
        let found = processes_cpu(|_| true);
        assert!(
            found.contains_key(&me),
            "this process is among all processes"
        );
        assert!(machine_cpu().is_some_and(|(busy, total)| busy <= total && total > 0));
    }

    #[test]
    fn cpu_between_counts_new_processes_whole_and_ignores_ended_ones() {
        let ms = Duration::from_millis;
        let before = [(1, ms(100)), (2, ms(50))].into_iter().collect();
        let after = [(1, ms(160)), (3, ms(30))].into_iter().collect();
        assert_eq!(cpu_between(&before, &after), ms(90));
    }

    #[test]
    fn busy_share_is_the_busy_delta_over_the_total_delta() {
        assert_eq!(busy_percent((10, 100), (60, 200)), Some(50.0));
        assert_eq!(busy_percent((10, 100), (10, 100)), None);
    }
}
