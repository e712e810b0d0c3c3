"""Decision Transformer (transformers, from DecisionTransformerConfig) on left-padded trajectory windows.

Follows the Hugging Face Decision Transformer training recipe (huggingface/blog
"train-decision-transformers", DecisionTransformerGymDataCollator.__call__: each sampled window of
states / actions / returns-to-go / timesteps is padded at the START with zeros, mask = zeros then
ones) and src/transformers/models/decision_transformer/modeling_decision_transformer.py
(DecisionTransformerModel.forward: the (R, s, a) triplets are interleaved, attention_mask is stacked
three times and permuted the same way, then fed to the causal GPT-2 encoder, action predicted from
the state token). Reference: each trajectory window alone, unpadded, attention_mask all ones; the
action predictions on real steps must agree.
"""
import torch
from transformers import DecisionTransformerConfig, DecisionTransformerModel

torch.manual_seed(0)
S, A, K = 5, 3, 6
cfg = DecisionTransformerConfig(state_dim=S, act_dim=A, hidden_size=32, n_layer=2, n_head=2, n_inner=64,
                                max_ep_len=50, n_positions=64, bos_token_id=None, eos_token_id=None, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
model = DecisionTransformerModel(cfg).double().eval()

lengths = [6, 2, 4]  # real steps in each sampled window (episodes shorter than K at their start)
starts = [10, 0, 3]
trajs = []
for n, st in zip(lengths, starts):
    trajs.append(dict(s=torch.randn(n, S, dtype=torch.float64), a=torch.tanh(torch.randn(n, A, dtype=torch.float64)),
                      rtg=torch.randn(n, 1, dtype=torch.float64), t=torch.arange(st, st + n)))

B = len(trajs)
s = torch.zeros(B, K, S, dtype=torch.float64); a = torch.ones(B, K, A, dtype=torch.float64) * -10.0
rtg = torch.zeros(B, K, 1, dtype=torch.float64); t = torch.zeros(B, K, dtype=torch.long)
mask = torch.zeros(B, K, dtype=torch.long)
for i, tr in enumerate(trajs):  # pad at the start, as DecisionTransformerGymDataCollator
    n = tr["s"].shape[0]
    s[i, K - n:] = tr["s"]; a[i, K - n:] = tr["a"]; rtg[i, K - n:] = tr["rtg"]; t[i, K - n:] = tr["t"]
    mask[i, K - n:] = 1

with torch.no_grad():
    out = model(states=s, actions=a, rewards=None, returns_to_go=rtg, timesteps=t, attention_mask=mask)
    maxdiff = 0.0
    for i, tr in enumerate(trajs):
        n = tr["s"].shape[0]
        ref = model(states=tr["s"][None], actions=tr["a"][None], rewards=None, returns_to_go=tr["rtg"][None],
                    timesteps=tr["t"][None], attention_mask=torch.ones(1, n, dtype=torch.long))
        maxdiff = max(maxdiff, (out.action_preds[i, K - n:] - ref.action_preds[0]).abs().max().item(),
                      (out.state_preds[i, K - n:] - ref.state_preds[0]).abs().max().item())
print("max |left-padded batch - per-trajectory unpadded| (action/state preds) =", maxdiff)
assert maxdiff < 1e-10
