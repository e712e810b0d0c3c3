# NeMo MagpieTTS transformer_2501 (NVIDIA-NeMo/Speech#14836, "Magpietts 2508 Attention mask bug fix"):
# SelfAttention.compute_qkv_and_mask built mask = query_mask[:, None, :, None], which only masks padded *query*
# rows; valid queries of the non-causal text encoder still attend to the padded key frames of a batched input.
import sys
from typing import Optional
import torch
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class ConvolutionLayer(torch.nn.Module):
    def __init__(self, in_channels, out_channels, kernel_size=1, bias=True, is_causal=False):
        super().__init__()
        self.is_causal = is_causal
        self.causal_padding = ((kernel_size - 1), 0) if is_causal else None
        padding = 0 if is_causal else (kernel_size - 1) // 2
        self.conv = torch.nn.Conv1d(in_channels, out_channels, kernel_size=kernel_size, padding=padding, bias=bias)

    def forward(self, signal):
        if self.is_causal:
            signal = F.pad(signal, self.causal_padding)
        return self.conv(signal)


class PositionwiseConvFF(torch.nn.Module):
    def __init__(self, d_model, d_ffn, p_dropout, kernel_size=1, bias=False, is_causal=True):
        super().__init__()
        self.non_linearity = torch.nn.GELU(approximate="tanh")
        self.proj = ConvolutionLayer(d_model, d_ffn, bias=bias, kernel_size=kernel_size, is_causal=is_causal)
        self.o_net = ConvolutionLayer(d_ffn, d_model, bias=bias, kernel_size=kernel_size, is_causal=is_causal)
        self.dropout = torch.nn.Dropout(p_dropout)

    def forward(self, x):
        x = self.non_linearity(self.proj(x.transpose(1, 2)))
        return self.dropout(self.o_net(x).transpose(1, 2))


class SelfAttention(torch.nn.Module):
    def __init__(self, n_heads, d_model, p_dropout, is_causal=True, max_length_causal_mask=64):
        super().__init__()
        self.d_head = d_model // n_heads
        self.n_heads = n_heads
        self.scale = self.d_head ** -0.5
        self.is_causal = is_causal
        self.o_net = torch.nn.Linear(n_heads * self.d_head, d_model, bias=False)
        self.dropout = torch.nn.Dropout(p_dropout)
        if is_causal:
            self.register_buffer(
                "causal_mask",
                torch.tril(torch.ones(max_length_causal_mask, max_length_causal_mask)).view(
                    1, 1, max_length_causal_mask, max_length_causal_mask
                ),
            )
        self.qkv_net = torch.nn.Linear(d_model, 3 * n_heads * self.d_head, bias=False)

    def compute_qkv_and_mask(self, query, query_mask=None):
        B, T, _ = query.shape
        qkv = self.qkv_net(query).reshape(B, T, 3, self.n_heads, self.d_head)
        q, k, v = qkv.chunk(3, dim=2)
        q, k, v = q.squeeze(2), k.squeeze(2), v.squeeze(2)
        if FIXED:
            # query_mask is a boolean mask of shape (B, T)
            # mask should be of shape (B, 1, T, T) where mask[:,0,i,:] == mask[:,0,:,i] == query_mask
            mask = query_mask.unsqueeze(1) * query_mask.unsqueeze(2)
            mask = mask.unsqueeze(1)
        else:
            mask = query_mask[:, None, :, None] if query_mask is not None else None
        return q, k, v, mask

    def attn_naive(self, query, query_mask=None):
        q, k, v, mask = self.compute_qkv_and_mask(query=query, query_mask=query_mask)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        B, T, _ = query.shape
        attn_score = torch.matmul(q, k.transpose(2, 3)) * self.scale
        if mask is not None:
            # assumes there's at least one mask
            attn_score.masked_fill_(mask == 0, float("-inf"))
        if self.is_causal:
            attn_score.masked_fill_(self.causal_mask[..., :T, :T] == 0, float("-inf"))
        attn_prob = F.softmax(attn_score, dim=-1)
        if mask is not None:
            attn_prob = attn_prob.masked_fill(mask == 0, 0.0)
        attn_prob = self.dropout(attn_prob)
        y = torch.matmul(attn_prob, v)
        y = y.transpose(1, 2).contiguous().view(B, T, -1)
        return y, [attn_prob, attn_score]

    def forward(self, query, query_mask=None):
        y, attn_prob = self.attn_naive(query, query_mask)
        return self.dropout(self.o_net(y)), attn_prob


class TransformerLayer(torch.nn.Module):
    def __init__(self, d_model, d_ffn, sa_n_heads, kernel_size, p_dropout, is_causal):
        super().__init__()
        self.norm_self = torch.nn.LayerNorm(d_model, bias=False)
        self.self_attention = SelfAttention(sa_n_heads, d_model, p_dropout, is_causal=is_causal)
        self.norm_pos_ff = torch.nn.LayerNorm(d_model, bias=False)
        self.pos_ff = PositionwiseConvFF(d_model, d_ffn, p_dropout, kernel_size=kernel_size, is_causal=is_causal)

    def forward(self, x, x_mask):
        x = x * x_mask.unsqueeze(-1)
        x_, s_attn_prob = self.self_attention(query=self.norm_self(x), query_mask=x_mask)
        x = x + x_
        # mlp final projection
        x = x + self.pos_ff(self.norm_pos_ff(x))
        x = x * x_mask.unsqueeze(-1)
        return {"output": x, "attn_probabilities": {"self_attn_probabilities": s_attn_prob}}


class Transformer(torch.nn.Module):
    def __init__(self, n_layers, d_model, d_ffn, sa_n_heads, kernel_size, p_dropout=0.0, is_causal=True):
        super().__init__()
        self.layers = torch.nn.ModuleList(
            [TransformerLayer(d_model, d_ffn, sa_n_heads, kernel_size, p_dropout, is_causal) for _ in range(n_layers)]
        )
        self.norm_out = torch.nn.LayerNorm(d_model, bias=False)

    def forward(self, x, x_mask):
        for layer in self.layers:
            x = layer(x, x_mask)["output"]
        return {"output": self.norm_out(x)}


# MagpieTTS text encoder: non-causal transformer over embedded text tokens (kernel_size 1 so only attention mixes time)
d_model = 32
text_embedding = torch.nn.Embedding(50, d_model)
encoder = Transformer(n_layers=2, d_model=d_model, d_ffn=64, sa_n_heads=4, kernel_size=1, is_causal=False).eval()

lens = torch.tensor([12, 7])
text = torch.randint(1, 50, (2, 12))
text_mask = torch.arange(12)[None, :] < lens[:, None]  # get_mask_from_lengths
text = text * text_mask

with torch.no_grad():
    batched = encoder(text_embedding(text), text_mask)["output"]
    alone = encoder(text_embedding(text[1:, :7]), text_mask[1:, :7])["output"]
print(f"short text: max |batched - alone| over its valid frames = {(batched[1, :7] - alone[0]).abs().max().item():.6f}")
