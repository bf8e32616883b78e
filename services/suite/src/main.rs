//! `ecoscan`: the whole suite in one process. The command line is in the library
//! ([`ecoscan::command`]).

fn main() -> anyhow::Result<()> {
    ecoscan::command::run()
}
