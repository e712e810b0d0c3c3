"""bert2bert (EncoderDecoderModel with two BertModels): ONE BertModel class whose config.is_decoder flag
decides whether get_extended_attention_mask makes the self-attention mask causal, with
add_cross_attention giving the decoder cross-attention over a per-row padded encoder output.

Follows huggingface/transformers src/transformers/modeling_utils.py (ModuleUtilsMixin.
get_extended_attention_mask, create_extended_attention_mask_for_decoder: `seq_ids[None, None, :]
.repeat(batch_size, seq_length, 1) <= seq_ids[None, :, None]` times the 2-D padding mask;
invert_attention_mask for the encoder mask; `(1.0 - mask) * finfo.min`), models/bert/modeling_bert.py
(BertSelfAttention eager path: scores + attention_mask, softmax) and
models/encoder_decoder/modeling_encoder_decoder.py (shift_tokens_right with decoder_start_token_id,
labels pad -> -100).  Written in plain torch with a BertConfig-like dataclass.

Mask meant: encoder = bidirectional over real source tokens; decoder self-attention = causal AND
real decoder tokens; decoder cross-attention = real encoder tokens of the same row, for every query.
"""
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class BertConfig:
    vocab_size: int = 60
    hidden_size: int = 32
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    intermediate_size: int = 64
    max_position_embeddings: int = 32
    pad_token_id: int = 0
    is_decoder: bool = False
    add_cross_attention: bool = False


def create_extended_attention_mask_for_decoder(input_shape, attention_mask):
    batch_size, seq_length = input_shape
    seq_ids = torch.arange(seq_length, device=attention_mask.device)
    causal_mask = seq_ids[None, None, :].repeat(batch_size, seq_length, 1) <= seq_ids[None, :, None]
    causal_mask = causal_mask.to(attention_mask.dtype)
    return causal_mask[:, None, :, :] * attention_mask[:, None, None, :]


class BertSelfAttention(nn.Module):
    def __init__(self, config, is_cross_attention=False):
        super().__init__()
        self.num_attention_heads = config.num_attention_heads
        self.attention_head_size = config.hidden_size // config.num_attention_heads
        self.query = nn.Linear(config.hidden_size, config.hidden_size)
        self.key = nn.Linear(config.hidden_size, config.hidden_size)
        self.value = nn.Linear(config.hidden_size, config.hidden_size)
        self.output = nn.Linear(config.hidden_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size)
        self.is_cross_attention = is_cross_attention

    def transpose_for_scores(self, x):
        return x.view(x.size()[:-1] + (self.num_attention_heads, self.attention_head_size)).permute(0, 2, 1, 3)

    def forward(self, hidden_states, attention_mask=None, encoder_hidden_states=None, encoder_attention_mask=None):
        query_layer = self.transpose_for_scores(self.query(hidden_states))
        if self.is_cross_attention:
            key_layer = self.transpose_for_scores(self.key(encoder_hidden_states))
            value_layer = self.transpose_for_scores(self.value(encoder_hidden_states))
            attention_mask = encoder_attention_mask
        else:
            key_layer = self.transpose_for_scores(self.key(hidden_states))
            value_layer = self.transpose_for_scores(self.value(hidden_states))
        attention_scores = torch.matmul(query_layer, key_layer.transpose(-1, -2)) / math.sqrt(self.attention_head_size)
        if attention_mask is not None:
            attention_scores = attention_scores + attention_mask
        attention_probs = nn.functional.softmax(attention_scores, dim=-1)
        context_layer = torch.matmul(attention_probs, value_layer).permute(0, 2, 1, 3).contiguous()
        context_layer = context_layer.view(context_layer.size()[:-2] + (-1,))
        return self.LayerNorm(self.output(context_layer) + hidden_states)


class BertLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.attention = BertSelfAttention(config)
        if config.add_cross_attention:
            self.crossattention = BertSelfAttention(config, is_cross_attention=True)
        self.ffn = nn.Sequential(nn.Linear(config.hidden_size, config.intermediate_size), nn.GELU(),
                                 nn.Linear(config.intermediate_size, config.hidden_size))
        self.ln = nn.LayerNorm(config.hidden_size)

    def forward(self, hidden_states, attention_mask=None, encoder_hidden_states=None, encoder_attention_mask=None):
        h = self.attention(hidden_states, attention_mask)
        if encoder_hidden_states is not None:
            h = self.crossattention(h, encoder_hidden_states=encoder_hidden_states,
                                    encoder_attention_mask=encoder_attention_mask)
        return self.ln(h + self.ffn(h))


class BertModel(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.config = config
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.layer = nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))

    def get_extended_attention_mask(self, attention_mask, input_shape, dtype=torch.float32):
        if attention_mask.dim() == 3:
            extended_attention_mask = attention_mask[:, None, :, :]
        elif attention_mask.dim() == 2:
            if self.config.is_decoder:
                extended_attention_mask = create_extended_attention_mask_for_decoder(input_shape, attention_mask)
            else:
                extended_attention_mask = attention_mask[:, None, None, :]
        else:
            raise ValueError(f"Wrong shape for input_ids (shape {input_shape}) or attention_mask (shape {attention_mask.shape})")
        extended_attention_mask = extended_attention_mask.to(dtype=dtype)
        return (1.0 - extended_attention_mask) * torch.finfo(dtype).min

    def invert_attention_mask(self, encoder_attention_mask, dtype=torch.float32):
        encoder_extended_attention_mask = encoder_attention_mask[:, None, None, :].to(dtype=dtype)
        return (1.0 - encoder_extended_attention_mask) * torch.finfo(dtype).min

    def forward(self, input_ids, attention_mask=None, encoder_hidden_states=None, encoder_attention_mask=None):
        input_shape = input_ids.size()
        if attention_mask is None:
            attention_mask = torch.ones(input_shape)
        extended_attention_mask = self.get_extended_attention_mask(attention_mask, input_shape)
        encoder_extended_attention_mask = None
        if self.config.is_decoder and encoder_hidden_states is not None:
            if encoder_attention_mask is None:
                encoder_attention_mask = torch.ones(encoder_hidden_states.shape[:2])
            encoder_extended_attention_mask = self.invert_attention_mask(encoder_attention_mask)
        h = self.word_embeddings(input_ids) + self.position_embeddings(torch.arange(input_shape[1]))[None]
        for layer_module in self.layer:
            h = layer_module(h, extended_attention_mask, encoder_hidden_states, encoder_extended_attention_mask)
        return h


def shift_tokens_right(input_ids, pad_token_id, decoder_start_token_id):
    shifted_input_ids = input_ids.new_zeros(input_ids.shape)
    shifted_input_ids[:, 1:] = input_ids[:, :-1].clone()
    shifted_input_ids[:, 0] = decoder_start_token_id
    shifted_input_ids.masked_fill_(shifted_input_ids == -100, pad_token_id)
    return shifted_input_ids


class EncoderDecoderModel(nn.Module):
    def __init__(self, encoder_config, decoder_config, decoder_start_token_id=41):
        super().__init__()
        self.encoder = BertModel(encoder_config)
        self.decoder = BertModel(decoder_config)
        self.lm_head = nn.Linear(decoder_config.hidden_size, decoder_config.vocab_size)
        self.pad_token_id = decoder_config.pad_token_id
        self.decoder_start_token_id = decoder_start_token_id

    def forward(self, input_ids, attention_mask, labels, decoder_attention_mask=None):
        encoder_hidden_states = self.encoder(input_ids, attention_mask=attention_mask)
        decoder_input_ids = shift_tokens_right(labels, self.pad_token_id, self.decoder_start_token_id)
        decoder_hidden = self.decoder(decoder_input_ids, attention_mask=decoder_attention_mask,
                                      encoder_hidden_states=encoder_hidden_states, encoder_attention_mask=attention_mask)
        logits = self.lm_head(decoder_hidden)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1), ignore_index=-100), logits


if __name__ == "__main__":
    torch.manual_seed(0)
    enc_cfg = BertConfig()
    dec_cfg = BertConfig(is_decoder=True, add_cross_attention=True)
    model = EncoderDecoderModel(enc_cfg, dec_cfg).eval()
    # row 0: source with no padding; row 1: one real token then padding
    input_ids = torch.tensor([[41, 7, 8, 9, 10, 11, 12, 42], [41, 0, 0, 0, 0, 0, 0, 0]])
    attention_mask = (input_ids != 0).long()
    target = torch.tensor([[41, 20, 21, 22, 42], [41, 23, 42, 0, 0]])
    decoder_attention_mask = (target != 0).long()
    labels = target.masked_fill(target == 0, -100)
    with torch.no_grad():
        loss, logits = model(input_ids, attention_mask, labels, decoder_attention_mask)
        # row 1 alone, unpadded, gives the same logits on its real positions
        _, alone = model(input_ids[1:, :1], attention_mask[1:, :1], labels[1:, :3], decoder_attention_mask[1:, :3])
    assert torch.allclose(logits[1, :3], alone[0], atol=1e-4)
    print(f"loss {loss.item():.4f}")
