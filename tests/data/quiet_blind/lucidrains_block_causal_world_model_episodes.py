# Follows lucidrains/improving-transformers-world-model-for-rl improving_transformers_world_model/world_model.py
# nonflex_block_causal_mask (tril over frames repeated to block_size tokens): a token sees its whole frame and earlier frames;
# here several episodes are packed in one row and episode boundaries also cut attention. Checked per episode, frame by frame with a KV cache.
import torch, torch.nn.functional as F
torch.manual_seed(4)
D, H, TOK = 32, 4, 3
ep_frames = [3, 2, 4]                       # frames per packed episode
frame_id = torch.cat([torch.arange(n).repeat_interleave(TOK) for n in ep_frames])
episode = torch.cat([torch.full((n * TOK,), e) for e, n in enumerate(ep_frames)])
S = frame_id.numel()
# block-causal and same-episode: True = may attend
allowed = (episode[:, None] == episode[None, :]) & (frame_id[None, :] <= frame_id[:, None])
bias = torch.zeros(S, S, dtype=torch.float64).masked_fill(~allowed, float('-inf'))  # additive float mask
Wq, Wk, Wv = (torch.randn(D, D, dtype=torch.float64) / D**0.5 for _ in range(3))
tpos = torch.randn(8, D, dtype=torch.float64)
x = torch.randn(S, D, dtype=torch.float64) + tpos[frame_id]
def heads(t): return t.view(-1, H, D // H).transpose(0, 1)
out = F.scaled_dot_product_attention(heads(x @ Wq), heads(x @ Wk), heads(x @ Wv), attn_mask=bias).transpose(0, 1).reshape(S, D)
ref = []
for e in range(len(ep_frames)):
    xe = x[episode == e]; Kc = torch.empty(H, 0, D // H, dtype=torch.float64); Vc = Kc.clone()
    for f in range(ep_frames[e]):                 # frame-by-frame with a KV cache, no mask inside the frame
        xf = xe[f * TOK:(f + 1) * TOK]
        Kc = torch.cat([Kc, heads(xf @ Wk)], 1); Vc = torch.cat([Vc, heads(xf @ Wv)], 1)
        ref.append(F.scaled_dot_product_attention(heads(xf @ Wq), Kc, Vc).transpose(0, 1).reshape(TOK, D))
diff = (out - torch.cat(ref)).abs().max().item()
print("packed block-causal episodes vs per-episode cached frames max diff", diff)
assert diff < 1e-12
