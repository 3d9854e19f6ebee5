#!/usr/bin/env python3
"""Trains the embedded demo model: a tiny Qwen3.5-MoE (byte-level, about 2 M parameters, 3 Gated
DeltaNet layers + 1 full-attention layer, 8 experts top-2, a shared expert) together with its
MTP head, on generated text of two kinds:

  code-like   small Python functions (loops, conditions, arithmetic) from a random grammar
  prose-like  English sentences from a random grammar with a wide vocabulary

The text is generated here (no downloaded corpus). The MTP head is trained as the model's own
speculative drafter: row p pairs token t[p+1] with the backbone's post-final-norm hidden H[p]
and predicts t[p+2] (vLLM's qwen3_5_mtp order), with transformers' own decoder-layer, RMSNorm
and rotary classes, exactly as tools/reference/make_fixtures.py computes the MTP reference.

Writes OUT/config.json, OUT/model.safetensors (BF16; experts fused in the main layers and per
expert in the MTP layer, as the real checkpoints store them), OUT/fp4spec_tokenizer.json and
OUT/train_log.txt. The checkpoint is reloaded with transformers before the script ends and its
logits compared with the trained model's.

Usage (GPU host): python3 tools/reference/train_demo.py --out DIR [--seconds 240]
"""

import argparse
import json
import math
import os
import random
import sys
import time

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers import Qwen3_5MoeTextConfig, Qwen3_5MoeForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_fixtures import Mtp  # noqa: E402  (the MTP head built from transformers' classes)

EOS = 256
VOCAB = 260
CONFIG = dict(
    vocab_size=VOCAB,
    hidden_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    linear_num_key_heads=4,
    linear_num_value_heads=8,
    linear_key_head_dim=32,
    linear_value_head_dim=32,
    linear_conv_kernel_dim=4,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=96,
    shared_expert_intermediate_size=128,
    rms_norm_eps=1e-6,
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.25,
        "mrope_section": [2, 1, 1],
        "mrope_interleaved": True,
    },
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)

# ------------------------------------------------------------------ generated text ----------

NAMES = ["total", "count", "value", "items", "result", "index", "left", "right", "size", "score",
         "limit", "step", "width", "height", "offset", "buffer", "node", "key", "data", "row"]
FUNCS = ["compute", "update", "merge", "scale", "filter", "count", "find", "parse", "build",
         "check", "sum", "split", "clamp", "load", "store"]
OPS = ["+", "-", "*", "//", "%"]
CMPS = ["<", ">", "<=", ">=", "==", "!="]


def code_snippet(r):
    fn = f"{r.choice(FUNCS)}_{r.choice(NAMES)}"
    args = r.sample(NAMES, r.randint(1, 3))
    lines = [f"def {fn}({', '.join(args)}):"]
    acc = r.choice([n for n in NAMES if n not in args])
    lines.append(f"    {acc} = {r.randint(0, 9)}")
    for _ in range(r.randint(1, 4)):
        kind = r.random()
        a = r.choice(args)
        if kind < 0.35:
            lines.append(f"    for i in range({a}):")
            lines.append(f"        {acc} = {acc} {r.choice(OPS)} i")
        elif kind < 0.7:
            lines.append(f"    if {a} {r.choice(CMPS)} {r.randint(0, 99)}:")
            lines.append(f"        {acc} = {acc} {r.choice(OPS)} {a}")
            if r.random() < 0.5:
                lines.append("    else:")
                lines.append(f"        {acc} = {acc} {r.choice(OPS)} {r.randint(1, 9)}")
        else:
            lines.append(f"    {acc} = {acc} {r.choice(OPS)} {a} {r.choice(OPS)} {r.randint(1, 9)}")
    lines.append(f"    return {acc}")
    return "\n".join(lines) + "\n"


ADJ = ["old", "quiet", "bright", "cold", "small", "distant", "narrow", "golden", "tired", "gentle",
       "heavy", "hidden", "ancient", "restless", "silver", "pale", "wild", "careful", "empty", "warm"]
NOUN = ["sailor", "river", "village", "garden", "mountain", "lantern", "stranger", "harbor",
        "forest", "letter", "bridge", "window", "teacher", "market", "storm", "horse", "candle",
        "road", "tower", "child", "widow", "merchant", "field", "bell", "ship"]
VERB = ["watched", "crossed", "remembered", "carried", "followed", "painted", "found", "left",
        "opened", "heard", "answered", "waited for", "climbed", "mended", "lost", "praised"]
PREP = ["near", "beyond", "under", "behind", "across", "beside", "toward", "above"]
TIME = ["In the morning", "At dusk", "Long ago", "That winter", "Every evening", "After the rain",
        "Before the fair", "On the third day"]


def noun_phrase(r):
    p = r.random()
    if p < 0.4:
        return f"the {r.choice(NOUN)}"
    if p < 0.8:
        return f"the {r.choice(ADJ)} {r.choice(NOUN)}"
    return f"a {r.choice(ADJ)} {r.choice(NOUN)} {r.choice(PREP)} the {r.choice(NOUN)}"


SYLLABLES = ["ka", "to", "mer", "li", "an", "sel", "ro", "vi", "dan", "el", "mo", "ris", "ta",
             "bor", "ne", "su", "gal", "fen", "o", "ith"]


def proper_name(r):
    word = "".join(r.choice(SYLLABLES) for _ in range(r.randint(2, 3)))
    return word[0].upper() + word[1:]


def prose_snippet(r):
    """Sentences about two made-up people: their names cannot be predicted until they recur,
    as in real prose, while the grammar words can."""
    people = [proper_name(r), proper_name(r)]
    sentences = []
    for _ in range(r.randint(2, 5)):
        subject = r.choice(people) if r.random() < 0.5 else noun_phrase(r)
        s = f"{subject} {r.choice(VERB)} {noun_phrase(r)}"
        if r.random() < 0.5:
            s += f" {r.choice(PREP)} {noun_phrase(r)}"
        if r.random() < 0.3:
            s = f"{r.choice(TIME)}, {s}"
        sentences.append(s[0].upper() + s[1:] + ".")
    return " ".join(sentences) + "\n"


def documents(r, n):
    return [(code_snippet if r.random() < 0.5 else prose_snippet)(r) for _ in range(n)]


def stream(r, length):
    """A token stream of documents separated by EOS."""
    out = []
    while len(out) < length:
        out.extend(documents(r, 1)[0].encode())
        out.append(EOS)
    return out[:length]


# ------------------------------------------------------------------ training ----------------

def mtp_logits(mtp, lm, ids, hidden):
    """MTP over a batch: rows p pair ids[:, p+1] with hidden[:, p]; logits [B, T-1, V]."""
    model = lm.model
    e = mtp.pre_fc_norm_embedding(model.embed_tokens(ids[:, 1:]))
    h = mtp.pre_fc_norm_hidden(hidden[:, :-1])
    x = mtp.fc(torch.cat([e, h], dim=-1))
    b, t, _ = x.shape
    positions = torch.arange(t, device=ids.device)[None, None, :].expand(3, b, t)
    cos_sin = model.rotary_emb(x, positions)
    mask = torch.full((t, t), float("-inf"), device=ids.device).triu(1)[None, None]
    x = mtp.layer(x, position_embeddings=cos_sin, attention_mask=mask)
    return lm.lm_head(mtp.norm(x))


def evaluate(lm, mtp, device, r, kind):
    """Agreement of the MTP argmax with the target's next argmax (greedy acceptance at draft
    position 1) on fresh text of one kind."""
    text = "".join((code_snippet if kind == "code" else prose_snippet)(r) for _ in range(40))
    ids = torch.tensor(list(text.encode())[:512], device=device)[None]
    with torch.no_grad():
        out = lm.model(ids)
        hidden = out.last_hidden_state
        target = lm.lm_head(hidden).argmax(-1)  # target's prediction of t[p+1] at row p
        draft = mtp_logits(mtp, lm, ids, hidden).argmax(-1)  # MTP's prediction of t[p+2] at row p
    return (draft[:, :-1] == target[:, 1:-1]).float().mean().item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--seconds", type=float, default=240.0)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--batch", type=int, default=48)
    ap.add_argument("--length", type=int, default=256)
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    r = random.Random(args.seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = Qwen3_5MoeTextConfig(**CONFIG)
    config._attn_implementation = "eager"
    lm = Qwen3_5MoeForCausalLM(config).to(device)
    gen = torch.Generator().manual_seed(args.seed)
    mtp = Mtp(config, gen).to(device)
    # start from small random weights: the fixture's scales are too large to train from
    with torch.no_grad():
        for module in (lm, mtp):
            for name, p in module.named_parameters():
                if "norm" in name and p.dim() == 1:
                    p.zero_() if not name.endswith("linear_attn.norm.weight") else p.fill_(1.0)
                elif name.endswith("A_log"):
                    p.copy_(torch.log(torch.empty_like(p).uniform_(1, 16)))
                elif name.endswith("dt_bias"):
                    p.fill_(0.5)
                else:
                    p.normal_(0.0, 0.02)
    params = list(lm.parameters()) + list(mtp.parameters())
    opt = torch.optim.AdamW(params, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.01)
    os.makedirs(args.out, exist_ok=True)
    log = open(os.path.join(args.out, "train_log.txt"), "w")

    def say(msg):
        print(msg, flush=True)
        log.write(msg + "\n")

    say(f"device {device}, {sum(p.numel() for p in params)} parameters "
        f"({sum(p.numel() for p in mtp.parameters())} in the MTP head)")
    start = time.time()
    step = 0
    while time.time() - start < args.seconds:
        frac = min(1.0, (time.time() - start) / args.seconds)
        lr = 3e-3 * min(1.0, step / 100) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        for g in opt.param_groups:
            g["lr"] = lr
        batch = torch.tensor([stream(r, args.length) for _ in range(args.batch)], device=device)
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16, enabled=device == "cuda"):
            out = lm.model(batch)
            hidden = out.last_hidden_state
            logits = lm.lm_head(hidden)
            main_loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB).float(),
                                        batch[:, 1:].reshape(-1))
            draft = mtp_logits(mtp, lm, batch, hidden)
            mtp_loss = F.cross_entropy(draft[:, :-1].reshape(-1, VOCAB).float(),
                                       batch[:, 2:].reshape(-1))
            loss = main_loss + mtp_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % 100 == 0:
            say(f"step {step:5d}  {time.time() - start:6.1f} s  lr {lr:.2e}  "
                f"loss {main_loss.item():.3f}  mtp loss {mtp_loss.item():.3f}")
        step += 1
    lm.eval()
    mtp.eval()
    er = random.Random(12345)
    say(f"trained {step} steps in {time.time() - start:.0f} s; MTP top-1 agreement with the "
        f"target: code {evaluate(lm, mtp, device, er, 'code'):.3f}, "
        f"prose {evaluate(lm, mtp, device, er, 'prose'):.3f}")

    # write: BF16 everywhere; round the trained weights to BF16 first so the reload is exact
    lm = lm.float().cpu()
    mtp = mtp.float().cpu()
    with torch.no_grad():
        for p in list(lm.parameters()) + list(mtp.parameters()):
            p.copy_(p.to(torch.bfloat16).to(torch.float32))
    tensors = {k: v.to(torch.bfloat16).contiguous() for k, v in lm.state_dict().items()}
    tensors.update({k: v.to(torch.bfloat16).contiguous() for k, v in mtp.tensors().items()})
    save_file(tensors, os.path.join(args.out, "model.safetensors"))
    cfg = dict(CONFIG)
    cfg.pop("num_hidden_layers")
    cfg.update(model_type="qwen3_5_moe_text", architectures=["Qwen3_5MoeForCausalLM"],
               num_hidden_layers=4, full_attention_interval=4, mtp_num_hidden_layers=1,
               torch_dtype="bfloat16", hidden_act="silu", attn_output_gate=True,
               eos_token_id=EOS)
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    with open(os.path.join(args.out, "fp4spec_tokenizer.json"), "w") as f:
        json.dump({"type": "bytes", "special": {"<|endoftext|>": EOS}, "eos": EOS}, f)
    reloaded = Qwen3_5MoeForCausalLM.from_pretrained(args.out, torch_dtype=torch.float32).eval()
    probe = torch.tensor([list(b"def count_items(items):\n")])
    with torch.no_grad():
        diff = (reloaded(probe).logits - lm(probe).logits).abs().max().item()
    say(f"reloaded with transformers: max logit difference {diff:.2e}")
    log.close()


if __name__ == "__main__":
    main()
