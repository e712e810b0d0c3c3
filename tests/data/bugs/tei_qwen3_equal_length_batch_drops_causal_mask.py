# huggingface/text-embeddings-inference#882 (fix PR #883): the Qwen3 candle backend attached the causal mask to the
# padding bias, so a batch of equal-length sequences (no padding -> no bias) ran fully bidirectional attention.
import sys
import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class Qwen3Config:
    vocab_size = 64
    hidden_size = 32
    num_attention_heads = 4
    num_hidden_layers = 2
    use_bidirectional_attention = False  # decoder embedding model: causal attention


class Qwen3Attention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=False)
        self.o_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)

    def forward(self, hidden_states, attention_bias):
        b, L, _ = hidden_states.shape
        q, k, v = self.qkv(hidden_states).view(b, L, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        attention_scores = q @ k.transpose(-1, -2) * self.head_dim ** -0.5
        if attention_bias is not None:
            attention_scores = attention_scores + attention_bias
        attention_probs = attention_scores.softmax(dim=-1)
        out = (attention_probs @ v).transpose(1, 2).reshape(b, L, -1)
        return self.o_proj(out)


class Qwen3Model(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.use_bidirectional_attention = config.use_bidirectional_attention
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([Qwen3Attention(config) for _ in range(config.num_hidden_layers)])
        self.norm = nn.LayerNorm(config.hidden_size)

    def get_causal_attention_bias(self, attention_bias):
        L = attention_bias.shape[-1]
        causal = torch.full((L, L), float("-inf")).triu(1)
        return attention_bias + causal

    def forward(self, batch):  # batch: list of token-id lists, left padded
        b = len(batch)
        max_length = max(len(ids) for ids in batch)
        masking = any(len(ids) != max_length for ids in batch)
        input_ids = torch.tensor([[0] * (max_length - len(ids)) + ids for ids in batch])

        if b == 1:
            # single-input path: causal bias built directly
            attention_bias = self.get_causal_attention_bias(torch.zeros(1, 1, 1, max_length))
        else:
            if masking:
                bias = torch.zeros(b, 1, 1, max_length)
                for i, ids in enumerate(batch):
                    bias[i, ..., :max_length - len(ids)] = float("-inf")
                attention_bias = bias
            elif FIXED:
                attention_bias = torch.zeros(b, 1, 1, max_length)
            else:
                attention_bias = None
            if self.use_bidirectional_attention:
                pass
            elif attention_bias is not None:
                attention_bias = self.get_causal_attention_bias(attention_bias)

        h = self.embed_tokens(input_ids)
        for layer in self.layers:
            h = h + layer(h, attention_bias)
        h = self.norm(h)
        return h[:, -1]  # last-token pooling (left padding)


model = Qwen3Model(Qwen3Config()).eval()
batch = [[3, 9, 14, 2, 7, 11], [5, 1, 8, 8, 20, 4]]  # equal lengths: no padding in the batch

with torch.no_grad():
    batched = model(batch)
    single = torch.cat([model([ids]) for ids in batch])

print(f"fixed={FIXED} max |batched - one-at-a-time| embedding: {(batched - single).abs().max().item():.3e}")
