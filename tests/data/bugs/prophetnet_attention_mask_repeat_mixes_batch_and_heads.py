# huggingface/transformers#17455 (fixed by huggingface/transformers#21870): ProphetNet builds its padding masks with
# `attention_mask[:, None, :].repeat(num_heads, 1, 1)` (head-major) while the attention scores are laid out
# batch-major (`batch_size * num_attn_heads`), so in a padded batch each head uses another sample's padding mask.
import sys

import torch
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class ProphetNetConfig:
    vocab_size = 50
    hidden_size = 16
    num_encoder_attention_heads = 4
    num_decoder_attention_heads = 4
    encoder_ffn_dim = 32
    decoder_ffn_dim = 32
    pad_token_id = 0
    decoder_start_token_id = 0


class ProphetNetAttention(nn.Module):
    def __init__(self, config, num_attn_heads):
        super().__init__()
        hidden_size = config.hidden_size
        self.num_attn_heads = num_attn_heads
        self.head_dim = hidden_size // num_attn_heads
        self.key_proj = nn.Linear(hidden_size, hidden_size)
        self.value_proj = nn.Linear(hidden_size, hidden_size)
        self.query_proj = nn.Linear(hidden_size, hidden_size)
        self.out_proj = nn.Linear(hidden_size, hidden_size)

    def _shape(self, tensor, seq_len, bsz):
        return tensor.view(bsz, seq_len, self.num_attn_heads, self.head_dim).transpose(1, 2).contiguous()

    def forward(self, hidden_states, key_value_states=None, attention_mask=None):
        batch_size, tgt_len, hidden_size = hidden_states.size()
        kv = hidden_states if key_value_states is None else key_value_states
        query_states = self.query_proj(hidden_states) / (self.head_dim**0.5)
        key_states = self._shape(self.key_proj(kv), -1, batch_size)
        value_states = self._shape(self.value_proj(kv), -1, batch_size)
        query_states = self._shape(query_states, tgt_len, batch_size)
        if FIXED:
            # after #21870: 4-D scores, mask (batch, heads, 1 or tgt, src)
            attn_weights = torch.einsum("bsij,bskj->bsik", query_states, key_states)
            if attention_mask is not None:
                attn_weights = attn_weights + attention_mask
            attn_probs = nn.functional.softmax(attn_weights, dim=-1)
            attn_output = torch.einsum("bsij,bsjk->bsik", attn_probs, value_states)
        else:
            proj_shape = (batch_size * self.num_attn_heads, -1, self.head_dim)
            query_states = query_states.view(*proj_shape)
            key_states = key_states.view(*proj_shape)
            value_states = value_states.view(*proj_shape)
            attn_weights = torch.bmm(query_states, key_states.transpose(1, 2))
            if attention_mask is not None:  # don't attend to padding symbols
                attn_weights = attn_weights + attention_mask
            attn_probs = nn.functional.softmax(attn_weights, dim=-1)
            attn_output = torch.bmm(attn_probs, value_states)
            attn_output = attn_output.view(batch_size, self.num_attn_heads, tgt_len, self.head_dim)
        attn_output = attn_output.transpose(1, 2).reshape(batch_size, tgt_len, hidden_size)
        return self.out_proj(attn_output)


class ProphetNetFeedForward(nn.Module):
    def __init__(self, config, ffn_dim):
        super().__init__()
        self.intermediate = nn.Linear(config.hidden_size, ffn_dim)
        self.output = nn.Linear(ffn_dim, config.hidden_size)

    def forward(self, x):
        return self.output(nn.functional.gelu(self.intermediate(x)))


class ProphetNetEncoder(nn.Module):
    def __init__(self, config, word_embeddings):
        super().__init__()
        self.config = config
        self.word_embeddings = word_embeddings
        self.self_attn = ProphetNetAttention(config, config.num_encoder_attention_heads)
        self.self_attn_layer_norm = nn.LayerNorm(config.hidden_size)
        self.feed_forward = ProphetNetFeedForward(config, config.encoder_ffn_dim)
        self.feed_forward_layer_norm = nn.LayerNorm(config.hidden_size)

    def forward(self, input_ids, attention_mask):
        inputs_embeds = self.word_embeddings(input_ids)
        # prepare attention mask
        if FIXED:
            extended_attention_mask = (
                1.0 - attention_mask[:, None, None, :].repeat(1, self.config.num_encoder_attention_heads, 1, 1)
            ) * torch.finfo(inputs_embeds.dtype).min
        else:
            extended_attention_mask = (
                1.0 - attention_mask[:, None, :].repeat(self.config.num_encoder_attention_heads, 1, 1)
            ) * -10000.0
        extended_attention_mask = extended_attention_mask.to(inputs_embeds.dtype)
        h = inputs_embeds
        h = self.self_attn_layer_norm(h + self.self_attn(h, attention_mask=extended_attention_mask))
        h = self.feed_forward_layer_norm(h + self.feed_forward(h))
        return h


class ProphetNetDecoder(nn.Module):
    """Main stream only (the n-gram predict stream is left out of this reduction)."""

    def __init__(self, config, word_embeddings):
        super().__init__()
        self.config = config
        self.word_embeddings = word_embeddings
        self.self_attn = ProphetNetAttention(config, config.num_decoder_attention_heads)
        self.self_attn_layer_norm = nn.LayerNorm(config.hidden_size)
        self.cross_attn = ProphetNetAttention(config, config.num_decoder_attention_heads)
        self.cross_attn_layer_norm = nn.LayerNorm(config.hidden_size)
        self.feed_forward = ProphetNetFeedForward(config, config.decoder_ffn_dim)
        self.feed_forward_layer_norm = nn.LayerNorm(config.hidden_size)

    def forward(self, input_ids, encoder_hidden_states, encoder_attention_mask):
        h = self.word_embeddings(input_ids)
        batch_size, seq_length = h.shape[:2]
        heads = self.config.num_decoder_attention_heads
        causal_mask = torch.triu(torch.full((seq_length, seq_length), -float("inf")), 1)
        if FIXED:
            self_mask = causal_mask[None, None].expand(batch_size, heads, -1, -1)
            extended_encoder_attention_mask = (
                1.0 - encoder_attention_mask[:, None, None, :].repeat(1, heads, 1, 1)
            ) * torch.finfo(h.dtype).min
        else:
            self_mask = causal_mask[None].expand(batch_size, -1, -1).repeat(heads, 1, 1)
            # prepare encoder attention mask
            extended_encoder_attention_mask = (
                1.0 - encoder_attention_mask[:, None, :].repeat(heads, 1, 1)
            ) * -10000.0
        h = self.self_attn_layer_norm(h + self.self_attn(h, attention_mask=self_mask))
        h = self.cross_attn_layer_norm(
            h + self.cross_attn(h, encoder_hidden_states, attention_mask=extended_encoder_attention_mask)
        )
        return self.feed_forward_layer_norm(h + self.feed_forward(h))


class ProphetNetModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.encoder = ProphetNetEncoder(config, self.word_embeddings)
        self.decoder = ProphetNetDecoder(config, self.word_embeddings)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, attention_mask, decoder_input_ids):
        enc = self.encoder(input_ids, attention_mask)
        dec = self.decoder(decoder_input_ids, enc, attention_mask)
        return self.lm_head(dec)


config = ProphetNetConfig()
model = ProphetNetModel(config).eval()

# a right-padded batch of two source sentences (as the tokenizer returns with padding=True)
sources = [[5, 9, 14, 22, 7, 31, 2], [11, 4, 26, 2]]
max_len = max(len(s) for s in sources)
input_ids = torch.tensor([s + [config.pad_token_id] * (max_len - len(s)) for s in sources])
attention_mask = (input_ids != config.pad_token_id).long()
decoder_input_ids = torch.tensor([[config.decoder_start_token_id, 8, 17], [config.decoder_start_token_id, 8, 17]])

with torch.no_grad():
    batched = model(input_ids, attention_mask, decoder_input_ids)
    diffs = []
    for i, s in enumerate(sources):
        single = model(torch.tensor([s]), torch.ones(1, len(s), dtype=torch.long), decoder_input_ids[i : i + 1])
        diffs.append((batched[i] - single[0]).abs().max().item())

print(f"{'fixed' if FIXED else 'buggy'}: max |logits(batched) - logits(alone)| per sample:",
      " ".join(f"{d:.2e}" for d in diffs))
