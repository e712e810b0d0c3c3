"""BLIP-2 Q-Former stage-1 step (salesforce/LAVIS): three attention patterns over queries, text and image.

Follows salesforce/LAVIS lavis/models/blip2_models/Qformer.py (BertSelfAttention adding an extended mask of
(1 - mask) * -10000.0, past_key_value concatenated in front of the keys, cross-attention applied only to the
first `query_length` positions, BertModel.get_extended_attention_mask with is_decoder: a causal mask over the
text prefixed by ones over the earlier positions) and lavis/models/blip2_models/blip2_qformer.py (Blip2Qformer
.forward: ITC, ITM and ITG losses).

Masks meant:
- ITC query pass: 8 learned queries attend to each other freely and cross-attend the 5 image patch embeddings
  (more queries than image tokens, no mask: the image is fully known); its keys are kept as past_key_values;
- ITC text pass: text alone, bidirectional, right padding hidden by -10000;
- ITM pass: [queries, text] concatenated, bidirectional, text padding hidden; only query positions cross-attend;
- ITG pass: text rows only, keys = [8 cached query keys, text]: every text token sees all queries and earlier
  text (causal), padding hidden. Queries never see the text in any pass.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class BertConfig:
    hidden_size = 32
    num_attention_heads = 4
    intermediate_size = 64
    num_hidden_layers = 2
    encoder_width = 24
    vocab_size = 50
    max_position_embeddings = 32
    cross_attention_freq = 2


class BertSelfAttention(nn.Module):
    def __init__(self, config, is_cross_attention):
        super().__init__()
        self.num_attention_heads = config.num_attention_heads
        self.attention_head_size = config.hidden_size // config.num_attention_heads
        self.query = nn.Linear(config.hidden_size, config.hidden_size)
        kv_width = config.encoder_width if is_cross_attention else config.hidden_size
        self.key = nn.Linear(kv_width, config.hidden_size)
        self.value = nn.Linear(kv_width, config.hidden_size)
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size)

    def transpose_for_scores(self, x):
        return x.view(x.size(0), x.size(1), self.num_attention_heads, -1).permute(0, 2, 1, 3)

    def forward(self, hidden_states, attention_mask=None, encoder_hidden_states=None, past_key_value=None):
        if encoder_hidden_states is not None:
            key_layer = self.transpose_for_scores(self.key(encoder_hidden_states))
            value_layer = self.transpose_for_scores(self.value(encoder_hidden_states))
        else:
            key_layer = self.transpose_for_scores(self.key(hidden_states))
            value_layer = self.transpose_for_scores(self.value(hidden_states))
            if past_key_value is not None:
                key_layer = torch.cat([past_key_value[0], key_layer], dim=2)
                value_layer = torch.cat([past_key_value[1], value_layer], dim=2)
        present = (key_layer, value_layer)
        query_layer = self.transpose_for_scores(self.query(hidden_states))
        attention_scores = query_layer @ key_layer.transpose(-1, -2) / math.sqrt(self.attention_head_size)
        if attention_mask is not None:
            attention_scores = attention_scores + attention_mask
        attention_probs = F.softmax(attention_scores, dim=-1)
        context = (attention_probs @ value_layer).permute(0, 2, 1, 3).flatten(2)
        return self.LayerNorm(self.dense(context) + hidden_states), present


class BertLayer(nn.Module):
    def __init__(self, config, layer_num):
        super().__init__()
        self.attention = BertSelfAttention(config, is_cross_attention=False)
        self.has_cross_attention = layer_num % config.cross_attention_freq == 0
        if self.has_cross_attention:
            self.crossattention = BertSelfAttention(config, is_cross_attention=True)
        self.ffn = nn.Sequential(nn.Linear(config.hidden_size, config.intermediate_size), nn.GELU(),
                                 nn.Linear(config.intermediate_size, config.hidden_size))
        self.ffn_query = nn.Sequential(nn.Linear(config.hidden_size, config.intermediate_size), nn.GELU(),
                                       nn.Linear(config.intermediate_size, config.hidden_size))

    def forward(self, hidden_states, attention_mask, encoder_hidden_states=None, past_key_value=None,
                query_length=0):
        attention_output, present = self.attention(hidden_states, attention_mask, past_key_value=past_key_value)
        if query_length > 0:
            query_attention_output = attention_output[:, :query_length]
            if self.has_cross_attention and encoder_hidden_states is not None:
                query_attention_output = self.crossattention(query_attention_output,
                                                             encoder_hidden_states=encoder_hidden_states)[0]
            layer_output = query_attention_output + self.ffn_query(query_attention_output)
            if attention_output.shape[1] > query_length:
                text = attention_output[:, query_length:]
                layer_output = torch.cat([layer_output, text + self.ffn(text)], dim=1)
        else:
            layer_output = attention_output + self.ffn(attention_output)
        return layer_output, present


class BertModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.layer = nn.ModuleList([BertLayer(config, i) for i in range(config.num_hidden_layers)])

    def get_extended_attention_mask(self, attention_mask, input_shape, is_decoder, has_query=False):
        if is_decoder:
            batch_size, seq_length = input_shape
            seq_ids = torch.arange(seq_length)
            causal_mask = seq_ids[None, None, :].repeat(batch_size, seq_length, 1) <= seq_ids[None, :, None]
            causal_mask = causal_mask.to(attention_mask.dtype)
            if causal_mask.shape[1] < attention_mask.shape[1]:
                prefix_seq_len = attention_mask.shape[1] - causal_mask.shape[1]
                if has_query:  # UniLM style attention mask
                    causal_mask = torch.cat([torch.zeros((batch_size, prefix_seq_len, seq_length),
                                                         dtype=causal_mask.dtype), causal_mask], dim=1)
                causal_mask = torch.cat([torch.ones((batch_size, causal_mask.shape[1], prefix_seq_len),
                                                    dtype=causal_mask.dtype), causal_mask], dim=-1)
            extended_attention_mask = causal_mask[:, None, :, :] * attention_mask[:, None, None, :]
        else:
            extended_attention_mask = attention_mask[:, None, None, :]
        return (1.0 - extended_attention_mask.float()) * -10000.0

    def forward(self, input_ids=None, attention_mask=None, query_embeds=None, encoder_hidden_states=None,
                past_key_values=None, is_decoder=False):
        past_length = past_key_values[0][0].shape[2] if past_key_values is not None else 0
        query_length = query_embeds.shape[1] if query_embeds is not None else 0
        parts = []
        if query_embeds is not None:
            parts.append(query_embeds)
        if input_ids is not None:
            # cached keys are the queries', so text positions still start at 0 (past length minus query_length)
            pos = torch.arange(input_ids.shape[1])
            parts.append(self.word_embeddings(input_ids) + self.position_embeddings(pos))
        embedding_output = torch.cat(parts, dim=1)
        batch_size, seq_length = embedding_output.shape[:2]
        if attention_mask is None:
            attention_mask = torch.ones(batch_size, seq_length + past_length)
        if is_decoder:
            extended = self.get_extended_attention_mask(attention_mask, input_ids.shape, True,
                                                        has_query=query_embeds is not None)
        else:
            extended = self.get_extended_attention_mask(attention_mask, (batch_size, seq_length), False)
        hidden, presents = embedding_output, []
        for i, layer in enumerate(self.layer):
            past = past_key_values[i] if past_key_values is not None else None
            hidden, present = layer(hidden, extended, encoder_hidden_states, past, query_length)
            presents.append(present)
        return hidden, presents


def main():
    torch.manual_seed(0)
    config = BertConfig()
    Qformer = BertModel(config)
    query_tokens = nn.Parameter(torch.randn(1, 8, config.hidden_size) * 0.02)
    lm_head = nn.Linear(config.hidden_size, config.vocab_size)
    itm_head = nn.Linear(config.hidden_size, 2)
    image_embeds = torch.randn(2, 5, config.encoder_width)  # ViT patch features

    text_ids = torch.randint(2, config.vocab_size, (2, 7))
    text_atts = torch.tensor([[1] * 7, [1] * 4 + [0] * 3])
    text_ids = text_ids * text_atts

    query_tokens_b = query_tokens.expand(2, -1, -1)
    # ITC: queries alone (cache kept for ITG), text alone
    query_output, query_past = Qformer(query_embeds=query_tokens_b, encoder_hidden_states=image_embeds)
    text_output, _ = Qformer(input_ids=text_ids, attention_mask=text_atts)
    image_feats = F.normalize(query_output, dim=-1)
    text_feat = F.normalize(text_output[:, 0], dim=-1)
    sim_i2t = (image_feats.unsqueeze(1) @ text_feat.unsqueeze(-1)).squeeze(-1).max(-1).values / 0.07
    loss_itc = F.cross_entropy(sim_i2t, torch.arange(2))

    # ITM: queries and text together, bidirectional, queries cross-attend the image
    query_atts = torch.ones(2, 8, dtype=torch.long)
    itm_output, _ = Qformer(input_ids=text_ids, query_embeds=query_tokens_b,
                            attention_mask=torch.cat([query_atts, text_atts], dim=1),
                            encoder_hidden_states=image_embeds)
    itm_logit = itm_head(itm_output[:, :8]).mean(dim=1)
    loss_itm = F.cross_entropy(itm_logit, torch.ones(2, dtype=torch.long))  # both pairs are matching pairs

    # ITG: text decoded causally on top of the cached query keys
    decoder_input_ids = text_ids.clone()
    decoder_input_ids[:, 0] = 1  # bos
    lm_output, _ = Qformer(input_ids=decoder_input_ids, attention_mask=torch.cat([query_atts, text_atts], dim=1),
                           past_key_values=query_past, is_decoder=True)
    logits = lm_head(lm_output)
    labels = decoder_input_ids.masked_fill(text_atts == 0, -100)
    loss_lm = F.cross_entropy(logits[:, :-1].reshape(-1, config.vocab_size), labels[:, 1:].reshape(-1),
                              ignore_index=-100)
    loss = loss_itc + loss_itm + loss_lm
    loss.backward()
    print(f"itc {loss_itc.item():.4f} itm {loss_itm.item():.4f} lm {loss_lm.item():.4f}")


if __name__ == "__main__":
    main()
