# Follows audiocraft: audiocraft/modules/transformer.py StreamingMultiheadAttention (_get_mask with past_context,
# _complete_kv trimming the streaming cache to past_context). Float mask 0/-inf; queries sit at offset past_steps,
# keys at 0..past_steps+current; each query sees itself and at most past_context earlier steps.
import torch
torch.manual_seed(2)
dt = torch.float64
B, H, T, D, P, CH = 2, 2, 23, 8, 5, 4   # past_context=5, stream in chunks of 4 (last chunk shorter)

def get_mask(current_steps, past_steps, past_context):
    queries_pos = torch.arange(past_steps, current_steps + past_steps).view(-1, 1)
    keys_pos = torch.arange(past_steps + current_steps).view(1, -1)
    delta = queries_pos - keys_pos
    valid = delta >= 0
    if past_context is not None:
        valid &= (delta <= past_context)
    return torch.where(valid, torch.zeros([], dtype=dt), torch.full([], float("-inf"), dtype=dt))

q = torch.randn(B, H, T, D, dtype=dt); k = torch.randn(B, H, T, D, dtype=dt); v = torch.randn(B, H, T, D, dtype=dt)

# streaming: cache is trimmed to the last past_context steps after every chunk (_complete_kv)
state = None
outs = []
for s in range(0, T, CH):
    qc, kc, vc = q[:, :, s:s+CH], k[:, :, s:s+CH], v[:, :, s:s+CH]
    if state is None:
        nk, nv = kc, vc
    else:
        nk, nv = torch.cat([state[0], kc], 2), torch.cat([state[1], vc], 2)
    past_steps = nk.shape[2] - kc.shape[2]
    mask = get_mask(kc.shape[2], past_steps, P)
    outs.append(torch.nn.functional.scaled_dot_product_attention(qc, nk, nv, attn_mask=mask))
    offset = max(0, nk.shape[2] - P)
    state = (nk[:, :, offset:], nv[:, :, offset:])
stream = torch.cat(outs, 2)

# reference: whole sequence, explicit per-query loop over the window [t-P, t]
ref = torch.empty_like(stream)
for t in range(T):
    lo = max(0, t - P)
    s_ = torch.einsum("bhd,bhkd->bhk", q[:, :, t], k[:, :, lo:t+1]) / D ** 0.5
    ref[:, :, t] = torch.einsum("bhk,bhkd->bhd", s_.softmax(-1), v[:, :, lo:t+1])
diff = (stream - ref).abs().max().item()
print("max diff", diff)
assert diff < 1e-12
