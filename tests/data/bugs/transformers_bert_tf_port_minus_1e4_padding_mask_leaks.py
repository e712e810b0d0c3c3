# huggingface/transformers#17306: the BERT attention ported from the TF reference built its padding mask as
# (1.0 - mask) * -10000.0; with large attention scores -1e4 does not remove padded keys. Fix: finfo(dtype).min.
import math
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class BertConfig:
    vocab_size = 50
    hidden_size = 32
    num_attention_heads = 4
    num_hidden_layers = 2
    intermediate_size = 64
    max_position_embeddings = 16


class BertSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_attention_heads = config.num_attention_heads
        self.attention_head_size = config.hidden_size // config.num_attention_heads
        self.all_head_size = self.num_attention_heads * self.attention_head_size
        self.query = nn.Linear(config.hidden_size, self.all_head_size)
        self.key = nn.Linear(config.hidden_size, self.all_head_size)
        self.value = nn.Linear(config.hidden_size, self.all_head_size)

    def transpose_for_scores(self, x):
        new_x_shape = x.size()[:-1] + (self.num_attention_heads, self.attention_head_size)
        return x.view(new_x_shape).permute(0, 2, 1, 3)

    def forward(self, hidden_states, attention_mask=None):
        query_layer = self.transpose_for_scores(self.query(hidden_states))
        key_layer = self.transpose_for_scores(self.key(hidden_states))
        value_layer = self.transpose_for_scores(self.value(hidden_states))
        attention_scores = torch.matmul(query_layer, key_layer.transpose(-1, -2))
        attention_scores = attention_scores / math.sqrt(self.attention_head_size)
        if attention_mask is not None:
            attention_scores = attention_scores + attention_mask
        attention_probs = nn.functional.softmax(attention_scores, dim=-1)
        context_layer = torch.matmul(attention_probs, value_layer)
        context_layer = context_layer.permute(0, 2, 1, 3).contiguous()
        return context_layer.view(context_layer.size()[:-2] + (self.all_head_size,))


class BertLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.attention = BertSelfAttention(config)
        self.output = nn.Linear(config.hidden_size, config.hidden_size)
        self.ln1 = nn.LayerNorm(config.hidden_size)
        self.ffn = nn.Sequential(nn.Linear(config.hidden_size, config.intermediate_size), nn.GELU(),
                                 nn.Linear(config.intermediate_size, config.hidden_size))
        self.ln2 = nn.LayerNorm(config.hidden_size)

    def forward(self, hidden_states, attention_mask=None):
        h = self.ln1(hidden_states + self.output(self.attention(hidden_states, attention_mask)))
        return self.ln2(h + self.ffn(h))


class BertModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.layer = nn.ModuleList([BertLayer(config) for _ in range(config.num_hidden_layers)])
        self.dtype = torch.float32

    def get_extended_attention_mask(self, attention_mask):
        extended_attention_mask = attention_mask[:, None, None, :]
        extended_attention_mask = extended_attention_mask.to(dtype=self.dtype)  # fp16 compatibility
        if FIXED:
            extended_attention_mask = (1.0 - extended_attention_mask) * torch.finfo(self.dtype).min
        else:
            extended_attention_mask = (1.0 - extended_attention_mask) * -10000.0
        return extended_attention_mask

    def forward(self, input_ids, attention_mask=None):
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        pos = torch.arange(input_ids.shape[1])[None]
        hidden_states = self.word_embeddings(input_ids) + self.position_embeddings(pos)
        extended_attention_mask = self.get_extended_attention_mask(attention_mask)
        for layer in self.layer:
            hidden_states = layer(hidden_states, extended_attention_mask)
        return hidden_states


config = BertConfig()
model = BertModel(config).eval()
with torch.no_grad():
    # a converted checkpoint with large-magnitude activations (e.g. unnormalised outlier features)
    model.word_embeddings.weight.mul_(40.0)
    for layer in model.layer:
        layer.attention.query.weight.mul_(8.0)
        layer.attention.key.weight.mul_(8.0)

input_ids = torch.tensor([[5, 9, 13, 21, 7, 3, 0, 0],
                          [11, 4, 8, 2, 0, 0, 0, 0]])
attention_mask = (input_ids != 0).long()

with torch.no_grad():
    batched = model(input_ids, attention_mask=attention_mask)
    worst = 0.0
    for b in range(input_ids.shape[0]):
        n = int(attention_mask[b].sum())
        alone = model(input_ids[b:b + 1, :n])
        worst = max(worst, (batched[b, :n] - alone[0]).abs().max().item())
print(f"fixed={FIXED} max |padded batch - unpadded| over real tokens: {worst:.3e}")
