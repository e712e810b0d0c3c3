# huggingface/transformers#23051 (issue #22903): Pix2StructTextConfig defaulted to is_decoder=False, so
# get_extended_attention_mask built a padding-only mask and the text decoder attended to future tokens in training.
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class Pix2StructTextConfig:
    def __init__(self, vocab_size=64, hidden_size=32, d_kv=8, num_heads=4, num_layers=2,
                 relative_attention_num_buckets=8, is_decoder=False, **kwargs):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.d_kv = d_kv
        self.num_heads = num_heads
        self.num_layers = num_layers
        self.relative_attention_num_buckets = relative_attention_num_buckets
        self.is_decoder = is_decoder


def get_extended_attention_mask(config, attention_mask, input_shape, dtype=torch.float32):
    # ModuleUtilsMixin.get_extended_attention_mask, as Pix2StructTextModel used it
    if config.is_decoder:
        batch_size, seq_length = input_shape
        seq_ids = torch.arange(seq_length)
        causal_mask = seq_ids[None, None, :].repeat(batch_size, seq_length, 1) <= seq_ids[None, :, None]
        causal_mask = causal_mask.to(attention_mask.dtype)
        extended_attention_mask = causal_mask[:, None, :, :] * attention_mask[:, None, None, :]
    else:
        extended_attention_mask = attention_mask[:, None, None, :]
    extended_attention_mask = extended_attention_mask.to(dtype)
    return (1.0 - extended_attention_mask) * torch.finfo(dtype).min


class Pix2StructTextAttention(nn.Module):
    def __init__(self, config, has_relative_attention_bias=False):
        super().__init__()
        self.n_heads, self.key_value_proj_dim = config.num_heads, config.d_kv
        inner = self.n_heads * self.key_value_proj_dim
        self.query = nn.Linear(config.hidden_size, inner, bias=False)
        self.key = nn.Linear(config.hidden_size, inner, bias=False)
        self.value = nn.Linear(config.hidden_size, inner, bias=False)
        self.output = nn.Linear(inner, config.hidden_size, bias=False)
        self.num_buckets = config.relative_attention_num_buckets
        if has_relative_attention_bias:
            self.relative_attention_bias = nn.Embedding(self.num_buckets, self.n_heads)
        self.has_relative_attention_bias = has_relative_attention_bias

    def compute_bias(self, q_len, k_len):
        rel = torch.arange(k_len)[None, :] - torch.arange(q_len)[:, None]
        buckets = rel.clamp(-(self.num_buckets // 2), self.num_buckets // 2 - 1) + self.num_buckets // 2
        return self.relative_attention_bias(buckets).permute(2, 0, 1).unsqueeze(0)

    def forward(self, hidden_states, mask=None, position_bias=None, key_value_states=None):
        b, q_len, _ = hidden_states.shape
        kv = hidden_states if key_value_states is None else key_value_states

        def shape(x):
            return x.view(b, -1, self.n_heads, self.key_value_proj_dim).transpose(1, 2)

        q, k, v = shape(self.query(hidden_states)), shape(self.key(kv)), shape(self.value(kv))
        scores = torch.matmul(q, k.transpose(3, 2))
        if position_bias is None:
            if self.has_relative_attention_bias:
                position_bias = self.compute_bias(q_len, k.shape[2])
            else:
                position_bias = torch.zeros((1, self.n_heads, q_len, k.shape[2]))
            if mask is not None:
                position_bias = position_bias + mask
        scores = scores + position_bias
        attn_weights = nn.functional.softmax(scores.float(), dim=-1).type_as(scores)
        out = torch.matmul(attn_weights, v).transpose(1, 2).reshape(b, q_len, -1)
        return self.output(out), position_bias


class Pix2StructTextBlock(nn.Module):
    def __init__(self, config, has_relative_attention_bias=False):
        super().__init__()
        self.self_attention = Pix2StructTextAttention(config, has_relative_attention_bias)
        self.encoder_decoder_attention = Pix2StructTextAttention(config)
        self.mlp = nn.Sequential(nn.Linear(config.hidden_size, 64), nn.GELU(), nn.Linear(64, config.hidden_size))
        self.ln1, self.ln2, self.ln3 = (nn.LayerNorm(config.hidden_size) for _ in range(3))

    def forward(self, h, attention_mask, position_bias, encoder_hidden_states, encoder_extended_attention_mask):
        a, position_bias = self.self_attention(self.ln1(h), mask=attention_mask, position_bias=position_bias)
        h = h + a
        c, _ = self.encoder_decoder_attention(self.ln2(h), mask=encoder_extended_attention_mask,
                                              key_value_states=encoder_hidden_states)
        h = h + c
        return h + self.mlp(self.ln3(h)), position_bias


class Pix2StructTextModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layer = nn.ModuleList(
            [Pix2StructTextBlock(config, has_relative_attention_bias=(i == 0)) for i in range(config.num_layers)])
        self.final_layer_norm = nn.LayerNorm(config.hidden_size)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, attention_mask=None, encoder_hidden_states=None, encoder_attention_mask=None,
                labels=None):
        input_shape = input_ids.size()
        h = self.embed_tokens(input_ids)
        if attention_mask is None:
            attention_mask = torch.ones(input_shape)
        extended_attention_mask = get_extended_attention_mask(self.config, attention_mask, input_shape)
        encoder_extended_attention_mask = (1.0 - encoder_attention_mask[:, None, None, :].float()) * torch.finfo(
            torch.float32).min
        position_bias = None
        for block in self.layer:
            h, position_bias = block(h, extended_attention_mask, position_bias, encoder_hidden_states,
                                     encoder_extended_attention_mask)
        logits = self.lm_head(self.final_layer_norm(h))
        loss = None
        if labels is not None:
            loss = nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1), ignore_index=-100)
        return logits, loss


def shift_right(labels, start_id=0):
    shifted = labels.new_zeros(labels.shape)
    shifted[:, 1:] = labels[:, :-1].clone()
    shifted[:, 0] = start_id
    return shifted.masked_fill(shifted == -100, 0)


# before the fix Pix2StructTextConfig() left is_decoder=False; the fix made the default is_decoder=True
config = Pix2StructTextConfig(is_decoder=True) if FIXED else Pix2StructTextConfig()
model = Pix2StructTextModel(config)

# encoder output of the vision encoder (flattened patches), second image padded
encoder_hidden_states = torch.randn(2, 12, config.hidden_size)
encoder_attention_mask = torch.ones(2, 12, dtype=torch.long)
encoder_attention_mask[1, 9:] = 0

labels = torch.randint(1, config.vocab_size, (2, 7))
decoder_input_ids = shift_right(labels)
decoder_attention_mask = torch.ones_like(decoder_input_ids)

logits, loss = model(decoder_input_ids, decoder_attention_mask, encoder_hidden_states, encoder_attention_mask,
                     labels=labels)

# change only the last decoder input token: a causal decoder's earlier logits must not move
changed = decoder_input_ids.clone()
changed[:, -1] = (changed[:, -1] + 1) % config.vocab_size
logits2, _ = model(changed, decoder_attention_mask, encoder_hidden_states, encoder_attention_mask, labels=labels)
leak = (logits[:, :-1] - logits2[:, :-1]).abs().max().item()
print(f"is_decoder={config.is_decoder} training loss={loss.item():.4f} "
      f"future-token leak into earlier logits={leak:.3e}")
