#!/usr/bin/env python3
"""Gated DeltaNet peers on the GPU host, on the same inputs as fp4spec's kernels.

Runs transformers' torch_chunk_gated_delta_rule / torch_recurrent_gated_delta_rule and fla's
chunk_gated_delta_rule / fused_recurrent_gated_delta_rule at the Qwen3.6-35B-A3B head shape
(Hk 16, Hv 32, dk = dv = 128), writes every case's inputs, the peers' outputs and final states
and their times to --out, and with --rust-test runs fp4spec's `gdn_peers` GPU test on that
folder, which runs our kernels on the same inputs and prints the comparison table (max abs /
rel differences of outputs and final states against fla and against transformers, and the
times of all three measured in this one run).

The inputs are raw projection rows as our kernels take them (qkv, a, b in bf16, A_log and
dt_bias in fp32) with the conv weights fixed to the identity tap (w[c] = [0, 0, 0, 1]), so
q, k, v = silu(qkv); the peers get q, k (L2-normalised in fp32), v in bf16, g = -exp(A_log)
softplus(a + dt_bias) in fp32 and beta = sigmoid(b) in bf16 (fla's tested dtypes), and the
scale 1/sqrt(dk). Each case starts from a random fp32 state (our sequences sit at position 4
so the state is read; the conv history is multiplied by the zero taps).

On the GPU host (python 3.12, torch, triton, transformers; no network), with the wheels from
the dev machine's /work/main/.whl copied next to the repository:
    python3 tools/reference/gdn_peers.py --wheels .whl --out /tmp/gdn_peers \
        --rust-test .gpu/tests/gpu-<hash>
The wheels (flash-linear-attention 0.6.0, fla-core 0.6.0, einops 0.8.1; pure Python) are
unpacked into a temporary folder on sys.path: nothing is installed.
"""

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import zipfile

HK, HV, DK, DV = 16, 32, 128, 128
CONV_DIM = 2 * HK * DK + HV * DV
PREFILL_T = [512, 4096, 16384]
DECODE_B = [1, 8, 64]
# a batch of sequences of different lengths (fla's cu_seqlens; transformers one by one)
VARLEN = [100, 1000, 65, 1]
# transformers' token loop is slow in Python: its recurrent form runs only up to this length
RECURRENT_MAX_T = 512


def unpack_wheels(folder):
    target = tempfile.mkdtemp(prefix="gdn_peers_wheels_")
    names = sorted(n for n in os.listdir(folder) if n.endswith(".whl"))
    for name in names:
        if name.startswith(("flash_linear_attention", "fla_core", "einops")):
            with zipfile.ZipFile(os.path.join(folder, name)) as wheel:
                wheel.extractall(target)
    sys.path.insert(0, target)
    return [n for n in names if n.startswith(("flash_linear_attention", "fla_core", "einops"))]


def transformers_rules():
    import importlib

    for module in (
        "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe",
        "transformers.models.qwen3_5.modeling_qwen3_5",
        "transformers.models.qwen3_next.modeling_qwen3_next",
    ):
        try:
            m = importlib.import_module(module)
            return module, m.torch_chunk_gated_delta_rule, m.torch_recurrent_gated_delta_rule
        except (ImportError, AttributeError):
            continue
    raise SystemExit("transformers has no torch_chunk_gated_delta_rule (qwen3_5_moe, qwen3_5, qwen3_next)")


def timed(fn, repeats, torch):
    """Median milliseconds of `repeats` calls (after one warm-up), CUDA events around each."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def make_inputs(torch, gen, rows, states):
    dev = "cuda"
    qkv = torch.randn(rows, CONV_DIM, generator=gen, device=dev).to(torch.bfloat16)
    a = torch.randn(rows, HV, generator=gen, device=dev).to(torch.bfloat16)
    b = torch.randn(rows, HV, generator=gen, device=dev).to(torch.bfloat16)
    a_log = torch.log1p(torch.arange(HV, device=dev, dtype=torch.float32) * 0.3) - 1.0
    dt_bias = 0.5 * torch.randn(HV, generator=gen, device=dev)
    state = 0.3 * torch.randn(states, HV, DK, DV, generator=gen, device=dev)
    return {"qkv": qkv, "a": a, "b": b, "A_log": a_log, "dt_bias": dt_bias, "initial_state": state}


def front_end(torch, inputs):
    """q, k (normalised, fp32), v, g (fp32), beta (fp32) per row, heads split."""
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


def run_case(torch, fla, hf, name, inputs, lengths, decode, repeats):
    """Runs the peers on one case; returns (tensors to save, manifest entry)."""
    hf_module, hf_chunk, hf_recurrent = hf
    q, k, v, g, beta = front_end(torch, inputs)
    bf = torch.bfloat16
    scale = 1.0 / math.sqrt(DK)
    state0 = inputs["initial_state"]
    out = {}
    entry = {"name": name, "lengths": lengths, "decode": decode, "times_ms": {}}
    n = len(lengths)
    cu = [0]
    for length in lengths:
        cu.append(cu[-1] + length)
    # fla: [B, T, H, D]; decode as a batch of B one-token sequences, prefill as one (varlen) row
    if decode:
        shape4 = lambda x: x.unsqueeze(1).contiguous()  # [B, 1, H, D]
        fq, fk, fv, fg, fb = shape4(q), shape4(k), shape4(v), g.unsqueeze(1), beta.unsqueeze(1)
        call = lambda: fla.fused_recurrent_gated_delta_rule(
            fq.to(bf), fk.to(bf), fv.to(bf), g=fg, beta=fb.to(bf), scale=scale,
            initial_state=state0.clone(), output_final_state=True)
        key = "fla_fused_recurrent"
    else:
        one = lambda x: x.unsqueeze(0).contiguous()  # [1, T, H, D]
        cu_t = torch.tensor(cu, device="cuda", dtype=torch.long) if n > 1 else None
        call = lambda: fla.chunk_gated_delta_rule(
            one(q).to(bf), one(k).to(bf), one(v).to(bf), one(g), one(beta).to(bf), scale=scale,
            initial_state=state0.clone(), output_final_state=True, cu_seqlens=cu_t)
        key = "fla_chunk"
    o, state = call()
    out["fla_o"] = o.reshape(-1, HV * DV).float().contiguous()
    out["fla_state"] = state.float().contiguous()
    entry["times_ms"][key] = timed(call, repeats, torch)

    # transformers: equal heads (q, k repeated to the value heads), one sequence at a time
    ratio = HV // HK
    qh, kh = q.repeat_interleave(ratio, dim=1).contiguous(), k.repeat_interleave(ratio, dim=1).contiguous()
    rules = [("hf_chunk", hf_chunk)]
    if max(lengths) <= RECURRENT_MAX_T:
        rules.append(("hf_recurrent", hf_recurrent))
    for label, rule in rules:
        def run_hf():
            os_, ss = [], []
            for i in range(n):
                r = slice(cu[i], cu[i + 1]) if not decode else slice(i, i + 1)
                oi, si = rule(qh[r].unsqueeze(0), kh[r].unsqueeze(0), v[r].unsqueeze(0),
                              g[r].unsqueeze(0), beta[r].unsqueeze(0),
                              initial_state=state0[i : i + 1].clone(), output_final_state=True)
                os_.append(oi.reshape(-1, HV * DV))
                ss.append(si)
            return torch.cat(os_).float(), torch.cat(ss).float()

        o_hf, s_hf = run_hf()
        out[f"{label}_o"] = o_hf.contiguous()
        out[f"{label}_state"] = s_hf.contiguous()
        entry["times_ms"][label] = timed(run_hf, 1 if max(lengths) > 1 else repeats, torch)
    # the peers against each other, for scale
    d = (out["fla_o"] - out["hf_chunk_o"]).abs().max().item()
    ds = (out["fla_state"] - out["hf_chunk_state"]).abs().max().item()
    entry["fla_vs_hf_chunk"] = {"o_max_abs": d, "state_max_abs": ds}
    tensors = {name_: t.contiguous() for name_, t in inputs.items()}
    tensors.update(out)
    return tensors, entry


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for the cases (created)")
    parser.add_argument("--wheels", help="folder with the fla / fla-core / einops wheels (unpacked, not installed)")
    parser.add_argument("--rust-test", help="fp4spec's GPU test binary: run its gdn_peers test on --out")
    parser.add_argument("--repeats", type=int, default=20, help="timed calls per peer (median)")
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args()

    wheels = unpack_wheels(args.wheels) if args.wheels else []
    import torch
    import fla
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    from safetensors.torch import save_file

    class Fla:
        pass

    peers = Fla()
    peers.chunk_gated_delta_rule = chunk_gated_delta_rule
    peers.fused_recurrent_gated_delta_rule = fused_recurrent_gated_delta_rule
    hf = transformers_rules()
    import transformers

    os.makedirs(args.out, exist_ok=True)
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    manifest = {
        "shape": {"key_heads": HK, "value_heads": HV, "dk": DK, "dv": DV},
        "conv": "identity tap: w[c] = [0, 0, 0, 1]",
        "position": 4,
        "versions": {"torch": torch.__version__, "fla": getattr(fla, "__version__", "?"),
                     "transformers": transformers.__version__, "transformers_module": hf[0],
                     "wheels": wheels, "device": torch.cuda.get_device_name()},
        "cases": [],
    }
    cases = [(f"prefill_T{t}", [t], False) for t in PREFILL_T]
    cases.append(("prefill_varlen", VARLEN, False))
    cases += [(f"decode_B{b}", [1] * b, True) for b in DECODE_B]
    for name, lengths, decode in cases:
        started = time.time()
        inputs = make_inputs(torch, gen, sum(lengths), len(lengths))
        tensors, entry = run_case(torch, peers, hf, name, inputs, lengths, decode, args.repeats)
        entry["file"] = f"{name}.safetensors"
        save_file({k: v.cpu() for k, v in tensors.items()}, os.path.join(args.out, entry["file"]))
        manifest["cases"].append(entry)
        times = ", ".join(f"{k} {v:.3f} ms" for k, v in entry["times_ms"].items())
        print(f"{name}: {times}; fla vs transformers chunk: o {entry['fla_vs_hf_chunk']['o_max_abs']:.2e}, "
              f"state {entry['fla_vs_hf_chunk']['state_max_abs']:.2e} ({time.time() - started:.0f} s)", flush=True)
    with open(os.path.join(args.out, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    print(f"wrote {len(cases)} cases to {args.out}")
    if args.rust_test:
        env = dict(os.environ, FP4SPEC_GDN_PEERS=os.path.abspath(args.out))
        result = subprocess.run([args.rust_test, "gdn_peers", "--nocapture", "--test-threads=1"], env=env)
        sys.exit(result.returncode)


if __name__ == "__main__":
    main()
