# huggingface/candle#1146 (commit 3115fe42e, "Blip attention mask + readme"), ported from Rust to torch.
# candle-transformers/src/models/blip_text.rs: the BLIP captioning text decoder (BERT-style self-attention,
# then cross-attention to the ViT image embeddings) ran its self-attention with no mask at all. The blip example
# decodes by re-running the whole caption prefix every step and reading the last position, so each earlier
# caption token attended to the tokens after it and the caption drifted.
# Fix: TextLMHeadModel.forward builds a (seq_len, seq_len) mask (-inf where j > i, else 0) and threads it
# through TextModel -> TextEncoder -> TextLayer -> TextAttention -> TextSelfAttention, where it is
# broadcast-added to the scores before the softmax; the cross-attention keeps no mask.
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import BlipVisionConfig, BlipVisionModel

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


@dataclass
class Config:
    vocab_size: int = 96
    hidden_size: int = 32
    encoder_hidden_size: int = 24
    intermediate_size: int = 64
    projection_dim: int = 32
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    max_position_embeddings: int = 32
    layer_norm_eps: float = 1e-12
    is_decoder: bool = True


class TextEmbeddings(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.word_embedddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.layer_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.register_buffer("position_ids", torch.arange(cfg.max_position_embeddings).unsqueeze(0))

    def forward(self, xs):
        seq_len = xs.shape[1]
        # Use past_key_values_length if we add a kv cache.
        position_ids = self.position_ids.narrow(1, 0, seq_len)
        embeddings = self.word_embedddings(xs)
        position_embeddings = self.position_embeddings(position_ids)
        return self.layer_norm(embeddings + position_embeddings)


class TextSelfAttention(nn.Module):
    def __init__(self, cfg, is_cross_attention):
        super().__init__()
        self.num_attention_heads = cfg.num_attention_heads
        self.attention_head_size = cfg.hidden_size // cfg.num_attention_heads
        self.all_head_size = self.num_attention_heads * self.attention_head_size
        self.query = nn.Linear(cfg.hidden_size, self.all_head_size)
        in_size = cfg.encoder_hidden_size if is_cross_attention else cfg.hidden_size
        self.key = nn.Linear(in_size, self.all_head_size)
        self.value = nn.Linear(in_size, self.all_head_size)
        self.attention_scale = 1.0 / (self.attention_head_size ** 0.5)

    def transpose_for_scores(self, xs):
        b_size, seq_len, _ = xs.shape
        return xs.reshape(b_size, seq_len, self.num_attention_heads, self.attention_head_size).permute(0, 2, 1, 3)

    def forward(self, xs, encoder_hidden_states=None, attention_mask=None):
        query = self.transpose_for_scores(self.query(xs)).contiguous()
        if encoder_hidden_states is None:
            key = self.transpose_for_scores(self.key(xs))
            value = self.transpose_for_scores(self.value(xs))
            # TODO: kv cache
        else:
            key = self.transpose_for_scores(self.key(encoder_hidden_states))
            value = self.transpose_for_scores(self.value(encoder_hidden_states))
            # no kv-cache in this case, but the results could probably be memoized.
        key = key.contiguous()
        value = value.contiguous()
        attention_scores = query.matmul(key.transpose(-1, -2))
        attention_scores = attention_scores * self.attention_scale
        if attention_mask is not None:
            attention_scores = attention_scores + attention_mask  # broadcast_add
        attention_probs = F.softmax(attention_scores, dim=-1)
        return attention_probs.matmul(value).permute(0, 2, 1, 3).flatten(-2)


class TextSelfOutput(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.layer_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, xs, input_tensor):
        return self.layer_norm(self.dense(xs) + input_tensor)


class TextAttention(nn.Module):
    def __init__(self, cfg, is_cross_attention):
        super().__init__()
        self.self_ = TextSelfAttention(cfg, is_cross_attention)
        self.output = TextSelfOutput(cfg)

    def forward(self, xs, encoder_hidden_states=None, attention_mask=None):
        self_outputs = self.self_(xs, encoder_hidden_states, attention_mask)
        return self.output(self_outputs, xs)


class TextIntermediate(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, xs):
        return F.gelu(self.dense(xs))


class TextOutput(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.dense = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.layer_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, xs, input_tensor):
        return self.layer_norm(self.dense(xs) + input_tensor)


class TextLayer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.attention = TextAttention(cfg, False)
        self.cross_attention = TextAttention(cfg, True) if cfg.is_decoder else None
        self.intermediate = TextIntermediate(cfg)
        self.output = TextOutput(cfg)

    def forward(self, xs, encoder_hidden_states, attention_mask):
        attention_output = self.attention(xs, None, attention_mask)
        if self.cross_attention is None:
            raise RuntimeError("expected some cross-attn")
        attention_output = self.cross_attention(attention_output, encoder_hidden_states, None)
        intermediate_output = self.intermediate(attention_output)
        return self.output(intermediate_output, attention_output)


class TextEncoder(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.layers = nn.ModuleList([TextLayer(cfg) for _ in range(cfg.num_hidden_layers)])

    def forward(self, xs, encoder_hidden_states, attention_mask):
        for layer in self.layers:
            xs = layer(xs, encoder_hidden_states, attention_mask)
        return xs


class TextPredictionHeadTransform(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.layer_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, xs):
        return self.layer_norm(F.gelu(self.dense(xs)))


class TextLMPredictionHead(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.transform = TextPredictionHeadTransform(cfg)
        self.decoder = nn.Linear(cfg.hidden_size, cfg.vocab_size)

    def forward(self, xs):
        return self.decoder(self.transform(xs))


class TextModel(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.embeddings = TextEmbeddings(cfg)
        self.encoder = TextEncoder(cfg)

    def forward(self, input_ids, encoder_hidden_states, attention_mask):
        embedding_output = self.embeddings(input_ids)
        # We're interested in the sequence-output rather than the pooled-output.
        return self.encoder(embedding_output, encoder_hidden_states, attention_mask)


class TextLMHeadModel(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.bert = TextModel(cfg)
        self.cls = TextLMPredictionHead(cfg)

    def forward(self, input_ids, encoder_hidden_states):
        if FIXED:
            seq_len = input_ids.shape[1]
            mask = [
                float("-inf") if j > i else 0.0
                for i in range(seq_len)
                for j in range(seq_len)
            ]
            mask = torch.tensor(mask, device=input_ids.device).reshape(seq_len, seq_len)
        else:
            mask = None
        sequence_output = self.bert(input_ids, encoder_hidden_states, mask)
        # return_logits is false so we don't discard the last sequence element.
        return self.cls(sequence_output)


def main():
    vision_config = BlipVisionConfig(
        hidden_size=24, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
        image_size=32, patch_size=8,
    )
    vision_model = BlipVisionModel(vision_config).eval()
    text_decoder = TextLMHeadModel(Config(encoder_hidden_size=vision_config.hidden_size)).eval()
    for p in text_decoder.parameters():
        p.data.normal_(0.0, 0.3)

    BOS_TOKEN_ID = 90  # [DEC]; the example starts from 30522 in the real vocab
    SEP_TOKEN_ID = 91

    image = torch.randn(3, 32, 32)
    with torch.no_grad():
        image_embeds = vision_model(pixel_values=image.unsqueeze(0)).last_hidden_state  # (1, 17, 24)

        token_ids = [BOS_TOKEN_ID]
        last_logits = []
        for _index in range(12):
            input_ids = torch.tensor(token_ids).unsqueeze(0)
            logits = text_decoder(input_ids, image_embeds)
            logits = logits.squeeze(0)
            logits = logits[logits.shape[0] - 1]
            last_logits.append(logits)
            token = int(logits.argmax())  # LogitsProcessor::new(1337, None, None): argmax
            if token == SEP_TOKEN_ID:
                break
            token_ids.append(token)

    print("caption ids:", token_ids[1:])
    print("last-step logits[:6]:", [round(v, 4) for v in last_logits[-1][:6].tolist()])


if __name__ == "__main__":
    main()
