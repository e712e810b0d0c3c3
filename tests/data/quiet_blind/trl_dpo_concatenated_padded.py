# TRL trl/trainer/dpo_trainer.py concatenated_inputs/concatenated_forward: chosen and rejected right-padded to one length,
# stacked along batch, attention_mask 1 = real token; logps summed with loss_mask (labels != -100). Checked vs each alone.
import torch
from transformers import GPT2Config, GPT2LMHeadModel
torch.manual_seed(0)
cfg = GPT2Config(vocab_size=50, n_positions=32, bos_token_id=2, eos_token_id=2, n_embd=32, n_layer=2, n_head=4, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
model = GPT2LMHeadModel(cfg).double().eval()
PAD = 0
prompt = [[5, 6, 7], [8, 9]]
chosen = [[11, 12, 13, 14], [15, 16]]
rejected = [[21, 22], [23, 24, 25, 26, 27]]
def seqs(resp): return [p + r for p, r in zip(prompt, resp)], [[-100] * len(p) + r for p, r in zip(prompt, resp)]
cid, clab = seqs(chosen); rid, rlab = seqs(rejected)
all_ids, all_lab = cid + rid, clab + rlab
L = max(map(len, all_ids))
ids = torch.tensor([s + [PAD] * (L - len(s)) for s in all_ids])
lab = torch.tensor([s + [-100] * (L - len(s)) for s in all_lab])
am = torch.tensor([[1] * len(s) + [0] * (L - len(s)) for s in all_ids])
def logps(logits, labels):
    labels = labels[:, 1:].clone(); logits = logits[:, :-1]
    loss_mask = labels != -100; labels[~loss_mask] = 0
    per_tok = torch.gather(logits.log_softmax(-1), 2, labels.unsqueeze(2)).squeeze(2)
    return (per_tok * loss_mask).sum(-1)
with torch.no_grad():
    batched = logps(model(ids, attention_mask=am).logits, lab)
    alone = torch.stack([logps(model(torch.tensor([s])).logits, torch.tensor([l]))[0] for s, l in zip(all_ids, all_lab)])
chosen_lp, rejected_lp = batched[:2], batched[2:]
d = (batched - alone).abs().max().item()
print("chosen", chosen_lp.tolist(), "rejected", rejected_lp.tolist())
print("max diff concatenated padded vs alone:", d); assert d < 1e-10
