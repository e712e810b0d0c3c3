"""BERT masked-LM over a right-padded batch: bidirectional encoder, padding keys excluded.

Follows huggingface/transformers src/transformers/data/data_collator.py
(DataCollatorForLanguageModeling.torch_mask_tokens: special tokens and padding never chosen,
80% [MASK] / 10% random / 10% kept, labels -100 elsewhere) and the model
src/transformers/models/bert/modeling_bert.py (BertForMaskedLM, built from BertConfig, its
attention_mask turned into an extended additive / SDPA mask over keys: every real token sees every
real token both ways, no token sees padding). Reference: each sentence alone, no padding, no mask;
logits at real positions and the summed MLM loss must agree.
"""
import torch
from transformers import BertConfig, BertForMaskedLM

torch.manual_seed(0)
cfg = BertConfig(vocab_size=60, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                 intermediate_size=64, max_position_embeddings=32, attn_implementation="sdpa")
model = BertForMaskedLM(cfg).double().eval()
PAD, CLS, SEP, MASK = 0, 1, 2, 3
lengths = [9, 5, 7]
sents = [torch.cat([torch.tensor([CLS]), torch.randint(5, 60, (n - 2,)), torch.tensor([SEP])]) for n in lengths]

B, L = len(sents), max(lengths)
input_ids = torch.full((B, L), PAD)
attention_mask = torch.zeros(B, L, dtype=torch.long)
for i, s in enumerate(sents):
    input_ids[i, :len(s)] = s
    attention_mask[i, :len(s)] = 1

# DataCollatorForLanguageModeling.torch_mask_tokens, mlm_probability 0.3
labels = input_ids.clone()
prob = torch.full(labels.shape, 0.3)
special = (input_ids == PAD) | (input_ids == CLS) | (input_ids == SEP)
prob.masked_fill_(special, 0.0)
masked = torch.bernoulli(prob).bool()
labels[~masked] = -100
replaced = torch.bernoulli(torch.full(labels.shape, 0.8)).bool() & masked
input_ids[replaced] = MASK
rand = torch.bernoulli(torch.full(labels.shape, 0.5)).bool() & masked & ~replaced
input_ids[rand] = torch.randint(5, 60, labels.shape)[rand]

with torch.no_grad():
    out = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
    loss_sum_batched = torch.nn.functional.cross_entropy(out.logits.view(-1, 60), labels.view(-1),
                                                         ignore_index=-100, reduction="sum")
    maxdiff, loss_sum_ref = 0.0, 0.0
    for i, n in enumerate(lengths):
        ref = model(input_ids=input_ids[i:i + 1, :n])
        maxdiff = max(maxdiff, (out.logits[i, :n] - ref.logits[0]).abs().max().item())
        loss_sum_ref += torch.nn.functional.cross_entropy(ref.logits[0], labels[i, :n], ignore_index=-100,
                                                          reduction="sum").item()
print("masked positions:", int(masked.sum()), " loss", out.loss.item())
print("max |batched logits - per-row unpadded| =", maxdiff, " loss-sum diff", abs(loss_sum_batched.item() - loss_sum_ref))
assert maxdiff < 1e-10 and abs(loss_sum_batched.item() - loss_sum_ref) < 1e-9
