# rllm-org/rllm#517: the verl transform built attention_mask as `batch != pad_token_id`; with pad == eos
# every real EOS inside a prompt/response is masked as padding. Fix: build the mask from sequence lengths.
import sys
import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

PAD_TOKEN_ID = 0  # tokenizer.pad_token_id == tokenizer.eos_token_id (Qwen-style)
EOS_TOKEN_ID = 0
VOCAB, DIM, HEADS, LAYERS = 32, 32, 4, 2


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.qkv, self.proj = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, x, attention_mask):
        B, T, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)
        causal = torch.tril(torch.ones(T, T, dtype=torch.bool))
        allowed = causal[None, None] & attention_mask[:, None, None, :].bool()
        bias = torch.zeros(B, 1, T, T).masked_fill(~allowed, torch.finfo(torch.float32).min)
        scores = q @ k.transpose(-1, -2) / (DIM // HEADS) ** 0.5 + bias
        out = torch.softmax(scores, dim=-1) @ v
        x = x + self.proj(out.transpose(1, 2).reshape(B, T, DIM))
        return x + self.mlp(self.ln2(x))


class TinyPolicy(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.pos = nn.Embedding(VOCAB, DIM), nn.Embedding(64, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, input_ids, attention_mask, position_ids):
        x = self.emb(input_ids) + self.pos(position_ids)
        for blk in self.blocks:
            x = blk(x, attention_mask)
        return self.head(x)


def _pad_sequence_batch(seqs, pad_token_id, left):
    max_len = max(len(s) for s in seqs)
    out = torch.full((len(seqs), max_len), pad_token_id, dtype=torch.long)
    for i, s in enumerate(seqs):
        if left:
            out[i, max_len - len(s):] = torch.tensor(s)
        else:
            out[i, :len(s)] = torch.tensor(s)
    return out


def _lengths_mask(seqs, width, left):
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        if left:
            mask[i, width - len(s):] = 1
        else:
            mask[i, :len(s)] = 1
    return mask


def transform_episodes_to_dataproto(prompts, responses):
    prompts_batch = _pad_sequence_batch(prompts, PAD_TOKEN_ID, left=True)
    response_batch = _pad_sequence_batch(responses, PAD_TOKEN_ID, left=False)
    input_ids = torch.cat([prompts_batch, response_batch], dim=1)
    if FIXED:
        attention_mask = torch.cat([_lengths_mask(prompts, prompts_batch.shape[1], True),
                                    _lengths_mask(responses, response_batch.shape[1], False)], dim=1)
    else:
        attention_mask = torch.where(input_ids != PAD_TOKEN_ID, 1, 0)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids,
            "responses": response_batch, "prompt_len": prompts_batch.shape[1]}


# multi-turn prompts whose turns end with the EOS id, responses terminated by EOS
prompts = [[5, 6, 7, EOS_TOKEN_ID, 8, 9], [11, 12, EOS_TOKEN_ID, 13]]
responses = [[14, 15, 16, EOS_TOKEN_ID], [17, 18, EOS_TOKEN_ID]]

policy = TinyPolicy().eval()
data = transform_episodes_to_dataproto(prompts, responses)
with torch.no_grad():
    logits = policy(data["input_ids"], data["attention_mask"], data["position_ids"])
P = data["prompt_len"]
logp = torch.log_softmax(logits[:, P - 1:-1], -1).gather(-1, data["responses"][..., None])[..., 0]

# reference: each episode alone, unpadded, every real token attended
ref = []
for p, r in zip(prompts, responses):
    ids = torch.tensor([p + r])
    with torch.no_grad():
        lg = policy(ids, torch.ones_like(ids), torch.arange(ids.shape[1])[None])
    ref.append(torch.log_softmax(lg[0, len(p) - 1:-1], -1).gather(-1, ids[0, len(p):, None])[:, 0])
diff = max((logp[i, :len(r)] - ref[i]).abs().max().item() for i, r in enumerate(responses))
print(f"fixed={FIXED} attention_mask[0]={data['attention_mask'][0].tolist()}")
print(f"max |response logprob - unpadded reference| = {diff:.4f}")
