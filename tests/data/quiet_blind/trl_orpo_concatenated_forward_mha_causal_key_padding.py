"""TRL ORPO: chosen and rejected concatenated into one right-padded batch, one forward, odds-ratio loss.

Follows huggingface/trl, trl/trainer/orpo_trainer.py (ORPOTrainer.concatenated_inputs: chosen and rejected
padded with pad_to_length to the longest of both and stacked; concatenated_forward: one model call with
concatenated_attention_mask, get_batch_logps over labels != label_pad_token_id (-100) with average_log_prob=True,
then odds_ratio_loss: log_odds = (chosen_logps - rejected_logps) - (log1p(-exp(chosen)) - log1p(-exp(rejected)))).
Commit: not pinned. The policy is a tiny plain-torch decoder using nn.MultiheadAttention with a causal attn_mask
and key_padding_mask. Reference: each sequence through the model alone, unpadded.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
D, V, PAD, IGNORE = 32, 40, 0, -100
BETA = 0.1


class Policy(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.pos = nn.Embedding(V, D), nn.Embedding(32, D)
        self.mha = nn.MultiheadAttention(D, 4, batch_first=True)
        self.ln = nn.LayerNorm(D)
        self.head = nn.Linear(D, V)

    def forward(self, ids, attention_mask):
        T = ids.shape[1]
        x = self.emb(ids) + self.pos(torch.arange(T))
        causal = torch.ones(T, T, dtype=torch.bool).triu(1)  # True = not allowed
        # right padding: query t always keeps key 0..t, which are real for real rows
        y, _ = self.mha(x, x, x, attn_mask=causal, key_padding_mask=~attention_mask.bool(), need_weights=False)
        return self.head(self.ln(x + y))


def batch_logps(logits, labels):
    """get_batch_logps with average_log_prob=True."""
    labels = labels[:, 1:].clone()
    logits = logits[:, :-1]
    loss_mask = labels != IGNORE
    labels[~loss_mask] = 0
    per_token = torch.gather(logits.log_softmax(-1), 2, labels.unsqueeze(2)).squeeze(2)
    return (per_token * loss_mask).sum(-1) / loss_mask.sum(-1)


def build(prompt, completion):
    ids = prompt + completion
    labels = [IGNORE] * len(prompt) + completion  # only the completion is scored
    return ids, labels


policy = Policy().eval().double()
examples = [
    ([5, 6, 7], [10, 11, 2], [12, 2]),
    ([8, 9], [13, 14, 15, 16, 2], [17, 18, 2]),
]
chosen = [build(p, c) for p, c, _ in examples]
rejected = [build(p, r) for p, _, r in examples]
rows = chosen + rejected  # concatenated: chosen first, then rejected
L = max(len(ids) for ids, _ in rows)
input_ids = torch.tensor([ids + [PAD] * (L - len(ids)) for ids, _ in rows])
labels = torch.tensor([lab + [IGNORE] * (L - len(lab)) for _, lab in rows])
attention_mask = torch.tensor([[1] * len(ids) + [0] * (L - len(ids)) for ids, _ in rows])

with torch.no_grad():
    logps = batch_logps(policy(input_ids, attention_mask), labels)
    n = len(examples)
    chosen_logps, rejected_logps = logps[:n], logps[n:]
    log_odds = (chosen_logps - rejected_logps) - (
        torch.log1p(-torch.exp(chosen_logps)) - torch.log1p(-torch.exp(rejected_logps)))
    ratio = F.logsigmoid(log_odds)
    losses = -BETA * ratio

    ref = []
    for ids, lab in rows:
        t = torch.tensor([ids])
        ref.append(batch_logps(policy(t, torch.ones_like(t)), torch.tensor([lab]))[0])
    ref = torch.stack(ref)
diff = (logps - ref).abs().max().item()
print("logps:", [round(v, 6) for v in logps.tolist()])
print("orpo losses:", [round(v, 6) for v in losses.tolist()])
print("max |concatenated padded logps - one sequence alone| =", diff)
assert diff < 1e-10, diff
