# vllm-project/speculators#691: Eagle3/DFlash drafts built their mask with flex_attention's
# create_mask (bool, True = attend) but the eager/SDPA backends add it to the scores, so the mask is ignored.
import sys

import torch
import torch.nn as nn
from torch.nn.attention.flex_attention import create_mask

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def create_float_mask(mask_mod, B, H, Q_LEN, KV_LEN, device="cpu"):
    mask = create_mask(mask_mod, B, H, Q_LEN, KV_LEN, device=device)
    return torch.zeros(mask.shape, dtype=torch.float32, device=device).masked_fill(~mask, float("-inf"))


def create_combined_mask_mod(lengths, total_seq_len):
    # packed documents, causal inside each document
    document_ids = torch.repeat_interleave(torch.arange(lengths.shape[0]), lengths)
    document_ids = torch.cat([document_ids, torch.full((total_seq_len - document_ids.numel(),), -1)])

    def causal_document_mask(b, h, q_idx, kv_idx):
        causal = q_idx >= kv_idx
        same_doc = document_ids[q_idx] == document_ids[kv_idx]
        valid = document_ids[kv_idx] >= 0
        return causal & same_doc & valid

    return causal_document_mask


def eager_attention_forward(module, query, key, value, attention_mask, scaling, dropout=0.0):
    # same as transformers' eager_attention_forward: the mask is added to the scores
    attn_weights = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        causal_mask = attention_mask[:, :, :, : key.shape[-2]]
        attn_weights = attn_weights + causal_mask
    attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype)
    attn_output = torch.matmul(attn_weights, value)
    return attn_output.transpose(1, 2).contiguous(), attn_weights


class Eagle3Attention(nn.Module):
    def __init__(self, hidden_size=32, num_heads=4):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = hidden_size // num_heads
        self.scaling = self.head_dim ** -0.5
        self.q_proj = nn.Linear(2 * hidden_size, hidden_size)
        self.k_proj = nn.Linear(2 * hidden_size, hidden_size)
        self.v_proj = nn.Linear(2 * hidden_size, hidden_size)
        self.o_proj = nn.Linear(hidden_size, hidden_size)

    def forward(self, hidden_states, attention_mask):
        b, s, _ = hidden_states.shape
        shape = (b, s, self.num_heads, self.head_dim)
        q = self.q_proj(hidden_states).view(shape).transpose(1, 2)
        k = self.k_proj(hidden_states).view(shape).transpose(1, 2)
        v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        out, _ = eager_attention_forward(self, q, k, v, attention_mask, self.scaling)
        return self.o_proj(out.reshape(b, s, -1))


class Eagle3DraftModel(nn.Module):
    def __init__(self, hidden_size=32, vocab=50):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, hidden_size)
        self.fc = nn.Linear(3 * hidden_size, hidden_size)
        self.attn = Eagle3Attention(hidden_size)
        self.lm_head = nn.Linear(hidden_size, vocab)

    def forward(self, input_ids, verifier_hidden, lengths, float_mask=FIXED):
        total = input_ids.shape[1]
        mask_mod = create_combined_mask_mod(lengths, total)
        if float_mask:
            attention_mask = create_float_mask(mask_mod, None, None, total, total)
        else:
            attention_mask = create_mask(mask_mod, None, None, total, total)
        h = self.fc(verifier_hidden)
        x = torch.cat([self.embed_tokens(input_ids), h], dim=-1)
        return self.lm_head(h + self.attn(x, attention_mask))


model = Eagle3DraftModel().eval()
lengths = torch.tensor([5, 4, 3])
total = int(lengths.sum()) + 2  # two pad slots at the end of the packed row
input_ids = torch.randint(0, 50, (1, total))
verifier_hidden = torch.randn(1, total, 96)
with torch.no_grad():
    logits = model(input_ids, verifier_hidden, lengths)
    # reference: first document alone, with the mask applied the correct way
    ref = model(input_ids[:, :5], verifier_hidden[:, :5], lengths[:1], float_mask=True)
print("mask dtype:", "float" if FIXED else "bool",
      "| doc 0 logits vs doc 0 run alone, max diff: %.4g" % (logits[:, :5] - ref).abs().max().item())
