# OpenRLHF/OpenRLHF commit 01b8a23d ("fix eos_token for llama3"): Actor.process_sequences built attention_mask as
# seq != eos & seq != pad, so the eos tokens that end each turn inside a Llama3/Qwen2 chat prompt were masked out.
import sys
import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
VOCAB, DIM, HEADS, LAYERS = 40, 32, 4, 2
PAD_TOKEN_ID, EOS_TOKEN_ID = 0, 9  # Llama3: <|eot_id|> closes every chat turn


class DecoderLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj, self.k_proj = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)
        self.v_proj, self.o_proj = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.SiLU(), nn.Linear(2 * DIM, DIM))

    def forward(self, x, causal_mask):
        B, T, _ = x.shape
        h = self.norm1(x)
        q, k, v = (p(h).view(B, T, HEADS, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_mask)
        x = x + self.o_proj(attn.transpose(1, 2).reshape(B, T, DIM))
        return x + self.mlp(self.norm2(x))


class TinyCausalLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens, self.embed_positions = nn.Embedding(VOCAB, DIM), nn.Embedding(64, DIM)
        self.layers = nn.ModuleList(DecoderLayer() for _ in range(LAYERS))
        self.lm_head = nn.Linear(DIM, VOCAB)

    def forward(self, input_ids, attention_mask, position_ids):
        T = input_ids.shape[1]
        # 4D float mask from the 2D padding mask, as in _prepare_4d_causal_attention_mask
        allowed = torch.ones(T, T, dtype=torch.bool).tril()[None, None] & attention_mask.bool()[:, None, None, :]
        causal_mask = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
        x = self.embed_tokens(input_ids) + self.embed_positions(position_ids)
        for layer in self.layers:
            x = layer(x, causal_mask)
        return self.lm_head(x)


class Actor(nn.Module):
    def __init__(self):
        super().__init__()
        self.model = TinyCausalLM()

    def process_sequences(self, sequences, input_len, eos_token_id, pad_token_id):
        attention_mask = (sequences.ne(eos_token_id) & sequences.ne(pad_token_id)).to(dtype=torch.long)
        seq_length = attention_mask.size(1)
        eos_indices = seq_length - attention_mask.long().fliplr().argmax(dim=1, keepdim=True).clamp(min=1)
        if FIXED:
            first_token_indices = attention_mask.long().argmax(dim=1, keepdim=True)
            # For Llama3 and Qwen2 models, there are some eos_tokens in the middle of the prompt.
            mask = torch.arange(seq_length).unsqueeze(0).expand(sequences.size(0), -1)
            mask = (mask <= eos_indices) & (mask >= first_token_indices)
            attention_mask.masked_fill_(mask, 1)
        else:
            attention_mask.scatter_(dim=1, index=eos_indices, value=1)
        sequences.scatter_(dim=1, index=eos_indices, value=eos_token_id)
        state_seq = sequences[:, input_len - 1 : -1]
        action_mask = state_seq.ne(eos_token_id) & state_seq.ne(pad_token_id)
        return sequences, attention_mask, action_mask

    def forward(self, sequences, num_actions, attention_mask):
        position_ids = attention_mask.long().cumsum(-1) - 1
        position_ids.masked_fill_(attention_mask == 0, 1)
        logits = self.model(sequences, attention_mask=attention_mask, position_ids=position_ids)
        log_probs = torch.log_softmax(logits[:, :-1], -1).gather(-1, sequences[:, 1:, None])[..., 0]
        return log_probs[:, -num_actions:]


actor = Actor().eval()
# two-turn chat prompts (each turn closed by <|eot_id|>), left-padded; generated responses right-padded
prompts = [[3, 4, 5, EOS_TOKEN_ID, 6, 7, EOS_TOKEN_ID, 8], [11, 12, EOS_TOKEN_ID, 13]]
responses = [[20, 21, 22, 23], [24, 25, 26]]
input_len = max(map(len, prompts))
out_len = max(map(len, responses)) + 1
rows = [[PAD_TOKEN_ID] * (input_len - len(p)) + p + r + [PAD_TOKEN_ID] * (out_len - len(r))
        for p, r in zip(prompts, responses)]
sequences, attention_mask, action_mask = actor.process_sequences(torch.tensor(rows), input_len,
                                                                  EOS_TOKEN_ID, PAD_TOKEN_ID)
num_actions = action_mask.size(1)
with torch.no_grad():
    action_log_probs = actor(sequences, num_actions, attention_mask)

# reference: the first sample alone, every prompt token visible
ref_seq = torch.tensor([prompts[0] + responses[0] + [EOS_TOKEN_ID]])
ones = torch.ones_like(ref_seq)
with torch.no_grad():
    ref = actor(ref_seq, len(responses[0]) + 1, ones)
diff = (action_log_probs[0, : len(responses[0]) + 1] - ref[0]).abs().max().item()
print(f"fixed={FIXED} attention_mask[0]={attention_mask[0].tolist()}")
print(f"max |action log prob - reference| = {diff:.4f}")
