# RUCAIBox/TextBox#60 (commit f023ad3, "FIX: fix bug in transformer encoder-decoder"); pre-fix files read at f023ad3^.
# TextBox's MultiHeadAttention applied both the causal `attn_mask` and the `key_padding_mask` with
# `attn_weights.masked_fill_(mask, 1e-10)`, i.e. it set the masked scores to ~0 instead of removing them, so the
# Transformer LM still attended to future tokens and to padding during training. The fix fills with float('-inf').
# (--fixed applies only the two masked_fill_ lines of that commit; its other changes are unrelated to attention.)
import math
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.init import constant_, xavier_normal_

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

config = {
    "embedding_size": 64,
    "ffn_size": 128,
    "num_dec_layers": 2,
    "num_heads": 8,
    "attn_dropout_ratio": 0.2,
    "attn_weight_dropout_ratio": 0.2,
    "ffn_dropout_ratio": 0.2,
    "ffn_activation_func": "gelu",
    "vocab_size": 60,
}
MASK_FILL = float("-inf") if FIXED else 1e-10


def xavier_normal_initialization(module):
    if isinstance(module, nn.Embedding):
        xavier_normal_(module.weight.data)
    elif isinstance(module, nn.Linear):
        xavier_normal_(module.weight.data)
        if module.bias is not None:
            constant_(module.bias.data, 0)


class SinusoidalPositionalEmbedding(nn.Module):
    def __init__(self, embedding_size, max_length=512):
        super(SinusoidalPositionalEmbedding, self).__init__()
        self.embedding_size = embedding_size
        self.weights = SinusoidalPositionalEmbedding.get_embedding(max_length, embedding_size)

    @staticmethod
    def get_embedding(max_length, embedding_size):
        half_dim = embedding_size // 2
        emb = math.log(10000) / (half_dim - 1)
        emb = torch.exp(torch.arange(half_dim, dtype=torch.float) * -emb)
        emb = torch.arange(max_length, dtype=torch.float).unsqueeze(1) * emb.unsqueeze(0)
        emb = torch.cat([torch.sin(emb), torch.cos(emb)], dim=1).view(max_length, -1)
        return emb

    def forward(self, input_seq, offset=0):
        batch_size, seq_len = input_seq.size()
        positions = offset + torch.arange(seq_len)
        return self.weights.index_select(0, positions).unsqueeze(0).expand(batch_size, -1, -1).detach()


class MultiHeadAttention(torch.nn.Module):
    def __init__(self, embedding_size, num_heads, attn_weights_dropout_ratio=0.0):
        super(MultiHeadAttention, self).__init__()
        self.embedding_size = embedding_size
        self.num_heads = num_heads
        self.head_size = embedding_size // num_heads
        self.scaling = self.head_size ** -0.5
        self.query_proj = nn.Linear(embedding_size, embedding_size)
        self.key_proj = nn.Linear(embedding_size, embedding_size)
        self.value_proj = nn.Linear(embedding_size, embedding_size)
        self.out_proj = nn.Linear(embedding_size, embedding_size)
        self.weight_dropout = nn.Dropout(attn_weights_dropout_ratio)

    def forward(self, query, key, value, key_padding_mask=None, attn_mask=None):
        batch_size, tgt_len, embedding_size = query.size()
        src_len = key.size(1)
        q = self.query_proj(query) * self.scaling
        k = self.key_proj(key)
        v = self.value_proj(value)
        q = q.view(batch_size, tgt_len, self.num_heads, self.head_size).permute(0, 2, 1, 3)
        k = k.view(batch_size, src_len, self.num_heads, self.head_size).permute(0, 2, 3, 1)
        v = v.view(batch_size, src_len, self.num_heads, self.head_size).permute(0, 2, 1, 3)

        attn_weights = torch.matmul(q, k)
        if attn_mask is not None:
            attn_weights.masked_fill_(attn_mask.unsqueeze(0), MASK_FILL)
        if key_padding_mask is not None:
            attn_weights.masked_fill_(key_padding_mask.unsqueeze(1).unsqueeze(2), MASK_FILL)

        attn_weights = self.weight_dropout(F.softmax(attn_weights, dim=-1))
        attn_repre = torch.matmul(attn_weights, v)
        attn_repre = attn_repre.transpose(1, 2).contiguous().view(batch_size, tgt_len, embedding_size)
        attn_repre = self.out_proj(attn_repre)
        attn_weights, _ = attn_weights.max(dim=1)
        return attn_repre, attn_weights


class SelfAttentionMask(torch.nn.Module):
    def __init__(self, init_size=100):
        super(SelfAttentionMask, self).__init__()
        self.weights = SelfAttentionMask.get_mask(init_size)

    @staticmethod
    def get_mask(size):
        weights = torch.ones((size, size), dtype=torch.uint8).triu_(1)
        return weights

    def forward(self, size):
        if self.weights is None or size > self.weights.size(0):
            self.weights = SelfAttentionMask.get_mask(size)
        return self.weights[:size, :size].detach()


class FeedForward(nn.Module):
    def __init__(self, embedding_size, inner_size, activate_function):
        super(FeedForward, self).__init__()
        self.dense_1 = nn.Linear(embedding_size, inner_size)
        self.dense_2 = nn.Linear(inner_size, embedding_size)
        self.intermediate_act_func = {"gelu": self.gelu, "relu": F.relu}[activate_function]

    def gelu(self, x):
        return x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))

    def forward(self, input_tensor):
        return self.dense_2(self.intermediate_act_func(self.dense_1(input_tensor)))


class TransformerLayer(torch.nn.Module):
    def __init__(self, embedding_size, ffn_size, num_heads, attn_dropout_ratio=0.0, attn_weight_dropout_ratio=0.0,
                 ffn_dropout_ratio=0.0, ffn_activate_func='gelu'):
        super(TransformerLayer, self).__init__()
        self.multi_head_attention = MultiHeadAttention(embedding_size, num_heads, attn_weight_dropout_ratio)
        self.feed_forward = FeedForward(embedding_size, ffn_size, ffn_activate_func)
        self.attn_layer_norm = nn.LayerNorm(embedding_size)
        self.ffn_layer_norm = nn.LayerNorm(embedding_size)
        self.attn_dropout = nn.Dropout(attn_dropout_ratio)
        self.ffn_dropout = nn.Dropout(ffn_dropout_ratio)

    def forward(self, x, kv=None, self_padding_mask=None, self_attn_mask=None):
        residual = x
        if kv is None:
            x, self_attn_weights = self.multi_head_attention(query=x, key=x, value=x,
                                                             key_padding_mask=self_padding_mask,
                                                             attn_mask=self_attn_mask)
        else:
            x, self_attn_weights = self.multi_head_attention(query=x, key=kv, value=kv,
                                                             key_padding_mask=self_padding_mask,
                                                             attn_mask=self_attn_mask)
        x = self.attn_dropout(x)
        x = self.attn_layer_norm(residual + x)
        residual = x
        x = self.feed_forward(x)
        x = self.ffn_dropout(x)
        x = self.ffn_layer_norm(residual + x)
        return x, self_attn_weights, None


class TransformerDecoder(torch.nn.Module):
    def __init__(self, embedding_size, ffn_size, num_dec_layers, num_heads, attn_dropout_ratio=0.0,
                 attn_weight_dropout_ratio=0.0, ffn_dropout_ratio=0.0, ffn_activate_func='gelu'):
        super(TransformerDecoder, self).__init__()
        self.transformer_layers = nn.ModuleList()
        for _ in range(num_dec_layers):
            self.transformer_layers.append(
                TransformerLayer(embedding_size, ffn_size, num_heads, attn_dropout_ratio, attn_weight_dropout_ratio,
                                 ffn_dropout_ratio, ffn_activate_func))

    def forward(self, x, kv=None, self_padding_mask=None, self_attn_mask=None):
        for idx, layer in enumerate(self.transformer_layers):
            x, _, _ = layer(x, kv, self_padding_mask, self_attn_mask)
        return x


class Transformer(nn.Module):
    def __init__(self, config, padding_token_idx, sos_token_idx, eos_token_idx):
        super(Transformer, self).__init__()
        self.vocab_size = config['vocab_size']
        self.embedding_size = config['embedding_size']
        self.ffn_size = config['ffn_size']
        self.num_dec_layers = config['num_dec_layers']
        self.num_heads = config['num_heads']
        self.attn_dropout_ratio = config['attn_dropout_ratio']
        self.attn_weight_dropout_ratio = config['attn_weight_dropout_ratio']
        self.ffn_dropout_ratio = config['ffn_dropout_ratio']
        self.ffn_activation_func = config['ffn_activation_func']
        self.padding_token_idx = padding_token_idx
        self.sos_token_idx = sos_token_idx
        self.eos_token_idx = eos_token_idx

        self.token_embedder = nn.Embedding(self.vocab_size, self.embedding_size, padding_idx=self.padding_token_idx)
        self.position_embedder = SinusoidalPositionalEmbedding(self.embedding_size)
        self.self_attn_mask = SelfAttentionMask()
        self.decoder = TransformerDecoder(self.embedding_size, self.ffn_size, self.num_dec_layers, self.num_heads,
                                          self.attn_dropout_ratio, self.attn_weight_dropout_ratio,
                                          self.ffn_dropout_ratio, self.ffn_activation_func)
        self.vocab_linear = nn.Linear(self.embedding_size, self.vocab_size)
        self.vocab_linear.weight = self.token_embedder.weight
        self.loss = nn.CrossEntropyLoss(ignore_index=self.padding_token_idx)
        self.apply(xavier_normal_initialization)

    def calculate_loss(self, corpus, epoch_idx=-1):
        input_text = corpus['target_idx'][:, :-1]
        target_text = corpus['target_idx'][:, 1:]
        input_embeddings = self.token_embedder(input_text) + self.position_embedder(input_text)
        self_padding_mask = torch.eq(input_text, self.padding_token_idx)
        self_attn_mask = self.self_attn_mask(input_text.size(-1)).bool()
        token_repre = self.decoder(input_embeddings, self_padding_mask=self_padding_mask,
                                   self_attn_mask=self_attn_mask)
        token_logits = self.vocab_linear(token_repre)
        token_logits = token_logits.view(-1, token_logits.size(-1))
        target_text = target_text.contiguous().view(-1)
        return self.loss(token_logits, target_text)


PAD, SOS, EOS = 0, 1, 2
model = Transformer(config, PAD, SOS, EOS)
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
lengths = [20, 14, 9, 17]
target_idx = torch.full((len(lengths), max(lengths) + 2), PAD, dtype=torch.long)
for b, n in enumerate(lengths):
    target_idx[b, 0] = SOS
    target_idx[b, 1:n + 1] = torch.randint(3, config["vocab_size"], (n,))
    target_idx[b, n + 1] = EOS
model.train()
for step in range(5):
    optimizer.zero_grad()
    loss = model.calculate_loss({"target_idx": target_idx})
    loss.backward()
    optimizer.step()
print("loss after 5 steps %.4f" % loss.item())
