# Citation: NielsRogge/Transformers-Tutorials#323 ("Donut Batch Inference result differents from
#   Single Inference", closed after the maintainer updated the Donut DocVQA inference notebook to
#   `processor.tokenizer.padding_side = 'left'`). Code paths as in huggingface/transformers v4.30
#   (June 2023): models/vision_encoder_decoder/modeling_vision_encoder_decoder.py
#   VisionEncoderDecoderModel.prepare_inputs_for_generation and models/mbart/modeling_mbart.py
#   MBartForCausalLM.prepare_inputs_for_generation / MBartDecoder (Donut's text decoder).
# Bug: batched DocVQA prompts "<s_docvqa><s_question>..</s_question><s_answer>" of different
#   lengths are right-padded as decoder_input_ids. VisionEncoderDecoderModel.prepare_inputs_for_generation
#   calls the decoder's prepare_inputs_for_generation without the user's decoder_attention_mask, and
#   MBartForCausalLM builds `input_ids.new_ones(input_ids.shape)`, so the decoder mask is all ones: the
#   short row generates its answer after its trailing pad tokens, attending to them and at shifted
#   learned positions.
# Fix (notebook): tokenize the prompts with padding_side='left', so every row's answer starts right
#   after its own "<s_answer>" token.
import sys
import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

PAD, BOS, EOS = 1, 0, 2
VOCAB, D, H, FFN, LAYERS, MAXPOS = 64, 32, 4, 64, 2, 64


class MBartLearnedPositionalEmbedding(nn.Embedding):
    def __init__(self, num_embeddings, embedding_dim):
        self.offset = 2
        super().__init__(num_embeddings + self.offset, embedding_dim)

    def forward(self, input_ids, past_key_values_length=0):
        bsz, seq_len = input_ids.shape[:2]
        positions = torch.arange(past_key_values_length, past_key_values_length + seq_len, dtype=torch.long)
        return super().forward(positions + self.offset).expand(bsz, -1, -1)


class MBartAttention(nn.Module):
    def __init__(self, is_cross):
        super().__init__()
        self.is_cross = is_cross
        self.k_proj, self.v_proj = nn.Linear(D, D), nn.Linear(D, D)
        self.q_proj, self.out_proj = nn.Linear(D, D), nn.Linear(D, D)
        self.scaling = (D // H) ** -0.5

    def _shape(self, t, bsz):
        return t.view(bsz, -1, H, D // H).transpose(1, 2)

    def forward(self, hidden_states, key_value_states=None, past_key_value=None, attention_mask=None):
        bsz, tgt_len, _ = hidden_states.shape
        q = self._shape(self.q_proj(hidden_states) * self.scaling, bsz)
        if self.is_cross and past_key_value is not None:
            k, v = past_key_value
        elif self.is_cross:
            k, v = self._shape(self.k_proj(key_value_states), bsz), self._shape(self.v_proj(key_value_states), bsz)
        else:
            k, v = self._shape(self.k_proj(hidden_states), bsz), self._shape(self.v_proj(hidden_states), bsz)
            if past_key_value is not None:
                k = torch.cat([past_key_value[0], k], dim=2)
                v = torch.cat([past_key_value[1], v], dim=2)
        w = q @ k.transpose(-1, -2)
        if attention_mask is not None:
            w = w + attention_mask
        out = F.softmax(w, dim=-1) @ v
        out = out.transpose(1, 2).reshape(bsz, tgt_len, D)
        return self.out_proj(out), (k, v)


class MBartDecoderLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attn, self.encoder_attn = MBartAttention(False), MBartAttention(True)
        self.self_attn_layer_norm, self.encoder_attn_layer_norm = nn.LayerNorm(D), nn.LayerNorm(D)
        self.fc1, self.fc2, self.final_layer_norm = nn.Linear(D, FFN), nn.Linear(FFN, D), nn.LayerNorm(D)

    def forward(self, x, attention_mask, encoder_hidden_states, past_key_value):
        self_past = past_key_value[:2] if past_key_value is not None else None
        cross_past = past_key_value[2:] if past_key_value is not None else None
        r = x
        x, self_kv = self.self_attn(self.self_attn_layer_norm(x), past_key_value=self_past, attention_mask=attention_mask)
        x = r + x
        r = x
        x, cross_kv = self.encoder_attn(self.encoder_attn_layer_norm(x), key_value_states=encoder_hidden_states,
                                        past_key_value=cross_past)
        x = r + x
        r = x
        x = r + self.fc2(F.gelu(self.fc1(self.final_layer_norm(x))))
        return x, self_kv + cross_kv


def _prepare_4d_causal_attention_mask(attention_mask, input_shape, dtype, past_key_values_length):
    bsz, tgt_len = input_shape
    min_val = torch.finfo(dtype).min
    causal = torch.full((tgt_len, tgt_len), min_val)
    causal.masked_fill_(torch.arange(tgt_len) < (torch.arange(tgt_len) + 1).view(tgt_len, 1), 0)
    causal = torch.cat([torch.zeros(tgt_len, past_key_values_length), causal], dim=-1)
    causal = causal[None, None].expand(bsz, 1, tgt_len, tgt_len + past_key_values_length)
    expanded = attention_mask[:, None, None, :].to(dtype).expand(bsz, 1, tgt_len, attention_mask.shape[-1])
    inverted = (1.0 - expanded).masked_fill((1.0 - expanded).bool(), min_val)
    return causal.masked_fill(inverted.bool(), min_val)


class MBartDecoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, D, padding_idx=PAD)
        self.embed_positions = MBartLearnedPositionalEmbedding(MAXPOS, D)
        self.layers = nn.ModuleList([MBartDecoderLayer() for _ in range(LAYERS)])
        self.layernorm_embedding, self.layer_norm = nn.LayerNorm(D), nn.LayerNorm(D)

    def forward(self, input_ids, attention_mask, encoder_hidden_states, past_key_values=None):
        past_len = past_key_values[0][0].shape[2] if past_key_values is not None else 0
        x = self.embed_tokens(input_ids)
        mask4d = _prepare_4d_causal_attention_mask(attention_mask, input_ids.shape, x.dtype, past_len)
        x = self.layernorm_embedding(x + self.embed_positions(input_ids, past_len))
        cache = []
        for i, layer in enumerate(self.layers):
            x, kv = layer(x, mask4d, encoder_hidden_states, past_key_values[i] if past_key_values else None)
            cache.append(kv)
        return self.layer_norm(x), cache


class MBartForCausalLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.model = nn.Module()
        self.model.decoder = MBartDecoder()
        self.lm_head = nn.Linear(D, VOCAB, bias=False)

    def prepare_inputs_for_generation(self, input_ids, past_key_values=None, attention_mask=None, use_cache=None, **kwargs):
        # if model is used as a decoder in encoder-decoder model, the decoder attention mask is created on the fly
        if attention_mask is None:
            attention_mask = input_ids.new_ones(input_ids.shape)
        if past_key_values:
            input_ids = input_ids[:, -1:]
        return {"input_ids": input_ids, "attention_mask": attention_mask, "past_key_values": past_key_values,
                "use_cache": use_cache}

    def forward(self, input_ids, attention_mask, encoder_hidden_states, past_key_values=None):
        h, cache = self.model.decoder(input_ids, attention_mask, encoder_hidden_states, past_key_values)
        return self.lm_head(h), cache


class VisionEncoderDecoderModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(48, D), nn.GELU(), nn.Linear(D, D))  # DonutSwin stand-in
        self.decoder = MBartForCausalLM()

    def prepare_inputs_for_generation(self, input_ids, past_key_values=None, attention_mask=None, use_cache=None,
                                      encoder_outputs=None, **kwargs):
        decoder_inputs = self.decoder.prepare_inputs_for_generation(input_ids, past_key_values=past_key_values)
        decoder_attention_mask = decoder_inputs["attention_mask"] if "attention_mask" in decoder_inputs else None
        return {"attention_mask": attention_mask, "decoder_attention_mask": decoder_attention_mask,
                "decoder_input_ids": decoder_inputs["input_ids"], "encoder_outputs": encoder_outputs,
                "past_key_values": decoder_inputs["past_key_values"], "use_cache": use_cache}

    @torch.no_grad()
    def generate(self, pixel_values, decoder_input_ids, max_new_tokens, **model_kwargs):
        encoder_outputs = self.encoder(pixel_values)
        past, ids, scores = None, decoder_input_ids, []
        for _ in range(max_new_tokens):
            inp = self.prepare_inputs_for_generation(ids, past_key_values=past, encoder_outputs=encoder_outputs,
                                                     use_cache=True, **model_kwargs)
            logits, past = self.decoder(inp["decoder_input_ids"], inp["decoder_attention_mask"],
                                        inp["encoder_outputs"], inp["past_key_values"])
            next_logits = logits[:, -1, :]
            next_logits[:, PAD] = -float("inf")
            scores.append(next_logits.log_softmax(-1))
            ids = torch.cat([ids, next_logits.argmax(-1, keepdim=True)], dim=-1)
        return ids, torch.stack(scores, 1)


def tokenize_prompts(prompts, padding_side):
    L = max(len(p) for p in prompts)
    out, mask = [], []
    for p in prompts:
        pad = [PAD] * (L - len(p))
        out.append(p + pad if padding_side == "right" else pad + p)
        mask.append([1] * len(p) + [0] * len(pad) if padding_side == "right" else [0] * len(pad) + [1] * len(p))
    return torch.tensor(out), torch.tensor(mask)


model = VisionEncoderDecoderModel().eval()
S_DOCVQA, S_Q, E_Q, S_A = 50, 51, 52, 53
questions = [[10, 11, 12, 13, 14, 15, 16], [20, 21]]  # "what is the invoice total ?" / "date ?"
prompts = [[S_DOCVQA, S_Q] + q + [E_Q, S_A] for q in questions]
pixel_values = torch.randn(2, 12, 48)  # 12 "patch" features per page image

processor_padding_side = "left" if FIXED else "right"
decoder_input_ids, decoder_attention_mask = tokenize_prompts(prompts, processor_padding_side)
seqs, scores = model.generate(pixel_values, decoder_input_ids, max_new_tokens=6,
                              decoder_attention_mask=decoder_attention_mask)
answers = seqs[:, decoder_input_ids.shape[1]:]
print("padding_side:", processor_padding_side)
print("decoder_input_ids:", decoder_input_ids.tolist())
print("answers:", answers.tolist())
print("answer log-prob per row:", [round(v, 4) for v in scores.max(-1).values.sum(-1).tolist()])
