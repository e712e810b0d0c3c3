# Citation: facebookresearch/fairseq2 commit 5f0d9122f ("Fix T2U decoder statebag bug").
#
# UnitY's T2U model (text-to-unit, an encoder-decoder inside fairseq2's UnitY) decodes units
# incrementally: the generator feeds one unit per step together with an IncrementalStateBag, which
# holds each attention module's cached keys/values and the current step. UnitYT2UModel.decode
# handed the state bag to the decoder but not to the decoder front-end:
#     seqs, padding_mask = self.decoder_frontend(seqs, seq_lens)
# so the sinusoidal position encoder, which reads its offset from `state_bag.step`, started at
# step 0 on every call: each new unit was encoded at position 0 while the cached keys of the
# self-attention held positions 0..t-1. The fix passes `state_bag` to the front-end too.
#
# Ported (trimmed) from fairseq2 @5f0d9122f^: models/unity/model.py (UnitYT2UModel),
# models/transformer/frontend.py (TransformerEmbeddingFrontend), nn/position_encoder.py
# (SinusoidalPositionEncoder), nn/incremental_state.py (IncrementalStateBag),
# nn/transformer/multihead_attention.py (StandardMultiheadAttention, MultiheadAttentionState),
# nn/transformer/decoder.py (StandardTransformerDecoder), nn/transformer/attention.py (naive SDPA,
# the CPU path), nn/utils/mask.py (to_padding_mask: float, -inf on pads).
import math
import sys
from typing import Dict, Optional, Tuple

import torch
import torch.nn as nn
from torch import Tensor
from torch.nn.functional import softmax

FIXED = "--fixed" in sys.argv

torch.manual_seed(0)


def to_padding_mask(seqs: Tensor, seq_lens: Optional[Tensor]) -> Optional[Tensor]:
    if seq_lens is None:
        return None
    batch_size, mask_seq_len = seqs.shape[:2]
    if (seq_lens == mask_seq_len).all():
        return None
    indices = torch.arange(mask_seq_len, device=seq_lens.device).expand(batch_size, -1)
    bool_mask = indices >= seq_lens.unsqueeze(1).expand(-1, mask_seq_len)
    mask = seqs.new_zeros((batch_size, mask_seq_len))
    mask.masked_fill_(bool_mask, -torch.inf)
    return mask


class IncrementalStateBag:
    def __init__(self) -> None:
        self._step = 0
        self._module_states: Dict[nn.Module, "MultiheadAttentionState"] = {}

    @property
    def step(self) -> int:
        return self._step

    def increment_step(self, delta: int = 1) -> None:
        self._step += delta

    def get_state(self, m, kls):
        state = self._module_states.get(m, None)
        return state if isinstance(state, kls) else None

    def set_state(self, m, state) -> None:
        self._module_states[m] = state


class SinusoidalPositionEncoder(nn.Module):
    def __init__(self, encoding_dim: int, max_seq_len: int) -> None:
        super().__init__()
        self.encoding_dim = encoding_dim
        self.max_seq_len = max_seq_len
        self._sin_offset = 0
        weight = torch.empty((max_seq_len, encoding_dim))
        self.register_buffer("weight", weight, persistent=False)
        self.reset_non_persistent_buffers()

    def reset_non_persistent_buffers(self) -> None:
        num_sin = self.encoding_dim // 2
        weight = self.weight.to(torch.float32)
        l_half = weight[:, :num_sin]
        r_half = weight[:, num_sin:]
        indices = torch.arange(num_sin, dtype=torch.float32).unsqueeze(0)
        start_step = self._sin_offset
        steps = torch.arange(start_step, start_step + self.max_seq_len, dtype=torch.float32)
        steps = steps.unsqueeze(1)
        factors = torch.exp(indices * -math.log(10000) / (num_sin - 1))
        torch.matmul(steps, factors, out=l_half)
        r_half.copy_(l_half)
        l_half.sin_()
        r_half.cos_()
        self.weight.copy_(weight)

    def forward(self, seqs: Tensor, padding_mask: Optional[Tensor] = None,
                state_bag: Optional[IncrementalStateBag] = None) -> Tensor:
        seq_len = seqs.size(1)
        if not self.training and state_bag is not None:
            start_step = state_bag.step
        else:
            start_step = 0
        return seqs + self.weight[start_step : start_step + seq_len]


class TransformerEmbeddingFrontend(nn.Module):
    def __init__(self, embed: nn.Embedding, pos_encoder: SinusoidalPositionEncoder) -> None:
        super().__init__()
        model_dim = embed.embedding_dim
        self.model_dim = model_dim
        self.embed = embed
        self.scale = math.sqrt(model_dim)
        self.pos_encoder = pos_encoder

    def forward(self, seqs: Tensor, seq_lens: Optional[Tensor],
                state_bag: Optional[IncrementalStateBag] = None) -> Tuple[Tensor, Optional[Tensor]]:
        embeds = self.embed(seqs)
        padding_mask = to_padding_mask(embeds, seq_lens)
        if self.scale != 1.0:
            embeds = embeds * self.scale
        if self.pos_encoder is not None:
            embeds = self.pos_encoder(embeds, padding_mask, state_bag)
        return embeds, padding_mask


def _naive_scaled_dot_product_attention(queries, keys, values, mask):
    queries = queries * (queries.size(-1) ** -0.5)
    if mask is None:
        attn_weights = torch.bmm(queries, keys.transpose(1, 2))
    else:
        attn_weights = torch.baddbmm(mask, queries, keys.transpose(1, 2))
    attn_weights = softmax(attn_weights, dim=-1, dtype=torch.float32)
    attn_weights = attn_weights.type_as(queries)
    return torch.bmm(attn_weights, values)


class MultiheadAttentionState:
    def __init__(self, k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor] = None) -> None:
        self.prev_k = k
        self.prev_v = v
        self.prev_key_padding_mask = key_padding_mask

    def append(self, k, v, key_padding_mask):
        seq_len = k.size(1)
        prev_seq_len = self.prev_k.size(1)
        self.prev_k = torch.cat([self.prev_k, k], dim=1)
        self.prev_v = torch.cat([self.prev_v, v], dim=1)
        prev_mask = self.prev_key_padding_mask
        if not (prev_mask is None and key_padding_mask is None):
            batch_size = self.prev_k.size(0)
            if prev_mask is None:
                prev_mask = self.prev_k.new_zeros((batch_size, prev_seq_len))
            if key_padding_mask is None:
                key_padding_mask = self.prev_k.new_zeros((batch_size, seq_len))
            self.prev_key_padding_mask = torch.cat([prev_mask, key_padding_mask], dim=1)
        return self.prev_k, self.prev_v, self.prev_key_padding_mask


class StandardMultiheadAttention(nn.Module):
    def __init__(self, model_dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.q_proj = nn.Linear(model_dim, model_dim)
        self.k_proj = nn.Linear(model_dim, model_dim)
        self.v_proj = nn.Linear(model_dim, model_dim)
        self.output_proj = nn.Linear(model_dim, model_dim)

    def forward(self, queries, padding_mask, keys, values, attn_mask=None,
                key_padding_mask=None, state_bag=None):
        q = self.q_proj(queries)
        if self.training or state_bag is None:
            k = self.k_proj(keys)
            v = self.v_proj(values)
        else:
            state = state_bag.get_state(self, MultiheadAttentionState)
            encoder_decoder_attn = keys is values and keys is not queries
            if encoder_decoder_attn:
                if state is not None:
                    k = state.prev_k
                    v = state.prev_v
                else:
                    k = self.k_proj(keys)
                    v = self.v_proj(values)
                    state_bag.set_state(self, MultiheadAttentionState(k, v))
            else:
                k = self.k_proj(keys)
                v = self.v_proj(values)
                if state is not None:
                    k, v, key_padding_mask = state.append(k, v, key_padding_mask)
                else:
                    state_bag.set_state(self, MultiheadAttentionState(k, v, key_padding_mask))

        q = q.unflatten(-1, (self.num_heads, -1)).transpose(1, 2).flatten(0, 1)
        k = k.unflatten(-1, (self.num_heads, -1)).transpose(1, 2).flatten(0, 1)
        v = v.unflatten(-1, (self.num_heads, -1)).transpose(1, 2).flatten(0, 1)

        if key_padding_mask is not None:
            # (N, S_kv) -> (N, 1, 1, S_kv) -> (N, H, 1, S_kv)
            key_padding_mask = key_padding_mask.unsqueeze(1).unsqueeze(1)
            key_padding_mask = key_padding_mask.expand(-1, self.num_heads, -1, -1)
            if attn_mask is None:
                attn_mask = key_padding_mask
            else:
                attn_mask = key_padding_mask + attn_mask
            attn_mask = attn_mask.flatten(0, 1)

        attn = _naive_scaled_dot_product_attention(q, k, v, attn_mask)
        attn = attn.unflatten(0, (-1, self.num_heads)).permute(0, 2, 1, 3).flatten(-2, -1)
        return self.output_proj(attn)


class CausalAttentionMaskGenerator:
    def __call__(self, seqs: Tensor) -> Tensor:
        seq_len = seqs.size(1)
        mask = seqs.new_full([seq_len, seq_len], -torch.inf)
        mask.triu_(diagonal=1)
        return mask


class StandardTransformerDecoderLayer(nn.Module):
    def __init__(self, model_dim: int, num_heads: int, ffn_dim: int) -> None:
        super().__init__()
        self.self_attn_layer_norm = nn.LayerNorm(model_dim)
        self.self_attn = StandardMultiheadAttention(model_dim, num_heads)
        self.encoder_decoder_attn_layer_norm = nn.LayerNorm(model_dim)
        self.encoder_decoder_attn = StandardMultiheadAttention(model_dim, num_heads)
        self.ffn_layer_norm = nn.LayerNorm(model_dim)
        self.ffn = nn.Sequential(nn.Linear(model_dim, ffn_dim), nn.ReLU(), nn.Linear(ffn_dim, model_dim))

    def forward(self, seqs, padding_mask, self_attn_mask, encoder_output,
                encoder_padding_mask, state_bag):
        residual = seqs
        seqs = self.self_attn_layer_norm(seqs)
        seqs = self.self_attn(seqs, padding_mask, keys=seqs, values=seqs,
                              attn_mask=self_attn_mask, key_padding_mask=padding_mask,
                              state_bag=state_bag)
        seqs = seqs + residual

        residual = seqs
        seqs = self.encoder_decoder_attn_layer_norm(seqs)
        seqs = self.encoder_decoder_attn(seqs, padding_mask, keys=encoder_output,
                                         values=encoder_output,
                                         key_padding_mask=encoder_padding_mask,
                                         state_bag=state_bag)
        seqs = seqs + residual

        residual = seqs
        seqs = self.ffn(self.ffn_layer_norm(seqs)) + residual
        return seqs, padding_mask


class StandardTransformerDecoder(nn.Module):
    def __init__(self, layers, model_dim: int) -> None:
        super().__init__()
        self.model_dim = model_dim
        self.layers = nn.ModuleList(layers)
        self.self_attn_mask_gen = CausalAttentionMaskGenerator()
        self.layer_norm = nn.LayerNorm(model_dim)

    def forward(self, seqs, padding_mask, encoder_output=None, encoder_padding_mask=None,
                state_bag=None):
        if seqs.size(1) > 1:
            self_attn_mask = self.self_attn_mask_gen(seqs)
        else:
            self_attn_mask = None
        for layer in self.layers:
            seqs, padding_mask = layer(seqs, padding_mask, self_attn_mask, encoder_output,
                                       encoder_padding_mask, state_bag)
        return self.layer_norm(seqs), padding_mask


class UnitYT2UModel(nn.Module):
    def __init__(self, decoder_frontend, decoder, final_proj, pad_idx) -> None:
        super().__init__()
        self.model_dim = decoder.model_dim
        self.encoder = None  # the T2U encoder is optional; this config has none
        self.decoder_frontend = decoder_frontend
        self.decoder = decoder
        self.final_proj = final_proj
        self.pad_idx = pad_idx

    def encode(self, text_decoder_output, text_decoder_padding_mask):
        if self.encoder is None:
            return text_decoder_output, text_decoder_padding_mask
        return self.encoder(text_decoder_output, text_decoder_padding_mask)

    def decode(self, seqs, seq_lens, encoder_output, encoder_padding_mask, state_bag=None):
        if FIXED:
            seqs, padding_mask = self.decoder_frontend(seqs, seq_lens, state_bag)
        else:
            seqs, padding_mask = self.decoder_frontend(seqs, seq_lens)

        return self.decoder(seqs, padding_mask, encoder_output, encoder_padding_mask, state_bag)

    def project(self, decoder_output, decoder_padding_mask):
        return self.final_proj(decoder_output)


MODEL_DIM, NUM_HEADS, FFN_DIM, NUM_LAYERS = 32, 4, 64, 2
UNIT_VOCAB, PAD_IDX, EOS_IDX, BOS_IDX = 24, 1, 2, 2
MAX_LEN = 10


def build_t2u_model() -> UnitYT2UModel:
    embed = nn.Embedding(UNIT_VOCAB, MODEL_DIM, padding_idx=PAD_IDX)
    pos_encoder = SinusoidalPositionEncoder(MODEL_DIM, max_seq_len=64)
    frontend = TransformerEmbeddingFrontend(embed, pos_encoder)
    layers = [StandardTransformerDecoderLayer(MODEL_DIM, NUM_HEADS, FFN_DIM) for _ in range(NUM_LAYERS)]
    decoder = StandardTransformerDecoder(layers, MODEL_DIM)
    final_proj = nn.Linear(MODEL_DIM, UNIT_VOCAB, bias=False)
    return UnitYT2UModel(frontend, decoder, final_proj, PAD_IDX)


@torch.inference_mode()
def generate_units(model: UnitYT2UModel, text_decoder_output: Tensor, text_seq_lens: Tensor):
    """Greedy incremental decoding, as fairseq2's Seq2SeqGenerator drives a Seq2SeqDecoder."""
    text_padding_mask = to_padding_mask(text_decoder_output, text_seq_lens)
    encoder_output, encoder_padding_mask = model.encode(text_decoder_output, text_padding_mask)

    batch_size = text_decoder_output.size(0)
    state_bag = IncrementalStateBag()
    seqs = torch.full((batch_size, 1), BOS_IDX, dtype=torch.long)
    step_logits = []
    for _ in range(MAX_LEN):
        decoder_output, decoder_padding_mask = model.decode(
            seqs[:, -1:], None, encoder_output, encoder_padding_mask, state_bag
        )
        state_bag.increment_step()
        logits = model.project(decoder_output, decoder_padding_mask)[:, -1]
        step_logits.append(logits)
        # keep EOS from ending the run early so every step is scored
        logits = logits.clone()
        logits[:, [PAD_IDX, EOS_IDX]] = -torch.inf
        seqs = torch.cat([seqs, logits.argmax(-1, keepdim=True)], dim=1)
    return seqs[:, 1:], torch.stack(step_logits, dim=1)


def main() -> None:
    model = build_t2u_model().eval()

    # The T2U model reads the text decoder's output (right-padded batch of two texts).
    text_seq_lens = torch.tensor([7, 4])
    text_decoder_output = torch.randn(2, 7, MODEL_DIM)
    text_decoder_output[1, 4:] = 0.0

    units, step_logits = generate_units(model, text_decoder_output, text_seq_lens)
    log_probs = torch.log_softmax(step_logits, dim=-1)
    score = log_probs.gather(-1, units.unsqueeze(-1)).squeeze(-1).sum(-1)
    print("fixed" if FIXED else "buggy")
    print("units:", units.tolist())
    print("sequence scores:", [round(s, 4) for s in score.tolist()])
    print("last-step logits[0,:6]:", [round(x, 4) for x in step_logits[0, -1, :6].tolist()])


if __name__ == "__main__":
    main()
