# OpenNMT/OpenNMT-py#1044 (fixed in #1045): TransformerDecoderLayer.forward built dec_mask from the target
# padding and the subsequent mask, then a leftover `dec_mask = None` threw it away before self-attention.
import sys
import math
import numpy as np
import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
MAX_SIZE = 64


class MultiHeadedAttention(nn.Module):
    def __init__(self, head_count, model_dim, dropout=0.1):
        super().__init__()
        assert model_dim % head_count == 0
        self.dim_per_head = model_dim // head_count
        self.model_dim = model_dim
        self.head_count = head_count
        self.linear_keys = nn.Linear(model_dim, head_count * self.dim_per_head)
        self.linear_values = nn.Linear(model_dim, head_count * self.dim_per_head)
        self.linear_query = nn.Linear(model_dim, head_count * self.dim_per_head)
        self.softmax = nn.Softmax(dim=-1)
        self.dropout = nn.Dropout(dropout)
        self.final_linear = nn.Linear(model_dim, model_dim)

    def forward(self, key, value, query, mask=None):
        batch_size = key.size(0)
        dim_per_head, head_count = self.dim_per_head, self.head_count

        def shape(x):
            return x.view(batch_size, -1, head_count, dim_per_head).transpose(1, 2)

        def unshape(x):
            return x.transpose(1, 2).contiguous().view(batch_size, -1, head_count * dim_per_head)

        key = shape(self.linear_keys(key))
        value = shape(self.linear_values(value))
        query = shape(self.linear_query(query))
        query = query / math.sqrt(dim_per_head)
        scores = torch.matmul(query, key.transpose(2, 3))
        if mask is not None:
            mask = mask.unsqueeze(1)  # [B, 1, 1|T_q, T_k]
            scores = scores.masked_fill(mask, -1e18)
        attn = self.softmax(scores)
        drop_attn = self.dropout(attn)
        context = unshape(torch.matmul(drop_attn, value))
        return self.final_linear(context), attn


class PositionwiseFeedForward(nn.Module):
    def __init__(self, d_model, d_ff, dropout=0.1):
        super().__init__()
        self.w_1 = nn.Linear(d_model, d_ff)
        self.w_2 = nn.Linear(d_ff, d_model)
        self.layer_norm = nn.LayerNorm(d_model, eps=1e-6)
        self.dropout_1 = nn.Dropout(dropout)
        self.relu = nn.ReLU()
        self.dropout_2 = nn.Dropout(dropout)

    def forward(self, x):
        inter = self.dropout_1(self.relu(self.w_1(self.layer_norm(x))))
        return self.dropout_2(self.w_2(inter)) + x


class TransformerDecoderLayer(nn.Module):
    def __init__(self, d_model, heads, d_ff, dropout):
        super().__init__()
        self.self_attn = MultiHeadedAttention(heads, d_model, dropout=dropout)
        self.context_attn = MultiHeadedAttention(heads, d_model, dropout=dropout)
        self.feed_forward = PositionwiseFeedForward(d_model, d_ff, dropout)
        self.layer_norm_1 = nn.LayerNorm(d_model, eps=1e-6)
        self.layer_norm_2 = nn.LayerNorm(d_model, eps=1e-6)
        self.drop = nn.Dropout(dropout)
        mask = self._get_attn_subsequent_mask(MAX_SIZE)
        self.register_buffer('mask', mask)

    def forward(self, inputs, memory_bank, src_pad_mask, tgt_pad_mask):
        dec_mask = torch.gt(tgt_pad_mask + self.mask[:, :tgt_pad_mask.size(-1), :tgt_pad_mask.size(-1)], 0)
        if not FIXED:
            dec_mask = None
        input_norm = self.layer_norm_1(inputs)
        query, attn = self.self_attn(input_norm, input_norm, input_norm, mask=dec_mask)
        query = self.drop(query) + inputs
        query_norm = self.layer_norm_2(query)
        mid, attn = self.context_attn(memory_bank, memory_bank, query_norm, mask=src_pad_mask)
        output = self.feed_forward(self.drop(mid) + query)
        return output, attn

    def _get_attn_subsequent_mask(self, size):
        attn_shape = (1, size, size)
        subsequent_mask = np.triu(np.ones(attn_shape), k=1).astype('uint8')
        return torch.from_numpy(subsequent_mask)


class TransformerDecoder(nn.Module):
    def __init__(self, num_layers, d_model, heads, d_ff, dropout, embeddings, padding_idx):
        super().__init__()
        self.embeddings = embeddings
        self.padding_idx = padding_idx
        self.transformer_layers = nn.ModuleList(
            [TransformerDecoderLayer(d_model, heads, d_ff, dropout) for _ in range(num_layers)])
        self.layer_norm = nn.LayerNorm(d_model, eps=1e-6)

    def forward(self, tgt, memory_bank, src):
        emb = self.embeddings(tgt)
        output = emb
        src_pad_mask = src.eq(self.padding_idx).unsqueeze(1)  # [B, 1, src_len]
        tgt_pad_mask = tgt.eq(self.padding_idx).unsqueeze(1)  # [B, 1, tgt_len]
        for layer in self.transformer_layers:
            output, attn = layer(output, memory_bank, src_pad_mask, tgt_pad_mask)
        return self.layer_norm(output)


class Embeddings(nn.Module):
    def __init__(self, d_model, vocab_size, padding_idx):
        super().__init__()
        self.word = nn.Embedding(vocab_size, d_model, padding_idx=padding_idx)
        pe = torch.zeros(MAX_SIZE, d_model)
        position = torch.arange(0, MAX_SIZE).unsqueeze(1).float()
        div_term = torch.exp(torch.arange(0, d_model, 2).float() * -(math.log(10000.0) / d_model))
        pe[:, 0::2] = torch.sin(position * div_term)
        pe[:, 1::2] = torch.cos(position * div_term)
        self.register_buffer('pe', pe.unsqueeze(0))
        self.d_model = d_model

    def forward(self, x):
        return self.word(x) * math.sqrt(self.d_model) + self.pe[:, :x.size(1)]


PAD, vocab, d_model = 1, 30, 32
decoder = TransformerDecoder(2, d_model, 4, 64, 0.1, Embeddings(d_model, vocab, PAD), PAD)
generator = nn.Linear(d_model, vocab)
optim = torch.optim.Adam(list(decoder.parameters()) + list(generator.parameters()), lr=1e-3)

src = torch.tensor([[5, 6, 7, 8, 9], [10, 11, 12, PAD, PAD]])
memory_bank = torch.randn(2, 5, d_model)
tgt = torch.tensor([[2, 13, 14, 15, 16, 3], [2, 17, 18, 3, PAD, PAD]])
dec_in, gold = tgt[:, :-1], tgt[:, 1:]

# a few teacher-forced training steps, the step that uses the decoder self-attention mask
for step in range(5):
    optim.zero_grad()
    logits = generator(decoder(dec_in, memory_bank, src))
    loss = nn.functional.cross_entropy(logits.reshape(-1, vocab), gold.reshape(-1), ignore_index=PAD)
    loss.backward()
    optim.step()
print('train loss %.4f' % loss.item())

decoder.eval()
with torch.no_grad():
    a = generator(decoder(dec_in, memory_bank, src))
    changed = dec_in.clone()
    changed[0, 3:] = torch.tensor([20, 21])  # only later target tokens of sentence 0 differ
    b = generator(decoder(changed, memory_bank, src))
print('max change of logits at positions 0..2 when only target tokens 3.. change: %.5f'
      % (a[0, :3] - b[0, :3]).abs().max().item())
