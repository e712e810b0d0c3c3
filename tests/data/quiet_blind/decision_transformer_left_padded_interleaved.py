# Follows kzl/decision-transformer gym/decision_transformer/models/decision_transformer.py (forward, get_action):
# the per-timestep attention_mask (1 = real step, left-padded in get_action) is stacked 3x so each
# return/state/action token inherits it; a causal mask is added on top of the interleaved sequence.
import torch
torch.manual_seed(0); torch.set_default_dtype(torch.float64)
B, T, S, A, H = 2, 6, 5, 3, 32
emb_t = torch.nn.Embedding(16, H); emb_r = torch.nn.Linear(1, H); emb_s = torch.nn.Linear(S, H); emb_a = torch.nn.Linear(A, H)
ln = torch.nn.LayerNorm(H); qkv = torch.nn.Linear(H, 3 * H); head = torch.nn.Linear(H, A)

def attn(x, keep):  # keep: (B, L) 1 = real token, combined with causal
    L = x.shape[1]
    q, k, v = qkv(x).chunk(3, -1)
    s = q @ k.transpose(1, 2) / H ** 0.5
    causal = torch.tril(torch.ones(L, L, dtype=torch.bool))
    allowed = causal[None] & keep[:, None, :].bool()
    s = s + (1.0 - allowed.to(s.dtype)) * -10000.0   # HF GPT2 additive convention
    return s.softmax(-1) @ v

def forward(states, actions, rtg, timesteps, attention_mask):
    b, t = states.shape[:2]
    te = emb_t(timesteps)
    stacked = torch.stack((emb_r(rtg) + te, emb_s(states) + te, emb_a(actions) + te), 1).permute(0, 2, 1, 3).reshape(b, 3 * t, H)
    stacked = ln(stacked)
    stacked_mask = torch.stack((attention_mask,) * 3, 1).permute(0, 2, 1).reshape(b, 3 * t)
    x = attn(stacked, stacked_mask).reshape(b, t, 3, H).permute(0, 2, 1, 3)
    return head(x[:, 1])  # predict action from state token

lens = [6, 3]
st = torch.randn(B, T, S); ac = torch.randn(B, T, A); rt = torch.randn(B, T, 1)
ts = torch.randint(0, 16, (B, T))
mask = torch.zeros(B, T)
for i, n in enumerate(lens):  # left padding as in get_action: zeros then real steps
    mask[i, T - n:] = 1
    st[i, :T - n] = 0; ac[i, :T - n] = 0; rt[i, :T - n] = 0; ts[i, :T - n] = 0
out = forward(st, ac, rt, ts, mask)
diff = 0.0
for i, n in enumerate(lens):
    ref = forward(st[i:i+1, T-n:], ac[i:i+1, T-n:], rt[i:i+1, T-n:], ts[i:i+1, T-n:], torch.ones(1, n))
    diff = max(diff, (out[i, T-n:] - ref[0]).abs().max().item())
print("max diff", diff)
assert diff < 1e-9
