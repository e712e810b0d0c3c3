"""NeMo Megatron T5 complete(): the encoder padding mask is inverted before the module inverts it.

Citation: NVIDIA-NeMo/Speech#3838 (then NVIDIA/NeMo#3838) "Fix T5 Encoder Mask while decoding",
merged 2022-03. Changelog: "One line removal of encoder_mask = encoder_mask < 0.5"; the PR notes
fine-tuning that calls `.decode()` directly is unaffected, only `.complete()` is. The buggy
`complete()` / `decode()` and megatron `utils.build_attention_mask_3d_padding` were read from
NeMo source of that time; the PR diff itself was not read.

Bug: after the token-level encoder-decoder module started taking 2-D masks that are True for real
tokens (it builds the 3-D masks itself and inverts them "for Megatron", True = masked),
`MegatronT5Model.complete()` still did `enc_mask = tokens_enc != pad_id; enc_mask = enc_mask < 0.5`.
The module then inverted that again: in the encoder and in the decoder's cross-attention every
real source token is masked and only the padding is visible.
Fix: drop the `enc_mask = enc_mask < 0.5` line in `complete()`.

This program: a one-layer encoder / one-layer decoder Megatron-style T5 (random weights, scores
`masked_fill_(mask, -10000.0)` then softmax), a right-padded prompt ('masked_sample'), three greedy
steps of the naive `decode()` loop that recomputes the decoder each step.
"""
import math
import sys
from operator import itemgetter

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv


class AttnMaskType:
    padding = 1
    causal = 2


def make_attention_mask_3d(source_mask, target_mask):
    mask = target_mask[:, None, :] * source_mask[:, :, None]
    return mask


def make_inference_history_mask_3d(block):
    batch, length = block.shape
    arange = torch.arange(length, device=block.device)
    history_mask = (arange[None,] <= arange[:, None])[None,]
    return history_mask.expand(batch, length, length)


def build_attention_mask_3d_padding(source_mask, target_mask):
    mask = make_attention_mask_3d(source_mask, target_mask)
    # invert mask for Megatron
    return mask < 0.5


def build_attention_mask_3d_causal(source_mask, target_mask):
    causal_mask = make_inference_history_mask_3d(target_mask)
    mask = make_attention_mask_3d(source_mask, target_mask)
    mask = mask * causal_mask
    # invert mask for Megatron
    return mask < 0.5


def build_attention_mask_3d(source_mask, target_mask, attn_mask_type):
    if attn_mask_type == AttnMaskType.padding:
        return build_attention_mask_3d_padding(source_mask, target_mask)
    return build_attention_mask_3d_causal(source_mask, target_mask)


class ParallelAttention(nn.Module):
    def __init__(self, hidden_size, num_attention_heads, cross=False):
        super().__init__()
        self.np = num_attention_heads
        self.hn = hidden_size // num_attention_heads
        self.cross = cross
        if cross:
            self.query = nn.Linear(hidden_size, hidden_size)
            self.key_value = nn.Linear(hidden_size, 2 * hidden_size)
        else:
            self.query_key_value = nn.Linear(hidden_size, 3 * hidden_size)
        self.dense = nn.Linear(hidden_size, hidden_size)

    def forward(self, hidden_states, attention_mask, encoder_output=None):
        # hidden_states: [s, b, h]; attention_mask: [b, 1, sq, sk], True = masked
        sq, b, _ = hidden_states.shape
        if self.cross:
            q = self.query(hidden_states)
            k, v = self.key_value(encoder_output).chunk(2, dim=-1)
        else:
            q, k, v = self.query_key_value(hidden_states).chunk(3, dim=-1)
        sk = k.shape[0]
        q = q.view(sq, b * self.np, self.hn).transpose(0, 1)
        k = k.reshape(sk, b * self.np, self.hn).transpose(0, 1)
        v = v.reshape(sk, b * self.np, self.hn).transpose(0, 1)
        attention_scores = torch.bmm(q, k.transpose(1, 2)) / math.sqrt(self.hn)
        attention_scores = attention_scores.view(b, self.np, sq, sk)
        attention_scores.masked_fill_(attention_mask, -10000.0)
        attention_probs = torch.softmax(attention_scores, dim=-1)
        context = torch.bmm(attention_probs.view(b * self.np, sq, sk), v)
        context = context.transpose(0, 1).reshape(sq, b, -1)
        return self.dense(context)


class ParallelTransformerLayer(nn.Module):
    def __init__(self, hidden_size, num_attention_heads, ffn_hidden_size, decoder=False):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(hidden_size)
        self.self_attention = ParallelAttention(hidden_size, num_attention_heads)
        self.decoder = decoder
        if decoder:
            self.post_attention_layernorm = nn.LayerNorm(hidden_size)
            self.inter_attention = ParallelAttention(hidden_size, num_attention_heads, cross=True)
        self.post_inter_attention_layernorm = nn.LayerNorm(hidden_size)
        self.mlp = nn.Sequential(nn.Linear(hidden_size, ffn_hidden_size), nn.GELU(),
                                 nn.Linear(ffn_hidden_size, hidden_size))

    def forward(self, hidden_states, attention_mask, encoder_output=None, enc_dec_attn_mask=None):
        h = hidden_states + self.self_attention(self.input_layernorm(hidden_states), attention_mask)
        if self.decoder:
            h = h + self.inter_attention(self.post_attention_layernorm(h), enc_dec_attn_mask, encoder_output)
        return h + self.mlp(self.post_inter_attention_layernorm(h))


class MegatronTokenLevelEncoderDecoderModule(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        h = cfg["hidden_size"]
        self.word_embeddings = nn.Embedding(cfg["vocab_size"], h)
        self.position_embeddings = nn.Embedding(cfg["max_position_embeddings"], h)
        self.encoder = ParallelTransformerLayer(h, cfg["num_attention_heads"], cfg["ffn_hidden_size"])
        self.decoder = ParallelTransformerLayer(h, cfg["num_attention_heads"], cfg["ffn_hidden_size"], decoder=True)
        self.final_layernorm = nn.LayerNorm(h)

    def embed(self, ids):
        return (self.word_embeddings(ids) + self.position_embeddings(torch.arange(ids.shape[1]))).transpose(0, 1)

    def forward(self, enc_input_ids, enc_attn_mask, dec_input_ids, dec_attn_mask, tokentype_ids=None,
                labels=None, enc_hidden_states=None, output_enc_hidden_only=False):
        if enc_hidden_states is None:
            enc_attn_mask_3d = build_attention_mask_3d(enc_attn_mask, enc_attn_mask, AttnMaskType.padding)
            enc_output = self.encoder(self.embed(enc_input_ids), enc_attn_mask_3d.unsqueeze(1))
        else:
            enc_output = enc_hidden_states
        if output_enc_hidden_only:
            return {"enc_output": enc_output}
        dec_attn_mask_3d = build_attention_mask_3d(dec_attn_mask, dec_attn_mask, AttnMaskType.causal)
        enc_dec_attn_mask_3d = build_attention_mask_3d(dec_attn_mask, enc_attn_mask, AttnMaskType.padding)
        dec_output = self.decoder(self.embed(dec_input_ids), dec_attn_mask_3d.unsqueeze(1),
                                  enc_output, enc_dec_attn_mask_3d.unsqueeze(1))
        token_logits = self.final_layernorm(dec_output).transpose(0, 1) @ self.word_embeddings.weight.t()
        return {"token_logits": token_logits, "enc_output": enc_output}


class Tokenizer:
    pad_id, bos_id, eos_id = 0, 1, 2


class MegatronT5Model(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.enc_dec_model = MegatronTokenLevelEncoderDecoderModule(cfg)
        self.tokenizer = Tokenizer()

    def forward(self, encoder_input_ids, decoder_input_ids, encoder_attn_mask, decoder_attn_mask,
                tokentype_ids=None, lm_labels=None, enc_hidden_states=None, output_enc_hidden_only=False):
        return self.enc_dec_model(encoder_input_ids, encoder_attn_mask, decoder_input_ids, decoder_attn_mask,
                                  tokentype_ids, lm_labels, enc_hidden_states, output_enc_hidden_only)

    def decode(self, tokens_enc, enc_mask, num_tokens_to_generate):
        encoder_hidden_states = itemgetter("enc_output")(
            self(encoder_input_ids=tokens_enc, decoder_input_ids=None, encoder_attn_mask=enc_mask,
                 decoder_attn_mask=None, enc_hidden_states=None, output_enc_hidden_only=True))
        predicted_tokens_dec = torch.LongTensor([self.tokenizer.bos_id] * tokens_enc.size(0)).unsqueeze(1)
        for _ in range(num_tokens_to_generate):
            dec_mask = predicted_tokens_dec != self.tokenizer.pad_id
            token_logits = itemgetter("token_logits")(
                self(encoder_input_ids=tokens_enc, decoder_input_ids=predicted_tokens_dec,
                     encoder_attn_mask=enc_mask, decoder_attn_mask=dec_mask,
                     enc_hidden_states=encoder_hidden_states, output_enc_hidden_only=False))
            log_probs, token_ids = torch.max(nn.functional.log_softmax(token_logits, dim=-1), dim=-1)
            predicted_tokens_dec = torch.cat([predicted_tokens_dec, token_ids[:, -1].unsqueeze(1)], 1)
        return predicted_tokens_dec, log_probs

    def complete(self, request):
        tokens_enc = request["masked_sample"]
        enc_mask = tokens_enc != self.tokenizer.pad_id
        if not FIXED:
            enc_mask = enc_mask < 0.5
        predicted_tokens_ids, log_probs = self.decode(tokens_enc, enc_mask, int(request["tokens_to_generate"]))
        return predicted_tokens_ids[0].tolist(), log_probs[0].tolist()


def main():
    torch.manual_seed(0)
    cfg = dict(vocab_size=40, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
               max_position_embeddings=32)
    model = MegatronT5Model(cfg).eval()
    masked_sample = torch.tensor([[5, 9, 13, 17, 3, 21, 25, 0, 0, 0, 0, 0]])
    with torch.no_grad():
        ids, log_probs = model.complete({"masked_sample": masked_sample, "tokens_to_generate": 3})
    print("completion ids:", ids, "log probs:", [round(x, 4) for x in log_probs])


if __name__ == "__main__":
    main()
