#!/usr/bin/env python3
"""Gated DeltaNet peers on the GPU host, on the same inputs as fp4spec's kernels.

Runs three peers at the Qwen3.6-35B-A3B head shape (Hk 16, Hv 32, dk = dv = 128):
  fla           fla's chunk_gated_delta_rule (prefill) / fused_recurrent_gated_delta_rule (decode)
  hf_chunk      transformers' pure-PyTorch torch_chunk_gated_delta_rule
  hf_recurrent  transformers' pure-PyTorch torch_recurrent_gated_delta_rule (up to 512 tokens)
writes every case's inputs, each peer's outputs and final states and their times to --out, and
with --rust-test runs fp4spec's `gdn_peers` GPU test on that folder, which runs our kernels on
the same inputs and prints the comparison table (max abs / rel differences of outputs and final
states against each peer, and the times measured in this one run).

transformers decorates its two functions with use_kernel_func_from_hub_with_fallback: when fla
can be imported (it can here: its wheels are on sys.path) the module attributes ARE fla's
kernels, so calling them compared fla with fla, and with positional arguments
(q, k, v, g, beta) handed transformers' `beta` to fla's fused_recurrent as its 5th parameter,
`gk` (per-key decays, [B, T, HV, K]): the kernel read a [B, T, HV] tensor 128 times past its
end (the illegal memory access of the first run). This script unwraps the decorator
(inspect.unwrap), checks that what it calls is defined in transformers' modeling file, and passes
every argument by keyword.

Each peer runs in its own worker process (the same script, --worker), all cases in turn, and
synchronises after every call, so an error is attributed to that peer and case. A peer that
raises is recorded (in the manifest and on stdout) and the worker goes on with the next case; a
CUDA error poisons the worker's context, so the worker exits, the case is run once more alone
with CUDA_LAUNCH_BLOCKING=1 to name the failing kernel, and a fresh worker takes the remaining
cases. The other peers are not affected. The parent process never touches the GPU.

The inputs are raw projection rows as our kernels take them (qkv, a, b in bf16, A_log and
dt_bias in fp32; made on the CPU from --seed, so reproducible anywhere) with the conv weights
fixed to the identity tap (w[c] = [0, 0, 0, 1]), so q, k, v = silu(qkv); the peers get q, k
(L2-normalised in fp32), v, g = -exp(A_log) softplus(a + dt_bias) in fp32 and beta = sigmoid(b):
fla in its tested dtypes (q, k, v, beta bf16; g and the state fp32), transformers in fp32 (it
computes in fp32 whatever it is given); both apply the scale 1/sqrt(dk). Each case starts from a
random fp32 state (our sequences sit at position 4 so the state is read; the conv history is
multiplied by the zero taps). fla takes a batch of sequences of different lengths as one row
with cu_seqlens (batch 1, one initial state per sequence); transformers' functions have no
cu_seqlens (they would ignore one), so they run such a batch one sequence at a time.

On the GPU host (python 3.12, torch, triton, transformers; no network), with the wheels from the
dev machine's /work/main/.whl copied next to the repository:
    python3 tools/reference/gdn_peers.py --wheels .whl --out /tmp/gdn_peers \\
        --rust-test .gpu/tests/gpu-<hash>
The wheels (flash-linear-attention 0.6.0, fla-core 0.6.0, einops 0.8.1; pure Python) are
unpacked into a temporary folder on fla's worker's sys.path: nothing is installed. --device cpu runs the
transformers peers on the CPU (fla then reports that it needs CUDA): a check of everything but
the GPU.
"""

import argparse
import inspect
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import traceback
import zipfile

HK, HV, DK, DV = 16, 32, 128, 128
CONV_DIM = 2 * HK * DK + HV * DV
PREFILL_T = [512, 4096, 16384]
DECODE_B = [1, 8, 64]
# a batch of sequences of different lengths (fla's cu_seqlens; transformers one by one)
VARLEN = [100, 1000, 65, 1]
# transformers' token loop is slow in Python: its recurrent form runs only up to this length
RECURRENT_MAX_T = 512
PEERS = ["fla", "hf_chunk", "hf_recurrent"]
# a worker's exit status after an error that leaves its CUDA context unusable
EXIT_CONTEXT_LOST = 3
WHEEL_PREFIXES = ("flash_linear_attention", "fla_core", "einops")


def case_list():
    """(name, lengths, decode) of every case."""
    cases = [(f"prefill_T{t}", [t], False) for t in PREFILL_T]
    cases.append(("prefill_varlen", VARLEN, False))
    cases += [(f"decode_B{b}", [1] * b, True) for b in DECODE_B]
    return cases


def unpack_wheels(folder):
    target = tempfile.mkdtemp(prefix="gdn_peers_wheels_")
    names = sorted(n for n in os.listdir(folder) if n.endswith(".whl") and n.startswith(WHEEL_PREFIXES))
    for name in names:
        with zipfile.ZipFile(os.path.join(folder, name)) as wheel:
            wheel.extractall(target)
    sys.path.insert(0, target)
    return names


def transformers_rules():
    """transformers' pure-PyTorch chunk and recurrent rules (never fla's kernels behind them)."""
    import importlib

    for module in (
        "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe",
        "transformers.models.qwen3_5.modeling_qwen3_5",
        "transformers.models.qwen3_next.modeling_qwen3_next",
    ):
        try:
            m = importlib.import_module(module)
            wrapped = (m.torch_chunk_gated_delta_rule, m.torch_recurrent_gated_delta_rule)
        except (ImportError, AttributeError):
            continue
        rules = tuple(inspect.unwrap(f) for f in wrapped)
        for rule in rules:
            where = inspect.getsourcefile(rule)
            if os.path.realpath(where) != os.path.realpath(m.__file__):
                raise SystemExit(f"{module}.{rule.__name__} unwraps to {where}, not transformers' own code")
        return module, rules[0], rules[1]
    raise SystemExit("transformers has no torch_chunk_gated_delta_rule (qwen3_5_moe, qwen3_5, qwen3_next)")


def make_inputs(torch, seed, rows, states):
    """Raw projection rows and a random state per sequence, on the CPU."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(rows, CONV_DIM, generator=gen).to(torch.bfloat16)
    a = torch.randn(rows, HV, generator=gen).to(torch.bfloat16)
    b = torch.randn(rows, HV, generator=gen).to(torch.bfloat16)
    a_log = torch.log1p(torch.arange(HV, dtype=torch.float32) * 0.3) - 1.0
    dt_bias = 0.5 * torch.randn(HV, generator=gen)
    state = 0.3 * torch.randn(states, HV, DK, DV, generator=gen)
    return {"qkv": qkv, "a": a, "b": b, "A_log": a_log, "dt_bias": dt_bias, "initial_state": state}


def front_end(torch, inputs):
    """q, k (normalised), v, g, beta per row in fp32, heads split: [rows, H, D] / [rows, HV]."""
    F = torch.nn.functional
    x = F.silu(inputs["qkv"].float())
    rows = x.shape[0]
    q = x[:, : HK * DK].reshape(rows, HK, DK)
    k = x[:, HK * DK : 2 * HK * DK].reshape(rows, HK, DK)
    v = x[:, 2 * HK * DK :].reshape(rows, HV, DV)
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    g = -inputs["A_log"].exp() * F.softplus(inputs["a"].float() + inputs["dt_bias"])
    beta = torch.sigmoid(inputs["b"].float())
    return tuple(t.contiguous() for t in (q, k, v, g, beta))


def expect(name, t, shape, dtype):
    """Raises (naming the tensor) unless `t` is contiguous with this shape and dtype."""
    if tuple(t.shape) != tuple(shape) or t.dtype != dtype or not t.is_contiguous():
        raise ValueError(f"{name}: {tuple(t.shape)} {t.dtype} contiguous={t.is_contiguous()}, "
                         f"expected {tuple(shape)} {dtype} contiguous")
    return t


def cumulative(lengths):
    cu = [0]
    for length in lengths:
        cu.append(cu[-1] + length)
    return cu


def peer_call(torch, peer, rules, inputs, lengths, decode, device):
    """A no-argument function running `peer` on one case (outputs [rows, HV DV] and final states
    [n, HV, DK, DV], both fp32), or None when the peer does not run this case."""
    q, k, v, g, beta = (t.to(device) for t in front_end(torch, inputs))
    state0 = inputs["initial_state"].to(device)
    n, rows = len(lengths), sum(lengths)
    cu = cumulative(lengths)
    scale = 1.0 / math.sqrt(DK)
    bf, f32 = torch.bfloat16, torch.float32

    if peer == "fla":
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

        if decode:
            # a batch of n one-token sequences: [n, 1, H, D]
            fq = expect("fla q", q.to(bf).unsqueeze(1).contiguous(), (n, 1, HK, DK), bf)
            fk = expect("fla k", k.to(bf).unsqueeze(1).contiguous(), (n, 1, HK, DK), bf)
            fv = expect("fla v", v.to(bf).unsqueeze(1).contiguous(), (n, 1, HV, DV), bf)
            fg = expect("fla g", g.unsqueeze(1).contiguous(), (n, 1, HV), f32)
            fb = expect("fla beta", beta.to(bf).unsqueeze(1).contiguous(), (n, 1, HV), bf)
            expect("fla initial_state", state0, (n, HV, DK, DV), f32)

            def run():
                o, s = fused_recurrent_gated_delta_rule(
                    q=fq, k=fk, v=fv, g=fg, beta=fb, scale=scale,
                    initial_state=state0.clone(), output_final_state=True)
                return o.reshape(rows, HV * DV).float(), s.float()
        else:
            # one row of `rows` tokens; several sequences through cu_seqlens (batch must be 1)
            fq = expect("fla q", q.to(bf).unsqueeze(0).contiguous(), (1, rows, HK, DK), bf)
            fk = expect("fla k", k.to(bf).unsqueeze(0).contiguous(), (1, rows, HK, DK), bf)
            fv = expect("fla v", v.to(bf).unsqueeze(0).contiguous(), (1, rows, HV, DV), bf)
            fg = expect("fla g", g.unsqueeze(0).contiguous(), (1, rows, HV), f32)
            fb = expect("fla beta", beta.to(bf).unsqueeze(0).contiguous(), (1, rows, HV), bf)
            expect("fla initial_state", state0, (n, HV, DK, DV), f32)
            cu_t = torch.tensor(cu, device=device, dtype=torch.long) if n > 1 else None

            def run():
                o, s = chunk_gated_delta_rule(
                    q=fq, k=fk, v=fv, g=fg, beta=fb, scale=scale,
                    initial_state=state0.clone(), output_final_state=True, cu_seqlens=cu_t)
                return o.reshape(rows, HV * DV).float(), s.float()
        return run

    # transformers: equal heads (q, k repeated to the value heads), fp32, no cu_seqlens
    _, hf_chunk, hf_recurrent = rules
    rule = hf_chunk if peer == "hf_chunk" else hf_recurrent
    if peer == "hf_recurrent" and max(lengths) > RECURRENT_MAX_T:
        return None
    ratio = HV // HK
    qh = q.repeat_interleave(ratio, dim=1).contiguous()
    kh = k.repeat_interleave(ratio, dim=1).contiguous()
    if decode:
        batches = [(slice(0, n), slice(0, n))]  # n sequences of one token: a batch of n
        shape4 = lambda x: x.unsqueeze(1).contiguous()  # [n, 1, H, D]
    else:
        batches = [(slice(cu[i], cu[i + 1]), slice(i, i + 1)) for i in range(n)]
        shape4 = lambda x: x.unsqueeze(0).contiguous()  # [1, T, H, D]

    def run():
        outs, states = [], []
        for rows_, seqs in batches:
            o, s = rule(
                shape4(qh[rows_]), shape4(kh[rows_]), shape4(v[rows_]),
                g=shape4(g[rows_]), beta=shape4(beta[rows_]),
                initial_state=state0[seqs].clone(), output_final_state=True,
                use_qk_l2norm_in_kernel=False)
            outs.append(o.reshape(-1, HV * DV).float())
            states.append(s.float())
        return torch.cat(outs), torch.cat(states)
    return run


def synchronize(torch, device):
    if device == "cuda":
        torch.cuda.synchronize()


def timed(torch, fn, repeats, device):
    """Median milliseconds of `repeats` calls (after the checked first call), CUDA events around
    each (wall clock on the CPU)."""
    times = []
    for _ in range(repeats):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            started = time.perf_counter()
            fn()
            times.append((time.perf_counter() - started) * 1e3)
    times.sort()
    return times[len(times) // 2]


def context_usable(torch, device):
    if device != "cuda":
        return True
    try:
        torch.cuda.synchronize()
        return torch.ones(1, device="cuda").add(1).item() == 2.0
    except Exception:
        return False


def worker(args):
    """Runs one peer on the named cases; writes `<case>.<peer>.safetensors` and one JSON line per
    case to `<peer>.jsonl` in --out. Exits EXIT_CONTEXT_LOST after an error that broke CUDA."""
    peer, device = args.worker, args.device
    if args.wheels and peer == "fla":
        # only fla's worker: transformers' workers then never import fla (nor its kernels)
        unpack_wheels(args.wheels)
    import torch
    from safetensors.torch import load_file, save_file

    rules = transformers_rules() if peer != "fla" else None
    if peer == "fla" and device != "cuda":
        # fla's kernels are Triton GPU kernels: say so per case rather than crash in Triton
        rules = None
    log = open(os.path.join(args.out, f"{peer}.jsonl"), "a")
    for name in args.cases.split(","):
        lengths, decode = next((l, d) for n, l, d in case_list() if n == name)
        record = {"case": name, "peer": peer, "blocking": os.environ.get("CUDA_LAUNCH_BLOCKING") == "1"}
        lost = False
        try:
            if peer == "fla" and device != "cuda":
                raise RuntimeError("fla's kernels need a CUDA device (run with --device cuda)")
            inputs = load_file(os.path.join(args.out, f"{name}.inputs.safetensors"))
            run = peer_call(torch, peer, rules, inputs, lengths, decode, device)
            if run is None:
                record["skipped"] = f"longer than {RECURRENT_MAX_T} tokens (a Python loop per token)"
            else:
                started = time.time()
                o, s = run()
                synchronize(torch, device)  # an error here is this peer's, on this case
                save_file({f"{peer}_o": o.cpu().contiguous(), f"{peer}_state": s.cpu().contiguous()},
                          os.path.join(args.out, f"{name}.{peer}.safetensors"))
                repeats = args.repeats if max(lengths) == 1 else max(1, min(args.repeats, 5))
                record["ms"] = timed(torch, run, repeats, device)
                record["seconds"] = time.time() - started
        except Exception as e:  # noqa: BLE001 - every failure is reported, then the next case runs
            record["error"] = f"{type(e).__name__}: {e}".strip()
            record["traceback"] = traceback.format_exc()[-4000:]
            lost = not context_usable(torch, device)
        log.write(json.dumps(record) + "\n")
        log.flush()
        status = record.get("error") or record.get("skipped") or f"{record['ms']:.3f} ms"
        print(f"  {peer} {name}: {status}", flush=True)
        if lost:
            sys.exit(EXIT_CONTEXT_LOST)


def run_worker(args, peer, names, blocking=False):
    """Runs a worker process for `peer` on `names`; returns its exit status and stderr's tail."""
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", peer, "--out", args.out,
           "--cases", ",".join(names), "--repeats", str(args.repeats), "--device", args.device]
    if args.wheels:
        cmd += ["--wheels", args.wheels]
    env = dict(os.environ)
    if blocking or args.launch_blocking:
        env["CUDA_LAUNCH_BLOCKING"] = "1"
    result = subprocess.run(cmd, env=env, stderr=subprocess.PIPE, text=True)
    sys.stderr.write(result.stderr)
    return result.returncode, result.stderr[-4000:]


def read_records(out, peer):
    path = os.path.join(out, f"{peer}.jsonl")
    if not os.path.exists(path):
        return {}
    records = {}
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            if r["case"] not in records or not r.get("blocking"):
                records[r["case"]] = r
            elif r.get("blocking"):
                records[r["case"]]["blocking_rerun"] = r.get("error") or "no error with CUDA_LAUNCH_BLOCKING=1"
                records[r["case"]]["blocking_traceback"] = r.get("traceback", "")
    return records


def run_peer(args, peer, names):
    """All cases for one peer, a fresh worker after each crash; returns the records by case."""
    remaining = list(names)
    while remaining:
        status, stderr = run_worker(args, peer, remaining)
        records = read_records(args.out, peer)
        done = [n for n in remaining if n in records]
        if status == 0 and len(done) == len(remaining):
            break
        # the first case without a record crashed the worker (or the last one recorded broke CUDA)
        undone = [n for n in remaining if n not in records]
        if status == EXIT_CONTEXT_LOST:
            crashed = next(n for n in reversed(remaining) if n in records)
        elif undone:
            crashed = undone[0]
            with open(os.path.join(args.out, f"{peer}.jsonl"), "a") as f:
                f.write(json.dumps({"case": crashed, "peer": peer,
                                    "error": f"worker exited with status {status}",
                                    "traceback": stderr}) + "\n")
        else:
            break
        print(f"  {peer} {crashed}: failed; rerunning it alone with CUDA_LAUNCH_BLOCKING=1 to name the kernel",
              flush=True)
        before = sum(1 for _ in open(os.path.join(args.out, f"{peer}.jsonl")))
        status, stderr = run_worker(args, peer, [crashed], blocking=True)
        if sum(1 for _ in open(os.path.join(args.out, f"{peer}.jsonl"))) == before:
            # the rerun died before recording: its stderr names the failing call
            with open(os.path.join(args.out, f"{peer}.jsonl"), "a") as f:
                f.write(json.dumps({"case": crashed, "peer": peer, "blocking": True,
                                    "error": f"worker exited with status {status}",
                                    "traceback": stderr}) + "\n")
        remaining = remaining[remaining.index(crashed) + 1:]
    return read_records(args.out, peer)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for the cases (created)")
    parser.add_argument("--wheels", help="folder with the fla / fla-core / einops wheels (unpacked, not installed)")
    parser.add_argument("--rust-test", help="fp4spec's GPU test binary: run its gdn_peers test on --out")
    parser.add_argument("--repeats", type=int, default=20, help="timed calls per peer (median)")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                        help="where the peers run (cpu: transformers only, a check without a GPU)")
    parser.add_argument("--peers", default=",".join(PEERS), help=f"comma-separated subset of {PEERS}")
    parser.add_argument("--cases", help="comma-separated subset of the cases (default: all)")
    parser.add_argument("--launch-blocking", action="store_true",
                        help="run every worker with CUDA_LAUNCH_BLOCKING=1 (times are then not meaningful)")
    parser.add_argument("--worker", choices=PEERS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.out = os.path.abspath(args.out)
    if args.wheels:
        args.wheels = os.path.abspath(args.wheels)
    if args.worker:
        return worker(args)

    import torch
    from safetensors.torch import load_file, save_file

    wheels = sorted(n for n in os.listdir(args.wheels) if n.startswith(WHEEL_PREFIXES)) if args.wheels else []
    os.makedirs(args.out, exist_ok=True)
    for peer in PEERS:
        path = os.path.join(args.out, f"{peer}.jsonl")
        if os.path.exists(path):
            os.remove(path)
    cases = case_list()
    if args.cases:
        wanted = args.cases.split(",")
        unknown = set(wanted) - {c[0] for c in cases}
        if unknown:
            raise SystemExit(f"unknown cases {sorted(unknown)}; known: {[c[0] for c in cases]}")
        cases = [c for c in cases if c[0] in wanted]
    peers = args.peers.split(",")
    if set(peers) - set(PEERS):
        raise SystemExit(f"unknown peers {sorted(set(peers) - set(PEERS))}; known: {PEERS}")
    for index, (name, lengths, _) in enumerate(cases):
        inputs = make_inputs(torch, args.seed + index, sum(lengths), len(lengths))
        save_file(inputs, os.path.join(args.out, f"{name}.inputs.safetensors"))
    print(f"inputs of {len(cases)} cases in {args.out}", flush=True)
    names = [c[0] for c in cases]
    records = {}
    for peer in peers:
        print(f"{peer}:", flush=True)
        records[peer] = run_peer(args, peer, names)

    import transformers

    manifest = {
        "shape": {"key_heads": HK, "value_heads": HV, "dk": DK, "dv": DV},
        "conv": "identity tap: w[c] = [0, 0, 0, 1]",
        "position": 4,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "transformers_module": transformers_rules()[0], "wheels": wheels,
                     "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu"},
        "cases": [],
    }
    failures = []
    for name, lengths, decode in cases:
        tensors = load_file(os.path.join(args.out, f"{name}.inputs.safetensors"))
        entry = {"name": name, "lengths": lengths, "decode": decode, "file": f"{name}.safetensors",
                 "times_ms": {}, "errors": {}}
        for peer in peers:
            r = records[peer].get(name, {"error": "no record (the worker never reached this case)"})
            key = peer if peer != "fla" else ("fla_fused_recurrent" if decode else "fla_chunk")
            if "ms" in r:
                tensors.update(load_file(os.path.join(args.out, f"{name}.{peer}.safetensors")))
                entry["times_ms"][key] = r["ms"]
            elif "error" in r:
                message = r["error"]
                if "blocking_rerun" in r:
                    message += f" | with CUDA_LAUNCH_BLOCKING=1: {r['blocking_rerun']}"
                entry["errors"][peer] = message
                failures.append(f"{name} {peer}: {message}\n{r.get('blocking_traceback') or r.get('traceback', '')}")
        if "fla_o" in tensors and "hf_chunk_o" in tensors:
            entry["fla_vs_hf_chunk"] = {
                "o_max_abs": (tensors["fla_o"] - tensors["hf_chunk_o"]).abs().max().item(),
                "state_max_abs": (tensors["fla_state"] - tensors["hf_chunk_state"]).abs().max().item(),
            }
        save_file(tensors, os.path.join(args.out, entry["file"]))
        manifest["cases"].append(entry)
        parts = [", ".join(f"{k} {v:.3f} ms" for k, v in entry["times_ms"].items()) or "no times"]
        versus = entry.get("fla_vs_hf_chunk")
        if versus:
            parts.append(f"fla vs transformers chunk: o {versus['o_max_abs']:.2e}, state {versus['state_max_abs']:.2e}")
        parts += [f"{p} FAILED: {m}" for p, m in entry["errors"].items()]
        print(f"{name}: " + "; ".join(parts), flush=True)
    with open(os.path.join(args.out, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    print(f"wrote {len(cases)} cases to {args.out}")
    for failure in failures:
        print(f"\npeer failure: {failure}")
    if args.rust_test:
        env = dict(os.environ, FP4SPEC_GDN_PEERS=args.out)
        result = subprocess.run([args.rust_test, "gdn_peers", "--nocapture", "--test-threads=1"], env=env)
        sys.exit(result.returncode or (1 if failures else 0))
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
