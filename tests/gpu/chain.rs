//! The `chain` family on the GPU: links launched directly and from a graph count in order on
//! grids of one block and of one block per SM, as the CPU reference does, and the dependent
//! launch time it measures is a positive figure that it prints (the decode bench reports it).

use crate::common::cuda;
use fp4spec::kernels::chain;

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
        let seconds = chain::dependent_launch_seconds(gpu, links, blocks, threads, 5)
            .expect("dependent launch time");
        println!(
            "dependent launch, {blocks} blocks of {threads} threads: {:.2} us",
            seconds * 1e6
        );
        assert!(seconds > 0.0 && seconds < 1e-3, "{seconds} s per link");
    }
}
