//! Project tasks, run as `cargo xtask <task>` (matklad's xtask convention).
//!
//! The modules import downwards only: `main.rs` dispatches; `cli.rs` turns the command line into
//! each task's options; the tasks (`demo`, `test`, `chaos`, `bench`, `inbox_scale`) take their
//! own options and use `workspace`, `services` and `nats_current`, which import no task.

mod bench;
mod chaos;
mod cli;
mod demo;
mod inbox_scale;
mod jobs;
mod nats_current;
mod services;
mod test;
mod workspace;

use std::process::ExitCode;

fn main() -> ExitCode {
    use clap::Parser;
    let cli = cli::Cli::parse();
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("xtask: no tokio runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = match &cli.task {
        cli::Task::Demo(args) => runtime.block_on(demo::run(args.only, args.timings)),
        cli::Task::Bench(args) if args.inbox_scale => {
            runtime.block_on(inbox_scale::run(args.into()))
        }
        cli::Task::Bench(args) => runtime.block_on(bench::run(args.into())),
        cli::Task::Chaos(args) if args.failover => {
            runtime.block_on(chaos::failover::run(args.into()))
        }
        cli::Task::Chaos(args) if args.cluster => {
            runtime.block_on(chaos::cluster::run(args.into()))
        }
        cli::Task::Chaos(args) => runtime.block_on(chaos::run(args.into())),
        cli::Task::Test(args) => runtime.block_on(test::run(args.into())),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask: {e}");
            ExitCode::FAILURE
        }
    }
}
