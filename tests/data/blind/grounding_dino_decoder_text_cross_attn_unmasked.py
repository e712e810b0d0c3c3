# huggingface/transformers#30364 (fixes #30176): in GroundingDinoDecoderLayer the object queries' cross-attention
# to the text features ran without the text mask, so the padding of a shorter prompt in a batch was attended.
# Reduced: two decoder layers; the deformable attention over image features is stood in by plain attention.
import math
import sys

import torch
from torch import nn

FIXED = "--fixed" in sys.argv


class Config:
    d_model = 32
    decoder_attention_heads = 4
    num_queries = 6
    decoder_layers = 2
    decoder_ffn_dim = 64
    vocab_size = 50


class GroundingDinoMultiheadAttention(nn.Module):
    """Equivalent implementation of nn.MultiheadAttention with `batch_first=True`."""

    def __init__(self, config, num_attention_heads):
        super().__init__()
        self.num_attention_heads = num_attention_heads
        self.attention_head_size = int(config.d_model / num_attention_heads)
        self.all_head_size = self.num_attention_heads * self.attention_head_size
        self.query = nn.Linear(config.d_model, self.all_head_size)
        self.key = nn.Linear(config.d_model, self.all_head_size)
        self.value = nn.Linear(config.d_model, self.all_head_size)
        self.out_proj = nn.Linear(config.d_model, config.d_model)

    def transpose_for_scores(self, x):
        new_x_shape = x.size()[:-1] + (self.num_attention_heads, self.attention_head_size)
        return x.view(new_x_shape).permute(0, 2, 1, 3)

    def forward(self, queries, keys, values, attention_mask=None):
        query_layer = self.transpose_for_scores(self.query(queries))
        key_layer = self.transpose_for_scores(self.key(keys))
        value_layer = self.transpose_for_scores(self.value(values))
        attention_scores = torch.matmul(query_layer, key_layer.transpose(-1, -2))
        attention_scores = attention_scores / math.sqrt(self.attention_head_size)
        if attention_mask is not None:
            attention_scores = attention_scores + attention_mask
        attention_probs = nn.functional.softmax(attention_scores, dim=-1)
        context_layer = torch.matmul(attention_probs, value_layer)
        context_layer = context_layer.permute(0, 2, 1, 3).contiguous()
        context_layer = context_layer.view(context_layer.size()[:-2] + (self.all_head_size,))
        return self.out_proj(context_layer)


class GroundingDinoDecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self_attn = GroundingDinoMultiheadAttention(config, config.decoder_attention_heads)
        self.self_attn_layer_norm = nn.LayerNorm(config.d_model)
        self.encoder_attn_text = GroundingDinoMultiheadAttention(config, config.decoder_attention_heads)
        self.encoder_attn_text_layer_norm = nn.LayerNorm(config.d_model)
        # stands in for GroundingDinoMultiscaleDeformableAttention over the image feature maps
        self.encoder_attn = nn.MultiheadAttention(config.d_model, config.decoder_attention_heads, batch_first=True)
        self.encoder_attn_layer_norm = nn.LayerNorm(config.d_model)
        self.fc1 = nn.Linear(config.d_model, config.decoder_ffn_dim)
        self.fc2 = nn.Linear(config.decoder_ffn_dim, config.d_model)
        self.final_layer_norm = nn.LayerNorm(config.d_model)

    @staticmethod
    def with_pos_embed(tensor, position_embeddings):
        return tensor if position_embeddings is None else tensor + position_embeddings

    def forward(self, hidden_states, position_embeddings, vision_encoder_hidden_states,
                text_encoder_hidden_states, text_encoder_attention_mask):
        residual = hidden_states
        queries = keys = self.with_pos_embed(hidden_states, position_embeddings)
        hidden_states = self.self_attn(queries=queries, keys=keys, values=hidden_states)
        hidden_states = self.self_attn_layer_norm(residual + hidden_states)

        second_residual = hidden_states
        # Cross-Attention Text
        queries = self.with_pos_embed(hidden_states, position_embeddings)
        if FIXED:
            hidden_states = self.encoder_attn_text(
                queries=queries, keys=text_encoder_hidden_states, values=text_encoder_hidden_states,
                attention_mask=text_encoder_attention_mask)
        else:
            hidden_states = self.encoder_attn_text(
                queries=queries, keys=text_encoder_hidden_states, values=text_encoder_hidden_states,
                # attention_mask=text_encoder_attention_mask,  # TODO fix cross-attention mask here
            )
        hidden_states = self.encoder_attn_text_layer_norm(second_residual + hidden_states)

        third_residual = hidden_states
        # Cross-Attention (image)
        hidden_states, _ = self.encoder_attn(hidden_states, vision_encoder_hidden_states,
                                             vision_encoder_hidden_states, need_weights=False)
        hidden_states = self.encoder_attn_layer_norm(third_residual + hidden_states)

        residual = hidden_states
        hidden_states = self.fc2(nn.functional.relu(self.fc1(hidden_states)))
        return self.final_layer_norm(residual + hidden_states)


class GroundingDinoDecoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList([GroundingDinoDecoderLayer(config) for _ in range(config.decoder_layers)])

    def forward(self, inputs_embeds, query_pos, vision_encoder_hidden_states, text_encoder_hidden_states,
                text_encoder_attention_mask=None):
        if text_encoder_attention_mask is not None:
            dtype = text_encoder_hidden_states.dtype
            text_encoder_attention_mask = text_encoder_attention_mask[:, None, None, :]
            text_encoder_attention_mask = text_encoder_attention_mask.repeat(
                1, self.config.decoder_attention_heads, self.config.num_queries, 1)
            text_encoder_attention_mask = text_encoder_attention_mask.to(dtype=dtype)
            text_encoder_attention_mask = text_encoder_attention_mask * torch.finfo(dtype).min
        hidden_states = inputs_embeds
        for decoder_layer in self.layers:
            hidden_states = decoder_layer(hidden_states, query_pos, vision_encoder_hidden_states,
                                          text_encoder_hidden_states, text_encoder_attention_mask)
        return hidden_states


class GroundingDinoForObjectDetection(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.text_embed = nn.Embedding(config.vocab_size, config.d_model)  # stands in for the BERT text backbone
        self.pixel_proj = nn.Linear(3, config.d_model)                      # stands in for the Swin backbone + encoder
        self.query_embeds = nn.Parameter(torch.randn(config.num_queries, config.d_model))
        self.query_pos = nn.Parameter(torch.randn(config.num_queries, config.d_model))
        self.decoder = GroundingDinoDecoder(config)

    def forward(self, pixel_values, input_ids, attention_mask):
        batch_size = input_ids.shape[0]
        text_token_mask = attention_mask.bool()
        text_features = self.text_embed(input_ids)
        vision_features = self.pixel_proj(pixel_values.flatten(2).transpose(1, 2))
        queries = self.query_embeds.expand(batch_size, -1, -1)
        pos = self.query_pos.expand(batch_size, -1, -1)
        last_hidden = self.decoder(queries, pos, vision_features, text_features,
                                   text_encoder_attention_mask=~text_token_mask)
        # GroundingDinoContrastiveEmbedding: query-to-token logits, padding tokens set to -inf
        logits = last_hidden @ text_features.transpose(-1, -2)
        logits = logits.masked_fill(~text_token_mask[:, None, :], float("-inf"))
        return logits


def main():
    torch.manual_seed(0)
    config = Config()
    model = GroundingDinoForObjectDetection(config).eval()
    pixel_values = torch.randn(2, 3, 6, 6)
    # "a cat. a remote control." and a longer prompt, padded to the longest
    short = [1, 5, 6, 7, 5, 8, 9, 7, 2]
    long = [1, 10, 11, 7, 5, 6, 7, 5, 8, 9, 7, 5, 12, 7, 2]
    input_ids = torch.zeros(2, len(long), dtype=torch.long)
    attention_mask = torch.zeros(2, len(long), dtype=torch.long)
    input_ids[0, :len(short)] = torch.tensor(short)
    attention_mask[0, :len(short)] = 1
    input_ids[1] = torch.tensor(long)
    attention_mask[1] = 1

    with torch.no_grad():
        batched = model(pixel_values, input_ids, attention_mask)
        alone = model(pixel_values[:1], input_ids[:1, :len(short)], attention_mask[:1, :len(short)])
    diff = (batched[0, :, :len(short)] - alone[0]).abs().max().item()
    print(f"max |logits of prompt 0 in a padded batch - prompt 0 alone| = {diff:.4e}")


if __name__ == "__main__":
    main()
