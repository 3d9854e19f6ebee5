//! `fp4spec graft-mtp --base BASE --into FINETUNE --out OUT`.

use crate::Failure;
use fp4spec::checkpoint::{atomic, bytes_progress, graft};
use std::path::PathBuf;

/// The options of `fp4spec graft-mtp`.
#[derive(clap::Args)]
pub struct Args {
    /// The checkpoint whose mtp.* head is taken (the model FINETUNE was tuned from).
    #[arg(long, value_name = "BASE")]
    base: PathBuf,
    /// The fine-tune without a head.
    #[arg(long = "into", value_name = "FINETUNE")]
    into: PathBuf,
    /// The new checkpoint folder (must not exist).
    #[arg(long, value_name = "OUT")]
    out: PathBuf,
    /// Copy FINETUNE's shards instead of hard-linking them.
    #[arg(long)]
    copy: bool,
    /// Machine-readable output.
    #[arg(long)]
    json: bool,
}

/// Grafts and prints the drift report.
pub fn run(args: Args) -> Result<(), Failure> {
    let _ = ctrlc::set_handler(atomic::request_cancel);
    let options = graft::GraftOptions {
        base: args.base,
        into: args.into,
        out: args.out,
        copy: args.copy,
    };
    let progress = bytes_progress(0, "graft-mtp");
    let report = graft::graft_mtp(&options, &progress)?;
    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&report).map_err(|e| Failure::Input(e.to_string()))?
        );
        return Ok(());
    }
    println!(
        "grafted {} mtp.* tensor(s) ({} MTP layer(s), {:.1} MiB) from {} into {} as {}",
        report.mtp_tensors,
        report.mtp_layers,
        report.mtp_bytes as f64 / 1048576.0,
        options.base.display(),
        options.into.display(),
        report.out.display()
    );
    let linked = report
        .shards
        .iter()
        .filter(|(_, p)| *p == atomic::Placed::Linked)
        .count();
    println!(
        "shards: {} of FINETUNE ({linked} hard-linked, {} copied) + {}",
        report.shards.len(),
        report.shards.len() - linked,
        report.mtp_shard
    );
    if let Some(entry) = &report.exclusion_added {
        println!("quantisation config: added `{entry}` to the exclusion list");
    }
    println!("drift of what the head reads from the backbone (relative L2, FINETUNE vs BASE):");
    for d in &report.drift {
        println!("  {:<13} {:>10.6}  {}", d.part, d.relative_l2, d.verdict);
    }
    for note in &report.notes {
        println!("note: {note}");
    }
    println!(
        "the acceptance rate is the real test: serve OUT with MTP and read `fp4spec spec-metrics`"
    );
    Ok(())
}
