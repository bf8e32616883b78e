//! A network namespace of the test's own, reached from the root namespace over a veth pair on a
//! /30 of `10.213.0.0/16` (a range only this test uses; no default route on either side, so
//! nothing leaves for anywhere else), and an nftables table inside it whose rules make the
//! stores' packets vanish: dropped, never answered with a reset, while every process keeps
//! running.
//!
//! Everything — the nft table, the veth pair, the namespace — is removed when the
//! [`Namespace`] is dropped, panics included. Without root, `ip` or `nft` it panics saying
//! what is missing: a partition test that skipped would pass without testing anything.

use std::{
    net::Ipv4Addr,
    process::{Command, Stdio},
};

/// The nftables table inside the namespace; its chains hold the fault rules.
const TABLE: &str = "ecoscan_partition";

/// Runs `program args`, returning its stdout, or why it failed.
fn run(program: &str, args: &[&str], stdin: Option<&str>) -> Result<String, String> {
    use std::io::Write;
    let mut cmd = Command::new(program);
    cmd.args(args)
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd
        .spawn()
        .map_err(|e| format!("`{program}` could not run ({e})"))?;
    if let Some(input) = stdin {
        let mut pipe = child.stdin.take().expect("stdin piped");
        pipe.write_all(input.as_bytes())
            .map_err(|e| format!("`{program}`: writing its input: {e}"))?;
    }
    let out = child
        .wait_with_output()
        .map_err(|e| format!("`{program}`: {e}"))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(format!(
            "`{program} {}` failed ({}): {}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// What the test needs before it makes anything, each missing piece named.
fn require_tools() {
    let mut missing = Vec::new();
    if !rustix::process::geteuid().is_root() {
        missing.push(
            "root (network namespaces, veth pairs and nftables rules need CAP_NET_ADMIN and \
             CAP_SYS_ADMIN; CI runs the tests as root)"
                .to_owned(),
        );
    }
    if run("ip", &["-V"], None).is_err() {
        missing.push("`ip` (Debian package iproute2)".to_owned());
    }
    if run("nft", &["--version"], None).is_err() {
        missing.push("`nft` (Debian package nftables; infra/test.sh installs it)".to_owned());
    }
    assert!(
        missing.is_empty(),
        "the partition test cannot make its network faults: missing {}",
        missing.join(", ")
    );
}

/// The namespace, its veth pair and its nft table.
pub struct Namespace {
    pub name: String,
    /// The veth end in the root namespace (deleting it deletes its peer).
    veth: String,
    /// The address of the namespace's end: the stores' forwarders listen on it.
    pub addr: Ipv4Addr,
}

impl Namespace {
    /// Makes namespace number `index` of this process (one per scenario).
    pub fn create(index: u32) -> Self {
        require_tools();
        let pid = std::process::id();
        // A /30 per (process, scenario): concurrent runs on one machine do not meet. The
        // block is skipped while another holds it (a run whose cleanup was killed with it).
        let mut block = (pid.wrapping_mul(8).wrapping_add(index)) % 16384;
        let addrs = |block: u32| {
            let base = u32::from(Ipv4Addr::new(10, 213, 0, 0)) + block * 4;
            (Ipv4Addr::from(base + 1), Ipv4Addr::from(base + 2))
        };
        for _ in 0..64 {
            let (root, _) = addrs(block);
            let held = run(
                "ip",
                &["-o", "-4", "addr", "show", "to", &format!("{root}/30")],
                None,
            )
            .unwrap_or_default();
            if held.trim().is_empty() {
                break;
            }
            block = (block + 1) % 16384;
        }
        let (root_addr, addr) = addrs(block);
        let ns = Self {
            name: format!("ecoscan-part-{pid}-{index}"),
            // Interface names are at most 15 bytes.
            veth: format!("ep{}s{index}", pid % 10_000_000),
            addr,
        };
        // From here on, whatever was made is removed on drop, even if a step below fails.
        let peer = format!("{}n", ns.veth);
        let root_cidr = format!("{root_addr}/30");
        let ns_cidr = format!("{addr}/30");
        let steps: Vec<Vec<&str>> = vec![
            vec!["netns", "add", &ns.name],
            vec![
                "link", "add", &ns.veth, "type", "veth", "peer", "name", &peer, "netns", &ns.name,
            ],
            vec!["addr", "add", &root_cidr, "dev", &ns.veth],
            vec!["link", "set", &ns.veth, "up"],
            vec!["-n", &ns.name, "addr", "add", &ns_cidr, "dev", &peer],
            vec!["-n", &ns.name, "link", "set", &peer, "up"],
            vec!["-n", &ns.name, "link", "set", "lo", "up"],
        ];
        for step in steps {
            if let Err(e) = run("ip", &step, None) {
                panic!("the partition test could not make its network namespace: {e}");
            }
        }
        // Rules go into these chains and are flushed to heal; policy accept otherwise.
        let table = format!(
            "table inet {TABLE} {{\n\
               chain input {{ type filter hook input priority 0; policy accept; }}\n\
               chain output {{ type filter hook output priority 0; policy accept; }}\n\
             }}\n"
        );
        if let Err(e) = ns.nft(&["-f", "-"], Some(&table)) {
            panic!("the partition test could not add its nftables table: {e}");
        }
        ns
    }

    fn nft(&self, args: &[&str], stdin: Option<&str>) -> Result<String, String> {
        let mut full = vec!["netns", "exec", &self.name, "nft"];
        full.extend_from_slice(args);
        run("ip", &full, stdin)
    }

    fn add_rules(&self, port: u16, verdict: &str) {
        // Both directions: the server's answers vanish as well as the client's requests.
        let rules = format!(
            "add rule inet {TABLE} input tcp dport {port} {verdict}\n\
             add rule inet {TABLE} output tcp sport {port} {verdict}\n"
        );
        if let Err(e) = self.nft(&["-f", "-"], Some(&rules)) {
            panic!("nft could not add the fault rules: {e}");
        }
    }

    /// Every packet to or from `port` in the namespace dropped: no answer, no reset.
    pub fn blackhole(&self, port: u16) {
        self.add_rules(port, "counter drop");
    }

    /// `percent` % of the packets to or from `port`, drawn at random, dropped.
    pub fn lose(&self, port: u16, percent: u8) {
        self.add_rules(
            port,
            &format!("numgen random mod 100 < {percent} counter drop"),
        );
    }

    /// Packets the fault rules dropped so far.
    pub fn dropped(&self) -> u64 {
        let listed = self
            .nft(&["list", "table", "inet", TABLE], None)
            .unwrap_or_default();
        listed
            .split_whitespace()
            .collect::<Vec<_>>()
            .windows(2)
            .filter(|w| w[0] == "packets")
            .filter_map(|w| w[1].parse::<u64>().ok())
            .sum()
    }

    /// Removes every fault rule; returns how many packets they dropped.
    pub fn heal(&self) -> u64 {
        let dropped = self.dropped();
        for chain in ["input", "output"] {
            if let Err(e) = self.nft(&["flush", "chain", "inet", TABLE, chain], None) {
                panic!("nft could not remove the fault rules: {e}");
            }
        }
        dropped
    }
}

impl Drop for Namespace {
    fn drop(&mut self) {
        // Each step on its own: a half-made namespace is removed as far as it was made. The
        // table and the veth go explicitly because a socket still open in the namespace (a
        // forwarder's, closing asynchronously) keeps the namespace itself alive until it closes.
        let _ = self.nft(&["delete", "table", "inet", TABLE], None);
        let _ = run("ip", &["link", "del", &self.veth], None);
        let _ = run("ip", &["netns", "del", &self.name], None);
        if run("ip", &["netns", "list"], None).is_ok_and(|l| l.contains(&self.name)) {
            eprintln!("partition test: namespace {} was not removed", self.name);
        }
    }
}
