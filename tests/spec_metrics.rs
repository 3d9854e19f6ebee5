//! vLLM speculative-decoding metrics: parsing, rates, intervals, rejections, and the command
//! over a file, standard input and a local HTTP server.

use fp4spec::spec_metrics::SpecCounters;
use std::io::{Read, Write};

fn page(drafts: f64, tokens: f64, accepted: f64, per_position: &[f64]) -> String {
    let mut text = String::from(
        "# HELP vllm:spec_decode_num_drafts_total drafts\n# TYPE vllm:spec_decode_num_drafts_total counter\n",
    );
    // two engines: every counter is summed over its label sets
    for engine in 0..2 {
        let l = format!("engine=\"{engine}\",model_name=\"a \\\"quoted\\\" {{name}}\"");
        text += &format!(
            "vllm:spec_decode_num_drafts_total{{{l}}} {}\n",
            drafts / 2.0
        );
        text += &format!(
            "vllm:spec_decode_num_draft_tokens_total{{{l}}} {}\n",
            tokens / 2.0
        );
        text += &format!(
            "vllm:spec_decode_num_accepted_tokens_total{{{l}}} {} 1733000000000\n",
            accepted / 2.0
        );
        for (p, v) in per_position.iter().enumerate() {
            text += &format!(
                "vllm:spec_decode_num_accepted_tokens_per_pos_total{{{l},position=\"{p}\"}} {}\n",
                v / 2.0
            );
        }
    }
    text + "vllm:num_requests_running{engine=\"0\"} 3\n"
}

#[test]
fn counters_sum_over_label_sets_and_give_the_rates() {
    let counters = SpecCounters::parse(&page(1000.0, 3000.0, 249.0, &[180.0, 50.0, 19.0]), "m.txt")
        .expect("parses");
    assert_eq!(
        (
            counters.drafts,
            counters.draft_tokens,
            counters.accepted_tokens
        ),
        (1000.0, 3000.0, 249.0)
    );
    let summary = counters.summary().expect("drafts were made");
    assert!((summary.acceptance_rate - 0.083).abs() < 1e-12);
    assert!((summary.mean_accepted_length - 1.249).abs() < 1e-12);
    assert_eq!(summary.per_position, vec![0.18, 0.05, 0.019]);
    assert_eq!(summary.regime, "prose-like");
    let edit =
        SpecCounters::parse(&page(100.0, 200.0, 170.0, &[90.0, 80.0]), "m.txt").expect("parses");
    assert_eq!(edit.summary().expect("drafts").regime, "edit-like");
}

#[test]
fn two_snapshots_give_the_interval_and_a_restart_is_an_error() {
    let old =
        SpecCounters::parse(&page(100.0, 200.0, 100.0, &[60.0, 40.0]), "old").expect("parses");
    let new =
        SpecCounters::parse(&page(300.0, 600.0, 500.0, &[190.0, 130.0]), "new").expect("parses");
    let interval = new.since(&old).expect("counters grew");
    assert_eq!((interval.drafts, interval.accepted_tokens), (200.0, 400.0));
    let summary = interval.summary().expect("drafts");
    assert_eq!(summary.acceptance_rate, 1.0);
    assert_eq!(summary.per_position, vec![0.65, 0.45]);
    let err = old.since(&new).expect_err("went down");
    assert!(err.to_string().contains("restarted"), "{err}");
}

#[test]
fn malformed_lines_and_missing_metrics_are_errors_naming_the_line_or_metric() {
    let mut text = page(10.0, 20.0, 5.0, &[5.0]);
    text.insert_str(0, "vllm:spec_decode_num_drafts_total{engine=\"0\" 4\n");
    let err = SpecCounters::parse(&text, "m.txt").expect_err("malformed");
    assert!(err.to_string().contains("m.txt:1"), "{err}");
    let err = SpecCounters::parse(
        "vllm:spec_decode_num_drafts_total 1\nvllm:x 2 3 4\n",
        "m.txt",
    )
    .expect_err("malformed");
    assert!(err.to_string().contains("m.txt:2"), "{err}");
    let err =
        SpecCounters::parse("vllm:num_requests_running 1\n", "m.txt").expect_err("no spec metrics");
    assert!(
        err.to_string()
            .contains("vllm:spec_decode_num_drafts_total is missing"),
        "{err}"
    );
    let text = page(10.0, 20.0, 5.0, &[])
        + "vllm:spec_decode_num_accepted_tokens_per_pos_total{engine=\"0\"} 1\n";
    let err = SpecCounters::parse(&text, "m.txt").expect_err("no position");
    assert!(err.to_string().contains("position"), "{err}");
    for position in ["4294967295", "4000000000"] {
        let text = page(10.0, 20.0, 5.0, &[])
            + &format!(
                "vllm:spec_decode_num_accepted_tokens_per_pos_total{{position=\"{position}\"}} 1\n"
            );
        let err = SpecCounters::parse(&text, "m.txt").expect_err("position past the limit");
        assert!(
            err.to_string()
                .contains(&format!("position {position} is past")),
            "{err}"
        );
    }
    let none = SpecCounters::parse(&page(0.0, 0.0, 0.0, &[]), "m.txt").expect("parses");
    assert!(none.summary().is_err(), "no drafts: nothing to measure");
}

fn fp4spec(args: &[&str], stdin: &str) -> (i32, String, String) {
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_fp4spec"))
        .args(args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run fp4spec");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(stdin.as_bytes())
        .expect("write stdin");
    let out = child.wait_with_output().expect("wait");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn the_command_reads_files_stdin_and_a_local_server() {
    let dir = tempfile::tempdir().expect("tempdir");
    let old = dir.path().join("old.txt");
    std::fs::write(&old, page(100.0, 200.0, 100.0, &[60.0, 40.0])).expect("write");
    let new_page = page(300.0, 600.0, 450.0, &[180.0, 170.0]);
    let (code, stdout, stderr) = fp4spec(
        &[
            "spec-metrics",
            "-",
            "--since",
            &old.display().to_string(),
            "--json",
        ],
        &new_page,
    );
    assert_eq!(code, 0, "{stderr}");
    let summary: serde_json::Value = serde_json::from_str(&stdout).expect("JSON");
    assert_eq!(summary["acceptance_rate"].as_f64(), Some(350.0 / 400.0));
    assert_eq!(
        summary["mean_accepted_length"].as_f64(),
        Some(1.0 + 350.0 / 200.0)
    );
    assert_eq!(summary["per_position"], serde_json::json!([0.6, 0.65]));

    // a one-shot HTTP server on loopback
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind loopback");
    let address = listener.local_addr().expect("address");
    let body = new_page.clone();
    let server = std::thread::spawn(move || {
        let (mut stream, _) = listener.accept().expect("accept");
        let mut request = [0u8; 1024];
        // a request may arrive in several segments: read up to its blank line
        let mut n = 0;
        while !request[..n].windows(4).any(|w| w == b"\r\n\r\n") {
            let got = stream.read(&mut request[n..]).expect("read request");
            assert!(got > 0, "the client closed before the end of its request");
            n += got;
        }
        assert!(String::from_utf8_lossy(&request[..n]).starts_with("GET /metrics HTTP/1.0"));
        write!(
            stream,
            "HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\n{body}"
        )
        .expect("respond");
    });
    let url = format!("http://{address}/metrics");
    let (code, stdout, stderr) = fp4spec(&["spec-metrics", "--url", &url], "");
    server.join().expect("server thread");
    assert_eq!(code, 0, "{stderr}");
    assert!(
        stdout.contains("acceptance rate: 0.750") && stdout.contains("position 1: 0.567"),
        "{stdout}"
    );

    let (code, _, stderr) = fp4spec(
        &["spec-metrics", "-"],
        "vllm:spec_decode_num_drafts_total{oops 1\n",
    );
    assert_eq!(code, 2, "{stderr}");
    assert!(stderr.contains("<stdin>:1"), "{stderr}");
    let (code, _, stderr) = fp4spec(
        &["spec-metrics", "--url", "https://example.invalid/metrics"],
        "",
    );
    assert_eq!(code, 2, "{stderr}");
    assert!(stderr.contains("only plain http://"), "{stderr}");
}
