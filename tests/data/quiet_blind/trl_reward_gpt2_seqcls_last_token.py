# TRL trl/trainer/reward_trainer.py compute_loss (rewards_chosen/rejected, -logsigmoid(diff)) over GPT2ForSequenceClassification,
# which pools at the last non-pad token; batch is right-padded, attention_mask 0 on pads. Checked vs each sequence alone.
import torch
from transformers import GPT2Config, GPT2ForSequenceClassification
torch.manual_seed(0)
cfg = GPT2Config(vocab_size=40, n_positions=32, bos_token_id=2, eos_token_id=2, n_embd=32, n_layer=2, n_head=4, num_labels=1, pad_token_id=1,
                 attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
model = GPT2ForSequenceClassification(cfg).double().eval()
chosen = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]; rejected = [[5, 6, 7, 20], [11, 12, 13, 21, 22, 23, 24]]
def batch(seqs):
    L = max(map(len, seqs))
    return (torch.tensor([s + [1] * (L - len(s)) for s in seqs]), torch.tensor([[1] * len(s) + [0] * (L - len(s)) for s in seqs]))
with torch.no_grad():
    ic, ac = batch(chosen); ir, ar = batch(rejected)
    rc = model(input_ids=ic, attention_mask=ac).logits[:, 0]
    rr = model(input_ids=ir, attention_mask=ar).logits[:, 0]
    loss = -torch.nn.functional.logsigmoid(rc - rr).mean()
    rc1 = torch.stack([model(input_ids=torch.tensor([s])).logits[0, 0] for s in chosen])
    rr1 = torch.stack([model(input_ids=torch.tensor([s])).logits[0, 0] for s in rejected])
    loss1 = -torch.nn.functional.logsigmoid(rc1 - rr1).mean()
d = max((rc - rc1).abs().max().item(), (rr - rr1).abs().max().item(), abs(loss - loss1).item())
print("loss", loss.item()); print("max diff padded batch vs alone:", d); assert d < 1e-10
