#!/usr/bin/env python3
"""Golden fixtures for the model runner, made with HF transformers (5.17).

Writes tiny random-weight checkpoints and what transformers computes for them:

  tests/fixtures/qwen35_text/      qwen3_5_moe_text, `model.layers.*`, fused 3-D experts, BF16
  tests/fixtures/qwen35_vl/        the same weights in the vision-language wrapper layout
                                   (`model.language_model.*`, `text_config`, a vision tensor to
                                   ignore), norms stored F32, sharded over three files + index
  tests/fixtures/qwen35_nvfp4/     the same weights with the attention projections and every
                                   expert (per-expert 2-D) in ModelOpt NVFP4, hf_quant_config.json
  tests/fixtures/qwen3_next/       a Qwen3-Next checkpoint (fused in_proj_qkvz / in_proj_ba,
                                   per-expert experts), its own weights
  tests/fixtures/*/reference.json  (the VL one repeats the text one) per prompt: logits of every position, MTP logits of every
                                   position p < T-1, and a greedy continuation

The MTP head is not implemented by transformers (it drops mtp.* on load), so its reference is
computed here from transformers' own classes: the model's RMSNorm, a Qwen3_5MoeDecoderLayer built
as a full-attention layer, the model's rotary embedding, in the order of vLLM's qwen3_5_mtp.py:
    e = pre_fc_norm_embedding(embed(t[p+1])); h = pre_fc_norm_hidden(H[p]) (post final norm)
    x = fc([e; h]); x = layer(x, positions 0..T-2, causal); logits = lm_head(mtp.norm(x))

Weights are random but shaped to catch bugs: every norm weight is random (a zero `w` hides the
`w` vs `1 + w` bug), dk != dv, the router is scaled up so routing is decisive, and every weight is
rounded to bf16 so BF16 storage is exact and the references are computed in float32 on exactly
the stored values. Continuations are checked for near-ties (a top-2 logit gap below 1e-3 would
make an exact comparison meaningless); prompts are redrawn until there are none.

Usage: python3 tools/reference/make_fixtures.py [--out tests/fixtures]   (CPU is enough)
"""

import argparse
import copy
import json
import math
import os

import torch
from safetensors.torch import save_file
from transformers import Qwen3_5MoeTextConfig, Qwen3_5MoeForCausalLM
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as q35

torch.set_num_threads(max(1, os.cpu_count() or 1))

TEXT = dict(
    vocab_size=320,
    hidden_size=64,
    num_hidden_layers=4,
    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=24,
    linear_conv_kernel_dim=4,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=48,
    rms_norm_eps=1e-6,
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.25,
        "mrope_section": [1, 1, 2],
        "mrope_interleaved": True,
    },
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)
MTP_LAYERS = 1
CONTINUATION = 24
PROMPT_LENGTHS = [1, 7, 19]


def bf16_exact(t):
    return t.to(torch.bfloat16).to(torch.float32)


def randomize(model, gen, scale=0.08):
    """Every parameter random (norms too), rounded to bf16."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                v = torch.rand(p.shape, generator=gen) * 2.0 - 1.0
            elif name.endswith("dt_bias"):
                v = torch.randn(p.shape, generator=gen) * 0.5
            elif "norm" in name and p.dim() == 1:
                v = torch.randn(p.shape, generator=gen) * 0.3
            elif name.endswith("conv1d.weight"):
                v = torch.randn(p.shape, generator=gen) * 0.4
            elif name.endswith("mlp.gate.weight"):
                v = torch.randn(p.shape, generator=gen) * 0.6  # decisive routing
            elif "embed_tokens" in name:
                v = torch.randn(p.shape, generator=gen) * 1.0
            else:
                fan_in = p.shape[-1]
                v = torch.randn(p.shape, generator=gen) * (scale * 8 / math.sqrt(fan_in))
            p.copy_(bf16_exact(v))


class Mtp(torch.nn.Module):
    """The MTP head from transformers' own classes (see the module docstring)."""

    def __init__(self, text_config, gen):
        super().__init__()
        h = text_config.hidden_size
        cfg = copy.deepcopy(text_config)
        cfg.layer_types = ["full_attention"]
        cfg.num_hidden_layers = 1
        self.fc = torch.nn.Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = q35.Qwen3_5MoeRMSNorm(h, eps=cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = q35.Qwen3_5MoeRMSNorm(h, eps=cfg.rms_norm_eps)
        self.norm = q35.Qwen3_5MoeRMSNorm(h, eps=cfg.rms_norm_eps)
        self.layer = q35.Qwen3_5MoeDecoderLayer(cfg, 0)
        self.layer.self_attn.config._attn_implementation = "eager"
        randomize(self, gen)

    def forward(self, lm, tokens_next, hidden):
        """tokens_next [T'], hidden [T', H] (post final norm): MTP logits [T', V] and out."""
        model = lm.model
        e = self.pre_fc_norm_embedding(model.embed_tokens(tokens_next[None]))
        h = self.pre_fc_norm_hidden(hidden[None])
        x = self.fc(torch.cat([e, h], dim=-1))
        t = tokens_next.shape[0]
        positions = torch.arange(t)[None, None, :].expand(3, 1, t)
        cos_sin = model.rotary_emb(x, positions)
        mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
        x = self.layer(x, position_embeddings=cos_sin, attention_mask=mask)
        out = self.norm(x)
        return lm.lm_head(out)[0], out[0]

    def tensors(self):
        """The mtp.* tensors as a real checkpoint stores them (per-expert MTP experts)."""
        sd = {}
        for name, t in self.state_dict().items():
            name = name.replace("layer.", "layers.0.", 1) if name.startswith("layer.") else name
            if name.endswith("mlp.experts.gate_up_proj"):
                base = name[: -len("gate_up_proj")]
                i = t.shape[1] // 2
                for e in range(t.shape[0]):
                    sd[f"mtp.{base}{e}.gate_proj.weight"] = t[e, :i]
                    sd[f"mtp.{base}{e}.up_proj.weight"] = t[e, i:]
                continue
            if name.endswith("mlp.experts.down_proj"):
                base = name[: -len("down_proj")]
                for e in range(t.shape[0]):
                    sd[f"mtp.{base}{e}.down_proj.weight"] = t[e]
                continue
            sd[f"mtp.{name}"] = t
        return sd


def reference(lm, mtp, prompts):
    out = {"prompts": [], "logits": [], "mtp_logits": [], "greedy": [], "greedy_min_gap": []}
    with torch.no_grad():
        for ids in prompts:
            ids_t = torch.tensor(ids)
            res = lm(ids_t[None], output_hidden_states=False)
            logits = res.logits[0]
            hidden = lm.model(ids_t[None]).last_hidden_state[0]
            out["prompts"].append(ids)
            out["logits"].append(logits.tolist())
            if mtp is not None and len(ids) > 1:
                mtp_logits, _ = mtp(lm, ids_t[1:], hidden[:-1])
                out["mtp_logits"].append(mtp_logits.tolist())
            else:
                out["mtp_logits"].append([])
            seq = list(ids)
            gap = float("inf")
            for _ in range(CONTINUATION):
                last = lm(torch.tensor(seq)[None]).logits[0, -1]
                top = torch.topk(last, 2).values
                gap = min(gap, float(top[0] - top[1]))
                seq.append(int(last.argmax()))
            out["greedy"].append(seq[len(ids):])
            out["greedy_min_gap"].append(gap)
    return out


def draw_prompts(gen, vocab, lm):
    """Prompts whose greedy continuations have no near-ties."""
    prompts = []
    for length in PROMPT_LENGTHS:
        for _ in range(50):
            ids = torch.randint(0, vocab, (length,), generator=gen).tolist()
            seq = list(ids)
            ok = True
            with torch.no_grad():
                for _ in range(CONTINUATION):
                    last = lm(torch.tensor(seq)[None]).logits[0, -1]
                    top = torch.topk(last, 2).values
                    if float(top[0] - top[1]) < 1e-3:
                        ok = False
                        break
                    seq.append(int(last.argmax()))
            if ok:
                prompts.append(ids)
                break
        else:
            raise SystemExit(f"no prompt of length {length} without near-ties in 50 draws")
    return prompts


def write_json(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f, separators=(",", ":"))


def text_config_json(extra=None):
    cfg = dict(TEXT)
    cfg.update(
        model_type="qwen3_5_moe_text",
        architectures=["Qwen3_5MoeForCausalLM"],
        mtp_num_hidden_layers=MTP_LAYERS,
        torch_dtype="bfloat16",
        hidden_act="silu",
        attn_output_gate=True,
        eos_token_id=0,
    )
    cfg.update(extra or {})
    return cfg


# ---------------------------------------------------------------- NVFP4 (ModelOpt) ---------

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def quantize_nvfp4(w):
    """ModelOpt NVFP4 of a 2-D weight: (packed uint8 [N, K/2], e4m3 scales [N, K/16], ws2)."""
    n, k = w.shape
    ws2 = w.abs().max() / (6.0 * 448.0)
    blocks = w.reshape(n, k // 16, 16)
    amax = blocks.abs().amax(-1)
    scale = (amax / (6.0 * ws2)).to(torch.float8_e4m3fn)
    scale_f = scale.to(torch.float32)
    scale_f = torch.where(scale_f == 0, torch.ones_like(scale_f), scale_f)
    scale = scale_f.to(torch.float8_e4m3fn)
    x = blocks / (scale_f[..., None] * ws2)
    mag = x.abs().clamp(max=6.0)
    idx = (mag[..., None] - E2M1).abs().argmin(-1)  # nearest; ties to the lower code
    codes = idx | ((x < 0) & (idx > 0)).to(torch.int64) << 3
    codes = codes.reshape(n, k).to(torch.uint8)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed.contiguous(), scale.contiguous(), ws2.reshape(()).to(torch.float32)


def dequantize_nvfp4(packed, scale, ws2):
    lo, hi = packed & 0xF, packed >> 4
    codes = torch.stack([lo, hi], -1).reshape(packed.shape[0], -1).to(torch.int64)
    vals = E2M1[codes & 7] * torch.where(codes >= 8, -1.0, 1.0)
    n, k = vals.shape
    s = scale.to(torch.float32).repeat_interleave(16, dim=1)
    return vals * s * ws2


def nvfp4_checkpoint(lm, mtp, dirname, exclude):
    """Quantises attention projections, shared experts and every routed expert (per-expert
    2-D), writes the checkpoint, and loads the dequantised weights back into `lm` (W4A16)."""
    sd = {k: v for k, v in lm.state_dict().items()}
    out = {}
    input_scale = torch.tensor(0.05 / 448.0 * 6.0, dtype=torch.float32)  # calibration-free default

    def put_nvfp4(prefix, w):
        packed, scale, ws2 = quantize_nvfp4(w)
        out[f"{prefix}.weight"] = packed
        out[f"{prefix}.weight_scale"] = scale
        out[f"{prefix}.weight_scale_2"] = ws2
        out[f"{prefix}.input_scale"] = input_scale.clone()
        return dequantize_nvfp4(packed, scale, ws2)

    new_sd = dict(sd)
    for name, t in sd.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            base = name[: -len("gate_up_proj")]
            i = t.shape[1] // 2
            deq = torch.empty_like(t)
            for e in range(t.shape[0]):
                deq[e, :i] = put_nvfp4(f"{base}{e}.gate_proj", t[e, :i])
                deq[e, i:] = put_nvfp4(f"{base}{e}.up_proj", t[e, i:])
            new_sd[name] = deq
        elif name.endswith("mlp.experts.down_proj"):
            base = name[: -len("down_proj")]
            deq = torch.empty_like(t)
            for e in range(t.shape[0]):
                deq[e] = put_nvfp4(f"{base}{e}.down_proj", t[e])
            new_sd[name] = deq
        elif any(s in name for s in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                     "self_attn.o_proj", "shared_expert.gate_proj",
                                     "shared_expert.up_proj", "shared_expert.down_proj")):
            new_sd[name] = put_nvfp4(name[: -len(".weight")], t)
        else:
            out[name] = t.to(torch.bfloat16)
    for name, t in mtp.tensors().items():
        out[name] = t.to(torch.bfloat16)
    lm.load_state_dict(new_sd)
    os.makedirs(dirname, exist_ok=True)
    save_file(out, os.path.join(dirname, "model.safetensors"))
    quant = {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
             "exclude_modules": exclude}
    write_json(os.path.join(dirname, "hf_quant_config.json"),
               {"producer": {"name": "fp4spec make_fixtures.py"}, "quantization": quant})
    cfg = text_config_json({"quantization_config": dict(quant, quant_method="modelopt")})
    write_json(os.path.join(dirname, "config.json"), cfg)


# ---------------------------------------------------------------- Qwen3-Next -----------------

def qwen3_next(out_dir, gen):
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    cfg = Qwen3NextConfig(
        vocab_size=300, hidden_size=48, num_hidden_layers=4, full_attention_interval=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, partial_rotary_factor=0.25,
        rope_theta=10000.0, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=4,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
        shared_expert_intermediate_size=32, intermediate_size=64, decoder_sparse_step=1,
        mlp_only_layers=[], norm_topk_prob=True, rms_norm_eps=1e-6, tie_word_embeddings=False,
        max_position_embeddings=4096,
    )
    cfg._attn_implementation = "eager"
    lm = Qwen3NextForCausalLM(cfg).eval()
    randomize(lm, gen)
    sd = {}
    for name, t in lm.state_dict().items():
        if name.endswith("mlp.experts.gate_up_proj"):
            base = name[: -len("gate_up_proj")]
            i = t.shape[1] // 2
            for e in range(t.shape[0]):
                sd[f"{base}{e}.gate_proj.weight"] = t[e, :i]
                sd[f"{base}{e}.up_proj.weight"] = t[e, i:]
        elif name.endswith("mlp.experts.down_proj"):
            base = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                sd[f"{base}{e}.down_proj.weight"] = t[e]
        else:
            sd[name] = t
    d = os.path.join(out_dir, "qwen3_next")
    os.makedirs(d, exist_ok=True)
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in sd.items()},
              os.path.join(d, "model.safetensors"))
    cfg_json = cfg.to_dict()
    cfg_json["model_type"] = "qwen3_next"
    cfg_json["num_nextn_predict_layers"] = 0
    write_json(os.path.join(d, "config.json"), cfg_json)
    # the reference is what transformers computes from the checkpoint as written
    lm2 = Qwen3NextForCausalLM.from_pretrained(d, torch_dtype=torch.float32).eval()
    lm2.config._attn_implementation = "eager"
    prompts = draw_prompts(gen, cfg.vocab_size, lm2)
    write_json(os.path.join(d, "reference.json"), reference(lm2, None, prompts))


# ---------------------------------------------------------------- main ----------------------

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="tests/fixtures")
    ap.add_argument("--seed", type=int, default=20261202)
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(args.seed)

    config = Qwen3_5MoeTextConfig(**TEXT)
    config._attn_implementation = "eager"
    lm = Qwen3_5MoeForCausalLM(config).eval()
    randomize(lm, gen)
    mtp = Mtp(config, gen).eval()

    # 1. text-only layout, BF16, one file
    text_dir = os.path.join(args.out, "qwen35_text")
    os.makedirs(text_dir, exist_ok=True)
    tensors = {k: v.to(torch.bfloat16).contiguous() for k, v in lm.state_dict().items()}
    tensors.update({k: v.to(torch.bfloat16).contiguous() for k, v in mtp.tensors().items()})
    save_file(tensors, os.path.join(text_dir, "model.safetensors"))
    write_json(os.path.join(text_dir, "config.json"), text_config_json())
    # transformers reads the checkpoint back: the reference is computed from the file as written
    lm_file = Qwen3_5MoeForCausalLM.from_pretrained(text_dir, torch_dtype=torch.float32).eval()
    lm_file.config._attn_implementation = "eager"
    for (n1, p1), (n2, p2) in zip(lm.state_dict().items(), lm_file.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2), f"{n1} did not round-trip through the file"
    prompts = draw_prompts(gen, TEXT["vocab_size"], lm_file)
    ref = reference(lm_file, mtp, prompts)
    write_json(os.path.join(text_dir, "reference.json"), ref)

    # 2. vision-language wrapper, norms in F32, three shards + index, same weights
    vl_dir = os.path.join(args.out, "qwen35_vl")
    os.makedirs(vl_dir, exist_ok=True)
    vl = {}
    for k, v in tensors.items():
        if k.startswith("model."):
            k = "model.language_model." + k[len("model."):]
        vl[k] = v.to(torch.float32) if ("norm" in k and v.dim() == 1) else v
    vl["model.visual.blocks.0.attn.qkv.weight"] = torch.zeros(12, 4, dtype=torch.bfloat16)
    names = sorted(vl)
    shards = [names[i::3] for i in range(3)]
    weight_map = {}
    for s, group in enumerate(shards):
        fname = f"model-{s + 1:05d}-of-00003.safetensors"
        save_file({n: vl[n] for n in group}, os.path.join(vl_dir, fname))
        weight_map.update({n: fname for n in group})
    write_json(os.path.join(vl_dir, "model.safetensors.index.json"),
               {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in vl.values())},
                "weight_map": weight_map})
    text = text_config_json()
    text.pop("architectures")
    vl_cfg = {"model_type": "qwen3_5_moe", "architectures": ["Qwen3_5MoeForConditionalGeneration"],
              "text_config": text, "vision_config": {"depth": 1, "hidden_size": 4},
              "tie_word_embeddings": False}
    write_json(os.path.join(vl_dir, "config.json"), vl_cfg)
    for f in ("preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json"):
        write_json(os.path.join(vl_dir, f), {})
    write_json(os.path.join(vl_dir, "reference.json"), ref)

    # 3. NVFP4 (ModelOpt): attention projections + experts + shared experts quantised
    nvfp4_dir = os.path.join(args.out, "qwen35_nvfp4")
    exclude = ["lm_head", "model.embed_tokens", "*linear_attn*", "*mlp.gate", "*shared_expert_gate",
               "mtp*"]
    nvfp4_checkpoint(lm_file, mtp, nvfp4_dir, exclude)
    write_json(os.path.join(nvfp4_dir, "reference.json"), reference(lm_file, mtp, prompts))

    # 4. Qwen3-Next
    qwen3_next(args.out, gen)
    print("fixtures written under", args.out)


if __name__ == "__main__":
    main()
