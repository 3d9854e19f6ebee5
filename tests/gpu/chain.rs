//! The `chain` family on the GPU: links of both hand-overs launched directly and from a graph
//! count in order on grids of one block and of one block per SM, as the CPU reference does (the
//! polled links' counters too), and the dependent launch times it measures are positive figures
//! that it prints (the decode bench reports them).

use crate::common::cuda;
use fp4spec::backend::Backend;
use fp4spec::kernels::chain::{self, Handover};

#[test]
fn chained_links_count_in_order_and_time_a_dependent_launch() {
    let Some(gpu) = cuda("chained_links_count_in_order_and_time_a_dependent_launch") else {
        return;
    };
    let sms = gpu.multiprocessors().expect("a device has multiprocessors");
    for (blocks, threads) in [(1, 32), (sms, 256), (3 * sms, 1024)] {
        let links = 300;
        let mut values = gpu.upload(&vec![7u32; links + 1]).expect("upload");
        for i in 1..=links {
            chain::link(gpu, &mut values, i, blocks, threads).expect("link");
        }
        let got = gpu.download(&values).expect("download");
        let want: Vec<u32> = (0..=links as u32).map(|i| 7 + i).collect();
        assert_eq!(got, want, "{blocks} blocks of {threads}: direct links");
        // polled links, twice over the same counters (the second run on the rearmed ones)
        let run_polled = |backend: &Backend| -> (Vec<u32>, Vec<u32>) {
            let mut values = backend.upload(&vec![7u32; links + 1]).expect("upload");
            let mut first = vec![0u32; links + 1];
            first[0] = blocks;
            let mut counters = backend.upload(&first).expect("upload");
            for _ in 0..2 {
                for i in 1..=links {
                    chain::link_polled(
                        backend,
                        &mut values,
                        &mut counters,
                        i,
                        links,
                        blocks,
                        threads,
                    )
                    .expect("polled link");
                }
            }
            (
                backend.download(&values).expect("values"),
                backend.download(&counters).expect("counters"),
            )
        };
        let (cpu_values, cpu_counters) = run_polled(&Backend::Cpu);
        let (gpu_values, gpu_counters) = run_polled(gpu);
        assert_eq!(
            gpu_values, want,
            "{blocks} blocks of {threads}: polled links"
        );
        assert_eq!(cpu_values, want, "the CPU reference of the polled links");
        assert_eq!(
            gpu_counters, cpu_counters,
            "{blocks} blocks of {threads}: counters"
        );
        for handover in [Handover::GridDependency, Handover::Counter] {
            let seconds = chain::dependent_launch_seconds(gpu, handover, links, blocks, threads, 5)
                .expect("dependent launch time");
            println!(
                "dependent launch ({handover:?}), {blocks} blocks of {threads} threads: {:.2} us",
                seconds * 1e6
            );
            assert!(seconds > 0.0 && seconds < 1e-3, "{seconds} s per link");
        }
    }
}
