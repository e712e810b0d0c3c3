# Follows bigcode-project/Megatron-LM megatron/utils.py get_ltor_masks_and_position_ids(reset_attention_mask=True,
# reset_position_ids=True) used for StarCoder FIM pretraining on packed files: mask is True = MASKED (attention_mask < 0.5),
# causal within each packed file, positions restart at each EOD. Checked against each file run alone.
import torch, torch.nn.functional as F
torch.manual_seed(0)
D, H, EOD, V = 32, 4, 0, 50
PRE, MID, SUF = 1, 2, 3  # FIM sentinel ids

def fim_permute(tokens):  # PSM format: <pre> prefix <suf> suffix <mid> middle
    n = len(tokens); a, b = sorted(torch.randint(0, n + 1, (2,)).tolist())
    return [PRE] + tokens[:a] + [SUF] + tokens[b:] + [MID] + tokens[a:b]

def get_ltor_masks_and_position_ids(data, eod_token):
    b, s = data.shape
    attention_mask = torch.tril(torch.ones(b, s, s)).view(b, 1, s, s)
    position_ids = torch.arange(s).unsqueeze(0).repeat(b, 1)
    for i in range(b):
        eod_index = position_ids[i, data[i] == eod_token]
        prev = 0
        for j in range(eod_index.numel()):
            k = eod_index[j].item()
            attention_mask[i, 0, (k + 1):, :(k + 1)] = 0
            position_ids[i, (k + 1):] -= (k + 1 - prev)
            prev = k + 1
    return attention_mask < 0.5, position_ids

emb = torch.randn(V, D, dtype=torch.float64); pos = torch.randn(32, D, dtype=torch.float64)
Wq, Wk, Wv = (torch.randn(D, D, dtype=torch.float64) / D**0.5 for _ in range(3))

def attn(x, masked):  # masked: True = blocked (Megatron convention)
    b, s, _ = x.shape
    q, k, v = ((x @ W).view(b, s, H, D // H).transpose(1, 2) for W in (Wq, Wk, Wv))
    sc = q @ k.transpose(-1, -2) / (D // H) ** 0.5
    sc = sc.masked_fill(masked, float('-inf'))
    return (sc.softmax(-1) @ v).transpose(1, 2).reshape(b, s, D)

files = [torch.randint(4, V, (n,)).tolist() for n in (5, 9, 4)]
docs = [fim_permute(f) + [EOD] for f in files]
packed = torch.tensor([sum(docs, [])])
mask, pid = get_ltor_masks_and_position_ids(packed, EOD)
out = attn(emb[packed] + pos[pid], mask)[0]
ref, i = [], 0
for d in docs:
    t = torch.tensor([d]); s = len(d)
    ref.append(attn(emb[t] + pos[torch.arange(s)], ~torch.tril(torch.ones(s, s, dtype=torch.bool)))[0])
ref = torch.cat(ref)
diff = (out - ref).abs().max().item()
print("packed FIM vs per-file max diff", diff)
assert diff < 1e-12
