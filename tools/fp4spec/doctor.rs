//! `fp4spec doctor DIR`.

use crate::Failure;
use fp4spec::checkpoint::doctor;
use std::path::PathBuf;

/// The options of `fp4spec doctor`.
#[derive(clap::Args)]
pub struct Args {
    /// The checkpoint folder.
    dir: PathBuf,
    /// Machine-readable output: `{"findings": [{"code", "subject", "message"}], "summary": {...}}`.
    #[arg(long)]
    json: bool,
}

/// Prints the findings and the summary; exit 1 when anything was found.
pub fn run(args: Args) -> Result<(), Failure> {
    let report = doctor::diagnose(&args.dir)?;
    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&report).map_err(|e| Failure::Input(e.to_string()))?
        );
    } else {
        for f in &report.findings {
            println!("{:<28} {}: {}", f.code, f.subject, f.message);
        }
        println!("{}", report.summary);
    }
    if report.healthy() {
        if !args.json {
            println!("ok: no findings in {}", args.dir.display());
        }
        Ok(())
    } else {
        Err(Failure::Check(format!(
            "doctor: {} finding(s) in {}",
            report.findings.len(),
            args.dir.display()
        )))
    }
}
