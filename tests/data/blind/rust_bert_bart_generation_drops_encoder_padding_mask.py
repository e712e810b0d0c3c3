# guillaume-be/rust-bert#64 (commit 9c08efa; Rust/tch, torch port): BART/Marian generation encoded the right-padded
# source with its attention mask, but every decoder step was called with attention_mask None, so the decoder's
# cross-attention attended to the encoder's pad positions.
import sys
import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
PAD, BOS, VOCAB, D, H = 1, 0, 40, 32, 4


class SelfAttention(nn.Module):
    def __init__(self, encoder_decoder_attention=False):
        super().__init__()
        self.k_proj, self.v_proj = nn.Linear(D, D), nn.Linear(D, D)
        self.q_proj, self.out_proj = nn.Linear(D, D), nn.Linear(D, D)
        self.encoder_decoder_attention = encoder_decoder_attention

    def shape(self, x):
        return x.view(x.shape[0], -1, H, D // H).transpose(1, 2)

    def forward(self, query, key, key_padding_mask=None, attention_mask=None, layer_state=None):
        q = self.shape(self.q_proj(query)) * (D // H) ** -0.5
        if self.encoder_decoder_attention:  # static kv: encoder outputs projected once
            if layer_state is not None and "prev_key" in layer_state:
                k, v = layer_state["prev_key"], layer_state["prev_value"]
            else:
                k, v = self.shape(self.k_proj(key)), self.shape(self.v_proj(key))
        else:
            k, v = self.shape(self.k_proj(query)), self.shape(self.v_proj(query))
            if layer_state is not None and "prev_key" in layer_state:
                k = torch.cat([layer_state["prev_key"], k], 2)
                v = torch.cat([layer_state["prev_value"], v], 2)
        if layer_state is not None:
            layer_state["prev_key"], layer_state["prev_value"] = k, v
        attention_weights = q @ k.transpose(-1, -2)
        if attention_mask is not None:
            attention_weights = attention_weights + attention_mask
        if key_padding_mask is not None:
            attention_weights = attention_weights.masked_fill(key_padding_mask[:, None, None, :], float("-inf"))
        attention_weights = F.softmax(attention_weights, dim=-1)
        out = (attention_weights @ v).transpose(1, 2).reshape(query.shape[0], -1, D)
        return self.out_proj(out)


class EncoderLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attn, self.ln1, self.ln2 = SelfAttention(), nn.LayerNorm(D), nn.LayerNorm(D)
        self.ff = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))

    def forward(self, x, encoder_padding_mask):
        x = self.ln1(x + self.self_attn(x, x, key_padding_mask=encoder_padding_mask))
        return self.ln2(x + self.ff(x))


class DecoderLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attn, self.encoder_attn = SelfAttention(), SelfAttention(encoder_decoder_attention=True)
        self.ln1, self.ln2, self.ln3 = nn.LayerNorm(D), nn.LayerNorm(D), nn.LayerNorm(D)
        self.ff = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))

    def forward(self, x, encoder_hidden_states, encoder_padding_mask, layer_state):
        x = self.ln1(x + self.self_attn(x, x, layer_state=layer_state["self"]))  # one new token: causal via cache
        x = self.ln2(x + self.encoder_attn(x, encoder_hidden_states, key_padding_mask=encoder_padding_mask,
                                           layer_state=layer_state["encoder_decoder"]))
        return self.ln3(x + self.ff(x))


class BartForConditionalGeneration(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.pos = nn.Embedding(VOCAB, D), nn.Embedding(64, D)
        self.encoder = nn.ModuleList([EncoderLayer() for _ in range(2)])
        self.decoder = nn.ModuleList([DecoderLayer() for _ in range(2)])

    def encode(self, input_ids, attention_mask):
        x = self.embed(input_ids) + self.pos(torch.arange(input_ids.shape[1]))
        mask = attention_mask.eq(0) if attention_mask is not None else None
        for layer in self.encoder:
            x = layer(x, mask)
        return x

    def forward_t(self, attention_mask, encoder_outputs, decoder_input_ids, cache, offset):
        # BartDecoder: encoder_padding_mask = attention_mask.eq(0), or None
        encoder_padding_mask = attention_mask.eq(0) if attention_mask is not None else None
        x = self.embed(decoder_input_ids) + self.pos(torch.arange(offset, offset + decoder_input_ids.shape[1]))
        for layer, state in zip(self.decoder, cache):
            x = layer(x, encoder_outputs, encoder_padding_mask, state)
        return x @ self.embed.weight.T


def prepare_inputs_for_generation(input_ids, encoder_outputs, past, attention_mask):
    if FIXED:
        return None, attention_mask, encoder_outputs, input_ids, past
    return None, None, encoder_outputs, input_ids, past


@torch.no_grad()
def generate(model, input_ids, max_length=6):
    attention_mask = input_ids.ne(PAD).long()
    encoder_outputs = model.encode(input_ids, attention_mask)
    past = [{"self": {}, "encoder_decoder": {}} for _ in model.decoder]
    decoder_ids = torch.full((input_ids.shape[0], 1), BOS)
    all_logits = []
    while decoder_ids.shape[1] < max_length:  # no beam search
        _, mask, enc, dec, past = prepare_inputs_for_generation(decoder_ids, encoder_outputs, past, attention_mask)
        logits = model.forward_t(mask, enc, dec[:, -1:], past, dec.shape[1] - 1)[:, -1]
        all_logits.append(logits)
        next_tokens = logits[:, 2:].argmax(-1, keepdim=True) + 2  # greedy, never BOS / PAD
        decoder_ids = torch.cat([decoder_ids, next_tokens], 1)
    return decoder_ids, torch.stack(all_logits, 1)


model = BartForConditionalGeneration().eval()
long_src = torch.randint(2, VOCAB, (9,))
short_src = torch.randint(2, VOCAB, (5,))
batch = torch.stack([long_src, torch.cat([short_src, torch.full((4,), PAD)])])  # right-padded, as encode_prompt_text
ids, logits = generate(model, batch)
alone_ids, alone_logits = generate(model, short_src[None])
print("batched:", ids.tolist(), "alone:", alone_ids.tolist())
print("short source, max |batched logits - unpadded logits| = %.5f" % (logits[1] - alone_logits[0]).abs().max().item())
