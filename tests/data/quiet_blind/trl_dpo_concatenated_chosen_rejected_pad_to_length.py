"""DPO concatenated forward: chosen and rejected stacked on the batch axis, padded to one length.

Follows TRL's DPOTrainer (trl/trainer/dpo_trainer.py: concatenated_inputs pads chosen and rejected
input_ids with pad_to_length(..., pad_value=padding_value) and attention masks with 0, then cats them
on dim 0; concatenated_forward runs the policy once; get_batch_logps masks labels == -100). The
prompt is left-padded by the collator, completions are right-padded, as DataCollatorForPreference does.

Mask meant: each of the 2B rows is causal over its own real tokens (prompt + its completion); left pad
of the prompt and right pad after the completion are hidden keys. Padded query rows still produce
output but are dropped by the loss mask.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)

config = {"vocab_size": 50, "d_model": 16, "n_heads": 2, "pad_token_id": 0, "label_pad_token_id": -100, "beta": 0.1}


def pad_to_length(tensor, length, pad_value, dim=-1):
    if tensor.size(dim) >= length:
        return tensor
    pad_size = list(tensor.shape)
    pad_size[dim] = length - tensor.size(dim)
    return torch.cat([tensor, pad_value * torch.ones(*pad_size, dtype=tensor.dtype)], dim=dim)


class TinyCausalLM(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.h, self.d = cfg["n_heads"], cfg["d_model"]
        self.embed = nn.Embedding(cfg["vocab_size"], self.d)
        self.qkv = nn.Linear(self.d, 3 * self.d)
        self.lm_head = nn.Linear(self.d, cfg["vocab_size"])

    def forward(self, input_ids, attention_mask):
        b, t = input_ids.shape
        # positions count real tokens only, so left padding does not shift the prompt
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        x = self.embed(input_ids) + 0.01 * position_ids.unsqueeze(-1).float()
        q, k, v = self.qkv(x).view(b, t, 3, self.h, self.d // self.h).permute(2, 0, 3, 1, 4)
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        allowed = causal[None, None] & attention_mask.bool()[:, None, None, :]
        # a left-pad query row sees no real key; let it see itself so softmax stays finite (it is unused)
        allowed = allowed | torch.eye(t, dtype=torch.bool)[None, None]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        return self.lm_head(x + o.transpose(1, 2).reshape(b, t, self.d))


def concatenated_inputs(batch, padding_value):
    max_length = max(batch["chosen_input_ids"].shape[1], batch["rejected_input_ids"].shape[1])
    out = {}
    for key, pad in (("input_ids", padding_value), ("attention_mask", 0), ("labels", config["label_pad_token_id"])):
        out["concatenated_" + key] = torch.cat(
            [pad_to_length(batch["chosen_" + key], max_length, pad), pad_to_length(batch["rejected_" + key], max_length, pad)]
        )
    return out


def build_batch(examples):
    """Left-pad prompts, right-pad each side's completion, labels -100 on prompt and pad."""
    pmax = max(len(e["prompt"]) for e in examples)
    batch = {}
    for side in ("chosen", "rejected"):
        cmax = max(len(e[side]) for e in examples)
        ids, att, lab = [], [], []
        for e in examples:
            p, c = e["prompt"], e[side]
            lp, rp = pmax - len(p), cmax - len(c)
            ids.append([0] * lp + p + c + [0] * rp)
            att.append([0] * lp + [1] * (len(p) + len(c)) + [0] * rp)
            lab.append([-100] * (lp + len(p)) + c + [-100] * rp)
        batch[side + "_input_ids"] = torch.tensor(ids)
        batch[side + "_attention_mask"] = torch.tensor(att)
        batch[side + "_labels"] = torch.tensor(lab)
    return batch


def get_batch_logps(logits, labels):
    labels = labels[:, 1:].clone()
    logits = logits[:, :-1]
    loss_mask = labels != config["label_pad_token_id"]
    labels[~loss_mask] = 0
    per_token = torch.gather(logits.log_softmax(-1), 2, labels.unsqueeze(2)).squeeze(2)
    return (per_token * loss_mask).sum(-1)


def main():
    examples = [
        {"prompt": [5, 6, 7], "chosen": [8, 9, 10, 11], "rejected": [12, 13]},
        {"prompt": [14, 15, 16, 17, 18], "chosen": [19, 20], "rejected": [21, 22, 23, 24, 25, 26]},
    ]
    batch = build_batch(examples)
    policy, reference = TinyCausalLM(config), TinyCausalLM(config)
    cat = concatenated_inputs(batch, config["pad_token_id"])
    n = batch["chosen_input_ids"].shape[0]

    logps = get_batch_logps(policy(cat["concatenated_input_ids"], cat["concatenated_attention_mask"]), cat["concatenated_labels"])
    with torch.no_grad():
        ref = get_batch_logps(reference(cat["concatenated_input_ids"], cat["concatenated_attention_mask"]), cat["concatenated_labels"])
    logits = config["beta"] * ((logps[:n] - ref[:n]) - (logps[n:] - ref[n:]))
    loss = -F.logsigmoid(logits).mean()

    # each sequence alone, unpadded, gives the same log-probs
    for i, e in enumerate(examples):
        for j, side in enumerate(("chosen", "rejected")):
            ids = torch.tensor([e["prompt"] + e[side]])
            lab = torch.tensor([[-100] * len(e["prompt"]) + e[side]])
            alone = get_batch_logps(policy(ids, torch.ones_like(ids)), lab)
            assert torch.allclose(alone, logps[j * n + i], atol=1e-4), (side, i)
    print("dpo loss %.4f" % loss.item())


if __name__ == "__main__":
    main()
