# Citation: huggingface/transformers#9601 "[TF Led] Fix wrong decoder attention mask behavior"
#   (patrickvonplaten, merged 2021-01-14, patch release after v4.2.0).
# Upstream: src/transformers/models/led/modeling_tf_led.py, TFLEDDecoder.call (the TF port of the
#   PyTorch LEDDecoder; the block was the one TF BART's decoder carried at the time,
#   src/transformers/models/bart/modeling_tf_bart.py TFBartDecoder.call, read in a stored copy;
#   the fixed form read in the current modeling_tf_led.py TFLEDDecoder.call).
# Bug: the TF port "automatically changed the attention mask": when a decoder_attention_mask
#   is given it is thrown away and replaced by tf.ones (the `else` branch), and when none is
#   given one is derived from pad_token_id. The PyTorch model uses the mask it is handed, so
#   a left-padded decoder prefix is attended to by the real decoder tokens in the TF port.
# Fix: `if attention_mask is not None and input_shape[-1] > 1:
#          combined_attention_mask = combined_attention_mask + _expand_mask(attention_mask, tgt_len)`
# Rendered in torch (tf.* ops translated one for one), tiny sizes, random weights.
import sys
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

LARGE_NEGATIVE = -1e8


class LEDConfig:
    def __init__(self):
        self.vocab_size = 40
        self.d_model = 32
        self.decoder_layers = 2
        self.decoder_attention_heads = 4
        self.decoder_ffn_dim = 64
        self.max_decoder_position_embeddings = 64
        self.pad_token_id = 1
        self.eos_token_id = 2
        self.decoder_start_token_id = 2
        self.dropout = 0.0
        self.attention_dropout = 0.0
        self.activation_dropout = 0.0


def shape_list(t):
    return list(t.shape)


def _make_causal_mask(input_ids_shape, past_key_values_length: int = 0):
    """Make causal mask used for bi-directional self-attention."""
    bsz, tgt_len = input_ids_shape
    mask = torch.ones((tgt_len, tgt_len)) * LARGE_NEGATIVE
    mask_cond = torch.arange(shape_list(mask)[-1])
    mask = torch.where(mask_cond < (mask_cond + 1).reshape(shape_list(mask)[-1], 1), torch.tensor(0.0), mask)
    if past_key_values_length > 0:
        mask = torch.cat([torch.zeros((tgt_len, past_key_values_length)), mask], dim=-1)
    return mask[None, None, :, :].expand(bsz, 1, tgt_len, tgt_len + past_key_values_length)


def _expand_mask(mask, tgt_len=None):
    """Expands attention_mask from `[bsz, seq_len]` to `[bsz, 1, tgt_seq_len, src_seq_len]`."""
    bsz, src_len = shape_list(mask)
    tgt_len = tgt_len if tgt_len is not None else src_len
    expanded_mask = mask[:, None, None, :].expand(bsz, 1, tgt_len, src_len).to(torch.float32)
    return (1.0 - expanded_mask) * LARGE_NEGATIVE


class TFLEDLearnedPositionalEmbedding(nn.Embedding):
    def forward(self, input_shape, past_key_values_length: int = 0):
        bsz, seq_len = input_shape[:2]
        positions = torch.arange(past_key_values_length, seq_len + past_key_values_length)
        return super().forward(positions)


class TFLEDDecoderAttention(nn.Module):
    """Multi-headed attention from "Attention Is All You Need"."""

    def __init__(self, embed_dim, num_heads, dropout=0.0, is_decoder=False, bias=True):
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.dropout = nn.Dropout(dropout)
        self.head_dim = embed_dim // num_heads
        self.scaling = self.head_dim ** -0.5
        self.is_decoder = is_decoder
        self.k_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.v_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias)

    def _shape(self, tensor, seq_len, bsz):
        return tensor.reshape(bsz, seq_len, self.num_heads, self.head_dim).permute(0, 2, 1, 3)

    def forward(self, hidden_states, key_value_states=None, past_key_value=None, attention_mask=None):
        is_cross_attention = key_value_states is not None
        bsz, tgt_len, embed_dim = shape_list(hidden_states)
        query_states = self.q_proj(hidden_states) * self.scaling
        if is_cross_attention:
            key_states = self._shape(self.k_proj(key_value_states), -1, bsz)
            value_states = self._shape(self.v_proj(key_value_states), -1, bsz)
        else:
            key_states = self._shape(self.k_proj(hidden_states), -1, bsz)
            value_states = self._shape(self.v_proj(hidden_states), -1, bsz)
        proj_shape = (bsz * self.num_heads, -1, self.head_dim)
        query_states = self._shape(query_states, tgt_len, bsz).reshape(proj_shape)
        key_states = key_states.reshape(proj_shape)
        value_states = value_states.reshape(proj_shape)
        src_len = shape_list(key_states)[1]
        attn_weights = torch.matmul(query_states, key_states.transpose(1, 2))
        if attention_mask is not None:
            attn_weights = attn_weights.reshape(bsz, self.num_heads, tgt_len, src_len) + attention_mask
            attn_weights = attn_weights.reshape(bsz * self.num_heads, tgt_len, src_len)
        attn_weights = torch.softmax(attn_weights, dim=-1)
        attn_probs = self.dropout(attn_weights)
        attn_output = torch.matmul(attn_probs, value_states)
        attn_output = attn_output.reshape(bsz, self.num_heads, tgt_len, self.head_dim).permute(0, 2, 1, 3)
        attn_output = attn_output.reshape(bsz, tgt_len, embed_dim)
        return self.out_proj(attn_output)


class TFLEDDecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_dim = config.d_model
        self.self_attn = TFLEDDecoderAttention(self.embed_dim, config.decoder_attention_heads,
                                               dropout=config.attention_dropout, is_decoder=True)
        self.dropout = nn.Dropout(config.dropout)
        self.activation_fn = F.gelu
        self.activation_dropout = nn.Dropout(config.activation_dropout)
        self.self_attn_layer_norm = nn.LayerNorm(self.embed_dim, eps=1e-5)
        self.encoder_attn = TFLEDDecoderAttention(self.embed_dim, config.decoder_attention_heads,
                                                  dropout=config.attention_dropout, is_decoder=True)
        self.encoder_attn_layer_norm = nn.LayerNorm(self.embed_dim, eps=1e-5)
        self.fc1 = nn.Linear(self.embed_dim, config.decoder_ffn_dim)
        self.fc2 = nn.Linear(config.decoder_ffn_dim, self.embed_dim)
        self.final_layer_norm = nn.LayerNorm(self.embed_dim, eps=1e-5)

    def forward(self, hidden_states, attention_mask=None, encoder_hidden_states=None, encoder_attention_mask=None):
        residual = hidden_states
        hidden_states = self.self_attn(hidden_states=hidden_states, attention_mask=attention_mask)
        hidden_states = self.dropout(hidden_states)
        hidden_states = self.self_attn_layer_norm(residual + hidden_states)
        if encoder_hidden_states is not None:
            residual = hidden_states
            hidden_states = self.encoder_attn(hidden_states=hidden_states, key_value_states=encoder_hidden_states,
                                              attention_mask=encoder_attention_mask)
            hidden_states = self.dropout(hidden_states)
            hidden_states = self.encoder_attn_layer_norm(residual + hidden_states)
        residual = hidden_states
        hidden_states = self.activation_fn(self.fc1(hidden_states))
        hidden_states = self.activation_dropout(hidden_states)
        hidden_states = self.fc2(hidden_states)
        hidden_states = self.dropout(hidden_states)
        hidden_states = self.final_layer_norm(residual + hidden_states)
        return hidden_states


class TFLEDDecoder(nn.Module):
    def __init__(self, config, embed_tokens):
        super().__init__()
        self.config = config
        self.padding_idx = config.pad_token_id
        self.embed_tokens = embed_tokens
        self.embed_positions = TFLEDLearnedPositionalEmbedding(config.max_decoder_position_embeddings, config.d_model)
        self.layers = nn.ModuleList([TFLEDDecoderLayer(config) for _ in range(config.decoder_layers)])
        self.layernorm_embedding = nn.LayerNorm(config.d_model, eps=1e-5)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, input_ids=None, attention_mask=None, encoder_hidden_states=None,
                encoder_attention_mask=None, past_key_values=None):
        inputs = {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "encoder_hidden_states": encoder_hidden_states,
            "encoder_attention_mask": encoder_attention_mask,
            "past_key_values": past_key_values,
        }
        input_shape = shape_list(inputs["input_ids"])
        past_key_values_length = 0
        positions = self.embed_positions(input_shape, past_key_values_length)
        inputs_embeds = self.embed_tokens(inputs["input_ids"])
        hidden_states = inputs_embeds

        # [bsz, seq_len] -> [bsz, 1, tgt_seq_len, src_seq_len]
        if input_shape[-1] > 1:
            combined_attention_mask = _make_causal_mask(input_shape, past_key_values_length=past_key_values_length)
        else:
            combined_attention_mask = _expand_mask(
                torch.ones((input_shape[0], input_shape[1] + past_key_values_length)), tgt_len=input_shape[-1]
            )

        if FIXED:
            if inputs["attention_mask"] is not None and input_shape[-1] > 1:
                combined_attention_mask = combined_attention_mask + _expand_mask(
                    inputs["attention_mask"], tgt_len=input_shape[-1]
                )
        else:
            if inputs["attention_mask"] is None and inputs["input_ids"] is not None and input_shape[-1] > 1:
                inputs["attention_mask"] = (inputs["input_ids"] != self.config.pad_token_id).to(
                    inputs["input_ids"].dtype
                )
                inputs["attention_mask"] = torch.cat(
                    [
                        torch.ones((input_shape[0], past_key_values_length), dtype=inputs["attention_mask"].dtype),
                        inputs["attention_mask"],
                    ],
                    dim=-1,
                )
            else:
                inputs["attention_mask"] = torch.ones(
                    (input_shape[0], input_shape[1] + past_key_values_length), dtype=torch.int32
                )
            # [bsz, seq_len] -> [bsz, 1, tgt_seq_len, src_seq_len]
            combined_attention_mask = combined_attention_mask + _expand_mask(
                inputs["attention_mask"], tgt_len=input_shape[-1]
            )

        if inputs["encoder_hidden_states"] is not None and inputs["encoder_attention_mask"] is not None:
            inputs["encoder_attention_mask"] = _expand_mask(inputs["encoder_attention_mask"], tgt_len=input_shape[-1])

        hidden_states = self.layernorm_embedding(hidden_states + positions)
        hidden_states = self.dropout(hidden_states)
        for decoder_layer in self.layers:
            hidden_states = decoder_layer(
                hidden_states,
                attention_mask=combined_attention_mask,
                encoder_hidden_states=inputs["encoder_hidden_states"],
                encoder_attention_mask=inputs["encoder_attention_mask"],
            )
        return hidden_states


def main():
    config = LEDConfig()
    shared = nn.Embedding(config.vocab_size, config.d_model, padding_idx=config.pad_token_id)
    decoder = TFLEDDecoder(config, shared).eval()
    final_logits_bias = torch.zeros(1, config.vocab_size)

    # Encoder output for two documents (the second one right-padded), as the LED encoder hands it over.
    enc_len = 10
    encoder_hidden_states = torch.randn(2, enc_len, config.d_model)
    encoder_attention_mask = torch.tensor([[1] * 10, [1] * 7 + [0] * 3])

    # Batched decoding continued from per-example decoder prefixes, left padded with pad_token_id
    # (decoder_start_token_id, forced prefix tokens, then the target), with the matching mask.
    pad, start = config.pad_token_id, config.decoder_start_token_id
    row0 = [start, 11, 12, 13, 14, 15, 16, 17]
    row1 = [pad, pad, pad, start, 21, 22, 23, 24]
    decoder_input_ids = torch.tensor([row0, row1])
    decoder_attention_mask = (decoder_input_ids != pad).long()
    labels = torch.tensor([[11, 12, 13, 14, 15, 16, 17, 2],
                           [-100, -100, -100, 21, 22, 23, 24, 2]])

    with torch.no_grad():
        hidden = decoder(decoder_input_ids, attention_mask=decoder_attention_mask,
                         encoder_hidden_states=encoder_hidden_states,
                         encoder_attention_mask=encoder_attention_mask)
        lm_logits = hidden @ shared.weight.t() + final_logits_bias
        loss = F.cross_entropy(lm_logits.reshape(-1, config.vocab_size), labels.reshape(-1), ignore_index=-100)

    print("decoder_attention_mask:", decoder_attention_mask.tolist())
    print("lm loss: %.6f" % loss.item())
    print("row 1 last-position logits[:5]:", [round(v, 4) for v in lm_logits[1, -1, :5].tolist()])
    print("row 1 greedy next tokens:", lm_logits[1].argmax(-1).tolist())
    print("row 0 last hidden[:4]:", [round(v, 4) for v in hidden[0, -1, :4].tolist()])


if __name__ == "__main__":
    main()
