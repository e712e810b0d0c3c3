# Follows automl/TabPFN (v1) tabpfn/transformer.py TransformerModel.generate_D_q_matrix (+ utils.bool_mask_to_att_mask),
# the src_mask of its encoder: every row sees the training rows; test rows also see themselves, never each other.
# True = keep, flipped to a float 0/-inf bias for nn.TransformerEncoderLayer (float masks are additive).
import torch
torch.manual_seed(2)
torch.set_default_dtype(torch.float64)

def bool_mask_to_att_mask(mask):
    return mask.float().masked_fill(mask == 0, float("-inf")).masked_fill(mask == 1, float(0.0)).double()

def generate_D_q_matrix(sz, query_size):
    train_size = sz - query_size
    mask = torch.zeros(sz, sz) == 0
    mask[:, train_size:].zero_()
    mask |= torch.eye(sz) == 1
    return bool_mask_to_att_mask(mask)

d, n_train, n_test, F = 32, 10, 7, 5
enc = torch.nn.Linear(F + 1, d)
layers = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(d, 4, 64, dropout=0.0), 2,
                                     enable_nested_tensor=False).eval()
X = torch.randn(n_train + n_test, 1, F)
y = torch.randn(n_train + n_test, 1, 1)
y[n_train:] = 0.0                       # test labels are unknown
src = enc(torch.cat([X, y], -1))        # (seq, batch, d): TabPFN v1 is sequence-first

with torch.no_grad():
    out = layers(src, mask=generate_D_q_matrix(n_train + n_test, n_test))
    # reference 1: training rows computed with only the training rows present
    ref_train = layers(src[:n_train], mask=generate_D_q_matrix(n_train, 0))
    d1 = (out[:n_train] - ref_train).abs().max().item()
    # reference 2: each test row alone next to the training set
    d2 = 0.0
    for t in range(n_test):
        one = torch.cat([src[:n_train], src[n_train + t:n_train + t + 1]])
        r = layers(one, mask=generate_D_q_matrix(n_train + 1, 1))
        d2 = max(d2, (out[n_train + t] - r[-1]).abs().max().item())
print("max diff train rows vs train-only run:", d1)
print("max diff test rows vs each test row alone:", d2)
assert d1 < 1e-12 and d2 < 1e-12
