# Follows DeepMind's AlphaFold 2: alphafold/model/modules.py GlobalAttention (q_avg = utils.mask_mean(q_mask, q_data,
# axis=1); q = einsum('ba,ahc->bhc') * key_dim**-0.5; bias = 1e9 * (q_mask[:, None, :, 0] - 1.); logits =
# einsum('bhc,bkc->bhk', q, k) + bias; softmax; a per-sequence sigmoid gate) under MSAColumnGlobalAttention (the MSA
# swapped to [N_res, N_seq, c] so that each residue column pools over the sequences), written in torch with a leading
# protein axis z on every einsum. A batch of two proteins padded to one MSA depth and length: padded sequences are
# never keys, and a fully padded residue column's logits are all -1e9 (uniform weights, finite), its rows dropped.
# Checked against each protein's unpadded MSA alone, with no mask.
import torch

torch.manual_seed(11)
dt = torch.float64
c_m, key_dim, heads = 12, 6, 3
weights = {name: torch.randn(*shape, dtype=dt) * 0.3 for name, shape in {
    "q": (c_m, heads, key_dim), "k": (c_m, key_dim), "v": (c_m, key_dim), "gate": (c_m, heads, key_dim),
    "out": (heads, key_dim, c_m)}.items()}


def mask_mean(mask, value, axis, eps=1e-10):  # alphafold/model/utils.py mask_mean
    return (mask * value).sum(axis) / (mask.sum(axis) + eps)


def global_attention(m_data, q_mask):  # m_data [z, b (residues), k (sequences), a], q_mask [z, b, k, 1]
    q_avg = mask_mean(q_mask, m_data, axis=2)  # [z, b, a]
    q = torch.einsum("zba,ahc->zbhc", q_avg, weights["q"]) * key_dim ** -0.5
    k = torch.einsum("zbka,ac->zbkc", m_data, weights["k"])
    v = torch.einsum("zbka,ac->zbkc", m_data, weights["v"])
    bias = 1e9 * (q_mask[:, :, None, :, 0] - 1.0)  # [z, b, 1, k]
    logits = torch.einsum("zbhc,zbkc->zbhk", q, k) + bias
    attn = torch.softmax(logits, dim=-1)
    avg = torch.einsum("zbhk,zbkc->zbhc", attn, v)
    gate = torch.sigmoid(torch.einsum("zbka,ahc->zbkhc", m_data, weights["gate"]))
    out = avg[:, :, None] * gate  # [z, b, k, h, c]
    return torch.einsum("zbkhc,hco->zbko", out, weights["out"])


def msa_column_global_attention(msa_act, msa_mask):  # [z, N_seq, N_res, c], [z, N_seq, N_res]
    act = msa_act.transpose(1, 2)
    mask = msa_mask.transpose(1, 2)[..., None]
    return global_attention(act, mask).transpose(1, 2)


sizes = [(5, 9), (4, 5)]  # (N_seq, N_res) of each protein
depth, length = 5, 9
msa = torch.zeros(len(sizes), depth, length, c_m, dtype=dt)
msa_mask = torch.zeros(len(sizes), depth, length, dtype=dt)
alone = []
for i, (s, r) in enumerate(sizes):
    x = torch.randn(s, r, c_m, dtype=dt)
    alone.append(x)
    msa[i, :s, :r], msa_mask[i, :s, :r] = x, 1.0
out = msa_column_global_attention(msa, msa_mask)
assert torch.isfinite(out).all()
diff = max((out[i, :s, :r] - msa_column_global_attention(alone[i][None], torch.ones(1, s, r, dtype=dt))[0]).abs().max().item()
           for i, (s, r) in enumerate(sizes))
print("max diff", diff)
assert diff < 1e-12
