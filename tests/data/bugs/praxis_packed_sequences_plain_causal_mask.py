# 0-5788719150923125/praxis#38 (fixed by PR #40): training packs documents into one row separated by the pad
# token, but PraxisAttention applied a plain causal mask, so every document attended to the ones before it.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

PAD_TOKEN_ID = 0  # also the separator between packed documents


def create_block_ids(input_ids, special_tokens):
    if not isinstance(special_tokens, torch.Tensor):
        special_tokens = torch.tensor(special_tokens, device=input_ids.device, dtype=input_ids.dtype)
    special_tokens_mask = torch.isin(input_ids, special_tokens)
    # Each special token OR token after special token starts new block
    block_boundaries = torch.cat(
        [torch.ones((input_ids.size(0), 1), dtype=torch.bool), special_tokens_mask[:, :-1] | special_tokens_mask[:, 1:]],
        dim=1,
    )
    return block_boundaries.cumsum(dim=1)


class ScaledDotProduct(nn.Module):
    def compute_scores(self, q, k, v):
        scaling = 1.0 / q.size(-1) ** 0.5
        return torch.matmul(q, k.transpose(-2, -1)) * scaling

    def apply_masking(self, scores, attention_mask, block_ids, seq_len, hist_len, causal):
        causal_mask = None
        if causal:
            if block_ids is None:
                # Regular causal mask when no sequence blocking needed
                causal_mask = torch.triu(torch.full((seq_len, hist_len), -1e9), diagonal=1).unsqueeze(0).unsqueeze(0)
            else:
                # Create block diagonal causal mask
                same_block = block_ids.unsqueeze(-1) == block_ids[..., :hist_len].unsqueeze(-2)
                pos = torch.arange(seq_len)
                causal = pos.unsqueeze(-1) >= torch.arange(hist_len)
                mask = (same_block & causal).unsqueeze(1).float()
                causal_mask = (1.0 - mask) * -1e9
            scores = scores + causal_mask
        attention_mask = F.pad(attention_mask, (hist_len - attention_mask.size(-1), 0), value=1)
        attention_mask = (1.0 - attention_mask.unsqueeze(1).unsqueeze(2)) * -1e9
        return scores + attention_mask


class PraxisAttention(nn.Module):
    def __init__(self, hidden_size, num_heads, causal=True):
        super().__init__()
        self.num_heads, self.head_dim, self.causal = num_heads, hidden_size // num_heads, causal
        self.query = nn.Linear(hidden_size, hidden_size, bias=False)
        self.key = nn.Linear(hidden_size, hidden_size, bias=False)
        self.value = nn.Linear(hidden_size, hidden_size, bias=False)
        self.output = nn.Linear(hidden_size, hidden_size, bias=False)
        self.algorithm = ScaledDotProduct()

    def forward(self, inputs, attention_mask=None, block_ids=None):
        batch_size, seq_len, _ = inputs.shape
        if not torch.is_tensor(attention_mask):
            attention_mask = torch.ones(inputs.shape[:2])
        shape = (batch_size, seq_len, self.num_heads, self.head_dim)
        q = self.query(inputs).view(shape).transpose(1, 2)
        k = self.key(inputs).view(shape).transpose(1, 2)
        v = self.value(inputs).view(shape).transpose(1, 2)
        scores = self.algorithm.compute_scores(q, k, v)
        scores = self.algorithm.apply_masking(scores, attention_mask, block_ids, seq_len, seq_len, self.causal)
        weights = F.softmax(scores, dim=-1)
        out = torch.matmul(weights, v).transpose(1, 2).reshape(batch_size, seq_len, -1)
        return self.output(out)


class PraxisBlock(nn.Module):
    def __init__(self, hidden_size, num_heads):
        super().__init__()
        self.attn_norm, self.ffn_norm = nn.LayerNorm(hidden_size), nn.LayerNorm(hidden_size)
        self.attn = PraxisAttention(hidden_size, num_heads)
        self.ffn = nn.Sequential(nn.Linear(hidden_size, 2 * hidden_size), nn.GELU(), nn.Linear(2 * hidden_size, hidden_size))

    def forward(self, x, attention_mask, block_ids):
        x = x + self.attn(self.attn_norm(x), attention_mask, block_ids)
        return x + self.ffn(self.ffn_norm(x))


class PraxisForCausalLM(nn.Module):
    def __init__(self, vocab_size=48, hidden_size=32, num_heads=4, depth=2, pad_token_id=PAD_TOKEN_ID):
        super().__init__()
        self.pad_token_id = pad_token_id
        self.embeds = nn.Embedding(vocab_size, hidden_size)
        self.blocks = nn.ModuleList([PraxisBlock(hidden_size, num_heads) for _ in range(depth)])
        self.head = nn.Linear(hidden_size, vocab_size)

    def forward(self, input_ids, attention_mask=None):
        block_ids = create_block_ids(input_ids, self.pad_token_id) if FIXED else None
        x = self.embeds(input_ids)
        for block in self.blocks:
            x = block(x, attention_mask, block_ids)
        return self.head(x)


model = PraxisForCausalLM().eval()
# packed training row: [doc A] <pad> [doc B] <pad> [doc C]
doc_a, doc_b, doc_c = [5, 6, 7, 8, 9], [11, 12, 13, 14], [21, 22, 23]
packed = torch.tensor([doc_a + [PAD_TOKEN_ID] + doc_b + [PAD_TOKEN_ID] + doc_c])
attention_mask = torch.ones_like(packed)
with torch.no_grad():
    logits = model(packed, attention_mask)
    alone = model(torch.tensor([doc_b]), torch.ones(1, len(doc_b)))
start = len(doc_a) + 1
diff = (logits[0, start:start + len(doc_b)] - alone[0]).abs().max().item()
print(f"fixed={FIXED} doc B logits packed vs. alone: max diff {diff:.4f}")
