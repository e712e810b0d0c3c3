# 0xallam/Direct-Preference-Optimization#2 (fixes #1), src/train.py collate_fn.
# Bug: the attention mask is ones over the prompt and ZEROS over every response token, so response
# tokens cannot attend to each other (and the tokenizer's real padding mask is ignored).
import sys
import torch
import torch.nn.functional as F
from transformers import PhiConfig, PhiForCausalLM

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

PAD = 0  # tokenizer.pad_token = tokenizer.eos_token


def encode(seqs):
    """tokenizer.batch_encode_plus(..., padding=True) with right padding."""
    L = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), L), PAD, dtype=torch.long)
    att = torch.zeros((len(seqs), L), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        att[i, : len(s)] = 1
    return {"input_ids": ids, "attention_mask": att}


def get_log_prob(logits, labels):
    log_probs = F.log_softmax(logits, dim=-1)
    return torch.gather(log_probs, -1, labels.unsqueeze(-1)).squeeze(-1).mean(-1)


def calculate_DPO_loss(mp, md, rp, rd, beta=0.5):
    p = mp - rp
    d = md - rd
    return -F.logsigmoid(beta * (p - d)).mean(dim=-1)


def collate_fn(batch):
    prompts = [item["prompt"] for item in batch]
    chosen = [item["chosen"] for item in batch]
    rejected = [item["rejected"] for item in batch]
    p = encode(prompts)
    c = encode(chosen)
    r = encode(rejected)
    prompt_ids, prefered_ids, disprefered_ids = p["input_ids"], c["input_ids"], r["input_ids"]
    prompt_prefered_ids = torch.cat([prompt_ids, prefered_ids], dim=-1)
    prompt_disprefered_ids = torch.cat([prompt_ids, disprefered_ids], dim=-1)
    if FIXED:
        prompt_prefered_mask = torch.cat([p["attention_mask"], c["attention_mask"]], dim=-1)
        prompt_disprefered_mask = torch.cat([p["attention_mask"], r["attention_mask"]], dim=-1)
    else:
        prompt_prefered_mask = torch.cat([torch.ones_like(prompt_ids), torch.zeros_like(prefered_ids)], dim=-1)
        prompt_disprefered_mask = torch.cat([torch.ones_like(prompt_ids), torch.zeros_like(disprefered_ids)], dim=-1)
    return {"prompt_prefered_ids": prompt_prefered_ids, "prompt_disprefered_ids": prompt_disprefered_ids,
            "prompt_prefered_mask": prompt_prefered_mask, "prompt_disprefered_mask": prompt_disprefered_mask,
            "prompt_len": prompt_ids.shape[1], "chosen_lens": c["attention_mask"].sum(-1)}


cfg = PhiConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, max_position_embeddings=64, pad_token_id=PAD)
cfg._attn_implementation = "eager"
model = PhiForCausalLM(cfg).eval()
ref_model = PhiForCausalLM(cfg).eval()

g = torch.Generator().manual_seed(1)
rnd = lambda n: torch.randint(1, 64, (n,), generator=g).tolist()
# equal-length prompts (no prompt padding), responses of different lengths (right padding)
batch = [{"prompt": rnd(6), "chosen": rnd(9), "rejected": rnd(5)},
         {"prompt": rnd(6), "chosen": rnd(4), "rejected": rnd(8)},
         {"prompt": rnd(6), "chosen": rnd(7), "rejected": rnd(7)}]
b = collate_fn(batch)

with torch.no_grad():
    logits = model(b["prompt_prefered_ids"], attention_mask=b["prompt_prefered_mask"]).logits
    mp = get_log_prob(model(b["prompt_prefered_ids"], attention_mask=b["prompt_prefered_mask"]).logits, b["prompt_prefered_ids"])
    md = get_log_prob(model(b["prompt_disprefered_ids"], attention_mask=b["prompt_disprefered_mask"]).logits, b["prompt_disprefered_ids"])
    rp = get_log_prob(ref_model(b["prompt_prefered_ids"], attention_mask=b["prompt_prefered_mask"]).logits, b["prompt_prefered_ids"])
    rd = get_log_prob(ref_model(b["prompt_disprefered_ids"], attention_mask=b["prompt_disprefered_mask"]).logits, b["prompt_disprefered_ids"])
    loss = calculate_DPO_loss(mp, md, rp, rd)

    # reference: each prompt+chosen alone, unpadded, plain causal LM forward
    worst = 0.0
    P = b["prompt_len"]
    for i, item in enumerate(batch):
        ids = torch.tensor([item["prompt"] + item["chosen"]])
        ref_logits = model(ids).logits[0]
        n = P + len(item["chosen"])
        worst = max(worst, (logits[i, :n] - ref_logits[:n]).abs().max().item())

print(f"DPO loss: {loss.item():.6f}")
print(f"max |batched chosen logits - each sequence alone|: {worst:.6e}")
