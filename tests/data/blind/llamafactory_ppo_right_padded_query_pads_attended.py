# hiyouga/LlamaFactory#2382: PPO queries were right-padded while get_inputs only strips *left* padding, so the
# trailing pad tokens stay inside each query and TRL's PPO forward attends them (all-ones attention_mask).
import sys
import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
PAD, VOCAB, DIM, HEADS = 0, 40, 32, 4


class CausalSelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_attn, self.c_proj = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)

    def forward(self, x, attention_mask):
        B, T, _ = x.shape
        q, k, v = self.c_attn(x).view(B, T, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        mask = causal[None, None] & attention_mask[:, None, None, :].bool()
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, DIM))


class AutoModelForCausalLMWithValueHead(nn.Module):
    def __init__(self, n_layer=2):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, DIM), nn.Embedding(64, DIM)
        self.h = nn.ModuleList(CausalSelfAttention() for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(DIM)
        self.lm_head, self.v_head = nn.Linear(DIM, VOCAB), nn.Linear(DIM, 1)

    def forward(self, input_ids, attention_mask):
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        x = self.wte(input_ids) + self.wpe(position_ids)
        for blk in self.h:
            x = x + blk(x, attention_mask)
        x = self.ln_f(x)
        return self.lm_head(x), None, self.v_head(x).squeeze(-1)


def collate(features, padding_side):
    max_len = max(len(f) for f in features)
    ids = torch.full((len(features), max_len), PAD)
    for i, f in enumerate(features):
        if padding_side == "left":
            ids[i, max_len - len(f):] = torch.tensor(f)
        else:
            ids[i, :len(f)] = torch.tensor(f)
    return {"input_ids": ids, "attention_mask": (ids != PAD).long()}


def get_inputs(batch, responses):
    # CustomPPOTrainer.get_inputs: strip left padding of the query, right padding of the response
    query = batch["input_ids"]
    queries, resps = [], []
    for i in range(len(query)):
        query_start_index = (query[i] != PAD).nonzero()[0].item()
        queries.append(query[i, query_start_index:])
        resps.append(torch.tensor(responses[i]))
    return queries, resps


def prepare_model_inputs(queries, responses):
    # trl PPOTrainer.prepare_model_inputs for decoder-only models
    input_ids = [torch.cat([q, r]) for q, r in zip(queries, responses)]
    feats = [ids.tolist() for ids in input_ids]
    batch = collate(feats, "right")
    for i, ids in enumerate(input_ids):
        batch["attention_mask"][i, :len(ids)] = torch.ones_like(ids)
    return batch


prompts = [[5, 6, 7, 8, 9], [11, 12]]
responses = [[20, 21, 22], [23, 24, 25]]
padding_side = "left" if FIXED else "right"  # tokenizer.padding_side used by the PPO dataset
batch = collate(prompts, padding_side)
queries, resps = get_inputs(batch, responses)

model = AutoModelForCausalLMWithValueHead().eval()
inputs = prepare_model_inputs(queries, resps)
with torch.no_grad():
    logits, _, values = model(**inputs)

# reference: the short query+response alone, no padding anywhere
ref_ids = torch.tensor([prompts[1] + responses[1]])
with torch.no_grad():
    _, _, ref_values = model(ref_ids, torch.ones_like(ref_ids))
n = len(queries[1]) + len(resps[1])
print(f"fixed={FIXED} query[1]={queries[1].tolist()} attention_mask[1]={inputs['attention_mask'][1].tolist()}")
print(f"value of last response token: {values[1, n - 1].item():.4f} vs unpadded {ref_values[0, -1].item():.4f}")
