"""PEFT prefix tuning on a BERT-style classifier: 6 virtual key/value tokens per layer, always visible.

Follows huggingface/peft src/peft/tuners/prefix_tuning/model.py (PrefixEncoder with
prefix_projection) and src/peft/peft_model.py (PeftModelForSequenceClassification: `prefix_attention_mask =
torch.ones(batch_size, num_virtual_tokens)`, `attention_mask = torch.cat((prefix_attention_mask,
attention_mask), dim=1)`, get_prompt's view/permute/split into per-layer (key, value) pairs passed
as past_key_values). The frozen encoder is a plain-torch BERT whose self-attention prepends the past
keys/values and adds the extended mask (1 - mask) * finfo.min over [virtual ; real] keys.
Queries are only the real tokens (L) while keys are 6 + L: the virtual tokens carry no query and are
not in the past of anything, they are trained prompts that every token may read.
Mask meant: [L x (6 + L)] per sample, bidirectional, the 6 virtual keys visible to every query,
right-padded real keys hidden.
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class PrefixTuningConfig:
    num_virtual_tokens: int = 6
    token_dim: int = 64
    num_transformer_submodules: int = 1
    num_attention_heads: int = 4
    num_layers: int = 2
    encoder_hidden_size: int = 32
    prefix_projection: bool = True


class PrefixEncoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.prefix_projection = config.prefix_projection
        token_dim, num_layers = config.token_dim, config.num_layers
        if self.prefix_projection:
            self.embedding = nn.Embedding(config.num_virtual_tokens, token_dim)
            self.transform = nn.Sequential(nn.Linear(token_dim, config.encoder_hidden_size), nn.Tanh(),
                                           nn.Linear(config.encoder_hidden_size, num_layers * 2 * token_dim))
        else:
            self.embedding = nn.Embedding(config.num_virtual_tokens, num_layers * 2 * token_dim)

    def forward(self, prefix):
        if self.prefix_projection:
            return self.transform(self.embedding(prefix))
        return self.embedding(prefix)


class BertSelfAttention(nn.Module):
    def __init__(self, hidden, heads):
        super().__init__()
        self.num_attention_heads = heads
        self.attention_head_size = hidden // heads
        self.query = nn.Linear(hidden, hidden)
        self.key = nn.Linear(hidden, hidden)
        self.value = nn.Linear(hidden, hidden)

    def transpose_for_scores(self, x):
        b, n, _ = x.shape
        return x.view(b, n, self.num_attention_heads, self.attention_head_size).permute(0, 2, 1, 3)

    def forward(self, hidden_states, attention_mask, past_key_value=None):
        query_layer = self.transpose_for_scores(self.query(hidden_states))
        key_layer = self.transpose_for_scores(self.key(hidden_states))
        value_layer = self.transpose_for_scores(self.value(hidden_states))
        if past_key_value is not None:
            key_layer = torch.cat([past_key_value[0], key_layer], dim=2)
            value_layer = torch.cat([past_key_value[1], value_layer], dim=2)
        scores = torch.matmul(query_layer, key_layer.transpose(-1, -2)) / self.attention_head_size ** 0.5
        scores = scores + attention_mask
        probs = F.softmax(scores, dim=-1)
        ctx = torch.matmul(probs, value_layer).permute(0, 2, 1, 3)
        return ctx.reshape(ctx.shape[0], ctx.shape[1], -1)


class BertLayer(nn.Module):
    def __init__(self, hidden, heads):
        super().__init__()
        self.attention = BertSelfAttention(hidden, heads)
        self.attn_out = nn.Linear(hidden, hidden)
        self.ln1 = nn.LayerNorm(hidden)
        self.ffn = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))
        self.ln2 = nn.LayerNorm(hidden)

    def forward(self, x, attention_mask, past_key_value=None):
        x = self.ln1(x + self.attn_out(self.attention(x, attention_mask, past_key_value)))
        return self.ln2(x + self.ffn(x))


class BertForSequenceClassification(nn.Module):
    def __init__(self, vocab_size=100, hidden=64, heads=4, layers=2, max_position=32, num_labels=3):
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab_size, hidden)
        self.position_embeddings = nn.Embedding(max_position, hidden)
        self.emb_ln = nn.LayerNorm(hidden)
        self.layer = nn.ModuleList([BertLayer(hidden, heads) for _ in range(layers)])
        self.classifier = nn.Linear(hidden, num_labels)

    def get_extended_attention_mask(self, attention_mask, dtype):
        extended = attention_mask[:, None, None, :].to(dtype)
        return (1.0 - extended) * torch.finfo(dtype).min

    def forward(self, input_ids, attention_mask, past_key_values=None):
        seq_length = input_ids.shape[1]
        x = self.word_embeddings(input_ids) + self.position_embeddings(torch.arange(seq_length))
        x = self.emb_ln(x)
        extended_attention_mask = self.get_extended_attention_mask(attention_mask, x.dtype)
        for i, layer in enumerate(self.layer):
            x = layer(x, extended_attention_mask, past_key_values[i] if past_key_values is not None else None)
        return self.classifier(x[:, 0])


class PeftModelForSequenceClassification(nn.Module):
    def __init__(self, base_model, peft_config):
        super().__init__()
        self.base_model = base_model
        self.peft_config = peft_config
        self.prompt_encoder = PrefixEncoder(peft_config)
        self.register_buffer("prompt_tokens", torch.arange(peft_config.num_virtual_tokens).long())
        for p in self.base_model.parameters():
            p.requires_grad_(False)

    def get_prompt(self, batch_size):
        cfg = self.peft_config
        prompt_tokens = self.prompt_tokens.unsqueeze(0).expand(batch_size, -1)
        past_key_values = self.prompt_encoder(prompt_tokens)
        past_key_values = past_key_values.view(batch_size, cfg.num_virtual_tokens, cfg.num_layers * 2,
                                               cfg.num_attention_heads, cfg.token_dim // cfg.num_attention_heads)
        return past_key_values.permute([2, 0, 3, 1, 4]).split(2)

    def forward(self, input_ids, attention_mask):
        batch_size = input_ids.shape[0]
        # the virtual tokens are keys for every real token: their mask entries are ones
        prefix_attention_mask = torch.ones(batch_size, self.peft_config.num_virtual_tokens)
        attention_mask = torch.cat((prefix_attention_mask, attention_mask), dim=1)
        past_key_values = self.get_prompt(batch_size)
        return self.base_model(input_ids=input_ids, attention_mask=attention_mask, past_key_values=past_key_values)


if __name__ == "__main__":
    torch.manual_seed(0)
    peft_config = PrefixTuningConfig()
    model = PeftModelForSequenceClassification(BertForSequenceClassification(), peft_config).eval()
    input_ids = torch.tensor([[2, 15, 16, 17, 3, 0, 0, 0],
                              [2, 40, 41, 42, 43, 44, 45, 3],
                              [2, 70, 3, 0, 0, 0, 0, 0]])
    attention_mask = (input_ids != 0).float()
    with torch.no_grad():
        logits = model(input_ids, attention_mask)
    print("logits", tuple(logits.shape))
