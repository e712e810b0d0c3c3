# TiSASRec (JiachengLi1995/TiSASRec#1 commit 1bd63d0, typo completed by #2 commit 9a34c20): modules.multihead_attention
# built key/query masks as sign(abs(reduce_sum(x))) instead of sign(reduce_sum(abs(x))), so a real item whose
# (layer-normalized) vector sums to exactly 0 is treated as padding. TF ops ported 1:1 to torch.
import sys
import torch

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
N, T, C, H, SPAN, ITEMS = 3, 16, 32, 2, 8, 40


def normalize(x, eps=1e-8):
    mean = x.mean(-1, keepdim=True)
    var = x.var(-1, unbiased=False, keepdim=True)
    return (x - mean) / ((var + eps) ** 0.5)  # gamma=1, beta=0 as initialised


def sign_mask(x, fixed=None):
    if FIXED if fixed is None else fixed:
        return torch.sign(torch.sum(torch.abs(x), dim=-1))  # (N, T)
    return torch.sign(torch.abs(torch.sum(x, dim=-1)))  # (N, T)


class Dense(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l = torch.nn.Linear(C, C)

    def forward(self, x):
        return self.l(x)


def split_heads(x, axis):
    return torch.cat(torch.split(x, C // H, dim=axis), dim=0)


def multihead_attention(queries, keys, time_matrix_K, time_matrix_V, absolute_pos_K, absolute_pos_V, d, causality=True, fixed=None):
    Q, K, V = d["q"](queries), d["k"](keys), d["v"](keys)
    Q_, K_, V_ = split_heads(Q, 2), split_heads(K, 2), split_heads(V, 2)
    time_matrix_K_ = split_heads(time_matrix_K, 3)
    time_matrix_V_ = split_heads(time_matrix_V, 3)
    absolute_pos_K_ = split_heads(absolute_pos_K, 2)
    absolute_pos_V_ = split_heads(absolute_pos_V, 2)
    outputs = Q_ @ K_.transpose(1, 2)
    outputs_pos = Q_ @ absolute_pos_K_.transpose(1, 2)
    outputs_time = (time_matrix_K_ @ Q_.unsqueeze(3)).squeeze(-1)
    outputs = (outputs + outputs_time + outputs_pos) / (K_.shape[-1] ** 0.5)
    # Key Masking
    key_masks = sign_mask(keys, fixed).repeat(H, 1)
    key_masks = key_masks.unsqueeze(1).expand(-1, queries.shape[1], -1)
    paddings = torch.ones_like(outputs) * (-2 ** 32 + 1)
    outputs = torch.where(key_masks == 0, paddings, outputs)
    if causality:
        tril = torch.tril(torch.ones_like(outputs[0]))
        masks = tril.unsqueeze(0).expand(outputs.shape[0], -1, -1)
        outputs = torch.where(masks == 0, paddings, outputs)
    outputs = torch.softmax(outputs, dim=-1)
    # Query Masking
    query_masks = sign_mask(queries, fixed).repeat(H, 1)
    query_masks = query_masks.unsqueeze(-1).expand(-1, -1, keys.shape[1])
    outputs = outputs * query_masks
    outputs_value = outputs @ V_
    outputs_pos_value = outputs @ absolute_pos_V_
    output_time_value = (outputs.unsqueeze(2) @ time_matrix_V_).reshape(outputs.shape[0], outputs.shape[1], C // H)
    outputs = outputs_value + output_time_value + outputs_pos_value
    outputs = torch.cat(torch.split(outputs, N, dim=0), dim=2)
    return outputs + queries


def feedforward(inputs, d):
    outputs = torch.relu(d["ff1"](inputs))  # conv1d, kernel_size=1
    outputs = d["ff2"](outputs)
    return outputs + inputs


item_emb = torch.randn(ITEMS, C) * 0.1
item_emb[0] = 0  # zero_pad
pos_K, pos_V = torch.randn(T, C), torch.randn(T, C)
time_K, time_V = torch.randn(SPAN + 1, C), torch.randn(SPAN + 1, C)
layers = [{n: Dense() for n in ("q", "k", "v", "ff1", "ff2")} for _ in range(2)]

# left-padded histories, as TiSASRec's sampler builds them
lens = [16, 11, 6]
u = torch.zeros(N, T, dtype=torch.long)
for b, L in enumerate(lens):
    u[b, T - L:] = torch.randint(1, ITEMS, (L,))
stamps = torch.cumsum(torch.randint(0, 4, (N, T)), 1)
time_matrix = (stamps.unsqueeze(2) - stamps.unsqueeze(1)).abs().clamp(max=SPAN)
mask = (u != 0).float().unsqueeze(-1)
test_item = torch.randint(1, ITEMS, (N, 101))


def predict(fixed=None):
    seq = item_emb[u] * (C ** 0.5)  # embedding(scale=True)
    seq = seq * mask
    tK, tV = time_K[time_matrix], time_V[time_matrix]
    aK, aV = pos_K.expand(N, -1, -1), pos_V.expand(N, -1, -1)
    n_dropped = 0
    for d in layers:
        q = normalize(seq)
        n_dropped += int(mask.sum() - (sign_mask(q, fixed).unsqueeze(-1) * mask).sum())
        seq = multihead_attention(q, seq, tK, tV, aK, aV, d, fixed=fixed)
        seq = feedforward(normalize(seq), d)
        seq = seq * mask
    seq = normalize(seq)
    test_logits = torch.einsum("nc,nkc->nk", seq[:, -1], item_emb[test_item])
    return test_logits, n_dropped


with torch.no_grad():
    logits, n_dropped = predict()
    ref, _ = predict(fixed=True)  # masks built from sum(abs(x)): only all-zero (padded) rows are masked
    print("real (query) positions treated as padding:", n_dropped)
    print("max |test_logits - reference|:", float((logits - ref).abs().max()))
