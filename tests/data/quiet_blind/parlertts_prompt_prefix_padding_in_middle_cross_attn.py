# Follows Parler-TTS: parler_tts/modeling_parler_tts.py ParlerTTSForConditionalGeneration.forward
# (inputs_embeds = cat([prompt_hidden_states, inputs_embeds]); attention_mask = cat([prompt_attention_mask, attention_mask]))
# The right-padded transcript prompt puts pad keys in the MIDDLE of a causal sequence; cross-attn masks padded description tokens.
import torch
torch.manual_seed(4)
dt = torch.float64
D, H = 32, 4
P_len = torch.tensor([6, 3])      # transcript prompt lengths (padded to 6)
A_len = torch.tensor([5, 8])      # audio-code lengths (padded to 8)
E_len = torch.tensor([4, 7])      # description encoder lengths (padded to 7); fewer keys than decoder queries
P, A, E = 6, 8, 7
B = 2

Wq, Wk, Wv, Cq, Ck, Cv = (torch.randn(D, D, dtype=dt) / D ** 0.5 for _ in range(6))
pos_table = torch.randn(64, D, dtype=dt) * 0.1

def mha(x, mem, Wq_, Wk_, Wv_, add_mask):
    b, n, _ = x.shape
    sh = lambda t: t.view(b, -1, H, D // H).transpose(1, 2)
    s = sh(x @ Wq_) @ sh(mem @ Wk_).transpose(-1, -2) / (D // H) ** 0.5 + add_mask
    return (s.softmax(-1) @ sh(mem @ Wv_)).transpose(1, 2).reshape(b, n, D)

def to_additive(keep):  # 1 = attend, 0 = masked, like _prepare_4d_*_attention_mask
    return torch.zeros(keep.shape, dtype=dt).masked_fill(~keep, torch.finfo(dt).min)

def decoder(prompt, prompt_mask, audio, audio_mask, enc, enc_mask):
    x = torch.cat([prompt, audio], 1)
    attention_mask = torch.cat([prompt_mask, audio_mask], 1)
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # pads do not advance the position
    x = x + pos_table[position_ids]
    n = x.shape[1]
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    keep = causal[None] & attention_mask.bool()[:, None, :]
    x = x + mha(x, x, Wq, Wk, Wv, to_additive(keep)[:, None])
    x = x + mha(x, enc, Cq, Ck, Cv, to_additive(enc_mask.bool()[:, None, :].expand(-1, n, -1))[:, None])
    return x

prompt = torch.randn(B, P, D, dtype=dt); audio = torch.randn(B, A, D, dtype=dt); enc = torch.randn(B, E, D, dtype=dt)
pm = (torch.arange(P)[None] < P_len[:, None]).long()
am = (torch.arange(A)[None] < A_len[:, None]).long()
em = (torch.arange(E)[None] < E_len[:, None]).long()
out = decoder(prompt, pm, audio, am, enc, em)

diff = 0.0
for i in range(B):
    p, a, e = P_len[i].item(), A_len[i].item(), E_len[i].item()
    r = decoder(prompt[i:i+1, :p], torch.ones(1, p, dtype=torch.long), audio[i:i+1, :a], torch.ones(1, a, dtype=torch.long),
                enc[i:i+1, :e], torch.ones(1, e, dtype=torch.long))
    real = torch.cat([pm[i], am[i]]).bool()
    diff = max(diff, (out[i][real] - r[0]).abs().max().item())
print("max diff", diff)
assert diff < 1e-12
