"""TRL KTO: unpaired desirable/undesirable completions plus a KL batch of mismatched (prompt, completion) pairs.

Follows huggingface/trl, trl/trainer/kto_trainer.py (_get_kl_dataset: completions rotated by one so each prompt
gets another example's completion; forward: the KL batch run under the same model with its own
KL_completion_attention_mask, the main batch with completion_attention_mask; get_batch_logps sums log-probs over
labels != -100 (prompt tokens labelled -100); kto_loss with the KL term kl = (policy_KL_logps -
reference_KL_logps).mean().clamp(min=0)). Commit: not pinned. Model: transformers LlamaForCausalLM built from a
tiny LlamaConfig (no download), right padding. Reference: each sequence alone, unpadded.
"""
import torch
from transformers import LlamaConfig, LlamaForCausalLM

torch.manual_seed(0)
PAD, IGNORE, BETA = 0, -100, 0.1
cfg = LlamaConfig(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, pad_token_id=PAD)
policy = LlamaForCausalLM(cfg).eval().double()
reference = LlamaForCausalLM(cfg).eval().double()  # a different init stands in for the frozen ref model

data = [  # (prompt, completion, label: True = desirable)
    ([5, 6, 7], [20, 21, 22, 2], True),
    ([8, 9], [23, 2], False),
    ([10, 11, 12, 13], [24, 25, 26, 27, 28, 2], True),
]


def collate(rows):
    seqs = [(p + c, [IGNORE] * len(p) + c) for p, c in rows]
    L = max(len(s) for s, _ in seqs)
    ids = torch.tensor([s + [PAD] * (L - len(s)) for s, _ in seqs])
    labels = torch.tensor([lab + [IGNORE] * (L - len(lab)) for _, lab in seqs])
    mask = torch.tensor([[1] * len(s) + [0] * (L - len(s)) for s, _ in seqs])
    return ids, labels, mask


def batch_logps(logits, labels):
    labels = labels[:, 1:].clone()
    logits = logits[:, :-1]
    loss_mask = labels != IGNORE
    labels[~loss_mask] = 0
    per_token = torch.gather(logits.log_softmax(-1), 2, labels.unsqueeze(2)).squeeze(2)
    return (per_token * loss_mask).sum(-1)


def logps(model, rows):
    ids, labels, mask = collate(rows)
    return batch_logps(model(input_ids=ids, attention_mask=mask).logits, labels)


def logps_one_by_one(model, rows):
    return torch.cat([batch_logps(model(input_ids=torch.tensor([p + c])).logits,
                                  torch.tensor([[IGNORE] * len(p) + c])) for p, c in rows])


main_rows = [(p, c) for p, c, _ in data]
completions = [c for _, c, _ in data]
kl_rows = [(p, completions[(i + 1) % len(data)]) for i, (p, _, _) in enumerate(data)]  # mismatched pairs
labels = torch.tensor([lab for _, _, lab in data])

with torch.no_grad():
    pol, ref = logps(policy, main_rows), logps(reference, main_rows)
    pol_kl, ref_kl = logps(policy, kl_rows), logps(reference, kl_rows)
    kl = (pol_kl - ref_kl).mean().clamp(min=0)
    chosen = torch.sigmoid(BETA * ((pol - ref)[labels] - kl))
    rejected = torch.sigmoid(BETA * (kl - (pol - ref)[~labels]))
    loss = torch.cat([1 - chosen, 1 - rejected]).mean()

    worst = 0.0
    for model, rows, got in [(policy, main_rows, pol), (reference, main_rows, ref),
                             (policy, kl_rows, pol_kl), (reference, kl_rows, ref_kl)]:
        worst = max(worst, (got - logps_one_by_one(model, rows)).abs().max().item())
print("kl = %.6f  loss = %.6f" % (kl.item(), loss.item()))
print("max |right-padded batch logps - one sequence alone| =", worst)
assert worst < 1e-9, worst
